// The GRPO step's settings (the recipe's grpo, loss, optimizer, rollout, parallel and lora sections
// as the trainer takes them) and the held-out evaluation's.
#pragma once
#include <cstdint>
#include <optional>

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

// Asynchronous GRPO (the recipe's grpo.async). A producer rolls out and rewards batch i with the
// weights of update max(0, i - 1 - max_staleness) while the trainer trains the batches before it:
// every batch is exactly min(i - 1, max_staleness) updates stale, the same whatever the timing, and
// the loss corrects for it through the rollout's log-probs (loss.tis, loss.mis). max_staleness 0
// runs the producer but stays on-policy (bitwise the synchronous run). Weights reach the engine
// between the producer's batches.
struct AsyncConfig {
  int64_t max_staleness = 0;
  enum class Placement {
    kColocated,  // the producer is a thread beside the trainer on every rank
    kSplit,      // of 2T ranks the first T train and rank T + t rolls out for trainer t
                 // (GrpoTrainer::serve_rollouts), the same batches with the same staleness;
                 // weights go to the rollout ranks after every update, and evaluation runs there
  };
  Placement placement = Placement::kColocated;
};

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
  std::optional<AsyncConfig> async;  // grpo.async; unset: the synchronous step
  // True under grpo.async.placement split: this job's second half of the ranks roll out.
  bool split_placement() const { return async && async->placement == AsyncConfig::Placement::kSplit; }
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
  std::optional<model::LoraConfig> lora;  // set: train adapters on a frozen base (model/lora.h);
                                          // the KL reference is then the base with adapters disabled
  // After every weight sync the trainer and the rollout score the same probe tokens; a mean
  // |log-prob difference| above the threshold stops the run. Threshold unset (the recipe's
  // rollout.sync_check_threshold below 0): 1e-3 for an unquantised rollout, 1.0 for NVFP4 (which
  // differs by its quantisation). 0 tokens: no check.
  int64_t sync_check_tokens = 16;
  std::optional<double> sync_check_threshold;
  void validate() const;
};

// Evaluation on the held-out examples: k samples per prompt (greedy when temperature is 0, then
// k = 1), scored by the training reward. A sample is correct when its "correct" component (or,
// without one, its reward) is at least 0.5; mean@k averages correctness over all samples, pass@k
// counts prompts with at least one correct sample.
struct EvalConfig {
  int64_t prompts = 100;            // prompts evaluated (the first of the test set)
  int64_t samples = 1;              // k
  double temperature = 0;           // 0 = greedy
  std::optional<int64_t> max_tokens;  // unset (the recipe's 0): grpo.max_tokens
  void validate() const;
};

// The recipe sections the GRPO step's settings come from (trainer/grpo_config_yaml.cpp,
// docs/CONFIG.md): prompt, grpo, loss, optim, parallel, rollout, lora, reward and environment,
// read from the recipe's top-level mapping, each finished and checked, errors at file:line. An
// unset sync_check_threshold is the recipe's -1. GrpoConfig::validate and the settings derived from
// other sections are the caller's (Recipe::from_yaml_file).
void read_yaml(yaml::MapReader& top, GrpoConfig& c);
// Writes those sections as keys of the open top-level mapping, in that order.
void write_yaml(YAML::Emitter& e, const GrpoConfig& c);
// The evaluation's keys of a recipe's eval: section (prompts, samples, temperature, max_tokens: 0
// for unset); the section's `every` is RunConfig's, whose reader finishes and checks the section.
void read_yaml(yaml::MapReader& m, EvalConfig& c);
void write_yaml(YAML::Emitter& e, const EvalConfig& c);

}  // namespace kiln::trainer
