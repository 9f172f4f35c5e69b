// NVFP4 as docs/MODEL.md §4 defines it: E2M1 codes (round-to-nearest-even, saturating), FP8 E4M3 block
// scales (one per 16 values along K), an FP32 tensor scale, two codes per byte (element 0 in the low
// nibble). CPU references, bit-exact, and the W4A16 / W4A4 linears the rollout engine serves with.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kernels/nvfp4_dispatch.h"  // the dispatch table, the process's GEMM choice
#include "kernels/nvfp4_layout.h"  // Nvfp4Gemm

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

// One quantised matrix [N, K], or a stack of them [E, N, K] (the experts of a layer: one tensor
// scale per matrix, as each expert is its own checkpoint tensor).
struct Nvfp4Tensor {
  // ModelOpt layout (below: the kernel layout moves blocks and permutes bits within each matrix).
  at::Tensor packed;        // uint8 [(E,) N, K/2]: element 2j in the low nibble of byte j
  at::Tensor block_scale;   // uint8 [(E,) N, K/16]: FP8 E4M3 bits (safetensors F8_E4M3), row-major
  at::Tensor tensor_scale;  // float32 [] (or [E]): amax(W) / (6 * 448)
  bool kernel_layout = false;  // packed and block_scale in the GEMMs' layout (nvfp4_to_kernel_layout)
  at::Tensor input_scale;   // float32 [] (or [E]), optional: ModelOpt's static activation scale (W4A4)
  int64_t rows() const { return packed.size(-2); }
  int64_t cols() const { return packed.size(-1) * 2; }  // K
  bool stacked() const { return packed.dim() == 3; }
  Nvfp4Tensor to(at::Device device) const;
};

// Checks shapes and dtypes and names what does not fit (`what` names the tensor in messages).
void nvfp4_check(const Nvfp4Tensor& q, const char* what = "nvfp4");

// Quantises W [N, K] or [E, N, K] (any float dtype; K a multiple of 16). An all-zero block gets
// scale 0 (and codes 0); an all-zero matrix gets tensor scale 1.
Nvfp4Tensor nvfp4_quantize_reference(const at::Tensor& w);
// W in `dtype`: e2m1(q) * float(sf) * s2, computed in fp32. Accepts any block scale, including
// ModelOpt's 1.0 for zero blocks. ModelOpt layout only.
at::Tensor nvfp4_dequantize_reference(const Nvfp4Tensor& q, at::ScalarType dtype = at::kFloat);
// Dispatch: the CUDA kernels for CUDA tensors (bit-identical to the references), else the references.
// kernel_layout: the codes in the GEMMs' layout (below); the CUDA quantiser writes it directly.
Nvfp4Tensor nvfp4_quantize(const at::Tensor& w, bool kernel_layout = false);
at::Tensor nvfp4_dequantize(const Nvfp4Tensor& q, at::ScalarType dtype);

// The kernel layout (kernels/nvfp4_layout.h), same shapes: the 32 bits of each word (8 codes)
// permuted, so the GEMM turns each pair of codes into a bf16x2 with a rotate and a mask or two; and
// each matrix's blocks (codes and scales) moved so that a warp step of 32 rows x 256 K is one
// contiguous tile. Experts still slice (the layout is per matrix); rows do not. ATen gathers: any
// device. The inverse restores the ModelOpt order.
Nvfp4Tensor nvfp4_to_kernel_layout(const Nvfp4Tensor& q);
Nvfp4Tensor nvfp4_to_modelopt_layout(const Nvfp4Tensor& q);

// Options of a quantised linear.
struct Nvfp4LinearOptions {
  // W4A4 (Blackwell numerics, emulated): activations are also quantised to NVFP4 per 16 values
  // along K under a second-level scale: `input_scale` when defined (static, calibrated: amax_in /
  // (6 * 448)), else each row's own amax / (6 * 448) (dynamic per token, so a token's numerics do
  // not depend on the rest of its batch). The product of the codes-times-block-scales accumulates
  // in FP32 and is multiplied by that scale and s2.
  bool w4a4 = false;
  at::Tensor input_scale;  // float32 scalar, optional
  // The grouped calls' rows that carry work, for their choice between the fused W4A16 kernel and
  // the dequantised GEMM (0: every row of x). An expert exchange's fixed-shape buffer also holds
  // spare rows that no expert runs; counting them would take the prefill path at half the load.
  int64_t live_rows = 0;
};

// y [M, N] = x [M, K] . W^T for W in NVFP4 (W4A16): y = (sum_k x_k * e2m1(q_k) * sf) * s2 with an
// FP32 sum; the output has x's dtype. Reference: fp32 math on any device (dequantises to fp32).
at::Tensor nvfp4_linear_reference(const at::Tensor& x, const Nvfp4Tensor& w, const Nvfp4LinearOptions& opt = {});
// Grouped (the MoE experts): x [R, K] holds rows sorted by expert, rows offsets[e]..offsets[e+1]
// going to expert e of the stacked W [E, N, K]; offsets int64 [E + 1] on x's device. Returns [R, N].
// Rows past offsets[E] belong to no expert: zero in the reference, unread elsewhere.
at::Tensor nvfp4_grouped_linear_reference(const at::Tensor& x, const Nvfp4Tensor& w, const at::Tensor& offsets,
                                          const Nvfp4LinearOptions& opt = {});
