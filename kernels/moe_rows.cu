// The MoE's row movers, one block per token: expand copies (and weights) a token's row into its k
// expert-sorted rows, reduce sums them back. Dispatch is expand (its backward reduce); the
// weighted combine is reduce (its backward expand with the weights, plus the k dot products that
// are the routing weights' gradient). Fixed summation order: deterministic, no atomics.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda_convert.cuh"
#include "kernels/moe_rows_cuda.h"

namespace kiln::kernels {
namespace {

constexpr int kThreads = 256;

template <typename T, int kVec>
__device__ __forceinline__ void load(const T* p, float (&out)[kVec]) {
  const Vec<T, kVec> v = *reinterpret_cast<const Vec<T, kVec>*>(p);
#pragma unroll
  for (int i = 0; i < kVec; ++i) out[i] = to_float(v.v[i]);
}

template <typename T, int kVec>
__device__ __forceinline__ void store(T* p, const float (&in)[kVec]) {
  store_vec<T, kVec>(p, in);
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) moe_expand(const T* __restrict__ x, const float* __restrict__ w,
                                                       const int64_t* __restrict__ slot_row, int k, int64_t cols,
                                                       T* __restrict__ out, const T* __restrict__ y,
                                                       float* __restrict__ dots) {
  __shared__ float partial[kThreads / 32][kMoeRowsMaxTopK];
  const int64_t t = blockIdx.x;
  const T* xr = x + t * cols;
  float dot[kMoeRowsMaxTopK];
#pragma unroll
  for (int j = 0; j < kMoeRowsMaxTopK; ++j) dot[j] = 0.f;
  for (int64_t c = int64_t(threadIdx.x) * kVec; c < cols; c += int64_t(blockDim.x) * kVec) {
    float xv[kVec];
    load<T, kVec>(xr + c, xv);
#pragma unroll
    for (int j = 0; j < kMoeRowsMaxTopK; ++j) {
      if (j >= k) break;
      const int64_t row = slot_row[t * k + j];
      const float scale = w ? w[t * k + j] : 1.f;
      float o[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) o[i] = xv[i] * scale;
      store<T, kVec>(out + row * cols + c, o);
      if (dots) {
        float yv[kVec];
        load<T, kVec>(y + row * cols + c, yv);
#pragma unroll
        for (int i = 0; i < kVec; ++i) dot[j] += xv[i] * yv[i];
      }
    }
  }
  if (!dots) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < kMoeRowsMaxTopK; ++j) {
    if (j >= k) break;
    float v = dot[j];
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) partial[warp][j] = v;
  }
  __syncthreads();
  if (threadIdx.x < k) {
    float s = 0.f;
    for (int i = 0; i < int(blockDim.x / 32); ++i) s += partial[i][threadIdx.x];
    dots[t * k + threadIdx.x] = s;
  }
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) moe_reduce(const T* __restrict__ y, const float* __restrict__ w,
                                                       const int64_t* __restrict__ slot_row, int k, int64_t cols,
                                                       T* __restrict__ out) {
  const int64_t t = blockIdx.x;
  for (int64_t c = int64_t(threadIdx.x) * kVec; c < cols; c += int64_t(blockDim.x) * kVec) {
    float acc[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] = 0.f;
    for (int j = 0; j < k; ++j) {
      const int64_t row = slot_row[t * k + j];
      const float scale = w ? w[t * k + j] : 1.f;
      float yv[kVec];
      load<T, kVec>(y + row * cols + c, yv);
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] += scale * yv[i];
    }
    store<T, kVec>(out + t * cols + c, acc);
  }
}

// Threads for rows of `cols`: enough to cover a row in one step, a multiple of 32, at most kThreads.
int threads_for(int64_t cols, int vec) {
  return int(std::min<int64_t>(kThreads, std::max<int64_t>(32, ((cols / vec) + 31) / 32 * 32)));
}

bool aligned16(std::initializer_list<const void*> ptrs) {
  uintptr_t bits = 0;
  for (const void* p : ptrs) bits |= reinterpret_cast<uintptr_t>(p);
  return bits % 16 == 0;
}

template <typename T>
cudaError_t expand(const T* x, const float* w, const int64_t* slot_row, int64_t tokens, int k, int64_t cols, T* out,
                   const T* y, float* dots, cudaStream_t stream) {
  if (tokens == 0 || cols == 0) return cudaSuccess;
  if (k < 1 || k > kMoeRowsMaxTopK || tokens > INT32_MAX) return cudaErrorInvalidValue;
  constexpr int kVec = 16 / sizeof(T);
  if (cols % kVec == 0 && aligned16({x, out, y})) {
    moe_expand<T, kVec><<<unsigned(tokens), threads_for(cols, kVec), 0, stream>>>(x, w, slot_row, k, cols, out, y, dots);
  } else {
    moe_expand<T, 1><<<unsigned(tokens), threads_for(cols, 1), 0, stream>>>(x, w, slot_row, k, cols, out, y, dots);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t reduce(const T* y, const float* w, const int64_t* slot_row, int64_t tokens, int k, int64_t cols, T* out,
                   cudaStream_t stream) {
  if (tokens == 0 || cols == 0) return cudaSuccess;
  if (k < 1 || tokens > INT32_MAX) return cudaErrorInvalidValue;
  constexpr int kVec = 16 / sizeof(T);
  if (cols % kVec == 0 && aligned16({y, out})) {
    moe_reduce<T, kVec><<<unsigned(tokens), threads_for(cols, kVec), 0, stream>>>(y, w, slot_row, k, cols, out);
  } else {
    moe_reduce<T, 1><<<unsigned(tokens), threads_for(cols, 1), 0, stream>>>(y, w, slot_row, k, cols, out);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_moe_expand(int dtype, const void* x, const float* w, const int64_t* slot_row, int64_t tokens,
                              int k, int64_t cols, void* out, const void* y, float* dots, cudaStream_t stream) {
  if (dtype == 0)
    return expand(static_cast<const float*>(x), w, slot_row, tokens, k, cols, static_cast<float*>(out),
                  static_cast<const float*>(y), dots, stream);
  using B = __nv_bfloat16;
  return expand(static_cast<const B*>(x), w, slot_row, tokens, k, cols, static_cast<B*>(out),
                static_cast<const B*>(y), dots, stream);
}

cudaError_t launch_moe_reduce(int dtype, const void* y, const float* w, const int64_t* slot_row, int64_t tokens,
                              int k, int64_t cols, void* out, cudaStream_t stream) {
  if (dtype == 0)
    return reduce(static_cast<const float*>(y), w, slot_row, tokens, k, cols, static_cast<float*>(out), stream);
  using B = __nv_bfloat16;
  return reduce(static_cast<const B*>(y), w, slot_row, tokens, k, cols, static_cast<B*>(out), stream);
}

}  // namespace kiln::kernels
