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
#include "model/lora.h"
#include "model/muse.h"
#include "optimizers/optimizer.h"
#include "rollout/engine.h"
#include "trainer/losses.h"
#include "parallel/parallel.h"
#include "parallel/sharded_model.h"
#include "trainer/schedule.h"
#include "trainer/dataset.h"
#include "trainer/environment.h"
#include "trainer/rewards.h"

namespace kiln::text {
class Tokenizer;
}

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

struct EvalScore {
  int64_t prompts = 0;
  double mean_at_k = 0, pass_at_k = 0, reward = 0;
};

struct EvalMetrics {
  int64_t step = 0, k = 1;
  EvalScore all;
  std::map<std::string, EvalScore> by_source;   // per data_source
  std::string to_json() const;
};

struct StepMetrics {
  int64_t step = 0;
  double reward = 0, accuracy = 0;        // mean reward; fraction of samples with the right answer
  double pass_at_n = 0;                   // fraction of prompts with at least one right sample
  double loss = 0, clip_fraction = 0, grad_norm = 0, kl = 0, lr = 0;  // lr: AdamW's, after the schedule
  int64_t skipped_updates = 0;           // mini-steps whose gradient norm was not finite (not applied)
  double response_length = 0;             // mean generated tokens
  double response_length_min = 0, response_length_max = 0;  // generated tokens, over all samples
  double truncated_fraction = 0;          // samples that hit max_tokens without a stop token
  double overlong_penalty = 0;            // mean over-long penalty added to the rewards (grpo.overlong_buffer)
  // Dynamic sampling: rounds sampled (1 without it), groups trained on and flat groups dropped, all
  // ranks. The reward metrics above are the first round's (a fresh batch, as without it).
  int64_t sampling_rounds = 1, groups_trained = 0, groups_dropped = 0;
  double mis_masked_fraction = 0;         // response tokens masked importance sampling dropped (loss.mis)
  double zero_variance_groups = 0;        // fraction of prompts whose samples all got one reward
  int64_t preemptions = 0;                // rollout: sequences preempted (recomputed) this step, all ranks
  int64_t expert_overflow_steps = 0;      // rollout: graph steps a sharded engine's exchange overflowed and
                                          // redid eagerly (the group redoes them together: the most of any rank)
  double kv_peak = 0;                     // rollout: the fullest KV-cache pool's peak use in this step's rollout
                                          // (fraction; the largest over ranks)
  int64_t staleness = -1;                 // grpo.async: updates between the batch's weights and the trained ones (-1: off)
  double async_wait_seconds = 0;          // grpo.async: how long the trainer waited for the batch
  double rollout_wait_seconds = 0;        // grpo.async: how long the producer waited for weights before it
                                          // (the most over ranks)
  double episode_turns = 0;               // multi-turn: mean sampled turns per episode (0: single-turn)
  double observation_tokens = 0;          // multi-turn: mean tokens the environment appended per episode
  std::map<std::string, double> reward_components;  // mean of each named part of the reward
  int64_t reward_failures = 0;            // samples the reward could not score (worker errors)
  RewardStats reward_stats;               // this step's reward-worker counters, all ranks (timeouts, restarts, ...)
  MismatchMetrics mismatch;               // with routing replay as configured
  // lp_old was the rollout's log-probs (rollout.numerics bitwise, an on-policy batch), and the
  // mismatch above is measured by the first mini-step's forward (its slice of the batch).
  bool lp_old_from_rollout = false;
  bool has_no_replay = false;
  MismatchMetrics mismatch_no_replay;     // with replay off (mismatch_ab)
  double routing_disagreement = 0;        // own vs replayed expert sets (mismatch_ab)
  // Phase times: rollout, scoring (rewards), lp_old (and the A/B and reference forwards), train
  // (the optimizer mini-steps) and sync (below), and the step in all.
  double rollout_seconds = 0, reward_seconds = 0, lp_old_seconds = 0, train_seconds = 0, step_seconds = 0;
  double tokens_per_second = 0;           // trained tokens (all ranks) per second of the step
  double peak_memory_gb = 0;              // peak device memory of this rank since the last step (CUDA)
  // ... and of each phase: the rollout (with rewards and dynamic sampling's rounds), lp_old (with
  // the reference and A/B forwards), train, and the weight sync (CUDA; the memory plan's calibration).
  double rollout_peak_gb = 0, lp_old_peak_gb = 0, train_peak_gb = 0, sync_peak_gb = 0;
  // The train phase in parts: allocated when it starts (gradients released), the peak of the
  // forwards and backwards, and of the clipping and optimizer steps (CUDA; the plan's calibration).
  double train_start_gb = 0, backward_peak_gb = 0, optimizer_peak_gb = 0;
  double memory_after_gb = 0;             // allocated at the step's end: what stays between steps (CUDA)
  // Weight sync to the rollout: adapters only (LoRA) or every weight (none where the engine reads
  // the trained tensors themselves: synchronous full-parameter); bytes sent, seconds, and the
  // probe check's mean |log-prob difference| between trainer and rollout (-1: not checked).
  int64_t sync_bytes = 0;
  double sync_seconds = 0, sync_check = -1;
  bool weights_shared = false;            // the engine reads the trained tensors themselves (no sync)
  double sync_gbps() const { return sync_seconds > 0 ? double(sync_bytes) / sync_seconds / 1e9 : 0.0; }
  int64_t tokens = 0;                     // prompt + response tokens trained on
  std::string to_json() const;
};

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
  // The last step's samples, for sample dumps: prompt, response, reward and its parts (this rank's).
  struct SampleRecord {
    std::string prompt, response, label, data_source;
    double reward = 0;
    std::map<std::string, double> components;
    bool truncated = false;
  };
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
