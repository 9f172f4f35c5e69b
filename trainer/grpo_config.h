// The GRPO step's settings (the recipe's grpo, loss, optimizer, rollout, parallel and lora sections
// as the trainer takes them) and the held-out evaluation's.
#pragma once
#include <cstdint>

#include "core/yaml_fwd.h"
#include "model/lora.h"
#include "optimizers/optimizer.h"
#include "parallel/parallel.h"
#include "rollout/engine.h"
#include "trainer/dataset.h"
#include "trainer/environment.h"
#include "trainer/losses.h"
#include "trainer/rewards.h"
#include "trainer/schedule.h"

namespace kiln::trainer {

struct GrpoConfig {
  int64_t prompts_per_step = 16;
  int64_t samples_per_prompt = 8;   // n, the GRPO group size
  int64_t max_tokens = 8;           // per response, the end-of-answer token included
  double temperature = 1.0;
  double top_p = 1.0;
  int64_t top_k = 0;
  bool std_normalize = true;        // GRPO (true) or Dr. GRPO (false) advantages
  // Shaping (docs/MODEL.md §6.11): DAPO's soft over-long penalty added to the reward of responses
  // longer than max_tokens - overlong_buffer (0: off), and truncated samples (max_tokens reached
  // without a stop token) left out of the loss.
  int64_t overlong_buffer = 0;
  double overlong_penalty = 1.0;
  bool mask_truncated = false;
  // DAPO's dynamic sampling: groups whose rewards are all equal (no advantage) are dropped, and
  // further rounds of prompts_per_step prompts are sampled until that many groups are kept or
  // max_sampling_rounds extra rounds were spent (then the step trains on what it has). Each rank
  // keeps one group at least, so a batch may pass prompts_per_step by up to the ranks less one.
  // Data parallel only (expert parallelism needs equal counts per rank).
  bool dynamic_sampling = false;
  int64_t max_sampling_rounds = 2;
  // Asynchronous GRPO (grpo.async.max_staleness = k; -1: off, the synchronous step). A producer
  // thread rolls out and rewards batch i with the weights of update max(0, i - 1 - k) while the
  // trainer trains the batches before it: every batch is exactly min(i - 1, k) updates stale, the
  // same whatever the timing, and the loss corrects for it through the rollout's log-probs (loss.tis,
  // loss.mis). k = 0 runs the thread but stays on-policy (bitwise the synchronous run). Weights
  // reach the engine between the producer's batches.
  int64_t async_staleness = -1;
  // grpo.async.placement: false (colocated) runs the producer as a thread beside the trainer on
  // every rank; true (split) gives it ranks of its own: of 2T ranks, the first T train and rank
  // T + t rolls out for trainer t (GrpoTrainer::serve_rollouts), the same batches with the same
  // staleness. Weights go to the rollout ranks after every update; evaluation runs there.
  bool async_split = false;
  PolicyLossConfig loss;
  RewardSpec reward;                // how responses are scored (trainer/rewards.h)
  // Multi-turn (trainer/environment.h): when its command is set, every sample is an episode whose
  // turns an environment worker answers and whose reward is the environment's (`reward` unused);
  // observation tokens are in the trajectory (replayed routing included) but not in the loss.
  EnvironmentSpec environment;
  PromptFormat prompt;              // how prompts become ids: chat template, length filter
  optimizers::OptimizerConfig optim;  // Muon + AdamW groups, state placement
  LrSchedule schedule;              // per GRPO step (its mini-steps share one lr), scales both lrs
  double grad_clip = 1.0;           // max global grad norm; 0 = off
  int64_t stop_after_nonfinite = 3; // non-finite gradient norms in a row that stop the run; each is skipped
  int64_t mini_steps = 1;           // optimizer steps per GRPO step, over disjoint slices of the batch
  int64_t micro_batch_seqs = 64;    // sequences per forward/backward (gradient accumulation)
  bool routing_replay = true;       // R3: the trainer's forward uses the rollout's expert sets
  bool mismatch_ab = false;         // also measure the mismatch with replay off (one extra forward)
  // Under rollout.numerics bitwise an on-policy batch's lp_old is the rollout's log-probs (the
  // same bits); true scores it with a forward anyway, as a check, at the cost of that forward.
  bool score_lp_old = false;
  bool recompute = false;           // recompute each layer in the backward (ForwardOptions::recompute)
  bool fused_kernels = true;        // CUDA: the fused training kernels and the multi-tensor AdamW
                                    // (false: the ATen reference ops, for A/B runs and debugging)
  uint64_t seed = 0;
  rollout::EngineConfig engine;
  parallel::ParallelConfig parallel;    // resolved against the group's size by the trainer
  model::LoraConfig lora;           // rank > 0: train adapters on a frozen base (model/lora.h);
                                    // the KL reference is then the base with adapters disabled
  // After every weight sync the trainer and the rollout score the same probe tokens; a mean
  // |log-prob difference| above the threshold stops the run. Threshold < 0: 1e-3 for an
  // unquantised rollout, 1.0 for NVFP4 (which differs by its quantisation). 0 tokens: no check.
  int64_t sync_check_tokens = 16;
  double sync_check_threshold = -1;
  void validate() const;
};

// Evaluation on the held-out examples: k samples per prompt (greedy when temperature is 0, then
// k = 1), scored by the training reward. A sample is correct when its "correct" component (or,
// without one, its reward) is at least 0.5; mean@k averages correctness over all samples, pass@k
// counts prompts with at least one correct sample.
struct EvalConfig {
  int64_t limit = 100;              // prompts evaluated (the first `limit` of the test set)
  int64_t samples = 1;              // k
  double temperature = 0;           // 0 = greedy
  int64_t max_tokens = 0;           // 0 = grpo.max_tokens
  void validate() const;
};

// The recipe sections the GRPO step's settings come from (trainer/grpo_config_yaml.cpp,
// docs/CONFIG.md): prompt, grpo, loss, optim, parallel, rollout, lora, reward and environment,
// read from the recipe's top-level mapping, each finished and checked, errors at file:line. The
// recipe's names that differ from the fields are mapped here: grpo.async.max_staleness to
// async_staleness (-1 without grpo.async), grpo.async.placement to async_split. GrpoConfig::validate
// and the settings derived from other sections are the caller's (Recipe::from_yaml_file).
void read_yaml(yaml::MapReader& top, GrpoConfig& c);
// Writes those sections as keys of the open top-level mapping, in that order.
void write_yaml(YAML::Emitter& e, const GrpoConfig& c);
// The evaluation's keys of a recipe's eval: section (prompts for limit, samples, temperature,
// max_tokens); the section's `every` is RunConfig's, whose reader finishes and checks the section.
void read_yaml(yaml::MapReader& m, EvalConfig& c);
void write_yaml(YAML::Emitter& e, const EvalConfig& c);

}  // namespace kiln::trainer
