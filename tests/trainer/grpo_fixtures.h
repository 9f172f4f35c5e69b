// Shared GRPO test data: problems a given policy sometimes answers right, so group advantages are
// not all zero and a training step has a gradient.
#pragma once
#include <cctype>
#include <vector>

#include "model/muse.h"
#include "rollout/engine.h"
#include "trainer/tasks.h"

namespace kiln::test {

// Problems whose answer is the policy's own greedy one-token reply, so that sampled replies are
// sometimes right and sometimes wrong and the advantages are not all zero.
inline trainer::Dataset self_consistent_problems(const model::Muse& policy, int64_t count) {
  trainer::CharTokenizer tok(128);
  rollout::EngineConfig ec;
  ec.kv_cache_bytes = 8 << 20;
  rollout::Engine engine(policy, ec);
  std::vector<trainer::Problem> all = trainer::arithmetic_problems(count, 2, 5), kept;
  std::vector<rollout::Request> reqs;
  for (const auto& p : all) {
    rollout::Request r;
    r.prompt = tok.encode(p.prompt);
    r.params.temperature = 0;
    r.params.max_tokens = 1;
    reqs.push_back(r);
  }
  auto outs = engine.generate(reqs);
  for (size_t i = 0; i < all.size(); ++i) {
    const int64_t t = outs[i].samples[0].tokens[0];
    if (std::isalnum(int(t))) kept.push_back({all[i].prompt, std::string(1, char(t))});
  }
  return trainer::split(kept, 0.25, 1);
}

}  // namespace kiln::test
