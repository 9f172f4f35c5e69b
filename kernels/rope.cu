// Fused RoPE: one thread per (token, head, pair) computes both halves of the pair. Products and the
// sum are rounded to the storage dtype in the reference's order, without FMA contraction, so the
// result is bitwise the reference's.
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda_convert.cuh"
#include "kernels/rope_cuda.h"

namespace kiln::kernels {
namespace {

__device__ inline float round_to(float v, float) { return v; }
__device__ inline float round_to(float v, __nv_bfloat16) { return __bfloat162float(__float2bfloat16_rn(v)); }
__device__ inline void put(float* p, float v) { *p = v; }
__device__ inline void put(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

template <typename T>
__global__ void rope_kernel(const T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin,
                            T* __restrict__ y, int64_t tokens, int64_t heads, int64_t hd) {
  const int64_t half = hd / 2;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens * heads * half) return;
  const int64_t j = i % half, th = i / half, t = th / heads;
  const T* xr = x + th * hd;
  const T* c = cos + t * hd;
  const T* s = sin + t * hd;
  const float a = to_float(xr[j]), b = to_float(xr[j + half]);
  // y[j] = x[j] * cos[j] + (-x[j + half]) * sin[j];  y[j + half] = x[j + half] * cos[j + half] + x[j] * sin[j + half]
  const T tag{};
  const float lo = round_to(__fadd_rn(round_to(__fmul_rn(a, to_float(c[j])), tag),
                                      round_to(__fmul_rn(-b, to_float(s[j])), tag)), tag);
  const float hi = round_to(__fadd_rn(round_to(__fmul_rn(b, to_float(c[j + half])), tag),
                                      round_to(__fmul_rn(a, to_float(s[j + half])), tag)), tag);
  put(y + th * hd + j, lo);
  put(y + th * hd + j + half, hi);
}

template <typename T>
cudaError_t launch(const T* x, const T* cos, const T* sin, T* y, int64_t tokens, int64_t heads, int64_t hd,
                   cudaStream_t stream) {
  const int64_t n = tokens * heads * (hd / 2);
  if (n == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  rope_kernel<T><<<unsigned((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(x, cos, sin, y, tokens, heads, hd);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rope_f32(const float* x, const float* cos, const float* sin, float* y, int64_t tokens,
                            int64_t heads, int64_t head_dim, cudaStream_t stream) {
  return launch(x, cos, sin, y, tokens, heads, head_dim, stream);
}

cudaError_t launch_rope_bf16(const void* x, const void* cos, const void* sin, void* y, int64_t tokens,
                             int64_t heads, int64_t head_dim, cudaStream_t stream) {
  using B = __nv_bfloat16;
  return launch(static_cast<const B*>(x), static_cast<const B*>(cos), static_cast<const B*>(sin), static_cast<B*>(y),
                tokens, heads, head_dim, stream);
}

}  // namespace kiln::kernels
