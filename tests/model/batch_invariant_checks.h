// The bitwise-numerics checks shared by the CPU and CUDA tests: a micro config, and the engine
// under rollout.numerics: bitwise against the trainer's forward, token by token.
#pragma once
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "model/muse.h"
#include "rollout/decode_graph.h"
#include "rollout/engine.h"
#include "tests/model/reference.h"
#include "tests/rollout/engine_fixtures.h"
#include "tests/test_util.h"

namespace kiln::test {

inline model::ModelConfig bitwise_config() {
  model::ModelConfig c = micro_config();
  c.vocab_size = 23;
  c.num_layers = 4;  // layers 1 and 3 full, 0 and 2 window
  c.full_attention_period = 2;
  c.sliding_window = 5;
  c.init_std = 0.2;
  return c;
}

// The loss both gradient checks differentiate: -sum of the targets' log-probs of two sequences,
// the given routing replayed.
inline at::Tensor bitwise_check_loss(const model::Muse& m, bool bitwise, const at::Tensor& routing) {
  const std::vector<std::vector<int64_t>> seqs = {{3, 1, 4, 1, 5, 9, 2, 6}, {5, 3, 5}};
  model::ForwardOptions o;
  o.numerics = bitwise ? model::Numerics::kBitwise : model::Numerics::kStandard;
  o.targets = at::tensor(std::vector<int64_t>{1, 4, 1, 5, 9, 2, 6, -100, 3, 5, -100}, at::kLong);
  o.replay_routing = routing.defined() ? routing.to(m.device())
                                       : m.forward(model::PackedBatch::from_sequences(seqs, m.device()), {}).routing;
  return -m.forward(model::PackedBatch::from_sequences(seqs, m.device()), o).logprobs.sum();
}

// The bitwise forward's gradient (GRPO's training step under rollout.numerics: bitwise) against
// the standard forward's, every parameter within `tol` (relative and absolute), routing replayed.
// For fp32 and fp64, where both are close to exact.
inline void check_bitwise_gradients(at::ScalarType dtype, at::Device device, double tol) {
  model::Muse a = model::Muse::init(bitwise_config(), 5, dtype, device);
  model::Muse b = a.clone();
  a.set_requires_grad(true);
  b.set_requires_grad(true);
  bitwise_check_loss(a, true, {}).backward();
  bitwise_check_loss(b, false, {}).backward();
  auto pa = a.named_parameters(), pb = b.named_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_TRUE(pa[i].second.grad().defined()) << pa[i].first;
    EXPECT_TRUE(all_close(pa[i].second.grad().cpu().to(at::kDouble), pb[i].second.grad().cpu().to(at::kDouble), tol,
                          tol))
        << pa[i].first << " " << dtype << " on " << device;
  }
}

// In bf16 two forwards' gradients differ by more than rounding wherever a few activations round
// the other way, so element-wise closeness says little. Both are measured against the fp64
// gradient of the same bf16 weights instead, under the same routing, on a model mild enough
// (init_std 0.02) that bf16 gradients are a few percent off: the bitwise gradients' relative
// errors (Frobenius, per tensor) must sum to at most 1.5 times the standard ones', and none may
// pass 25% (a transposed or misplaced gradient is off by about 100%). At the sharp bitwise_config
// (init_std 0.2) either numerics' bf16 gradients are off by 10-100% by seed, in no consistent order.
inline void check_bitwise_gradients_bf16(at::Device device) {
  model::ModelConfig mc = bitwise_config();
  mc.init_std = 0.02;
  model::Muse a = model::Muse::init(mc, 5, at::kBFloat16, device);
  model::Muse b = a.clone();
  model::Muse exact = model::Muse::init(mc, 5, at::kDouble, at::kCPU);
  {
    at::NoGradGuard g;
    auto pe = exact.named_parameters(), pa = a.named_parameters();
    for (size_t i = 0; i < pe.size(); ++i) pe[i].second.copy_(pa[i].second.cpu().to(at::kDouble));
  }
  for (model::Muse* m : {&a, &b, &exact}) m->set_requires_grad(true);
  const at::Tensor routing = b.forward(model::PackedBatch::from_sequences({{3, 1, 4, 1, 5, 9, 2, 6}, {5, 3, 5}}, device),
                                       {}).routing;
  bitwise_check_loss(a, true, routing).backward();
  bitwise_check_loss(b, false, routing).backward();
  bitwise_check_loss(exact, false, routing).backward();
  auto pa = a.named_parameters(), pb = b.named_parameters(), pe = exact.named_parameters();
  double bitwise_sum = 0, standard_sum = 0;
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_TRUE(pa[i].second.grad().defined()) << pa[i].first;
    const at::Tensor want = pe[i].second.grad();
    const double scale = std::max(want.norm().item<double>(), 1e-12);
    auto error = [&](const at::Tensor& got) { return (got.cpu().to(at::kDouble) - want).norm().item<double>() / scale; };
    const double bitwise = error(pa[i].second.grad()), standard = error(pb[i].second.grad());
    EXPECT_LT(bitwise, 0.25) << pa[i].first << ": bf16 gradient relative error " << bitwise << " under bitwise numerics, "
                             << standard << " under the standard ones (against fp64)";
    bitwise_sum += bitwise;
    standard_sum += standard;
  }
  EXPECT_LE(bitwise_sum, 1.5 * standard_sum) << "summed relative errors of the bf16 gradients against fp64";
  EXPECT_GT(standard_sum, 0) << "the bf16 gradients are not bf16";
}

