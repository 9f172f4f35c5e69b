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

// The unsigned type of `Bytes` bytes, for moving a Vec as one access.
template <int Bytes>
struct RawOf;
template <>
struct RawOf<16> { using type = uint4; };
template <>
struct RawOf<8> { using type = uint2; };
template <>
struct RawOf<4> { using type = unsigned; };
template <>
struct RawOf<2> { using type = unsigned short; };

// Stores kVec floats rounded to T at p (aligned to the whole vector) as one access. Assigning a
// Vec of bf16 directly compiles to one 2-byte store per element, each a partial L2 sector write
// (the MoE dispatch ran at 12% of DRAM bandwidth with its L2 saturated that way).
template <typename T, int kVec>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[kVec]) {
  Vec<T, kVec> v;
#pragma unroll
  for (int i = 0; i < kVec; ++i) v.v[i] = from_float<T>(in[i]);
  using Raw = typename RawOf<int(sizeof(T)) * kVec>::type;
  *reinterpret_cast<Raw*>(p) = *reinterpret_cast<const Raw*>(&v);
}

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
