// Tensor-core and bit helpers shared by the CUDA kernels: the bf16 mma.m16n8k16 (FP32
// accumulation), a byte permute, and two floats packed as bf16x2. Device code; include from .cu files.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace kiln::kernels {

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// c += A . B for A 16x16 (row-major fragments a0..a3) and B 16x8 (b0, b1), bf16 in, fp32 out. A
// lane (g = lane / 4, t = lane % 4) holds A rows g and g + 8 at k 2t, 2t + 1 (a0, a1) and k 2t + 8,
// 2t + 9 (a2, a3), B column g at the same k pairs, and C rows g, g + 8 at columns 2t, 2t + 1.
__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);  // a in the low half
  return *reinterpret_cast<const uint32_t*>(&h);
}

}  // namespace kiln::kernels
