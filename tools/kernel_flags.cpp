// The shared GEMM-choice flags (kernel_flags.h).
#include "tools/kernel_flags.h"

#include <CLI/CLI.hpp>

#include "kernels/kernel_choice.h"
#include "kernels/nvfp4_dispatch.h"

namespace kiln::tools {

void add_kernel_flags(CLI::App* cmd, KernelFlags& f) {
  cmd->add_option("--nvfp4-gemm", f.nvfp4_gemm,
                  "NVFP4 GEMM (overrides kernels.nvfp4_gemm): auto (the measured table), splitk, wgmma or stagedtiles")
      ->check(CLI::IsMember({"auto", "splitk", "wgmma", "stagedtiles"}));
  cmd->add_option("--bitwise-gemm", f.bitwise_gemm,
                  "Bitwise-numerics GEMM (overrides kernels.bitwise_gemm): auto (wgmma on Hopper, else mma), mma or wgmma")
      ->check(CLI::IsMember({"auto", "mma", "wgmma"}));
}

void select_kernels(const KernelFlags& f, kernels::KernelChoice& choice) {
  if (!f.nvfp4_gemm.empty()) choice.nvfp4_gemm = kernels::parse_nvfp4_gemm(f.nvfp4_gemm);
  if (!f.bitwise_gemm.empty()) choice.bitwise_gemm = kernels::parse_bitwise_gemm(f.bitwise_gemm);
  kernels::select_kernels(choice);
}

void select_kernels(const KernelFlags& f) {
  kernels::KernelChoice choice;
  select_kernels(f, choice);
}

}  // namespace kiln::tools
