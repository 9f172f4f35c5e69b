// RL quantities of docs/MODEL.md §6: GRPO group advantages, the PPO-clip policy loss with its options
// (aggregation, k3 KL to a reference, truncated and masked importance sampling, GSPO's sequence
// ratio), DAPO's over-long penalty, the train-vs-rollout mismatch metrics, and the routing
// disagreement between own and replayed top-k.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "core/yaml_fwd.h"

namespace kiln::trainer {

// rewards [num_groups * group_size], grouped consecutively. A_i = (r_i - mean) / (std + eps) with
// the unbiased std of the group (torch.std's default, as TRL and verl use), or r_i - mean when
// std_normalize is false (Dr. GRPO). Returns float64 [num_groups * group_size].
at::Tensor group_advantages(const at::Tensor& rewards, int64_t group_size, bool std_normalize, double eps = 1e-6);

enum class Aggregation { kTokenMean, kSeqMeanTokenMean };
Aggregation parse_aggregation(const std::string& name);  // "token-mean" | "seq-mean-token-mean"
const char* aggregation_name(Aggregation a);

struct PolicyLossConfig {
  double eps_low = 0.2;        // rho clipped to [1 - eps_low, 1 + eps_high] (DAPO clip-higher)
  double eps_high = 0.28;
  Aggregation aggregation = Aggregation::kTokenMean;
  double kl_coef = 0.0;        // beta for k3 KL to the reference (needs ref_logprobs)
  bool tis = false;            // weight tokens by min(exp(lp_old - lp_roll), tis_cap), detached
  double tis_cap = 2.0;
  bool gspo = false;           // one ratio per sequence: exp(mean over its tokens of lp - lp_old)
  bool mis = false;            // masked importance sampling: tokens whose exp(lp_old - lp_roll)
  double mis_low = 0.5;        // lies outside [mis_low, mis_high] carry no policy term
  double mis_high = 2.0;
};

// A recipe's loss: section (trainer/losses.cpp, docs/CONFIG.md): every field under its own name,
// finished, then checked, a bad value named at its key's file and line.
void read_yaml(yaml::MapReader& m, PolicyLossConfig& c);
void write_yaml(YAML::Emitter& e, const PolicyLossConfig& c);

// All [T] over the packed tokens of a micro-batch; only tokens with mask 1 count.
struct PolicyLossInputs {
  at::Tensor logprobs;          // current policy, carries the gradient
  at::Tensor old_logprobs;      // lp_old, detached
  at::Tensor advantages;        // the sequence's advantage on each of its tokens
  at::Tensor mask;              // 1 for response tokens, 0 for prompt and padding
  at::Tensor seq_ids;           // int64 sequence index of each token, in [0, num_seqs)
  int64_t num_seqs = 0;
  at::Tensor ref_logprobs;      // optional: lp_ref for the KL term
  at::Tensor rollout_logprobs;  // optional: lp_roll for TIS
  // Normalisers for gradient accumulation: response tokens (token-mean) or sequences
  // (seq-mean-token-mean) of the whole step; 0 = this micro-batch's own count. With them the
  // micro-batch losses sum to the loss of the whole step.
  double total_tokens = 0;
  double total_seqs = 0;
};

struct PolicyLossOutput {
  at::Tensor loss;              // scalar, differentiable
  double clip_fraction = 0;     // response tokens whose clipped term was the active one
  double ratio_mean = 0;        // mean rho over response tokens
  double kl = 0;                // mean k3 KL to the reference (0 without one)
  double tis_weight_mean = 0;   // mean TIS weight (0 without TIS)
  double mis_masked_fraction = 0;  // response tokens MIS dropped (0 without MIS)
};

PolicyLossOutput policy_loss(const PolicyLossInputs& in, const PolicyLossConfig& cfg);

// DAPO's soft over-long penalty (docs/MODEL.md §6.11) for a response of `length` tokens when at
// most `max_tokens` are sampled: 0 up to max_tokens - buffer, then falling linearly to -penalty at
// max_tokens. buffer 0: no penalty.
double overlong_penalty(int64_t length, int64_t max_tokens, int64_t buffer, double penalty);

// Train-vs-rollout mismatch over response tokens, d = lp_old - lp_roll (docs/MODEL.md §6.9).
struct MismatchMetrics {
  double mean_abs_seq = 0;      // mean |d| per sequence, then over sequences (the Miles convention)
  double mean_abs_token = 0;    // mean |d| over all response tokens
  double max_abs = 0;
  double k3_kl = 0;             // mean(exp(d) - d - 1)
  double frac_outside = 0;      // fraction of tokens with exp(d) outside [0.5, 2]
  int64_t tokens = 0;
};
MismatchMetrics mismatch_metrics(const at::Tensor& old_logprobs, const at::Tensor& rollout_logprobs,
                                 const at::Tensor& mask, const at::Tensor& seq_ids, int64_t num_seqs);

// Fraction of (token, layer) pairs whose own top-k expert set differs from the replayed one
// (order within the set ignored). own, replayed: [T, L, k] uint8; mask [T] picks the tokens.
double routing_disagreement(const at::Tensor& own, const at::Tensor& replayed, const at::Tensor& mask);

}  // namespace kiln::trainer
