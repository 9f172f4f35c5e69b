// Which NVFP4 W4A16 GEMM runs a call: the one shape -> kernel table (nvfp4_dispatch.cpp, each row
// with the measurement behind it) and the process's override of it (recipe kernels.nvfp4_gemm,
// flag --nvfp4-gemm). No torch headers: the table is a function of sizes, so the CPU tests walk it.
#pragma once
#include <cstdint>
#include <string>

#include "kernels/nvfp4_layout.h"  // Nvfp4Gemm

namespace kiln::kernels {

// What a call runs. kStaged/kStagedTiles: the grouped staged kernel launched per expert or as
// tiles; kDequantized: the weights dequantised to x's dtype, then cuBLAS; kDequantizedGrouped: the
// stack dequantised into torch's grouped GEMM; kDequantizedLoop: one cuBLAS GEMM per expert (fp32,
// or torch before 2.8).
enum class Nvfp4Kernel {
  kReference, kSplitK, kStaged, kStagedTiles, kWgmma, kDequantized, kDequantizedGrouped, kDequantizedLoop
};
// "reference", "splitK", "staged", "staged tiles", "wgmma", "deq+mm", "deq+grouped_mm", "deq+mm per expert".
const char* nvfp4_kernel_name(Nvfp4Kernel k);

// One call as the table sees it.
struct Nvfp4Call {
  bool served = false;        // a CUDA build, x on CUDA in bf16 or fp32, weights in the kernel layout
  bool bf16 = false;          // x is bf16 (else fp32, split into two bf16 terms)
  int64_t rows = 0;           // x's rows (a stack: all experts' rows, or the live rows)
  int64_t experts = 0;        // 0: one matrix; else the stack's experts
  int64_t out = 0;            // the weight's rows (N)
  bool wgmma_usable = false;  // nvfp4_wgmma_usable(x, w): Hopper, sm_90a code, N % 64, K % 256
  bool staged_aligned = false;  // a stack the grouped staged kernel takes (grouped_stack_aligned)
  bool grouped_mm = false;    // torch's grouped GEMM exists (torch >= 2.8)
};

// The kernel for `call` under the process's choice `gemm` (kAuto: the table; kWgmma: the wgmma GEMM
// wherever usable above 16 rows per matrix or expert; kSplitK: split-K where the table takes the
// grouped staged kernel; kStagedTiles: that kernel's tiled launch wherever it runs).
Nvfp4Kernel nvfp4_kernel(const Nvfp4Call& call, Nvfp4Gemm gemm);

// The process's choice, kAuto until set. Only kAuto, kSplitK, kWgmma and kStagedTiles are choices
// (the others force one block shape, for benchmarks, and are refused here).
Nvfp4Gemm nvfp4_gemm_selected();
Nvfp4Gemm select_nvfp4_gemm(Nvfp4Gemm gemm);  // returns the previous choice
bool nvfp4_wgmma_selected();
// "auto", "splitk", "wgmma", "stagedtiles" <-> the choice; another name throws, listing these.
Nvfp4Gemm parse_nvfp4_gemm(const std::string& name);
const char* nvfp4_gemm_name(Nvfp4Gemm gemm);

}  // namespace kiln::kernels
