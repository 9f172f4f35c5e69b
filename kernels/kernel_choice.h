// The GEMM kernels a process runs where more than one could: each auto (the shape tables) or one
// forced, from the recipe's kernels: section or the --nvfp4-gemm and --bitwise-gemm flags.
#pragma once
#include <string>

#include "core/yaml_fwd.h"
#include "kernels/nvfp4_layout.h"  // Nvfp4Gemm

namespace kiln::kernels {

// The batch-invariant bf16 GEMM's instructions (rollout.numerics: bitwise; kernels/invariant.h).
enum class BitwiseGemm { kAuto, kMma, kWgmma };
BitwiseGemm parse_bitwise_gemm(const std::string& name);  // "auto" | "mma" | "wgmma"; throws otherwise
const char* bitwise_gemm_name(BitwiseGemm g);

struct KernelChoice {
  // NVFP4 W4A16 GEMM (rollout.quantization nvfp4): auto, the table in nvfp4_dispatch.cpp; splitk,
  // wgmma or stagedtiles force one where it runs (nvfp4_dispatch.h says where).
  Nvfp4Gemm nvfp4_gemm = Nvfp4Gemm::kAuto;
  // auto: wgmma on a compute capability 9.0 GPU (measured faster on every shape, the same bits),
  // else mma. Forcing wgmma elsewhere is an error at the first bitwise GEMM.
  BitwiseGemm bitwise_gemm = BitwiseGemm::kAuto;
};

// Puts `choice` in place for the whole process (every engine and trainer in it).
void select_kernels(const KernelChoice& choice);

// The recipe's kernels: section (nvfp4_gemm, bitwise_gemm), read strictly and written back.
void read_yaml(yaml::MapReader& m, KernelChoice& c);
void write_yaml(YAML::Emitter& e, const KernelChoice& c);

}  // namespace kiln::kernels
