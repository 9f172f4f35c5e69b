// Log-probabilities of chosen tokens under the lm_head, log softmax(h W^T / temperature)[target],
// without an fp32 [rows, vocab] tensor: on CUDA one GEMM writes the logits in the model's dtype,
// one kernel takes the logsumexp and the chosen logit, and the backward writes the softmax
// gradient in one pass before the two GEMMs. The ATen reference runs anywhere.
#pragma once
#include <ATen/core/Tensor.h>

namespace kiln::kernels {

// hidden [n, d], lm_head [V, d] (one dtype), targets [n] int64 in [0, V): float32 [n].
// Differentiable in hidden and lm_head.
at::Tensor token_logprobs(const at::Tensor& hidden, const at::Tensor& lm_head, const at::Tensor& targets,
                          double temperature);
at::Tensor token_logprobs_reference(const at::Tensor& hidden, const at::Tensor& lm_head, const at::Tensor& targets,
                                    double temperature);

}  // namespace kiln::kernels
