// The process's GEMM choices (kernel_choice.h): names, the recipe section, and putting them in place.
#include "kernels/kernel_choice.h"

#include <yaml-cpp/yaml.h>

#include "core/error.h"
#include "core/yaml_util.h"
#include "kernels/invariant.h"
#include "kernels/nvfp4_dispatch.h"

namespace kiln::kernels {

BitwiseGemm parse_bitwise_gemm(const std::string& name) {
  if (name == "auto") return BitwiseGemm::kAuto;
  if (name == "mma") return BitwiseGemm::kMma;
  if (name == "wgmma") return BitwiseGemm::kWgmma;
  KILN_FAIL("must be auto, mma or wgmma (got '", name, "')");
}

const char* bitwise_gemm_name(BitwiseGemm g) {
  return g == BitwiseGemm::kMma ? "mma" : g == BitwiseGemm::kWgmma ? "wgmma" : "auto";
}

void select_kernels(const KernelChoice& choice) {
  select_nvfp4_gemm(choice.nvfp4_gemm);
  set_invariant_gemm(bitwise_gemm_name(choice.bitwise_gemm));
}

void read_yaml(yaml::MapReader& m, KernelChoice& c) {
  m.get_enum("nvfp4_gemm", c.nvfp4_gemm, parse_nvfp4_gemm, nvfp4_gemm_name);
  m.get_enum("bitwise_gemm", c.bitwise_gemm, parse_bitwise_gemm, bitwise_gemm_name);
  m.finish();
}

void write_yaml(YAML::Emitter& e, const KernelChoice& c) {
  e << YAML::Key << "nvfp4_gemm" << YAML::Value << nvfp4_gemm_name(c.nvfp4_gemm);
  e << YAML::Key << "bitwise_gemm" << YAML::Value << bitwise_gemm_name(c.bitwise_gemm);
}

}  // namespace kiln::kernels
