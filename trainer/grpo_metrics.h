// What a GRPO step and a held-out evaluation report: the metrics.jsonl line of each, and the
// global sums they are made of.
#pragma once
#include <cstdint>
#include <map>
#include <string>

#include "trainer/losses.h"
#include "trainer/rewards.h"

namespace kiln::trainer {

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

// One sample of the last step, for sample dumps: prompt, response, reward and its parts.
struct SampleRecord {
  std::string prompt, response, label, data_source;
  double reward = 0;
  std::map<std::string, double> components;
  bool truncated = false;
};

}  // namespace kiln::trainer
