// Token log-probs from logits, one block per row: an online max-and-sum logsumexp in one pass over
// the row (fp32), and a backward that writes the softmax gradient in one pass. The [rows, vocab]
// row is read once each way; no fp32 copy of the logits is made.
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda_convert.cuh"
#include "kernels/logprob_cuda.h"

namespace kiln::kernels {
namespace {

constexpr int kThreads = 512;

// (max, sum of exp(x - max)) pairs, merged.
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) {
    m = m2;
    s = s2;
    return;
  }
  const float hi = fmaxf(m, m2);
  s = s * __expf(m - hi) + s2 * __expf(m2 - hi);
  m = hi;
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) logprob_forward(const T* __restrict__ logits,
                                                            const int64_t* __restrict__ targets, int64_t vocab,
                                                            float inv_temp, float* __restrict__ lp,
                                                            float* __restrict__ lse) {
  __shared__ float sm[kThreads / 32], ss[kThreads / 32];
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab;
  float m = -INFINITY, s = 0.f;
  for (int64_t c = int64_t(threadIdx.x) * kVec; c < vocab; c += int64_t(blockDim.x) * kVec) {
    const Vec<T, kVec> v = *reinterpret_cast<const Vec<T, kVec>*>(x + c);
    float vals[kVec], hi = -INFINITY;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      vals[i] = to_float(v.v[i]) * inv_temp;
      hi = fmaxf(hi, vals[i]);
    }
    float part = 0.f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) part += __expf(vals[i] - hi);
    merge(m, s, hi, part);
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, offset), s2 = __shfl_xor_sync(0xffffffffu, s, offset);
    merge(m, s, m2, s2);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float M = -INFINITY, S = 0.f;
    for (int i = 0; i < int(blockDim.x / 32); ++i) merge(M, S, sm[i], ss[i]);
    const float l = M + __logf(S);
    lse[row] = l;
    lp[row] = to_float(x[targets[row]]) * inv_temp - l;
  }
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) logprob_backward(const T* __restrict__ logits,
                                                             const int64_t* __restrict__ targets,
                                                             const float* __restrict__ lse, const float* __restrict__ g,
                                                             int64_t vocab, float inv_temp, T* __restrict__ dlogits) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab;
  T* d = dlogits + row * vocab;
  const float l = lse[row], scale = g[row] * inv_temp;
  const int64_t target = targets[row];
  for (int64_t c = int64_t(threadIdx.x) * kVec; c < vocab; c += int64_t(blockDim.x) * kVec) {
    const Vec<T, kVec> v = *reinterpret_cast<const Vec<T, kVec>*>(x + c);
    Vec<T, kVec> out;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float p = __expf(to_float(v.v[i]) * inv_temp - l);
      out.v[i] = from_float<T>(scale * ((c + i == target ? 1.f : 0.f) - p));
    }
    *reinterpret_cast<Vec<T, kVec>*>(d + c) = out;
  }
}

template <typename T>
bool vector_ok(const void* a, const void* b, int64_t vocab) {
  constexpr int kVec = 16 / sizeof(T);
  return vocab % kVec == 0 && (reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) % 16 == 0;
}

template <typename T>
cudaError_t forward(const T* logits, const int64_t* targets, int64_t rows, int64_t vocab, float inv_temp, float* lp,
                    float* lse, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows > INT32_MAX || vocab == 0) return cudaErrorInvalidValue;
  constexpr int kVec = 16 / sizeof(T);
  if (vector_ok<T>(logits, logits, vocab))
    logprob_forward<T, kVec><<<unsigned(rows), kThreads, 0, stream>>>(logits, targets, vocab, inv_temp, lp, lse);
  else
    logprob_forward<T, 1><<<unsigned(rows), kThreads, 0, stream>>>(logits, targets, vocab, inv_temp, lp, lse);
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward(const T* logits, const int64_t* targets, const float* lse, const float* g, int64_t rows,
                     int64_t vocab, float inv_temp, T* dlogits, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows > INT32_MAX || vocab == 0) return cudaErrorInvalidValue;
  constexpr int kVec = 16 / sizeof(T);
  if (vector_ok<T>(logits, dlogits, vocab))
    logprob_backward<T, kVec><<<unsigned(rows), kThreads, 0, stream>>>(logits, targets, lse, g, vocab, inv_temp, dlogits);
  else
    logprob_backward<T, 1><<<unsigned(rows), kThreads, 0, stream>>>(logits, targets, lse, g, vocab, inv_temp, dlogits);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_token_logprob_forward(int dtype, const void* logits, const int64_t* targets, int64_t rows,
                                         int64_t vocab, float inv_temp, float* lp, float* lse, cudaStream_t stream) {
  if (dtype == 0) return forward(static_cast<const float*>(logits), targets, rows, vocab, inv_temp, lp, lse, stream);
  return forward(static_cast<const __nv_bfloat16*>(logits), targets, rows, vocab, inv_temp, lp, lse, stream);
}

cudaError_t launch_token_logprob_backward(int dtype, const void* logits, const int64_t* targets, const float* lse,
                                          const float* g, int64_t rows, int64_t vocab, float inv_temp, void* dlogits,
                                          cudaStream_t stream) {
  if (dtype == 0)
    return backward(static_cast<const float*>(logits), targets, lse, g, rows, vocab, inv_temp,
                    static_cast<float*>(dlogits), stream);
  using B = __nv_bfloat16;
  return backward(static_cast<const B*>(logits), targets, lse, g, rows, vocab, inv_temp, static_cast<B*>(dlogits),
                  stream);
}

}  // namespace kiln::kernels
