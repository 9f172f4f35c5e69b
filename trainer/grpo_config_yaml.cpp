// The GRPO step's settings as recipe sections: grpo: here, the others through the readers beside
// their structs, and the evaluation's keys of eval:. Read strictly (errors at file:line) and
// written back in the resolved recipe, in the same key order.
#include <yaml-cpp/yaml.h>

#include "core/yaml_util.h"
#include "trainer/grpo_config.h"

namespace kiln::trainer {

namespace {

const char* placement_name(AsyncConfig::Placement p) {
  return p == AsyncConfig::Placement::kSplit ? "split" : "colocated";
}

// grpo.async: asynchronous GRPO with bounded staleness (AsyncConfig).
void read_async(yaml::MapReader& a, GrpoConfig& g) {
  AsyncConfig async = g.async.value_or(AsyncConfig{});
  a.require("max_staleness", async.max_staleness);
  std::string placement = placement_name(async.placement);
  a.get("placement", placement);
  if (placement != "colocated" && placement != "split")
    a.fail("placement", "expected colocated (a producer thread on every rank) or split (the second half of the "
                        "ranks roll out for the first), got '" + placement + "'");
  async.placement = placement == "split" ? AsyncConfig::Placement::kSplit : AsyncConfig::Placement::kColocated;
  a.finish();
  if (async.max_staleness < 0) a.fail("max_staleness", "must be >= 0 (leave async out for the synchronous step)");
  g.async = async;
}

void read_grpo(yaml::MapReader& s, GrpoConfig& g) {
  s.get("prompts_per_step", g.prompts_per_step);
  s.get("samples_per_prompt", g.samples_per_prompt);
  s.get("max_tokens", g.max_tokens);
  s.get("temperature", g.temperature);
  s.get("top_p", g.top_p);
  s.get("top_k", g.top_k);
  s.get("std_normalize", g.std_normalize);
  s.get("overlong_buffer", g.overlong_buffer);
  s.get("overlong_penalty", g.overlong_penalty);
  s.get("mask_truncated", g.mask_truncated);
  s.get("dynamic_sampling", g.dynamic_sampling);
  s.get("max_sampling_rounds", g.max_sampling_rounds);
  if (s.has("async")) {
    auto a = s.child("async");
    read_async(a, g);
  }
  s.get("routing_replay", g.routing_replay);
  s.get("mismatch_ab", g.mismatch_ab);
  s.get("score_lp_old", g.score_lp_old);
  s.get("fused_kernels", g.fused_kernels);
  s.get("recompute", g.recompute);
  s.finish();
}

void write_grpo(YAML::Emitter& e, const GrpoConfig& g) {
  e << YAML::Key << "prompts_per_step" << YAML::Value << g.prompts_per_step;
  e << YAML::Key << "samples_per_prompt" << YAML::Value << g.samples_per_prompt;
  e << YAML::Key << "max_tokens" << YAML::Value << g.max_tokens;
  e << YAML::Key << "temperature" << YAML::Value << g.temperature;
  e << YAML::Key << "top_p" << YAML::Value << g.top_p;
  e << YAML::Key << "top_k" << YAML::Value << g.top_k;
  e << YAML::Key << "std_normalize" << YAML::Value << g.std_normalize;
  e << YAML::Key << "overlong_buffer" << YAML::Value << g.overlong_buffer;
  e << YAML::Key << "overlong_penalty" << YAML::Value << g.overlong_penalty;
  e << YAML::Key << "mask_truncated" << YAML::Value << g.mask_truncated;
  e << YAML::Key << "dynamic_sampling" << YAML::Value << g.dynamic_sampling;
  e << YAML::Key << "max_sampling_rounds" << YAML::Value << g.max_sampling_rounds;
  e << YAML::Key << "routing_replay" << YAML::Value << g.routing_replay;
  e << YAML::Key << "mismatch_ab" << YAML::Value << g.mismatch_ab;
  e << YAML::Key << "fused_kernels" << YAML::Value << g.fused_kernels;
  e << YAML::Key << "recompute" << YAML::Value << g.recompute;
  // Written only when on: `kiln train --resume` compares the run's saved resolved recipe with this
  // one, and recipes saved without the key must still compare equal.
  if (g.score_lp_old) e << YAML::Key << "score_lp_old" << YAML::Value << true;
  if (g.async) {
    e << YAML::Key << "async" << YAML::Value << YAML::BeginMap;
    e << YAML::Key << "max_staleness" << YAML::Value << g.async->max_staleness;
    e << YAML::Key << "placement" << YAML::Value << placement_name(g.async->placement);
    e << YAML::EndMap;
  }
}

// optim: the optimizer's keys, then the step's own (clipping, mini-steps, micro-batches, schedule).
void read_optim(yaml::MapReader& o, GrpoConfig& g) {
  read_yaml(o, g.optim);
  o.get("grad_clip", g.grad_clip);
  o.get("stop_after_nonfinite", g.stop_after_nonfinite);
  o.get("mini_steps", g.mini_steps);
  o.get("micro_batch_seqs", g.micro_batch_seqs);
  read_yaml(o, g.schedule);
  o.finish();
}

void write_optim(YAML::Emitter& e, const GrpoConfig& g) {
  write_yaml(e, g.optim);
  e << YAML::Key << "grad_clip" << YAML::Value << g.grad_clip;
  e << YAML::Key << "stop_after_nonfinite" << YAML::Value << g.stop_after_nonfinite;
  e << YAML::Key << "mini_steps" << YAML::Value << g.mini_steps;
  e << YAML::Key << "micro_batch_seqs" << YAML::Value << g.micro_batch_seqs;
  write_yaml(e, g.schedule);
}

// rollout: the engine's keys, then the weight-sync check's.
void read_rollout(yaml::MapReader& ro, GrpoConfig& g) {
  read_yaml(ro, g.engine);
  ro.get("sync_check_tokens", g.sync_check_tokens);
  double threshold = g.sync_check_threshold.value_or(-1);
  ro.get("sync_check_threshold", threshold);
  // Below 0: unset, the threshold by quantisation.
  g.sync_check_threshold = threshold >= 0 ? std::optional<double>(threshold) : std::nullopt;
  ro.finish();
}

void write_rollout(YAML::Emitter& e, const GrpoConfig& g) {
  write_yaml(e, g.engine);
  e << YAML::Key << "sync_check_tokens" << YAML::Value << g.sync_check_tokens;
  e << YAML::Key << "sync_check_threshold" << YAML::Value << g.sync_check_threshold.value_or(-1);
}

}  // namespace

void read_yaml(yaml::MapReader& top, GrpoConfig& g) {
  auto prompt = top.child("prompt");
  read_yaml(prompt, g.prompt);
  auto grpo = top.child("grpo");
  read_grpo(grpo, g);
  auto loss = top.child("loss");
  read_yaml(loss, g.loss);
  auto optim = top.child("optim");
  read_optim(optim, g);
  auto parallel = top.child("parallel");
  read_yaml(parallel, g.parallel);
  auto rollout = top.child("rollout");
  read_rollout(rollout, g);
  if (top.has("lora")) {  // a lora: section turns adapters on: rank 32, alpha 64 unless it says otherwise
    auto lora = top.child("lora");
    read_yaml(lora, g.lora);
  }
  if (top.has("reward")) {
    auto reward = top.child("reward");
    read_yaml(reward, g.reward);
  }
  if (top.has("environment")) {  // multi-turn episodes (trainer/environment.h)
    auto environment = top.child("environment");
    read_yaml(environment, g.environment);
  }
}

void write_yaml(YAML::Emitter& e, const GrpoConfig& g) {
  yaml::write_map(e, "prompt", [&] { write_yaml(e, g.prompt); });
  yaml::write_map(e, "grpo", [&] { write_grpo(e, g); });
  yaml::write_map(e, "loss", [&] { write_yaml(e, g.loss); });
  yaml::write_map(e, "optim", [&] { write_optim(e, g); });
  yaml::write_map(e, "parallel", [&] { write_yaml(e, g.parallel); });
  yaml::write_map(e, "rollout", [&] { write_rollout(e, g); });
  yaml::write_map(e, "lora", [&] { write_yaml(e, g.lora); });
  yaml::write_map(e, "reward", [&] { write_yaml(e, g.reward); });
  if (g.environment.enabled()) yaml::write_map(e, "environment", [&] { write_yaml(e, g.environment); });
}

void read_yaml(yaml::MapReader& m, EvalConfig& c) {
  m.get("prompts", c.prompts);
  m.get("samples", c.samples);
  m.get("temperature", c.temperature);
  int64_t max_tokens = c.max_tokens.value_or(0);
  m.get("max_tokens", max_tokens);
  c.max_tokens = max_tokens != 0 ? std::optional<int64_t>(max_tokens) : std::nullopt;  // 0: grpo.max_tokens
}

void write_yaml(YAML::Emitter& e, const EvalConfig& c) {
  e << YAML::Key << "prompts" << YAML::Value << c.prompts;
  e << YAML::Key << "samples" << YAML::Value << c.samples;
  e << YAML::Key << "temperature" << YAML::Value << c.temperature;
  e << YAML::Key << "max_tokens" << YAML::Value << c.max_tokens.value_or(0);
}

}  // namespace kiln::trainer
