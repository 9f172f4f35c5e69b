// Fused RoPE: one thread per (token, head, pair) computes both halves of the pair. Products and the
// sum are rounded to the storage dtype in the reference's order, without FMA contraction, so the
// result is bitwise the reference's. A second kernel rotates a decode step's q and k and writes k
// and v into the paged KV cache in the same pass.
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

// The rotated pair (lo, hi) of x's values a = x[j], b = x[j + half], in the reference's roundings.
template <typename T>
__device__ inline void rotate(float a, float b, const T* c, const T* s, int64_t j, int64_t half, float& lo, float& hi) {
  const T tag{};
  lo = round_to(__fadd_rn(round_to(__fmul_rn(a, to_float(c[j])), tag), round_to(__fmul_rn(-b, to_float(s[j])), tag)), tag);
  hi = round_to(__fadd_rn(round_to(__fmul_rn(b, to_float(c[j + half])), tag),
                          round_to(__fmul_rn(a, to_float(s[j + half])), tag)), tag);
}

// The decode step's RoPE and cache write: thread (t, head, pair) over q's heads, then k's, then
// v's; q rotated into q_out, k rotated into k_cache[rows[t]], v copied into v_cache[rows[t]].
template <typename T>
__global__ void rope_cache_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                  const T* __restrict__ cos, const T* __restrict__ sin,
                                  const int64_t* __restrict__ rows, T* __restrict__ q_out, T* __restrict__ k_cache,
                                  T* __restrict__ v_cache, int64_t tokens, int64_t hq, int64_t hkv, int64_t hd) {
  const int64_t half = hd / 2, heads = hq + 2 * hkv;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens * heads * half) return;
  const int64_t j = i % half, th = i / half, t = th / heads, h = th % heads;
  if (h >= hq + hkv) {  // a value: copied as it is
    const int64_t hv = h - hq - hkv;
    const T* src = v + (t * hkv + hv) * hd;
    T* dst = v_cache + (rows[t] * hkv + hv) * hd;
    dst[j] = src[j];
    dst[j + half] = src[j + half];
    return;
  }
  const bool is_q = h < hq;
  const T* src = is_q ? q + (t * hq + h) * hd : k + (t * hkv + (h - hq)) * hd;
  T* dst = is_q ? q_out + (t * hq + h) * hd : k_cache + (rows[t] * hkv + (h - hq)) * hd;
  float lo, hi;
  rotate(to_float(src[j]), to_float(src[j + half]), cos + t * hd, sin + t * hd, j, half, lo, hi);
  put(dst + j, lo);
  put(dst + j + half, hi);
}

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
  // y[j] = x[j] * cos[j] + (-x[j + half]) * sin[j];  y[j + half] = x[j + half] * cos[j + half] + x[j] * sin[j + half]
  float lo, hi;
  rotate(to_float(xr[j]), to_float(xr[j + half]), c, s, j, half, lo, hi);
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

template <typename T>
cudaError_t launch_cache(const T* q, const T* k, const T* v, const T* cos, const T* sin, const int64_t* rows, T* q_out,
                         T* k_cache, T* v_cache, int64_t tokens, int64_t hq, int64_t hkv, int64_t hd,
                         cudaStream_t stream) {
  const int64_t n = tokens * (hq + 2 * hkv) * (hd / 2);
  if (n == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  rope_cache_kernel<T><<<unsigned((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      q, k, v, cos, sin, rows, q_out, k_cache, v_cache, tokens, hq, hkv, hd);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rope_cache_write(int dtype, const void* q, const void* k, const void* v, const void* cos,
                                    const void* sin, const int64_t* rows, void* q_out, void* k_cache, void* v_cache,
                                    int64_t tokens, int64_t hq, int64_t hkv, int64_t head_dim, cudaStream_t stream) {
  if (dtype == 0)
    return launch_cache(static_cast<const float*>(q), static_cast<const float*>(k), static_cast<const float*>(v),
                        static_cast<const float*>(cos), static_cast<const float*>(sin), rows,
                        static_cast<float*>(q_out), static_cast<float*>(k_cache), static_cast<float*>(v_cache), tokens,
                        hq, hkv, head_dim, stream);
  using B = __nv_bfloat16;
  return launch_cache(static_cast<const B*>(q), static_cast<const B*>(k), static_cast<const B*>(v),
                      static_cast<const B*>(cos), static_cast<const B*>(sin), rows, static_cast<B*>(q_out),
                      static_cast<B*>(k_cache), static_cast<B*>(v_cache), tokens, hq, hkv, head_dim, stream);
}

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
