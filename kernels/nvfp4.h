// NVFP4 as MUSE.md §6 defines it, CPU reference: E2M1 codes with round-to-nearest-even and
// saturation, FP8 E4M3 block scales (one per 16 values along K), an FP32 tensor scale, and packing
// two codes per byte with element 0 in the low nibble. Bit-exact; the CUDA kernels are checked
// against it.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kiln::kernels {

constexpr int64_t kNvfp4Block = 16;  // values per FP8 block scale, along K

// The E2M1 code (sign in bit 3) of x: nearest of {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to the even
// code, saturating at 6. Negative inputs keep the sign bit, also when they round to zero.
uint8_t e2m1_encode(float x);
float e2m1_decode(uint8_t code);  // the low 4 bits

// FP8 E4M3 (the "fn" variant: bias 7, no infinities, max 448): round to nearest even, saturating
// at 448; NaN stays NaN (0x7F with the sign).
uint8_t e4m3_encode(float x);
float e4m3_decode(uint8_t bits);

struct Nvfp4Tensor {
  at::Tensor packed;        // uint8 [N, K/2]: element 2j in the low nibble of byte j
  at::Tensor block_scale;   // uint8 [N, K/16]: FP8 E4M3 bits (safetensors F8_E4M3), row-major
  at::Tensor tensor_scale;  // float32 scalar: amax(W) / (6 * 448)
};

// Quantises W [N, K] (any float dtype; K a multiple of 16). An all-zero block gets scale 0 (and
// codes 0); an all-zero tensor gets tensor scale 1.
Nvfp4Tensor nvfp4_quantize_reference(const at::Tensor& w);
// W [N, K] in `dtype`: e2m1(q) * float(sf) * s2, computed in fp32. Accepts any block scale,
// including ModelOpt's 1.0 for zero blocks. Checks shapes and names what does not fit.
at::Tensor nvfp4_dequantize_reference(const Nvfp4Tensor& q, at::ScalarType dtype = at::kFloat);

}  // namespace kiln::kernels
