// Shared GRPO test data: problems a given policy sometimes answers right, so group advantages are
// not all zero and a training step has a gradient.
#pragma once
#include <cctype>
#include <vector>

#include "model/muse.h"
#include "rollout/engine.h"
#include "text/tokenizer.h"
#include "trainer/grpo.h"
#include "trainer/tasks.h"

namespace kiln::test {

// The muse-tiny byte tokenizer the trainer tests use.
inline std::shared_ptr<const text::Tokenizer> byte_tokenizer() { return text::make_byte_tokenizer(128); }

// A GRPO step small enough for the CPU tests: `prompts` x `samples` samples of at most
// `max_tokens` tokens, lr 1e-2, an 8 MiB KV cache of 4-token blocks.
inline trainer::GrpoConfig small_grpo(int64_t prompts, int64_t samples, int64_t max_tokens) {
  trainer::GrpoConfig g;
  g.prompts_per_step = prompts;
  g.samples_per_prompt = samples;
  g.max_tokens = max_tokens;
  g.optim.adamw.lr = 1e-2;
  g.engine.kv_cache_bytes = 8 << 20;
  g.engine.block_size = 4;
  return g;
}

// An evaluation of the first `prompts` test prompts (greedy, one sample per prompt).
inline trainer::EvalConfig eval_prompts(int64_t prompts) {
  trainer::EvalConfig e;
  e.prompts = prompts;
  return e;
}

// Problems whose answer is the policy's own greedy one-token reply, so that sampled replies are
// sometimes right and sometimes wrong and the advantages are not all zero.
inline trainer::Dataset self_consistent_problems(const model::Muse& policy, int64_t count) {
  auto tok = byte_tokenizer();
  rollout::EngineConfig ec;
  ec.kv_cache_bytes = 8 << 20;
  rollout::Engine engine(policy, ec);
  std::vector<trainer::Example> all = trainer::arithmetic_problems(count, 2, 5), kept;
  std::vector<rollout::Request> reqs;
  for (const auto& p : all) {
    rollout::Request r;
    r.prompt = tok->encode(p.prompt);
    r.params.temperature = 0;
    r.params.max_tokens = 1;
    reqs.push_back(r);
  }
  auto outs = engine.generate(reqs);
  for (size_t i = 0; i < all.size(); ++i) {
    const int64_t t = outs[i].samples[0].tokens[0];
    if (!std::isalnum(int(t))) continue;
    trainer::Example ex = all[i];
    ex.label = std::string(1, char(t));
    kept.push_back(ex);
  }
  return trainer::split(kept, 0.25, 1);
}

}  // namespace kiln::test
