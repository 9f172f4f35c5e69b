// Checks of the GRPO and evaluation settings, each error naming the recipe key and what it expects.
#include "trainer/grpo_config.h"

#include <cmath>

#include "core/error.h"

namespace kiln::trainer {

void GrpoConfig::validate() const {
  KILN_CHECK(prompts_per_step > 0, "grpo: prompts_per_step must be positive (got ", prompts_per_step, ")");
  KILN_CHECK(samples_per_prompt >= 2, "grpo: samples_per_prompt must be at least 2 for group advantages (got ",
             samples_per_prompt, ")");
  KILN_CHECK(max_tokens > 0, "grpo: max_tokens must be positive (got ", max_tokens, ")");
  KILN_CHECK(std::isfinite(temperature) && temperature > 0,
             "grpo: temperature must be positive and finite for RL sampling (got ", temperature, ")");
  KILN_CHECK(std::isfinite(top_p) && top_p > 0 && top_p <= 1, "grpo: top_p must be in (0, 1] (got ", top_p, ")");
  KILN_CHECK(top_k >= 0, "grpo: top_k must be >= 0 (got ", top_k, "); 0 is off");
  KILN_CHECK(!engine.bitwise() || (top_p >= 1 && top_k == 0), "grpo: rollout.numerics bitwise rescores the ",
             "whole softmax; top_p (", top_p, ") and top_k (", top_k, ") must stay at 1 and 0");
  KILN_CHECK(!async || async->max_staleness >= 0, "grpo: async.max_staleness must be >= 0 (got ",
             async ? async->max_staleness : 0, "); leave async out for the synchronous step");
  KILN_CHECK(!async || !dynamic_sampling, "grpo: dynamic_sampling needs every rank in step ",
             "(its extra rounds are collective), which async rollouts are not; use one or the other");
  KILN_CHECK(max_sampling_rounds >= 0, "grpo: max_sampling_rounds must be >= 0 (got ", max_sampling_rounds,
             "): the extra rounds dynamic sampling may spend");
  KILN_CHECK(overlong_buffer >= 0 && overlong_buffer <= max_tokens, "grpo: overlong_buffer must be in [0, max_tokens=",
             max_tokens, "] (got ", overlong_buffer, "); 0 is off");
  KILN_CHECK(std::isfinite(overlong_penalty) && overlong_penalty >= 0, "grpo: overlong_penalty must be finite and >= 0 (got ",
             overlong_penalty, ")");
  KILN_CHECK(!loss.mis || (loss.mis_low >= 0 && loss.mis_low <= 1 && loss.mis_high >= 1),
             "loss: masked importance sampling needs 0 <= mis_low <= 1 <= mis_high (got mis_low=", loss.mis_low,
             ", mis_high=", loss.mis_high, ")");
  KILN_CHECK(std::isfinite(grad_clip) && grad_clip >= 0, "grpo: grad_clip must be finite and >= 0 (got ", grad_clip,
             "); 0 turns clipping off");
  KILN_CHECK(stop_after_nonfinite >= 1, "grpo: stop_after_nonfinite must be at least 1 (got ", stop_after_nonfinite,
             "): that many non-finite gradient norms in a row stop the run");
  optim.validate();
  KILN_CHECK(mini_steps >= 1 && mini_steps <= prompts_per_step * samples_per_prompt, "grpo: mini_steps must be in [1, ",
             prompts_per_step * samples_per_prompt, "] (got ", mini_steps, ")");
  KILN_CHECK(micro_batch_seqs >= 1, "grpo: micro_batch_seqs must be positive (got ", micro_batch_seqs, ")");
  reward.validate();
  if (environment.enabled()) {
    environment.validate();
    KILN_CHECK(overlong_buffer == 0, "grpo: overlong_buffer is per response and not defined for multi-turn episodes ",
               "(environment set, overlong_buffer=", overlong_buffer, "); use environment.max_episode_tokens");
  }
  prompt.validate();
  engine.validate();
  schedule.validate();
  // The rollout engine attends a sequence's keys in one order; the cp ranks attend their pieces over
  // gathered keys in another, so the trainer's log-probs could not equal the rollout's bit for bit.
  KILN_CHECK(parallel.cp == 1 || !engine.bitwise(), "grpo: rollout.numerics bitwise needs the trainer to attend ",
             "whole sequences as the rollout engine does; parallel.cp ", parallel.cp, " splits them over ranks and ",
             "attends gathered keys in another order, so the mismatch could not stay 0. Use parallel.cp 1 or ",
             "rollout.numerics standard");
  KILN_CHECK(parallel.cp == 1 || !split_placement(), "grpo: async.placement split with parallel.cp ", parallel.cp,
             " is not supported: the rollout ranks pair one to one with trainer ranks, which cp groups share; use ",
             "async.placement colocated or parallel.cp 1");
  if (lora) lora->validate();
  KILN_CHECK(sync_check_tokens >= 0, "grpo: sync_check_tokens must be >= 0 (got ", sync_check_tokens, ")");
  KILN_CHECK(!sync_check_threshold || *sync_check_threshold >= 0, "grpo: sync_check_threshold must be >= 0 when ",
             "set (got ", sync_check_threshold.value_or(0), "); leave it unset for the default by quantisation");
}

void EvalConfig::validate() const {
  KILN_CHECK(prompts >= 0, "eval: limit must be >= 0 (got ", prompts, ")");
  KILN_CHECK(samples >= 1, "eval: samples must be at least 1 (got ", samples, ")");
  KILN_CHECK(std::isfinite(temperature) && temperature >= 0, "eval: temperature must be finite and >= 0 (got ",
             temperature, "); 0 is greedy");
  if (!max_tokens) return;
  KILN_CHECK(*max_tokens >= 0, "eval: max_tokens must be >= 0 (got ", *max_tokens, "); 0 uses grpo.max_tokens");
  KILN_CHECK(*max_tokens > 0, "eval: max_tokens must be positive when set (got 0); leave it unset for grpo.max_tokens");
}

}  // namespace kiln::trainer
