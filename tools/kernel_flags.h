// The --nvfp4-gemm and --bitwise-gemm flags that kiln's commands share: they override the recipe's
// kernels: section (or the defaults) for the whole process.
#pragma once
#include <string>

namespace CLI {
class App;
}
namespace kiln::kernels {
struct KernelChoice;
}

namespace kiln::tools {

struct KernelFlags {
  std::string nvfp4_gemm, bitwise_gemm;  // empty: not given
};
void add_kernel_flags(CLI::App* cmd, KernelFlags& flags);
// Overrides `choice` with the flags given, then puts it in place (kernels::select_kernels).
void select_kernels(const KernelFlags& flags, kernels::KernelChoice& choice);
void select_kernels(const KernelFlags& flags);  // over the defaults (auto, auto)

}  // namespace kiln::tools
