// The bitwise-numerics checks shared by the CPU and CUDA tests: a micro config, and the engine
// under rollout.numerics: bitwise against the trainer's forward, token by token.
#pragma once
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

#include "model/muse.h"
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

// The bitwise forward's gradient (GRPO's training step under rollout.numerics: bitwise) against
// the standard forward's, every parameter within `tol` (relative and absolute), routing replayed.
inline void check_bitwise_gradients(at::ScalarType dtype, at::Device device, double tol) {
  model::Muse a = model::Muse::init(bitwise_config(), 5, dtype, device);
  model::Muse b = a.clone();
  a.set_requires_grad(true);
  b.set_requires_grad(true);
  const std::vector<std::vector<int64_t>> seqs = {{3, 1, 4, 1, 5, 9, 2, 6}, {5, 3, 5}};
  auto loss = [&](const model::Muse& m, bool bitwise) {
    model::ForwardOptions o;
    o.batch_invariant = bitwise;
    o.targets = at::tensor(std::vector<int64_t>{1, 4, 1, 5, 9, 2, 6, -100, 3, 5, -100}, at::kLong);
    o.replay_routing = m.forward(model::PackedBatch::from_sequences(seqs, device), model::ForwardOptions{}).routing;
    return -m.forward(model::PackedBatch::from_sequences(seqs, device), o).logprobs.sum();
  };
  loss(a, true).backward();
  loss(b, false).backward();
  auto pa = a.named_parameters(), pb = b.named_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_TRUE(pa[i].second.grad().defined()) << pa[i].first;
    EXPECT_TRUE(all_close(pa[i].second.grad().cpu().to(at::kDouble), pb[i].second.grad().cpu().to(at::kDouble), tol,
                          tol))
        << pa[i].first << " " << dtype << " on " << device;
  }
}

// The engine under bitwise numerics against the trainer's forward: every sampled token's log-prob
// and every token's routing, bit for bit, through a mixed batch with chunked prefill and a cache
// small enough to preempt.
inline void check_engine_is_bitwise(at::ScalarType dtype, int64_t kv_bytes, at::Device device) {
  const model::Muse m = model::Muse::init(bitwise_config(), 6, dtype, device);
  rollout::EngineConfig ec = small_engine(kv_bytes);
  ec.prefill_chunk = 3;
  ec.batch_invariant = true;
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
      o.batch_invariant = true;
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
  if (kv_bytes < (1 << 20)) {
    EXPECT_GT(engine.stats().preemptions, 0) << "the small cache did not preempt";
  }
}

}  // namespace kiln::test
