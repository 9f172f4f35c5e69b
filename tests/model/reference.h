// A naive Muse forward for tests: one sequence, one token at a time, plain loops in float64,
// written from docs/MODEL.md §1 without sharing code with model/.
#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

#include "model/muse.h"

namespace kiln::test {

struct ReferenceOutput {
  at::Tensor logits;                   // [n, V] float64
  std::vector<std::vector<int64_t>> routing;  // [n * L][k]: token-major, then layer
};

// `replay` (optional) is [n, L, k] uint8 for this sequence.
ReferenceOutput reference_forward(const model::Muse& model, const std::vector<int64_t>& tokens,
                                  const at::Tensor& replay = {});

// A micro config that runs in milliseconds: 2 layers (window then full), 4 experts top-2.
model::ModelConfig micro_config();
// The micro config with every quantised width a multiple of 16 (NVFP4, LoRA over NVFP4).
model::ModelConfig nvfp4_micro_config();

}  // namespace kiln::test
