// Token sampling for the rollout engine: softmax(logits / temperature), one inverse-CDF draw in id
// order from a counter-based stream, and the drawn token's log-prob. CPU reference + CUDA kernel.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

namespace kiln::kernels {

// SplitMix64 finaliser: the mixing function behind every sampling stream.
uint64_t mix64(uint64_t z);
// The uniform draw in [0, 1) of a stream: 53 bits of mix64(stream_seed).
double stream_uniform(uint64_t stream_seed);

// One row of fp32 logits [V]. temperature 0 = greedy: the first maximum, with its log-prob under
// the raw softmax. Otherwise the first id whose cumulative probability (in id order) exceeds the
// stream's uniform. Returns (id, log-prob); sums run in fp64.
std::pair<int64_t, double> sample_row_reference(const float* logits, int64_t V, double temperature,
                                                uint64_t stream_seed);

// Rows: logits [N, V] fp32, temperature [N] fp64, stream_seed [N] int64 (the uint64 bits).
// Returns ids [N] int64 and log-probs [N] fp32 on the logits' device. CUDA logits take the kernel,
// which agrees with the reference except where the draw lies within rounding of a CDF boundary.
std::pair<at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits, const at::Tensor& temperature,
                                              const at::Tensor& stream_seed);
std::pair<at::Tensor, at::Tensor> sample_rows_reference(const at::Tensor& logits, const at::Tensor& temperature,
                                                        const at::Tensor& stream_seed);
// The CUDA kernel; throws in builds without CUDA. Makes no host sync (CUDA-graph safe).
std::pair<at::Tensor, at::Tensor> sample_rows_cuda(const at::Tensor& logits, const at::Tensor& temperature,
                                                   const at::Tensor& stream_seed);

}  // namespace kiln::kernels