// Dispatch: the CUDA GEMMs for CUDA bf16/fp32 inputs with kernel-layout weights, else the references;
// which kernel runs which shape is the table in nvfp4_dispatch.cpp (nvfp4_kernel), under the
// process's choice (nvfp4_gemm_selected). Dequantising W rounds each weight once to x's dtype, the
// tensor scale folded in (no separate scale pass over the output). Above the fused kernels' rows,
// bf16 stacks run through torch's grouped GEMM (torch >= 2.8) without a host sync; fp32 (and older
// torch) read the offsets on the host and loop over the experts.
at::Tensor nvfp4_linear(const at::Tensor& x, const Nvfp4Tensor& w, const Nvfp4LinearOptions& opt = {});
// The path nvfp4_linear takes for these inputs (nvfp4_kernel_name): "splitK", "wgmma", "deq+mm" or "reference".
const char* nvfp4_linear_path(const at::Tensor& x, const Nvfp4Tensor& w);
at::Tensor nvfp4_grouped_linear(const at::Tensor& x, const Nvfp4Tensor& w, const at::Tensor& offsets,
                                const Nvfp4LinearOptions& opt = {});
// The path nvfp4_grouped_linear takes for `rows` rows like x on w's stack: "splitK", "staged" (the
// grouped staged kernel launched per expert), "staged tiles" (its tiled launch), "wgmma",
// "deq+grouped_mm", "deq+mm per expert" or "reference".
const char* nvfp4_grouped_linear_path(const at::Tensor& x, const Nvfp4Tensor& w, int64_t rows);
// Whether nvfp4_grouped_linear runs `rows` rows like x (dtype, device) on the dequantised stack and
// torch's grouped GEMM (Nvfp4Kernel::kDequantizedGrouped in the table).
bool nvfp4_grouped_dequantizes(const Nvfp4Tensor& w, int64_t rows, const at::Tensor& x);
// The grouped GEMM on rows already in the MoE layer's padded layout (kernels::moe_layout with
// align 16): expert e's rows end at ends[e] (int32 [E], on x's device) and start on a 16-row
// boundary; rows between segments are padding (zeros), and rows past ends[E - 1] belong to no
// expert: the outputs of both are not meant to be read. Where nvfp4_grouped_dequantizes holds, the
// dequantised stack goes straight into torch's grouped GEMM (no row moves: the caller's layout is
// the GEMM's); elsewhere the dispatch above, each padded segment as its expert's rows. `segments`
// ([E + 1] int64: 0 then ends, MoeLayout::segments) saves building those offsets when given.
at::Tensor nvfp4_grouped_linear_aligned(const at::Tensor& xp, const Nvfp4Tensor& w, const at::Tensor& ends,
                                        const Nvfp4LinearOptions& opt = {}, const at::Tensor& segments = {});
// Whether nvfp4_grouped_linear_aligned runs rows like x on the GPU without waiting for the host
// (bf16 on CUDA, the kernel layout, a stack; torch >= 2.8 for its prefill sizes): the fused MoE path.
bool nvfp4_grouped_on_device(const Nvfp4Tensor& w, const at::Tensor& x);
// W4A4's activation step: x [M, K] -> the dequantised values e2m1(q) * sf (without the second-level
// scale, which the GEMM applies), exact in bf16; `scale` is that scale: [] (static) or [M, 1].
at::Tensor nvfp4_fake_quantize_activations(const at::Tensor& x, const at::Tensor& input_scale, at::Tensor* scale);

// The CUDA kernels (nvfp4_cuda.cpp); each throws in builds without CUDA. Inputs on one CUDA device.
Nvfp4Tensor nvfp4_quantize_cuda(const at::Tensor& w, bool kernel_layout = false);  // bit-exact to the reference
at::Tensor nvfp4_dequantize_cuda(const Nvfp4Tensor& q, at::ScalarType dtype);  // either layout
// x bf16 or fp32 [M, K] (fp32 is split into two bf16 terms, hi + lo, ~16 mantissa bits); w in the
// kernel layout; `scale` an fp32 scalar tensor multiplied into the epilogue with s2 (undefined = 1);
// gemm: the kernel (kAuto: by shape; kStaged takes bf16 x only).
at::Tensor nvfp4_linear_cuda(const at::Tensor& x, const Nvfp4Tensor& w, const at::Tensor& scale,
                             Nvfp4Gemm gemm = Nvfp4Gemm::kAuto);
// live_rows: the rows that carry work, for the tile choice (0: every row; see Nvfp4LinearOptions).
// gemm: kAuto or kSplitK (the split-K kernels), kStaged, kStagedTiles or kStagedTiles64 (bf16 x,
// grouped_stack_aligned) or one of the wgmma GEMMs (nvfp4_wgmma_usable must hold).
at::Tensor nvfp4_grouped_linear_cuda(const at::Tensor& x, const Nvfp4Tensor& w, const at::Tensor& offsets,
                                     const at::Tensor& scale, int64_t live_rows = 0, Nvfp4Gemm gemm = Nvfp4Gemm::kAuto);
// Whether the wgmma GEMM (Nvfp4Gemm::kWgmma) can run x (bf16 on CUDA) against w: the kernel layout,
// N a multiple of 64 and K of 256, a build with sm_90a code and a compute capability 9.0 device.
bool nvfp4_wgmma_usable(const at::Tensor& x, const Nvfp4Tensor& w);

}  // namespace kiln::kernels
