// float <-> storage-type conversions shared by the CUDA kernels (fp32, bf16, fp16), round to
// nearest even, and a 16-value load that converts. Device code only; include from .cu files.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kiln::kernels {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// kVec values moved as one aligned access (16 bytes for 8 bf16 or 4 floats).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Vec {
  T v[kVec];
};

// 16 consecutive values of a 16-byte aligned row as floats.
template <typename T>
__device__ __forceinline__ void load16(const T* p, float (&v)[16]) {
  constexpr int kPer = 16 / int(sizeof(T));
  const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < 16 / kPer; ++i) {
    const uint4 u = __ldg(q + i);
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int j = 0; j < kPer; ++j) v[i * kPer + j] = to_float(e[j]);
  }
}

}  // namespace kiln::kernels
