// What rolls out a GRPO batch on the rank that holds the rollout engine: the step's prompts drawn
// from the data stream, n samples of each (or multi-turn episodes), scored by the reward, as a
// ProducedBatch that no collective went into; and the held-out evaluation, sampled the same way.
#pragma once
#include <cstdint>
#include <vector>

#include "core/comm.h"
#include "rollout/engine.h"
#include "trainer/dataset.h"
#include "trainer/environment.h"
#include "trainer/episodes.h"
#include "trainer/grpo_config.h"
#include "trainer/grpo_metrics.h"
#include "trainer/produced.h"
#include "trainer/rewards.h"

namespace kiln::text {
class Tokenizer;
}

namespace kiln::trainer {

class Producer {
 public:
  // Every reference outlives the producer. `env` is null for single-turn GRPO; `group` is the
  // ranks that share each step's prompts (each rolls out its own share).
  Producer(const GrpoConfig& cfg, rollout::Engine& engine, const text::Tokenizer& tok, Reward& reward,
           Environment* env, DataStream& stream, const comm::Group& group);

  // The next prompts_per_step prompts of the stream, this rank's contiguous share of them.
  PromptBatch draw_prompts(int64_t step);
  // `b` rolled out and rewarded on this rank alone; `round` > 0 are dynamic sampling's extra rounds,
  // which draw fresh sampling seeds.
  ProducedBatch produce(const PromptBatch& b, int64_t round);
  // The batch of step `step`, the next of the stream, with the position it was drawn at.
  ProducedBatch produce_next(int64_t step);
  // The first `limit` test prompts, this rank's share, sampled and scored; the scores summed over
  // the group per data_source (collective).
  EvalMetrics evaluate(const EvalConfig& ec, const std::vector<Example>& test, int64_t step);

  // The update the engine's weights come from: its own count of updates, from where rebase() set it.
  int64_t weight_version() const { return engine_.weight_version() + version_base_; }
  // The engine's weights are those of `updates` updates (a resume, or the start of a session).
  void rebase(int64_t updates) { version_base_ = updates - engine_.weight_version(); }
  rollout::Engine& engine() { return engine_; }

 private:
  ProducedBatch produce_rollout(const PromptBatch& b, int64_t round);
  std::vector<rollout::Request> requests_for(const PromptBatch& b, int64_t round) const;
  Trajectory trajectory(const Example& ex, const std::vector<int64_t>& response, const std::vector<float>& logprobs,
                        const at::Tensor& routing, bool truncated) const;
  void score_samples(const PromptBatch& b, const std::vector<rollout::RequestOutput>& outs, ProducedBatch& p);
  void collect_episodes(const PromptBatch& b, const std::vector<std::vector<Episode>>& eps, ProducedBatch& p) const;
  RewardRequest reward_request(const Example& ex, const rollout::Sample& s, int64_t id) const;
  std::vector<RewardResult> sample_and_score(const std::vector<Example>& test, int64_t e0, int64_t e1, int64_t k,
                                             const EvalConfig& ec, int64_t step);

  const GrpoConfig& cfg_;
  rollout::Engine& engine_;
  const text::Tokenizer& tok_;
  Reward& reward_;
  Environment* env_;
  DataStream& stream_;
  const comm::Group& group_;
  int64_t version_base_ = 0;
};

}  // namespace kiln::trainer
