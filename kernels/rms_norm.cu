// Fused RMSNorm CUDA kernels: one block per row, fp32 sum of squares, Llama-convention rounding
// (normalised value cast to the storage dtype, then multiplied by the weight). Rows whose width is a
// multiple of 16 bytes use 16-byte loads and keep the row in registers; others take a scalar path.
// The weight is one row shared by all rows (w_stride 0) or one row per row (w_stride = cols).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda_convert.cuh"
#include "kernels/rms_norm_cuda.h"

namespace kiln::kernels {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kMaxChunks = 16;  // 16-byte chunks per thread held in registers: rows up to 32 KiB


// y = cast(x * inv) * w, rounded twice exactly as the ATen reference does.
template <typename T>
__device__ inline T normalise(T x, T w, float inv) {
  return from_float<T>(to_float(from_float<T>(to_float(x) * inv)) * to_float(w));
}

// Sum over the block; every thread gets the total.
__device__ inline float block_sum(float v) {
  __shared__ float warp_sums[kMaxThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < int(blockDim.x / 32) ? warp_sums[lane] : 0.f;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) warp_sums[0] = v;
  }
  __syncthreads();
  return warp_sums[0];
}

template <typename T>
__global__ void rms_norm_scalar(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                int64_t cols, int64_t w_stride, float eps) {
  const T* row = x + blockIdx.x * cols;
  w += blockIdx.x * w_stride;
  T* out = y + blockIdx.x * cols;
  float sum = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = to_float(row[c]);
    sum += v * v;
  }
  const float inv = rsqrtf(block_sum(sum) / float(cols) + eps);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) out[c] = normalise(row[c], w[c], inv);
}

template <typename T>
struct alignas(16) Chunk {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

template <typename T, int kChunks>
__global__ void rms_norm_vector(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                int64_t cols, int64_t w_stride, float eps) {
  w += blockIdx.x * w_stride;
  using C = Chunk<T>;
  const int64_t num_chunks = cols / C::kSize;
  const C* row = reinterpret_cast<const C*>(x + blockIdx.x * cols);
  const C* weight = reinterpret_cast<const C*>(w);
  C* out = reinterpret_cast<C*>(y + blockIdx.x * cols);
  C held[kChunks];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t c = threadIdx.x + int64_t(i) * blockDim.x;
    if (c < num_chunks) {
      held[i] = row[c];
#pragma unroll
      for (int j = 0; j < C::kSize; ++j) {
        const float v = to_float(held[i].v[j]);
        sum += v * v;
      }
    }
  }
  const float inv = rsqrtf(block_sum(sum) / float(cols) + eps);
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t c = threadIdx.x + int64_t(i) * blockDim.x;
    if (c < num_chunks) {
      const C wc = weight[c];
      C o;
#pragma unroll
      for (int j = 0; j < C::kSize; ++j) o.v[j] = normalise(held[i].v[j], wc.v[j], inv);
      out[c] = o;
    }
  }
}

template <typename T, int kChunks>
bool try_vector(const T* x, const T* w, T* y, int64_t rows, int64_t cols, int64_t w_stride, float eps,
                int threads, int64_t num_chunks, cudaStream_t stream) {
  if (num_chunks > int64_t(kChunks) * threads) return false;
  rms_norm_vector<T, kChunks><<<dim3(unsigned(rows)), dim3(threads), 0, stream>>>(x, w, y, cols, w_stride, eps);
  return true;
}

template <typename T>
cudaError_t launch(const T* x, const T* w, T* y, int64_t rows, int64_t cols, int64_t w_stride, float eps,
                   cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  constexpr int64_t kSize = Chunk<T>::kSize;
  const bool aligned = (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w) |
                        reinterpret_cast<uintptr_t>(y)) % 16 == 0;
  if (aligned && cols % kSize == 0) {
    const int64_t num_chunks = cols / kSize;
    const int threads = int(std::min<int64_t>(kMaxThreads, (num_chunks + 31) / 32 * 32));
    if (try_vector<T, 1>(x, w, y, rows, cols, w_stride, eps, threads, num_chunks, stream) ||
        try_vector<T, 2>(x, w, y, rows, cols, w_stride, eps, threads, num_chunks, stream) ||
        try_vector<T, 4>(x, w, y, rows, cols, w_stride, eps, threads, num_chunks, stream) ||
        try_vector<T, 8>(x, w, y, rows, cols, w_stride, eps, threads, num_chunks, stream) ||
        try_vector<T, kMaxChunks>(x, w, y, rows, cols, w_stride, eps, threads, num_chunks, stream))
      return cudaGetLastError();
  }
  rms_norm_scalar<T><<<dim3(unsigned(rows)), dim3(kMaxThreads), 0, stream>>>(x, w, y, cols, w_stride, eps);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rms_norm_f32(const float* x, const float* w, float* y, int64_t rows, int64_t cols,
                                int64_t w_stride, float eps, cudaStream_t stream) {
  return launch(x, w, y, rows, cols, w_stride, eps, stream);
}

cudaError_t launch_rms_norm_bf16(const void* x, const void* w, void* y, int64_t rows, int64_t cols,
                                 int64_t w_stride, float eps, cudaStream_t stream) {
  return launch(static_cast<const __nv_bfloat16*>(x), static_cast<const __nv_bfloat16*>(w),
                static_cast<__nv_bfloat16*>(y), rows, cols, w_stride, eps, stream);
}

}  // namespace kiln::kernels
