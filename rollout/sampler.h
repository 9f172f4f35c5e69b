// Sampling for the rollout engine: the parameters of a request, the per-(sample, position) random
// stream, one token drawn on the host (top-k, top-p, temperature, greedy), and a step's draws, sent
// to the GPU sampling kernel where it applies (kernels/sampling.h) and drawn on the host otherwise.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace kiln::rollout {

struct SamplingParams {
  int64_t n = 1;                    // samples of this prompt; they share its prefill
  int64_t max_tokens = 16;          // generated tokens per sample, stop token included
  std::vector<int64_t> stop_token_ids;
  double temperature = 1.0;         // 0 = greedy
  double top_p = 1.0;               // nucleus mass kept, (0, 1]
  int64_t top_k = 0;                // 0 = no top-k filter
  uint64_t seed = 0;                // sample j draws token t from a stream seeded by (seed, j, t)
};

// The stream seed of sample `sample` of a request at generated position `step`.
uint64_t sample_stream_seed(uint64_t seed, int64_t sample, int64_t step);

// Samples one token from fp32 logits [V] with the given params and stream; returns (id, log-prob).
std::pair<int64_t, double> sample_token(const at::Tensor& logits, const SamplingParams& params, uint64_t stream_seed);

// Whether top-k or top-p cut the distribution (sampling at temperature > 0): the GPU kernel draws
// only from the whole distribution, so such draws go to sample_token.
bool filtered(const SamplingParams& p);

// One token to draw in a step: a row of the step's logits, the sample's parameters and its stream.
struct Draw {
  int64_t row = 0;
  const SamplingParams* params = nullptr;
  uint64_t stream_seed = 0;
};

// (id, log-prob) for each draw from logits [rows, V] on any device. graph_ids / graph_logprobs
// (CPU, indexed by row), when given, are what a CUDA-graph step already sampled on the GPU: the
// unfiltered draws take them. Otherwise unfiltered draws from fp32 CUDA logits go to the sampling
// kernel in one launch; the rest (CPU logits, filtered draws) are drawn on the host, all from the
// same streams, so each draw's result does not depend on where it ran (up to fp64 ties).
std::vector<std::pair<int64_t, double>> draw_tokens(const std::vector<Draw>& draws, const at::Tensor& logits,
                                                    const at::Tensor& graph_ids = {},
                                                    const at::Tensor& graph_logprobs = {});

}  // namespace kiln::rollout
