// The NVFP4 GEMMs' kernel layout of packed codes: a fixed permutation of the 32 bits of every word
// of 8 codes, and the bit step of its decode. Shared by the CPU conversion (nvfp4.cpp), the CUDA
// kernels (nvfp4.cu) and the tests; no torch or CUDA headers.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define KILN_HOST_DEVICE __host__ __device__
#else
#define KILN_HOST_DEVICE
#endif

namespace kiln::kernels::nvfp4_layout {

// ModelOpt order: element j (0..7) in bits 4j..4j+3 as mantissa, exponent low, exponent high, sign.
// Kernel order: elements 2q and 2q+1 (q = 0..3) sit at the same places of the low and the high
// 16-bit half, magnitude (m, e0, e1) at bits mag(q)..mag(q)+2 and the sign at bit sign(q) (+16
// for element 2q+1). The places are chosen so that pair_bits below needs a rotate and a mask for
// q = 0 and 1, and a rotate (or none), a shift and two masks for q = 2 and 3.
KILN_HOST_DEVICE constexpr int mag_bit(int q) { return q == 0 ? 0 : q == 1 ? 3 : q == 2 ? 6 : 13; }
KILN_HOST_DEVICE constexpr int sign_bit(int q) { return q == 0 ? 9 : q == 1 ? 12 : q == 2 ? 10 : 11; }

// Where ModelOpt bit i (0..31) of a word goes in the kernel layout.
KILN_HOST_DEVICE constexpr int kernel_bit(int i) {
  const int j = i / 4, b = i % 4, q = j / 2, half = (j % 2) * 16;
  return (b < 3 ? mag_bit(q) + b : sign_bit(q)) + half;
}

KILN_HOST_DEVICE inline uint32_t to_kernel_word(uint32_t w) {
  uint32_t out = 0;
  for (int i = 0; i < 32; ++i) out |= ((w >> i) & 1u) << kernel_bit(i);
  return out;
}

KILN_HOST_DEVICE inline uint32_t to_modelopt_word(uint32_t w) {
  uint32_t out = 0;
  for (int i = 0; i < 32; ++i) out |= ((w >> kernel_bit(i)) & 1u) << i;
  return out;
}

KILN_HOST_DEVICE inline uint32_t rotl(uint32_t w, int k) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_l(w, w, k);  // one SHF
#else
  return (w << k) | (w >> (32 - k));  // k in 1..31
#endif
}

// Pair q of a kernel-layout word as a bf16x2 (element 2q low): sign at bit 15, the code's
// exponent and mantissa at bits 8..6, the rest zero; the same at 31 and 24..22. Read as bf16 this
// is e2m1 * 2^-126 (0.5 becomes the subnormal 2^-127), so one exact multiply by a power-of-two
// multiple of the block scale gives the weight.
KILN_HOST_DEVICE inline uint32_t pair_bits(uint32_t w, int q) {
  constexpr uint32_t kPair = 0x81C081C0u, kMag = 0x01C001C0u, kSign = 0x80008000u;
  switch (q) {
    case 0: return rotl(w, 6) & kPair;
    case 1: return rotl(w, 3) & kPair;
    case 2: return (w & kMag) | ((w << 5) & kSign);
    default: return (rotl(w, 25) & kMag) | ((w << 4) & kSign);
  }
}

}  // namespace kiln::kernels::nvfp4_layout
