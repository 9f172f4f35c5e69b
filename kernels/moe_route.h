// The latent MoE's router after its GEMV: scores (softmax, or sigmoid with a selection bias), the
// top-k experts, and their scores renormalised over the chosen set. The ATen reference is what the
// trainer differentiates; on CUDA, where no gradient is wanted, one kernel (a warp per token)
// replaces the ~6 ATen ops of the rollout's decode step.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kiln::kernels {

struct MoeRoute {
  at::Tensor ids;      // [T, k] int64: chosen experts, best first (ties: the lower id)
  at::Tensor weights;  // [T, k] in logits' dtype: score / sum of the chosen scores
  at::Tensor scores;   // [T, E]: every score (the reference only: the balance loss reads it)
};

// logits [T, E] fp32 or fp64; bias [E] (sigmoid scores only; may be undefined) shifts the selection,
// not the weights; replay [T, k] int64 (may be undefined): use these experts instead of a top-k.
MoeRoute moe_route(const at::Tensor& logits, int64_t k, bool sigmoid, const at::Tensor& bias,
                   const at::Tensor& replay);
MoeRoute moe_route_reference(const at::Tensor& logits, int64_t k, bool sigmoid, const at::Tensor& bias,
                             const at::Tensor& replay);
MoeRoute moe_route_cuda(const at::Tensor& logits, int64_t k, bool sigmoid, const at::Tensor& bias,
                        const at::Tensor& replay);

}  // namespace kiln::kernels
