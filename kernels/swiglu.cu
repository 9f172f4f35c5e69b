// SwiGLU forward and backward, elementwise in fp32 over 16-byte vectors (a scalar tail), with
// silu(g) = g * sigmoid(g) and silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda_convert.cuh"
#include "kernels/swiglu_cuda.h"

namespace kiln::kernels {
namespace {

constexpr int kThreads = 256;

template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

__device__ __forceinline__ float sigmoid(float g) { return 1.f / (1.f + __expf(-g)); }

template <typename T>
__global__ void swiglu_forward(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ a, int64_t n) {
  using P = Pack<T>;
  const int64_t packs = n / P::kSize;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < packs; i += stride) {
    const P gp = reinterpret_cast<const P*>(g)[i], up = reinterpret_cast<const P*>(u)[i];
    P ap;
#pragma unroll
    for (int j = 0; j < P::kSize; ++j) {
      const float gv = to_float(gp.v[j]);
      ap.v[j] = from_float<T>(gv * sigmoid(gv) * to_float(up.v[j]));
    }
    reinterpret_cast<P*>(a)[i] = ap;
  }
  for (int64_t i = packs * P::kSize + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const float gv = to_float(g[i]);
    a[i] = from_float<T>(gv * sigmoid(gv) * to_float(u[i]));
  }
}

template <typename T>
__device__ __forceinline__ void backward_one(T g, T u, T da, T& dg, T& du) {
  const float gv = to_float(g), uv = to_float(u), dav = to_float(da);
  const float s = sigmoid(gv);
  du = from_float<T>(dav * gv * s);
  dg = from_float<T>(dav * uv * s * (1.f + gv * (1.f - s)));
}

template <typename T>
__global__ void swiglu_backward(const T* __restrict__ g, const T* __restrict__ u, const T* __restrict__ da,
                                T* __restrict__ dg, T* __restrict__ du, int64_t n) {
  using P = Pack<T>;
  const int64_t packs = n / P::kSize;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < packs; i += stride) {
    const P gp = reinterpret_cast<const P*>(g)[i], up = reinterpret_cast<const P*>(u)[i],
            dp = reinterpret_cast<const P*>(da)[i];
    P gout, uout;
#pragma unroll
    for (int j = 0; j < P::kSize; ++j) backward_one(gp.v[j], up.v[j], dp.v[j], gout.v[j], uout.v[j]);
    reinterpret_cast<P*>(dg)[i] = gout;
    reinterpret_cast<P*>(du)[i] = uout;
  }
  for (int64_t i = packs * P::kSize + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride)
    backward_one(g[i], u[i], da[i], dg[i], du[i]);
}

unsigned blocks_for(int64_t n, int per_thread) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((n / per_thread + kThreads - 1) / kThreads, 65536)));
}

bool aligned16(std::initializer_list<const void*> ptrs) {
  uintptr_t bits = 0;
  for (const void* p : ptrs) bits |= reinterpret_cast<uintptr_t>(p);
  return bits % 16 == 0;
}

template <typename T>
cudaError_t forward(const T* g, const T* u, T* a, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (!aligned16({g, u, a})) return cudaErrorMisalignedAddress;
  swiglu_forward<T><<<blocks_for(n, Pack<T>::kSize), kThreads, 0, stream>>>(g, u, a, n);
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward(const T* g, const T* u, const T* da, T* dg, T* du, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (!aligned16({g, u, da, dg, du})) return cudaErrorMisalignedAddress;
  swiglu_backward<T><<<blocks_for(n, Pack<T>::kSize), kThreads, 0, stream>>>(g, u, da, dg, du, n);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_swiglu_forward(int dtype, const void* g, const void* u, void* a, int64_t n, cudaStream_t stream) {
  if (dtype == 0) return forward(static_cast<const float*>(g), static_cast<const float*>(u), static_cast<float*>(a), n, stream);
  using B = __nv_bfloat16;
  return forward(static_cast<const B*>(g), static_cast<const B*>(u), static_cast<B*>(a), n, stream);
}

cudaError_t launch_swiglu_backward(int dtype, const void* g, const void* u, const void* da, void* dg, void* du,
                                   int64_t n, cudaStream_t stream) {
  if (dtype == 0)
    return backward(static_cast<const float*>(g), static_cast<const float*>(u), static_cast<const float*>(da),
                    static_cast<float*>(dg), static_cast<float*>(du), n, stream);
  using B = __nv_bfloat16;
  return backward(static_cast<const B*>(g), static_cast<const B*>(u), static_cast<const B*>(da), static_cast<B*>(dg),
                  static_cast<B*>(du), n, stream);
}

}  // namespace kiln::kernels
