// The multi-tensor AdamW step: one launch updates a batch of tensors (their pointers in the kernel's
// arguments), each block 4096 elements of one tensor, fp32 math, 16-byte loads where aligned.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/adamw_cuda.h"
#include "kernels/cuda_convert.cuh"

namespace kiln::kernels {
namespace {

constexpr int kThreads = 256, kVec = 4, kIters = 4;
constexpr int64_t kPerBlock = int64_t(kThreads) * kVec * kIters;  // elements per block
constexpr int kMaxSlices = 40;  // keeps the argument block under the classic 4 KiB limit

struct Batch {
  AdamWSlice s[kMaxSlices];
  int64_t first_block[kMaxSlices + 1];  // block offsets; the last is the grid size
  bool vec[kMaxSlices];                 // every pointer of the slice 16-byte (fp32) / 8-byte aligned
  int count;
};

__device__ __forceinline__ float load1(const void* p, uint8_t code, int64_t i) {
  if (code == kAdamWF32) return static_cast<const float*>(p)[i];
  if (code == kAdamWBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return __half2float(static_cast<const __half*>(p)[i]);
}

__device__ __forceinline__ void store1(void* p, uint8_t code, int64_t i, float v) {
  if (code == kAdamWF32)
    static_cast<float*>(p)[i] = v;
  else if (code == kAdamWBF16)
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  else
    static_cast<__half*>(p)[i] = __float2half_rn(v);
}

// Four consecutive values at element i (aligned to 4 elements), as one access.
__device__ __forceinline__ void load4(const void* p, uint8_t code, int64_t i, float (&v)[4]) {
  if (code == kAdamWF32) {
    const float4 x = *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
    return;
  }
  const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(p) + i);
  const uint16_t* h = reinterpret_cast<const uint16_t*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j)
    v[j] = code == kAdamWBF16 ? __bfloat162float(__ushort_as_bfloat16(h[j])) : __half2float(__ushort_as_half(h[j]));
}

__device__ __forceinline__ void store4(void* p, uint8_t code, int64_t i, const float (&v)[4]) {
  if (code == kAdamWF32) {
    *reinterpret_cast<float4*>(static_cast<float*>(p) + i) = make_float4(v[0], v[1], v[2], v[3]);
    return;
  }
  uint2 raw;
  uint16_t* h = reinterpret_cast<uint16_t*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j)
    h[j] = code == kAdamWBF16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v[j])) : __half_as_ushort(__float2half_rn(v[j]));
  *reinterpret_cast<uint2*>(static_cast<uint16_t*>(p) + i) = raw;
}

// torch.optim.AdamW's order: decay, the moments (lerp, then the addcmul), then the addcdiv. Every
// operation rounds on its own (no contraction into FMAs), so that the vector and scalar paths,
// and so any chunking of a tensor, give the same bits.
__device__ __forceinline__ void adamw_one(float& w, float g, float& m, float& v, const AdamWScalars& s) {
  w = __fmul_rn(w, s.decay);
  m = __fadd_rn(m, __fmul_rn(s.one_minus_beta1, __fsub_rn(g, m)));
  v = __fadd_rn(__fmul_rn(v, s.beta2), __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.sqrt_bc2), s.eps);
  w = __fsub_rn(w, __fmul_rn(s.step_size, __fdiv_rn(m, denom)));
}

// Element k of slice t, one value at a time (misaligned slices and vector tails).
__device__ __forceinline__ void adamw_element(const AdamWSlice& t, int64_t k, const AdamWScalars& s) {
  float w = load1(t.w, t.w_dtype, k), m = load1(t.m, t.m_dtype, k), v = load1(t.v, t.m_dtype, k);
  adamw_one(w, load1(t.g, t.g_dtype, k), m, v, s);
  store1(t.w, t.w_dtype, k, w);
  store1(t.m, t.m_dtype, k, m);
  store1(t.v, t.m_dtype, k, v);
  if (t.p) store1(t.p, t.p_dtype, k, w);
}

__global__ void __launch_bounds__(kThreads) adamw_kernel(const __grid_constant__ Batch b, const AdamWScalars s) {
  // The slice of this block: the last with first_block <= blockIdx.x.
  int lo = 0, hi = b.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (b.first_block[mid] <= int64_t(blockIdx.x))
      lo = mid;
    else
      hi = mid - 1;
  }
  const AdamWSlice& t = b.s[lo];
  const int64_t begin = (int64_t(blockIdx.x) - b.first_block[lo]) * kPerBlock;
  const int64_t end = min(t.n, begin + kPerBlock);
  if (b.vec[lo]) {
    for (int64_t i = begin + int64_t(threadIdx.x) * kVec; i < end; i += int64_t(kThreads) * kVec) {
      if (i + kVec <= end) {
        float w[4], g[4], m[4], v[4];
        load4(t.w, t.w_dtype, i, w);
        load4(t.g, t.g_dtype, i, g);
        load4(t.m, t.m_dtype, i, m);
        load4(t.v, t.m_dtype, i, v);
#pragma unroll
        for (int j = 0; j < 4; ++j) adamw_one(w[j], g[j], m[j], v[j], s);
        store4(t.w, t.w_dtype, i, w);
        store4(t.m, t.m_dtype, i, m);
        store4(t.v, t.m_dtype, i, v);
        if (t.p) store4(t.p, t.p_dtype, i, w);
      } else {
        for (int64_t k = i; k < end; ++k) adamw_element(t, k, s);
      }
    }
    return;
  }
  for (int64_t k = begin + threadIdx.x; k < end; k += kThreads) adamw_element(t, k, s);
}

// A pointer fit for 4-element accesses of its dtype (16 bytes for fp32, 8 for 16-bit types).
bool vec_aligned(const void* p, uint8_t code) {
  if (code == kAdamWNone) return true;
  return reinterpret_cast<uintptr_t>(p) % (code == kAdamWF32 ? 16 : 8) == 0;
}

bool valid_code(uint8_t c) { return c <= kAdamWF16; }

}  // namespace

cudaError_t launch_adamw(const AdamWSlice* slices, int count, const AdamWScalars& s, cudaStream_t stream) {
  for (int i = 0; i < count; ++i) {
    const AdamWSlice& t = slices[i];
    if (!valid_code(t.w_dtype) || !valid_code(t.g_dtype) || !valid_code(t.m_dtype) ||
        (t.p != nullptr) != (t.p_dtype != kAdamWNone) || (t.p && !valid_code(t.p_dtype)))
      return cudaErrorInvalidValue;
  }
  Batch b;
  int i = 0;
  while (i < count) {
    b.count = 0;
    int64_t blocks = 0;
    for (; i < count && b.count < kMaxSlices; ++i) {
      const AdamWSlice& t = slices[i];
      if (t.n <= 0) continue;
      const int64_t need = (t.n + kPerBlock - 1) / kPerBlock;
      if (b.count > 0 && blocks + need > int64_t(INT32_MAX)) break;
      b.s[b.count] = t;
      b.first_block[b.count] = blocks;
      b.vec[b.count] = vec_aligned(t.w, t.w_dtype) && vec_aligned(t.g, t.g_dtype) && vec_aligned(t.m, t.m_dtype) &&
                       vec_aligned(t.v, t.m_dtype) && (t.p == nullptr || vec_aligned(t.p, t.p_dtype));
      blocks += need;
      ++b.count;
    }
    if (b.count == 0) continue;
    b.first_block[b.count] = blocks;
    adamw_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(b, s);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace kiln::kernels
