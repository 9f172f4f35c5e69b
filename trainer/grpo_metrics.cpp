// The metrics.jsonl lines of a GRPO step and of an evaluation.
#include "trainer/grpo_metrics.h"

#include <nlohmann/json.hpp>

namespace kiln::trainer {

std::string EvalMetrics::to_json() const {
  nlohmann::ordered_json j;
  j["step"] = step;
  j["eval_k"] = k;
  auto put = [&](const EvalScore& s) {
    return nlohmann::ordered_json{{"prompts", s.prompts}, {"mean_at_k", s.mean_at_k}, {"pass_at_k", s.pass_at_k},
                                  {"mean_reward", s.reward}};
  };
  j["eval"] = put(all);
  j["eval_accuracy"] = all.mean_at_k;
  nlohmann::ordered_json by = nlohmann::ordered_json::object();
  for (const auto& [source, s] : by_source) by[source] = put(s);
  j["eval_by_source"] = by;
  return j.dump();
}

std::string StepMetrics::to_json() const {
  nlohmann::ordered_json j;
  j["step"] = step;
  j["reward"] = reward;
  j["accuracy"] = accuracy;
  j["pass_at_n"] = pass_at_n;
  j["loss"] = loss;
  j["clip_fraction"] = clip_fraction;
  j["grad_norm"] = grad_norm;
  j["skipped_updates"] = skipped_updates;
  j["kl"] = kl;
  j["lr"] = lr;
  j["response_length"] = response_length;
  j["response_length_min"] = response_length_min;
  j["response_length_max"] = response_length_max;
  j["truncated_fraction"] = truncated_fraction;
  if (overlong_penalty != 0) j["overlong_penalty"] = overlong_penalty;
  if (sampling_rounds != 1 || groups_dropped != 0)
    j["dynamic_sampling"] = {{"rounds", sampling_rounds}, {"groups_trained", groups_trained},
                             {"groups_dropped", groups_dropped}};
  if (mis_masked_fraction != 0) j["mis_masked_fraction"] = mis_masked_fraction;
  j["zero_variance_groups"] = zero_variance_groups;
  j["rollout_engine"] = {{"preemptions", preemptions}, {"kv_peak", kv_peak}};
  if (expert_overflow_steps > 0) j["rollout_engine"]["expert_overflow_steps"] = expert_overflow_steps;
  if (staleness >= 0)
    j["async"] = {{"staleness", staleness}, {"wait_seconds", async_wait_seconds},
                  {"rollout_wait_seconds", rollout_wait_seconds}};
  if (episode_turns > 0) j["episodes"] = {{"turns", episode_turns}, {"observation_tokens", observation_tokens}};
  if (!reward_components.empty()) j["reward_components"] = reward_components;
  j["reward_failures"] = reward_failures;
  if (reward_stats.num_answered > 0 || reward_stats.num_restarts > 0 || reward_stats.num_protocol_violations > 0) {
    const RewardStats& w = reward_stats;
    j["reward_worker"] = {{"answered", w.num_answered}, {"timeouts", w.num_timeouts}, {"restarts", w.num_restarts},
                          {"retries", w.num_retries}, {"garbage_lines", w.num_garbage_lines},
                          {"protocol_violations", w.num_protocol_violations}, {"mean_seconds", w.mean_seconds()}};
  }
  auto put = [](const MismatchMetrics& m) {
    return nlohmann::ordered_json{{"mean_abs_seq", m.mean_abs_seq}, {"mean_abs_token", m.mean_abs_token},
                                  {"max_abs", m.max_abs}, {"k3_kl", m.k3_kl}, {"frac_outside", m.frac_outside}};
  };
  j["mismatch"] = put(mismatch);
  if (has_no_replay) {
    j["mismatch_no_replay"] = put(mismatch_no_replay);
    j["routing_disagreement"] = routing_disagreement;
  }
  j["rollout_seconds"] = rollout_seconds;
  j["reward_seconds"] = reward_seconds;
  j["lp_old_seconds"] = lp_old_seconds;
  j["train_seconds"] = train_seconds;
  j["sync_bytes"] = sync_bytes;
  j["sync_seconds"] = sync_seconds;
  j["sync_gbps"] = sync_gbps();
  if (sync_check >= 0) j["sync_check"] = sync_check;
  j["step_seconds"] = step_seconds;
  j["tokens"] = tokens;
  j["tokens_per_second"] = tokens_per_second;
  if (lp_old_from_rollout) j["lp_old_from_rollout"] = true;
  if (weights_shared) j["weights_shared"] = true;
  if (peak_memory_gb > 0) {
    j["peak_memory_gb"] = peak_memory_gb;
    j["phase_peak_gb"] = {{"rollout", rollout_peak_gb}, {"lp_old", lp_old_peak_gb}, {"train", train_peak_gb},
                          {"sync", sync_peak_gb}};
    j["memory_after_gb"] = memory_after_gb;
    j["train_memory_gb"] = {{"start", train_start_gb}, {"backward", backward_peak_gb}, {"optimizer", optimizer_peak_gb}};
  }
  return j.dump();
}

}  // namespace kiln::trainer