// The engine under bitwise numerics against the trainer's forward: every sampled token's log-prob
// and every token's routing, bit for bit, through a mixed batch with chunked prefill and a cache
// small enough to preempt.
// bitwise_config at widths CUDA graphs capture: head_dim 16, expert widths of 8k.
inline model::ModelConfig bitwise_graph_config() {
  model::ModelConfig c = bitwise_config();
  c.hidden_size = 32;
  c.latent_size = 16;
  c.expert_ffn_size = 32;
  c.head_dim = 16;
  return c;
}

inline void check_engine_is_bitwise(at::ScalarType dtype, int64_t kv_bytes, at::Device device, bool uncaptured = false,
                                    const model::ModelConfig& config = bitwise_config()) {
  const model::Muse m = model::Muse::init(config, 6, dtype, device);
  rollout::EngineConfig ec = small_engine(kv_bytes);
  ec.prefill_chunk = 3;
  ec.numerics = model::Numerics::kBitwise;
  ec.uncaptured_graph_steps = uncaptured;
  rollout::Engine engine(m, ec);
  std::vector<rollout::Request> reqs = {request({1, 2, 3}, 3, 9, 1.0, 1), request({4}, 2, 12, 0.7, 2),
                                        request({5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17}, 2, 7, 1.0, 3)};
  const auto outs = engine.generate(reqs);
  int64_t tokens = 0;
  for (size_t r = 0; r < reqs.size(); ++r)
    for (const rollout::Sample& s : outs[r].samples) {
      std::vector<int64_t> all = reqs[r].prompt;
      all.insert(all.end(), s.tokens.begin(), s.tokens.end());
      std::vector<int64_t> targets(all.begin() + 1, all.end());
      targets.push_back(-100);
      model::ForwardOptions o;
      o.numerics = model::Numerics::kBitwise;
      o.temperature = reqs[r].params.temperature;
      o.targets = at::tensor(targets, at::kLong);
      o.replay_routing = s.routing.to(device);
      const model::ForwardOutput f = m.forward(model::PackedBatch::from_sequences({all}, device), o);
      const int64_t P = int64_t(reqs[r].prompt.size());
      for (size_t j = 0; j < s.tokens.size(); ++j) {
        EXPECT_EQ(f.logprobs[P - 1 + int64_t(j)].item<float>(), s.logprobs[j]) << "request " << r << " token " << j;
        ++tokens;
      }
      // Its own routing, not replayed, is the engine's too.
      o.replay_routing = at::Tensor();
      EXPECT_TRUE(all_equal(m.forward(model::PackedBatch::from_sequences({all}, device), o).routing.cpu(), s.routing.cpu()));
    }
  EXPECT_GT(tokens, 30);
  // Pure decode steps take the graph step (captured where graphs are available).
  const bool captured = !uncaptured && rollout::DecodeGraphs::available(m, nullptr, model::Numerics::kBitwise);
  if (uncaptured || captured) EXPECT_GT(engine.stats().graph_steps, 0);
  if (captured) EXPECT_GT(engine.stats().graphs_captured, 0);
  if (kv_bytes < (1 << 20)) {
    EXPECT_GT(engine.stats().preemptions, 0) << "the small cache did not preempt";
  }
}

}  // namespace kiln::test
