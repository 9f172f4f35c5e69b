// Sampling for the rollout engine (sampler.h): the stream seeds, the host sampler with top-k and
// top-p, and a step's draws split between a graph step's results, the GPU kernel and the host.
#include "rollout/sampler.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/sampling.h"

namespace kiln::rollout {

uint64_t sample_stream_seed(uint64_t seed, int64_t sample, int64_t step) {
  using kernels::mix64;
  return mix64(mix64(mix64(seed + 0x9e3779b97f4a7c15ull) ^ uint64_t(sample)) ^ uint64_t(step) * 0x2545f4914f6cdd1dull);
}

std::pair<int64_t, double> sample_token(const at::Tensor& logits, const SamplingParams& p, uint64_t stream_seed) {
  at::Tensor l = logits.detach().to(at::kCPU, at::kFloat).contiguous();
  const float* x = l.data_ptr<float>();
  const int64_t V = l.numel();
  if (p.temperature == 0 || (p.top_k == 0 && p.top_p >= 1.0))
    return kernels::sample_row_reference(x, V, p.temperature, stream_seed);  // what the GPU kernel does
  const double mx = *std::max_element(x, x + V);
  const double u = kernels::stream_uniform(stream_seed);
  auto weight = [&](int64_t i) { return std::exp((double(x[i]) - mx) / p.temperature); };
  // Filters: candidates by logit, descending, ties broken by the lower id (a strict total order,
  // so the result does not depend on the sort's stability).
  auto before = [&](int64_t a, int64_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  std::vector<int64_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  int64_t keep = p.top_k > 0 ? std::min<int64_t>(p.top_k, V) : V;
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), before);
  std::vector<double> prob(keep);
  double z = 0;
  for (int64_t i = 0; i < keep; ++i) z += (prob[i] = weight(order[i]));
  for (double& q : prob) q /= z;
  if (p.top_p < 1.0) {
    double mass = 0;
    int64_t n = 0;
    while (n < keep && mass < p.top_p) mass += prob[n++];
    keep = std::max<int64_t>(n, 1);
    const double kept = std::accumulate(prob.begin(), prob.begin() + keep, 0.0);
    for (int64_t i = 0; i < keep; ++i) prob[i] /= kept;
  }
  double c = 0;
  int64_t pick = keep - 1;
  for (int64_t i = 0; i < keep; ++i) {
    c += prob[i];
    if (u < c) {
      pick = i;
      break;
    }
  }
  return {order[pick], std::log(prob[pick])};
}

bool filtered(const SamplingParams& p) { return p.temperature > 0 && (p.top_k > 0 || p.top_p < 1.0); }

std::vector<std::pair<int64_t, double>> draw_tokens(const std::vector<Draw>& draws, const at::Tensor& logits,
                                                    const at::Tensor& graph_ids, const at::Tensor& graph_logprobs) {
  std::vector<std::pair<int64_t, double>> picked(draws.size(), {-1, 0.0});
  if (draws.empty()) return picked;
  std::vector<size_t> gpu;  // draws for the sampling kernel (CUDA fp32 logits, no top-k/top-p filter)
  for (size_t i = 0; i < draws.size(); ++i) {
    if (filtered(*draws[i].params)) continue;
    if (graph_ids.defined()) {
      picked[i] = {graph_ids.data_ptr<int64_t>()[draws[i].row], graph_logprobs.data_ptr<float>()[draws[i].row]};
    } else if (logits.is_cuda() && logits.scalar_type() == at::kFloat) {
      gpu.push_back(i);
    }
  }
  if (!gpu.empty()) {
    std::vector<int64_t> rows, seeds;
    std::vector<double> temps;
    for (size_t i : gpu) {
      rows.push_back(draws[i].row);
      temps.push_back(draws[i].params->temperature);
      seeds.push_back(int64_t(draws[i].stream_seed));
    }
    const at::Device dev = logits.device();
    auto [ids, lps] = kernels::sample_rows(logits.index_select(0, at::tensor(rows, at::kLong).to(dev)),
                                           at::tensor(temps, at::kDouble).to(dev), at::tensor(seeds, at::kLong).to(dev));
    ids = ids.cpu();
    lps = lps.cpu();
    for (size_t j = 0; j < gpu.size(); ++j) picked[gpu[j]] = {ids.data_ptr<int64_t>()[j], lps.data_ptr<float>()[j]};
  }
  at::Tensor host;  // CPU sampling: every draw from CPU logits, filtered draws from CUDA ones
  for (size_t i = 0; i < draws.size(); ++i) {
    if (picked[i].first >= 0) continue;
    if (!host.defined()) host = logits.cpu();
    picked[i] = sample_token(host[draws[i].row], *draws[i].params, draws[i].stream_seed);
  }
  return picked;
}

}  // namespace kiln::rollout
