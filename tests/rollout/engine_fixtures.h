// Shared by the CPU and CUDA engine tests: a micro model config for the cache, a small engine config
// (block 4, up to 8 sequences), a one-line request builder, and the check that recorded routing is
// the routing of the sampling step.
#pragma once
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <map>
#include <utility>
#include <vector>

#include "rollout/engine.h"
#include "tests/model/reference.h"

namespace kiln::test {

// A 4-layer micro model for the cache and scheduler tests: window 5, and one full-attention layer
// in `period` (2: layers 1 and 3 full, 0 and 2 window; 1: every layer full, no window pool).
inline model::ModelConfig paged_config(int64_t period = 2) {
  model::ModelConfig c = micro_config();
  c.num_layers = 4;
  c.full_attention_period = period;
  c.sliding_window = 5;
  return c;
}

inline rollout::EngineConfig small_engine(int64_t kv_bytes = 1 << 20) {
  rollout::EngineConfig e;
  e.kv_cache_bytes = kv_bytes;
  e.block_size = 4;
  e.max_num_seqs = 8;
  e.max_batch_tokens = 64;
  e.prefill_chunk = 16;
  return e;
}

inline rollout::Request request(std::vector<int64_t> prompt, int64_t n, int64_t max_tokens, double temperature,
                                uint64_t seed) {
  rollout::Request r;
  r.prompt = std::move(prompt);
  r.params.n = n;
  r.params.max_tokens = max_tokens;
  r.params.temperature = temperature;
  r.params.seed = seed;
  return r;
}

// Runs `reqs` step by step with a trace, calling `between(engine)` after every step (it may update
// weights), and checks that each sample's recorded routing at position p is what the step that
// drew token p + 1 routed p to: exactly one traced step per drawn token. Returns how many traced
// positions were routed again later (a recompute after preemption) to other experts than those
// recorded, so a caller can check that the run exercised the case.
inline int64_t check_routing_of_sampling_steps(rollout::Engine& engine, const std::vector<rollout::Request>& reqs,
                                               const std::function<void(rollout::Engine&)>& between) {
  std::vector<rollout::StepTrace> traces;
  engine.set_trace([&](const rollout::StepTrace& t) { traces.push_back(t); });
  std::map<int64_t, size_t> index;
  for (size_t i = 0; i < reqs.size(); ++i) index[engine.add_request(reqs[i])] = i;
  std::vector<rollout::RequestOutput> outs(reqs.size());
  while (engine.has_unfinished()) {
    for (auto& o : engine.step()) outs[index.at(o.request_id)] = std::move(o);
    if (between) between(engine);
  }
  engine.set_trace({});
  int64_t rerouted = 0;
  for (const auto& [id, r] : index) {
    const int64_t P = int64_t(reqs[r].prompt.size());
    for (size_t s = 0; s < outs[r].samples.size(); ++s) {
      const rollout::Sample& smp = outs[r].samples[s];
      for (size_t j = 0; j < smp.tokens.size(); ++j) {
        const int64_t p = P + int64_t(j) - 1;
        const std::pair<int64_t, int64_t> want{int64_t(s), smp.tokens[j]};
        int found = 0;
        for (const auto& t : traces)
          for (const auto& it : t.items) {
            const bool mine = it.request_id == id && (it.sample == int64_t(s) || it.sample == -1);
            if (!mine || p < it.start || p >= it.start + it.n) continue;
            const at::Tensor routed = it.routing[p - it.start];
            const bool draws = p == it.start + it.n - 1 &&
                               std::find(it.drawn.begin(), it.drawn.end(), want) != it.drawn.end();
            if (draws) {
              ++found;
              EXPECT_TRUE(routed.equal(smp.routing[p])) << "request " << r << " sample " << s << " position " << p;
            } else if (!routed.equal(smp.routing[p])) {
              ++rerouted;
            }
          }
        EXPECT_EQ(found, 1) << "request " << r << " sample " << s << " token " << j << ": steps that drew it";
      }
    }
  }
  return rerouted;
}

}  // namespace kiln::test

