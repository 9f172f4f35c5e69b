// Fused RMSNorm CUDA kernel: one block per row, fp32 sum of squares, Llama-convention rounding
// (normalised value cast to the storage dtype, then multiplied by the weight).
#include <cuda_bf16.h>

#include "kernels/rms_norm_cuda.h"

namespace kiln::kernels {
namespace {

constexpr int kThreads = 256;

__device__ inline float to_float(float v) { return v; }
__device__ inline float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ inline T from_float(float v);
template <>
__device__ inline float from_float<float>(float v) { return v; }
template <>
__device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
__global__ void rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                int64_t cols, float eps) {
  const T* row = x + blockIdx.x * cols;
  T* out = y + blockIdx.x * cols;
  float sum = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = to_float(row[c]);
    sum += v * v;
  }
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  __shared__ float warp_sums[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = sum;
  __syncthreads();
  if (warp == 0) {
    sum = lane < int(blockDim.x / 32) ? warp_sums[lane] : 0.f;
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) warp_sums[0] = sum;
  }
  __syncthreads();
  const float inv = rsqrtf(warp_sums[0] / float(cols) + eps);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const T normed = from_float<T>(to_float(row[c]) * inv);
    out[c] = from_float<T>(to_float(normed) * to_float(w[c]));
  }
}

template <typename T>
cudaError_t launch(const T* x, const T* w, T* y, int64_t rows, int64_t cols, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  rms_norm_kernel<T><<<dim3(unsigned(rows)), dim3(kThreads), 0, stream>>>(x, w, y, cols, eps);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rms_norm_f32(const float* x, const float* w, float* y, int64_t rows, int64_t cols,
                                float eps, cudaStream_t stream) {
  return launch(x, w, y, rows, cols, eps, stream);
}

cudaError_t launch_rms_norm_bf16(const void* x, const void* w, void* y, int64_t rows, int64_t cols,
                                 float eps, cudaStream_t stream) {
  return launch(static_cast<const __nv_bfloat16*>(x), static_cast<const __nv_bfloat16*>(w),
                static_cast<__nv_bfloat16*>(y), rows, cols, eps, stream);
}

}  // namespace kiln::kernels
