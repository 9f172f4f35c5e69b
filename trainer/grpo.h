// One GRPO step in named phases: draw prompts, sample n responses with the rollout engine, reward
// them, score them with the trainer's forward under routing replay (lp_old, mismatch metrics), take
// optimizer steps on the policy loss, and send the new weights back to the engine. Evaluation
// (mean@k, pass@k per data_source) and checkpoints.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/comm.h"
#include "model/muse.h"
#include "parallel/sharded_model.h"
#include "trainer/dataset.h"
#include "trainer/grpo_config.h"
#include "trainer/grpo_metrics.h"
#include "trainer/rewards.h"

namespace kiln::text {
class Tokenizer;
}

namespace kiln::trainer {

// What a rank holds of the policy under a layout, and how to build only that (parallel/sharded_model.h).
using parallel::PolicyShare;
using parallel::policy_share;

class GrpoTrainer {
 public:
  // `policy` is trained in place (fp32 or fp64 on the CPU, or bf16/fp32 on GPU). With a group of
  // several ranks (data parallel): each rank rolls out and trains on its share of every step's
  // prompts (whole groups), gradients are summed, each rank keeps the optimizer state of the
  // parameters it owns (ZeRO-1) and broadcasts them after the step. Metrics are global.
  // Under expert parallelism or ZeRO-3 `policy` may be this rank's share (policy_share): it is
  // then trained in place and never gathered; a whole policy is copied, and only sync_policy() and
  // save() bring it up to date.
  // Prompts are rendered and tokenized here (config.prompt), over-long ones dropped. The reward
  // is make_reward(config.reward) unless one is given.
  // Under grpo.async.placement split `group` is split in two halves: on a rollout rank (the second
  // half) the engine takes its own copy and `policy` becomes zero-element placeholders (LoRA's
  // engine shares the frozen base, which stays).
  GrpoTrainer(model::Muse& policy, GrpoConfig config, std::shared_ptr<const text::Tokenizer> tokenizer,
              Dataset data, const comm::Group& group = comm::Group::world(), std::shared_ptr<Reward> reward = nullptr);
  ~GrpoTrainer();
  StepMetrics step();
  // Scores the held-out examples (collective).
  EvalMetrics evaluate(const EvalConfig& config);
  // The train/test prompts that survived the length filter, and how many were dropped.
  const PrepareReport& train_prompts() const;
  const PrepareReport& test_prompts() const;
  // The last step's samples (this rank's), for sample dumps.
  using SampleRecord = trainer::SampleRecord;
  const std::vector<SampleRecord>& last_samples() const;
  int64_t steps_done() const;
  // The ranks that train together: the group given, or under grpo.async.placement split its first
  // half. Every call above except serve_rollouts is collective over it.
  const comm::Group& group() const;
  // Device memory allocated (GB) after each part of construction, in order: the policy as given,
  // LoRA's adapters and the layout's shards, the rollout engine (its weights and KV cache), the KL
  // reference, the optimizer with its state and the gradient reducer (the last two where there
  // is one); empty on the CPU. For the memory plan's calibration.
  const std::vector<std::pair<std::string, double>>& construction_memory() const;
  // grpo.async.placement split: whether this rank is one of the second half, which roll out. Such a
  // rank only calls serve_rollouts, which returns once its trainer is destroyed.
  bool serves_rollouts() const;
  void serve_rollouts();
  // The last step the caller will run (0: unknown). Under grpo.async the producer samples no batch
  // past it, so a run's end waits for no rollout it will not train on.
  void set_last_step(int64_t step);
  // Under expert parallelism or ZeRO-3 a whole `policy` is brought up to date only by save() and
  // by this call (collective: every rank calls it); a share is always current (it is what trains).
  void sync_policy();
  const DataStream& stream() const;
  // A resumable checkpoint in `dir`: weights (safetensors + config.json), optimizer state, the step,
  // the data position, and with kl_coef != 0 the frozen reference policy (the policy the trainer
  // started from). Rank 0 writes all but the optimizer state, of which each rank writes its shard. Written into a temporary directory that replaces `dir` at the end, so
  // the previous checkpoint survives a crash mid-write. Sampling seeds derive from (seed, step),
  // so no RNG state is needed for the same samples after a resume.
  void save(const std::string& dir) const;
  void load(const std::string& dir);
  // The trained weights alone into `dir` (collective): a checkpoint with the tokenizer's files, or
  // with LoRA a PEFT adapter. Written as save() writes them (each rank its own tensors when the
  // trainer shards), into dir.tmp, then renamed.
  void save_model(const std::string& dir) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::trainer
