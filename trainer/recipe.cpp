// Recipe parsing with strict keys (core/yaml_util.h) and its resolved YAML form.
#include "trainer/recipe.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>

#include "core/error.h"
#include "core/yaml_util.h"
#include "model/config.h"
#include "text/tokenizer.h"
#include "text/unicode.h"
#include "trainer/tasks.h"

namespace kiln::trainer {
namespace {

// A path in a recipe is taken relative to the current directory when it exists there, else
// relative to the recipe's folder.
// Whether `path` names something; a name the OS refuses (too long, say) names nothing. Found by
// fuzz_recipe: the throwing overload of exists() ended the run with filesystem_error.
bool exists_quietly(const std::filesystem::path& path) {
  std::error_code ec;
  return std::filesystem::exists(path, ec) && !ec;
}

std::string resolve(const std::string& path, const std::string& recipe) {
  if (path.empty() || exists_quietly(path)) return path;
  auto beside = std::filesystem::path(recipe).parent_path() / path;
  return exists_quietly(beside) ? beside.string() : path;
}


// The optimizer keys shared by the optim (GRPO) and sft sections.
// An enum written by name: a bad name fails naming the file, line and key, with the parser's message.
template <typename E>
void get_enum(yaml::MapReader& m, const std::string& key, E& out, E (*parse)(const std::string&),
              const char* (*name)(E)) {
  std::string s = name(out);
  m.get(key, s);
  try {
    out = parse(s);
  } catch (const Error& e) {
    m.fail(key, e.what());
  }
}

void read_optim(yaml::MapReader& m, optimizers::OptimizerConfig& o) {
  using optimizers::Placement;
  m.get("lr", o.adamw.lr);
  m.get("weight_decay", o.adamw.weight_decay);
  // Muon's update is scaled to AdamW's RMS, so by default both groups share lr and decay.
  o.muon.weight_decay = o.adamw.weight_decay;
  o.muon.lr = o.adamw.lr;
  m.get("beta1", o.adamw.beta1);
  m.get("beta2", o.adamw.beta2);
  m.get("eps", o.adamw.eps);
  m.get("muon", o.use_muon);
  m.get("muon_lr", o.muon.lr);
  m.get("muon_momentum", o.muon.momentum);
  m.get("muon_weight_decay", o.muon.weight_decay);
  m.get("muon_nesterov", o.muon.nesterov);
  m.get("ns_steps", o.muon.ns_steps);
  std::string state = optimizers::placement_name(o.placement), moments = o.moment_dtype == at::kFloat ? "fp32" : "bf16";
  m.get("state", state);
  m.get("nvme_dir", o.nvme_dir);
  double chunk_mb = double(o.chunk_bytes) / double(1 << 20);
  m.get("chunk_mb", chunk_mb);
  o.chunk_bytes = std::max<int64_t>(1, int64_t(chunk_mb * double(1 << 20)));
  m.get("master_weights", o.master_weights);
  m.get("moments", moments);
  for (yaml::MapReader& r : m.children("rules")) {
    optimizers::GroupRule rule;
    std::string kind;
    r.get("match", rule.match);
    r.get("min_dim", rule.min_dim);
    r.get("max_dim", rule.max_dim);
    r.require("optimizer", kind);
    r.finish();
    try {
      rule.kind = optimizers::parse_kind(kind);
    } catch (const Error& e) {
      r.fail("optimizer", e.what());
    }
    o.rules.push_back(rule);
  }
  try {
    o.placement = optimizers::parse_placement(state);
  } catch (const Error& e) {
    m.fail("state", e.what());
  }
  if (moments != "fp32" && moments != "bf16") m.fail("moments", "must be fp32 or bf16 (got " + moments + ")");
  o.moment_dtype = moments == "bf16" ? at::kBFloat16 : at::kFloat;
  try {
    o.validate();
  } catch (const Error& e) {
    m.fail("", e.what());
  }
}

void emit_optim(YAML::Emitter& e, const optimizers::OptimizerConfig& o) {
  e << YAML::Key << "lr" << YAML::Value << o.adamw.lr << YAML::Key << "weight_decay" << YAML::Value
    << o.adamw.weight_decay << YAML::Key << "beta1" << YAML::Value << o.adamw.beta1 << YAML::Key << "beta2"
    << YAML::Value << o.adamw.beta2 << YAML::Key << "eps" << YAML::Value << o.adamw.eps << YAML::Key << "muon"
    << YAML::Value << o.use_muon << YAML::Key << "muon_lr" << YAML::Value << o.muon.lr << YAML::Key
    << "muon_momentum" << YAML::Value << o.muon.momentum << YAML::Key << "muon_weight_decay" << YAML::Value
    << o.muon.weight_decay << YAML::Key << "muon_nesterov" << YAML::Value << o.muon.nesterov << YAML::Key
    << "ns_steps" << YAML::Value << o.muon.ns_steps << YAML::Key << "state" << YAML::Value
    << optimizers::placement_name(o.placement);
  if (!o.nvme_dir.empty()) e << YAML::Key << "nvme_dir" << YAML::Value << o.nvme_dir;
  e << YAML::Key << "chunk_mb" << YAML::Value << double(o.chunk_bytes) / double(1 << 20) << YAML::Key
    << "master_weights" << YAML::Value << o.master_weights << YAML::Key << "moments" << YAML::Value
    << (o.moment_dtype == at::kFloat ? "fp32" : "bf16");
  if (!o.rules.empty()) {
    e << YAML::Key << "rules" << YAML::Value << YAML::BeginSeq;
    for (const auto& r : o.rules)
      e << YAML::BeginMap << YAML::Key << "match" << YAML::Value << r.match << YAML::Key << "min_dim" << YAML::Value
        << r.min_dim << YAML::Key << "max_dim" << YAML::Value << r.max_dim << YAML::Key << "optimizer"
        << YAML::Value << optimizers::kind_name(r.kind) << YAML::EndMap;
    e << YAML::EndSeq;
  }
}


// A free-form YAML value (template variables) as JSON: scalars become booleans, integers, numbers
// or strings, as YAML 1.2's core schema reads them.
nlohmann::json yaml_to_json(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return nullptr;
  if (n.IsMap()) {
    nlohmann::json j = nlohmann::json::object();
    for (const auto& kv : n) j[kv.first.Scalar()] = yaml_to_json(kv.second);  // keys: names (yaml::load_file)
    return j;
  }
  if (n.IsSequence()) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& v : n) j.push_back(yaml_to_json(v));
    return j;
  }
  const std::string text = n.Scalar();
  if (n.Tag() == "!") return text;  // quoted: a string whatever it looks like
  if (text == "true" || text == "True") return true;
  if (text == "false" || text == "False") return false;
  try {
    size_t used = 0;
    const long long i = std::stoll(text, &used);
    if (used == text.size()) return i;
    const double d = std::stod(text, &used);
    if (used == text.size()) return d;
  } catch (const std::exception&) {
  }
  return text;
}

void emit_json(YAML::Emitter& e, const nlohmann::json& j) {
  if (j.is_object()) {
    e << YAML::BeginMap;
    for (auto& [k, v] : j.items()) {
      e << YAML::Key << k << YAML::Value;
      emit_json(e, v);
    }
    e << YAML::EndMap;
  } else if (j.is_array()) {
    e << YAML::BeginSeq;
    for (const auto& v : j) emit_json(e, v);
    e << YAML::EndSeq;
  } else if (j.is_string()) {
    e << YAML::DoubleQuoted << j.get<std::string>();
  } else if (j.is_null()) {
    e << YAML::Null;
  } else {
    e << j.dump();
  }
}

// The worker-pool keys a reward worker and an environment share (trainer/worker_pool.h).
void read_worker(yaml::MapReader& m, WorkerSpec& w) {
  m.require("command", w.command);
  m.get("num_workers", w.num_workers);
  m.get("max_in_flight", w.max_in_flight);
  m.get("timeout_s", w.timeout_s);
  m.get("max_retries", w.max_retries);
  m.get("max_restarts", w.max_restarts);
  m.get("max_garbage_lines", w.max_garbage_lines);
  m.get("shutdown_grace_s", w.shutdown_grace_s);
  std::string policy = on_failure_name(w.on_failure);
  m.get("on_failure", policy);
  try {
    w.on_failure = parse_on_failure(policy);
  } catch (const Error& e) {
    m.fail("on_failure", e.what());
  }
}

void emit_worker(YAML::Emitter& e, const WorkerSpec& w) {
  e << YAML::Key << "command" << YAML::Value << YAML::Flow << w.command << YAML::Key << "num_workers" << YAML::Value
    << w.num_workers << YAML::Key << "max_in_flight" << YAML::Value << w.max_in_flight << YAML::Key << "timeout_s"
    << YAML::Value << w.timeout_s << YAML::Key << "max_retries" << YAML::Value << w.max_retries << YAML::Key
    << "max_restarts" << YAML::Value << w.max_restarts << YAML::Key << "max_garbage_lines" << YAML::Value
    << w.max_garbage_lines << YAML::Key << "shutdown_grace_s" << YAML::Value << w.shutdown_grace_s << YAML::Key
    << "on_failure" << YAML::Value << on_failure_name(w.on_failure);
}

// An argv resolves like the recipe's paths: an argument naming a file that exists beside the recipe
// but not in the current directory becomes that file, so a recipe that ships its worker next to it
// runs from anywhere. command[0] without a '/' is a program on PATH and stays.
void resolve_command(std::vector<std::string>& argv, const std::string& recipe) {
  for (size_t i = 0; i < argv.size(); ++i)
    if (i > 0 || argv[i].find('/') != std::string::npos) argv[i] = resolve(argv[i], recipe);
}

void resolve_worker_paths(RewardSpec& spec, const std::string& recipe) {
  resolve_command(spec.worker.command, recipe);
  for (auto& part : spec.parts) resolve_worker_paths(part, recipe);
}

// reward: a built-in, a worker or a weighted sum of parts (trainer/rewards.h).
RewardSpec read_reward(yaml::MapReader& m) {
  RewardSpec spec;
  std::string type = reward_type_name(spec.type);
  m.get("type", type);
  try {
    spec.type = parse_reward_type(type);
  } catch (const Error& e) {
    m.fail("type", e.what());
  }
  m.get("name", spec.name);
  m.get("weight", spec.weight);
  switch (spec.type) {
    case RewardType::kExactMatch:
      m.get("stops", spec.exact_match.stops);
      m.get("normalize_whitespace", spec.exact_match.normalize_whitespace);
      m.get("ignore_case", spec.exact_match.ignore_case);
      break;
    case RewardType::kRegexFormat:
      m.require("pattern", spec.regex_format.pattern);
      break;
    case RewardType::kMath:
      m.get("last_number_fallback", spec.math.last_number_fallback);
      break;
    case RewardType::kWorker:
      read_worker(m, spec.worker);
      break;
    case RewardType::kSum:
      for (yaml::MapReader& part : m.children("parts")) spec.parts.push_back(read_reward(part));
      if (spec.parts.empty()) m.fail("parts", "a sum needs at least one part");
      break;
  }
  m.finish();
  return spec;
}

void emit_reward(YAML::Emitter& e, const RewardSpec& r) {
  e << YAML::BeginMap << YAML::Key << "type" << YAML::Value << reward_type_name(r.type);
  if (!r.name.empty()) e << YAML::Key << "name" << YAML::Value << r.name;
  e << YAML::Key << "weight" << YAML::Value << r.weight;
  switch (r.type) {
    case RewardType::kExactMatch:
      e << YAML::Key << "stops" << YAML::Value << YAML::Flow << YAML::BeginSeq;
      for (const auto& stop : r.exact_match.stops) e << YAML::DoubleQuoted << stop;
      e << YAML::EndSeq << YAML::Key << "normalize_whitespace" << YAML::Value << r.exact_match.normalize_whitespace
        << YAML::Key << "ignore_case" << YAML::Value << r.exact_match.ignore_case;
      break;
    case RewardType::kRegexFormat:
      e << YAML::Key << "pattern" << YAML::Value << YAML::DoubleQuoted << r.regex_format.pattern;
      break;
    case RewardType::kMath:
      e << YAML::Key << "last_number_fallback" << YAML::Value << r.math.last_number_fallback;
      break;
    case RewardType::kWorker:
      emit_worker(e, r.worker);
      break;
    case RewardType::kSum:
      e << YAML::Key << "parts" << YAML::Value << YAML::BeginSeq;
      for (const auto& part : r.parts) emit_reward(e, part);
      e << YAML::EndSeq;
      break;
  }
  e << YAML::EndMap;
}

const char* chat_mode_name(ChatMode m) {
  return m == ChatMode::kAlways ? "always" : m == ChatMode::kNever ? "never" : "auto";
}

}  // namespace

Recipe Recipe::from_yaml_file(const std::string& path) {
  Recipe r;
  yaml::MapReader top(yaml::load_file(path), path, "");
  {
    auto m = top.child("model");
    m.get("config", r.model_config);
    m.get("init_from", r.init_from);
    m.get("seed", r.model_seed);
    m.get("dtype", r.dtype);
    m.get("device", r.device);
    m.get("tokenizer", r.tokenizer);
    m.finish();
    if (r.model_config.empty() == r.init_from.empty())
      m.fail("config", "give exactly one of model.config (random init) and model.init_from (a checkpoint)");
  }
  {
    auto d = top.child("data");
    d.get("task", r.task);
    d.get("path", r.data_path);
    d.get("eval_path", r.eval_path);
    d.get("difficulty", r.difficulty);
    d.get("num_problems", r.num_problems);
    d.get("test_fraction", r.test_fraction);
    d.get("data_source", r.jsonl.data_source);
    std::string bad = r.jsonl.bad_lines == BadLines::kSkip ? "skip" : "error";
    d.get("bad_lines", bad);
    if (bad != "error" && bad != "skip") d.fail("bad_lines", "must be error or skip (got " + bad + ")");
    r.jsonl.bad_lines = bad == "skip" ? BadLines::kSkip : BadLines::kError;
    {
      auto k = d.child("keys");
      k.get("prompt", r.jsonl.keys.prompt);
      k.get("label", r.jsonl.keys.label);
      k.get("data_source", r.jsonl.keys.data_source);
      k.get("metadata", r.jsonl.keys.metadata);
      k.finish();
      if (r.jsonl.keys.prompt.empty()) k.fail("prompt", "the prompt key cannot be empty");
    }
    d.finish();
    if (!r.eval_path.empty() && r.task != "jsonl") d.fail("eval_path", "eval_path needs task jsonl");
    if (r.task != "arithmetic" && r.task != "jsonl") d.fail("task", "must be arithmetic or jsonl (got " + r.task + ")");
    if (r.task == "jsonl" && r.data_path.empty()) d.fail("path", "task jsonl needs data.path");
    if (!(r.test_fraction >= 0 && r.test_fraction < 1)) d.fail("test_fraction", "must be in [0, 1)");
  }
  GrpoConfig& g = r.grpo;
  {
    auto p = top.child("prompt");
    PromptFormat& f = g.prompt;
    std::string chat = chat_mode_name(f.chat);
    p.get("chat", chat);
    if (chat != "auto" && chat != "always" && chat != "never")
      p.fail("chat", "must be auto (chats through the template, text as it is), always or never (got " + chat + ")");
    f.chat = chat == "always" ? ChatMode::kAlways : chat == "never" ? ChatMode::kNever : ChatMode::kAuto;
    p.get("system", f.system_prompt);
    // Prompts and template variables become JSON for the chat template: text must be UTF-8.
    if (!text::unicode::is_valid_utf8(f.system_prompt)) p.fail("system", "must be UTF-8 text");
    p.get("add_generation_prompt", f.add_generation_prompt);
    p.get("max_prompt_tokens", f.max_prompt_tokens);
    const YAML::Node kw = p.raw("template_kwargs");
    if (kw.IsDefined()) {
      if (!kw.IsMap()) p.fail("template_kwargs", "must be a mapping of template variables, e.g. {enable_thinking: false}");
      try {
        f.template_kwargs = yaml_to_json(kw).dump();
      } catch (const nlohmann::json::exception&) {  // found by fuzz_recipe: invalid UTF-8 ended the run
        p.fail("template_kwargs", "must be UTF-8 text");
      }
    }
    p.finish();
    try {
      f.validate();
    } catch (const Error& e) {
      p.fail("", e.what());
    }
    r.sft.prompt = f;
  }
  {
    auto s = top.child("grpo");
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
    if (s.has("async")) {  // asynchronous GRPO with bounded staleness
      auto a = s.child("async");
      a.require("max_staleness", g.async_staleness);
      std::string placement = g.async_split ? "split" : "colocated";
      a.get("placement", placement);
      if (placement != "colocated" && placement != "split")
        a.fail("placement", "expected colocated (a producer thread on every rank) or split (the second half of the "
                            "ranks roll out for the first), got '" + placement + "'");
      g.async_split = placement == "split";
      a.finish();
      if (g.async_staleness < 0) a.fail("max_staleness", "must be >= 0 (leave async out for the synchronous step)");
    }
    s.get("routing_replay", g.routing_replay);
    s.get("mismatch_ab", g.mismatch_ab);
    s.get("score_lp_old", g.score_lp_old);
    s.get("fused_kernels", g.fused_kernels);
    s.get("recompute", g.recompute);
    s.finish();
  }
  {
    auto l = top.child("loss");
    std::string agg = "token-mean";
    l.get("eps_low", g.loss.eps_low);
    l.get("eps_high", g.loss.eps_high);
    l.get("aggregation", agg);
    l.get("kl_coef", g.loss.kl_coef);
    l.get("tis", g.loss.tis);
    l.get("tis_cap", g.loss.tis_cap);
    l.get("gspo", g.loss.gspo);
    l.get("mis", g.loss.mis);
    l.get("mis_low", g.loss.mis_low);
    l.get("mis_high", g.loss.mis_high);
    l.finish();
    try {
      g.loss.aggregation = parse_aggregation(agg);
    } catch (const Error& e) {
      l.fail("aggregation", e.what());
    }
    if (g.loss.kl_coef < 0) l.fail("kl_coef", "must be >= 0 (0 turns the KL term off)");
  }
  {
    auto o = top.child("optim");
    read_optim(o, g.optim);
    o.get("grad_clip", g.grad_clip);
    o.get("stop_after_nonfinite", g.stop_after_nonfinite);
    o.get("mini_steps", g.mini_steps);
    o.get("micro_batch_seqs", g.micro_batch_seqs);
    o.get("warmup_steps", g.schedule.warmup_steps);
    o.get("lr_decay", g.schedule.decay);
    o.get("min_lr_ratio", g.schedule.min_ratio);
    o.finish();
  }
  {
    auto p = top.child("parallel");
    p.get("dp", g.parallel.dp);
    p.get("ep", g.parallel.ep);
    p.get("tp", g.parallel.tp);
    p.get("collective_timeout_s", g.parallel.collective_timeout_s);
    if (!std::isfinite(g.parallel.collective_timeout_s) || g.parallel.collective_timeout_s < 0)
      p.fail("collective_timeout_s", "must be a number of seconds >= 0 (0: no timeout)");
    get_enum(p, "dense", g.parallel.dense, parallel::parse_dense_sharding, parallel::dense_sharding_name);
    get_enum(p, "rollout", g.parallel.rollout, parallel::parse_rollout_placement, parallel::rollout_placement_name);
    p.finish();
  }
  {
    auto ro = top.child("rollout");
    double mb = double(g.engine.kv_cache_bytes) / double(1 << 20);
    ro.get("kv_cache_mb", mb);
    g.engine.kv_cache_bytes = int64_t(mb * double(1 << 20));
    ro.get("block_size", g.engine.block_size);
    ro.get("max_num_seqs", g.engine.max_num_seqs);
    ro.get("max_model_len", g.engine.max_model_len);
    if (g.engine.max_model_len < 0) ro.fail("max_model_len", "expected tokens >= 0 (0: sequences of any length)");
    ro.get("max_batch_tokens", g.engine.max_batch_tokens);
    ro.get("prefill_chunk", g.engine.prefill_chunk);
    ro.get("cuda_graphs", g.engine.cuda_graphs);
    ro.get("expert_capacity", g.engine.expert_capacity);
    if (!std::isfinite(g.engine.expert_capacity) || g.engine.expert_capacity < 0)
      ro.fail("expert_capacity", "expected a finite number >= 0 (0: the worst case, no overflow)");
    std::string quantization = rollout::quantization_name(g.engine.quantization);
    ro.get("quantization", quantization);
    try {
      g.engine.quantization = rollout::parse_quantization(quantization);
    } catch (const Error& e) {
      ro.fail("quantization", e.what());
    }
    std::string numerics = g.engine.batch_invariant ? "bitwise" : "standard";
    ro.get("numerics", numerics);
    if (numerics != "standard" && numerics != "bitwise")
      ro.fail("numerics", "expected standard or bitwise (got '" + numerics + "')");
    g.engine.batch_invariant = numerics == "bitwise";
    ro.get("sync_check_tokens", g.sync_check_tokens);
    ro.get("sync_check_threshold", g.sync_check_threshold);
    ro.finish();
  }
  {
    if (top.has("lora")) g.lora.rank = 32;  // a lora: section turns adapters on: rank 32, alpha 64
    auto lo = top.child("lora");
    lo.get("rank", g.lora.rank);
    lo.get("alpha", g.lora.alpha);
    lo.get("targets", g.lora.targets);
    lo.finish();
    try {
      g.lora.validate();
    } catch (const Error& e) {  // named at the key the check is about
      const std::string what = e.what();
      lo.fail(what.find("target") != std::string::npos ? "targets" : what.find("alpha") != std::string::npos ? "alpha" : "rank",
              what);
    }
  }
  if (top.has("reward")) {
    auto w = top.child("reward");
    g.reward = read_reward(w);
    try {
      g.reward.validate();
    } catch (const Error& e) {
      w.fail("", e.what());
    }
  }
  if (top.has("environment")) {  // multi-turn episodes (trainer/environment.h)
    auto v = top.child("environment");
    read_worker(v, g.environment.worker);
    v.get("max_turns", g.environment.max_turns);
    v.get("max_episode_tokens", g.environment.max_episode_tokens);
    v.get("max_observation_tokens", g.environment.max_observation_tokens);
    v.finish();
    try {
      g.environment.validate("environment");
    } catch (const Error& e) {
      v.fail("", e.what());
    }
  }
  {
    auto s = top.child("sft");
    s.get("steps", r.sft.steps);
    s.get("batch_size", r.sft.batch_size);
    read_optim(s, r.sft.optim);
    s.get("grad_clip", r.sft.grad_clip);
    s.get("stop_after_nonfinite", r.sft.stop_after_nonfinite);
    s.get("warmup_steps", r.sft.schedule.warmup_steps);
    s.get("lr_decay", r.sft.schedule.decay);
    s.get("min_lr_ratio", r.sft.schedule.min_ratio);
    get_enum(s, "demonstrations", r.sft.demonstrations, parse_demonstrations, demonstrations_name);
    if (r.sft.demonstrations == Demonstrations::kEnvironment && !r.grpo.environment.enabled())
      s.fail("demonstrations", "environment needs the recipe's environment: section (its workers demonstrate)");
    s.finish();
    try {
      r.sft.validate();
    } catch (const Error& e) {
      s.fail("", e.what());
    }
  }
  {
    auto run = top.child("run");
    run.get("steps", r.run.steps);
    run.get("checkpoint_every", r.run.checkpoint_every);
    run.get("samples_every", r.run.samples_every);
    run.get("samples_per_dump", r.run.samples_per_dump);
    run.get("tensorboard", r.run.tensorboard);
    run.get("seed", g.seed);
    run.get("out", r.run.out);
    run.finish();
    if (r.run.steps < 0) run.fail("steps", "must be >= 0");
    if (r.run.checkpoint_every < 0) run.fail("checkpoint_every", "must be >= 0 (0: only at the end)");
    if (r.run.samples_every < 0) run.fail("samples_every", "must be >= 0 (0: no sample dumps)");
  }
  {
    auto ev = top.child("eval");
    EvalConfig& e = r.run.eval;
    ev.get("every", r.run.eval_every);
    ev.get("prompts", e.limit);
    ev.get("samples", e.samples);
    ev.get("temperature", e.temperature);
    ev.get("max_tokens", e.max_tokens);
    ev.finish();
    if (r.run.eval_every < 0) ev.fail("every", "must be >= 0 (0: only at the start and the end)");
    try {
      e.validate();
    } catch (const Error& err) {
      ev.fail("", err.what());
    }
  }
  top.finish();
  r.sft.seed = g.seed;
  r.sync_schedules();
  // rollout.max_model_len left 0 is known when prompts are capped and every sample is one turn:
  // the engine's window pool then holds what such sequences touch (rollout/kv_cache.h).
  if (g.engine.max_model_len == 0 && g.prompt.max_prompt_tokens > 0 && !g.environment.enabled())
    g.engine.max_model_len = g.prompt.max_prompt_tokens + std::max(g.max_tokens, r.run.eval.max_tokens);
  try {
    g.validate();
  } catch (const Error& e) {
    KILN_FAIL("recipe ", path, ": ", e.what());
  }
  r.model_config = resolve(r.model_config, path);
  r.init_from = resolve(r.init_from, path);
  r.data_path = resolve(r.data_path, path);
  r.eval_path = resolve(r.eval_path, path);
  r.tokenizer = resolve(r.tokenizer, path);
  resolve_worker_paths(g.reward, path);
  resolve_command(g.environment.worker.command, path);
  return r;
}

std::string Recipe::to_yaml() const {
  YAML::Emitter e;
  const GrpoConfig& g = grpo;
  e << YAML::BeginMap;
  e << YAML::Key << "model" << YAML::Value << YAML::BeginMap;
  if (!model_config.empty()) e << YAML::Key << "config" << YAML::Value << model_config;
  if (!init_from.empty()) e << YAML::Key << "init_from" << YAML::Value << init_from;
  e << YAML::Key << "seed" << YAML::Value << model_seed << YAML::Key << "dtype" << YAML::Value << dtype
    << YAML::Key << "device" << YAML::Value << device;
  if (!tokenizer.empty()) e << YAML::Key << "tokenizer" << YAML::Value << tokenizer;
  e << YAML::EndMap;
  e << YAML::Key << "data" << YAML::Value << YAML::BeginMap << YAML::Key << "task" << YAML::Value << task;
  if (!data_path.empty()) e << YAML::Key << "path" << YAML::Value << data_path;
  if (!eval_path.empty()) e << YAML::Key << "eval_path" << YAML::Value << eval_path;
  e << YAML::Key << "difficulty" << YAML::Value << difficulty << YAML::Key << "num_problems" << YAML::Value
    << num_problems << YAML::Key << "test_fraction" << YAML::Value << test_fraction;
  if (!jsonl.data_source.empty()) e << YAML::Key << "data_source" << YAML::Value << jsonl.data_source;
  e << YAML::Key << "bad_lines" << YAML::Value << (jsonl.bad_lines == BadLines::kSkip ? "skip" : "error")
    << YAML::Key << "keys" << YAML::Value << YAML::BeginMap << YAML::Key << "prompt" << YAML::Value << jsonl.keys.prompt
    << YAML::Key << "label" << YAML::Value << jsonl.keys.label << YAML::Key << "data_source" << YAML::Value
    << jsonl.keys.data_source << YAML::Key << "metadata" << YAML::Value << jsonl.keys.metadata << YAML::EndMap
    << YAML::EndMap;
  e << YAML::Key << "prompt" << YAML::Value << YAML::BeginMap << YAML::Key << "chat" << YAML::Value
    << chat_mode_name(g.prompt.chat);
  if (!g.prompt.system_prompt.empty()) e << YAML::Key << "system" << YAML::Value << YAML::DoubleQuoted << g.prompt.system_prompt;
  e << YAML::Key << "add_generation_prompt" << YAML::Value << g.prompt.add_generation_prompt << YAML::Key
    << "max_prompt_tokens" << YAML::Value << g.prompt.max_prompt_tokens << YAML::Key << "template_kwargs"
    << YAML::Value;
  emit_json(e, nlohmann::json::parse(g.prompt.template_kwargs));
  e << YAML::EndMap;
  e << YAML::Key << "grpo" << YAML::Value << YAML::BeginMap << YAML::Key << "prompts_per_step" << YAML::Value
    << g.prompts_per_step << YAML::Key << "samples_per_prompt" << YAML::Value << g.samples_per_prompt
    << YAML::Key << "max_tokens" << YAML::Value << g.max_tokens << YAML::Key << "temperature" << YAML::Value
    << g.temperature << YAML::Key << "top_p" << YAML::Value << g.top_p << YAML::Key << "top_k" << YAML::Value
    << g.top_k << YAML::Key << "std_normalize" << YAML::Value << g.std_normalize << YAML::Key << "overlong_buffer"
    << YAML::Value << g.overlong_buffer << YAML::Key << "overlong_penalty" << YAML::Value << g.overlong_penalty
    << YAML::Key << "mask_truncated" << YAML::Value << g.mask_truncated << YAML::Key << "dynamic_sampling"
    << YAML::Value << g.dynamic_sampling << YAML::Key << "max_sampling_rounds" << YAML::Value << g.max_sampling_rounds
    << YAML::Key << "routing_replay"
    << YAML::Value << g.routing_replay << YAML::Key << "mismatch_ab" << YAML::Value << g.mismatch_ab << YAML::Key << "fused_kernels" << YAML::Value
    << g.fused_kernels << YAML::Key << "recompute" << YAML::Value << g.recompute;
  if (g.score_lp_old) e << YAML::Key << "score_lp_old" << YAML::Value << true;  // runs before the key: false
  if (g.async_staleness >= 0)
    e << YAML::Key << "async" << YAML::Value << YAML::BeginMap << YAML::Key << "max_staleness" << YAML::Value
      << g.async_staleness << YAML::Key << "placement" << YAML::Value << (g.async_split ? "split" : "colocated")
      << YAML::EndMap;
  e << YAML::EndMap;
  e << YAML::Key << "loss" << YAML::Value << YAML::BeginMap << YAML::Key << "eps_low" << YAML::Value
    << g.loss.eps_low << YAML::Key << "eps_high" << YAML::Value << g.loss.eps_high << YAML::Key << "aggregation"
    << YAML::Value
    << (g.loss.aggregation == Aggregation::kTokenMean ? "token-mean" : "seq-mean-token-mean") << YAML::Key
    << "kl_coef" << YAML::Value << g.loss.kl_coef << YAML::Key << "tis" << YAML::Value << g.loss.tis << YAML::Key
    << "tis_cap" << YAML::Value << g.loss.tis_cap << YAML::Key << "gspo" << YAML::Value << g.loss.gspo << YAML::Key
    << "mis" << YAML::Value << g.loss.mis << YAML::Key << "mis_low" << YAML::Value << g.loss.mis_low << YAML::Key
    << "mis_high" << YAML::Value << g.loss.mis_high << YAML::EndMap;
  e << YAML::Key << "optim" << YAML::Value << YAML::BeginMap;
  emit_optim(e, g.optim);
  e << YAML::Key << "grad_clip" << YAML::Value << g.grad_clip << YAML::Key << "stop_after_nonfinite" << YAML::Value
    << g.stop_after_nonfinite << YAML::Key << "mini_steps" << YAML::Value << g.mini_steps << YAML::Key << "micro_batch_seqs"
    << YAML::Value << g.micro_batch_seqs << YAML::Key << "warmup_steps" << YAML::Value << g.schedule.warmup_steps
    << YAML::Key << "lr_decay" << YAML::Value << g.schedule.decay << YAML::Key << "min_lr_ratio" << YAML::Value
    << g.schedule.min_ratio << YAML::EndMap;
  e << YAML::Key << "parallel" << YAML::Value << YAML::BeginMap << YAML::Key << "dp" << YAML::Value << g.parallel.dp
    << YAML::Key << "ep" << YAML::Value << g.parallel.ep << YAML::Key << "tp" << YAML::Value << g.parallel.tp
    << YAML::Key << "rollout" << YAML::Value << parallel::rollout_placement_name(g.parallel.rollout) << YAML::Key << "dense"
    << YAML::Value << parallel::dense_sharding_name(g.parallel.dense) << YAML::Key
    << "collective_timeout_s" << YAML::Value << g.parallel.collective_timeout_s << YAML::EndMap;
  e << YAML::Key << "rollout" << YAML::Value << YAML::BeginMap << YAML::Key << "kv_cache_mb" << YAML::Value
    << double(g.engine.kv_cache_bytes) / double(1 << 20) << YAML::Key << "block_size" << YAML::Value
    << g.engine.block_size << YAML::Key << "max_num_seqs" << YAML::Value << g.engine.max_num_seqs << YAML::Key
    << "max_model_len" << YAML::Value << g.engine.max_model_len << YAML::Key
    << "max_batch_tokens" << YAML::Value << g.engine.max_batch_tokens << YAML::Key << "prefill_chunk"
    << YAML::Value << g.engine.prefill_chunk << YAML::Key << "cuda_graphs" << YAML::Value << g.engine.cuda_graphs
    << YAML::Key << "expert_capacity" << YAML::Value << g.engine.expert_capacity
    << YAML::Key << "quantization" << YAML::Value << rollout::quantization_name(g.engine.quantization)
    << YAML::Key << "numerics" << YAML::Value << (g.engine.batch_invariant ? "bitwise" : "standard") << YAML::Key << "sync_check_tokens"
    << YAML::Value << g.sync_check_tokens << YAML::Key << "sync_check_threshold" << YAML::Value
    << g.sync_check_threshold << YAML::EndMap;
  e << YAML::Key << "lora" << YAML::Value << YAML::BeginMap << YAML::Key << "rank" << YAML::Value << g.lora.rank
    << YAML::Key << "alpha" << YAML::Value << g.lora.alpha << YAML::Key << "targets" << YAML::Value << YAML::Flow
    << g.lora.targets << YAML::EndMap;
  e << YAML::Key << "reward" << YAML::Value;
  emit_reward(e, g.reward);
  if (g.environment.enabled()) {
    e << YAML::Key << "environment" << YAML::Value << YAML::BeginMap;
    emit_worker(e, g.environment.worker);
    e << YAML::Key << "max_turns" << YAML::Value << g.environment.max_turns << YAML::Key << "max_episode_tokens"
      << YAML::Value << g.environment.max_episode_tokens << YAML::Key << "max_observation_tokens" << YAML::Value
      << g.environment.max_observation_tokens << YAML::EndMap;
  }
  e << YAML::Key << "sft" << YAML::Value << YAML::BeginMap << YAML::Key << "steps" << YAML::Value << sft.steps
    << YAML::Key << "batch_size" << YAML::Value << sft.batch_size;
  emit_optim(e, sft.optim);
  e << YAML::Key << "grad_clip" << YAML::Value << sft.grad_clip << YAML::Key << "stop_after_nonfinite"
    << YAML::Value << sft.stop_after_nonfinite << YAML::Key << "warmup_steps" << YAML::Value << sft.schedule.warmup_steps << YAML::Key
    << "lr_decay" << YAML::Value << sft.schedule.decay << YAML::Key << "min_lr_ratio" << YAML::Value
    << sft.schedule.min_ratio << YAML::Key << "demonstrations" << YAML::Value << demonstrations_name(sft.demonstrations)
    << YAML::EndMap;
  e << YAML::Key << "eval" << YAML::Value << YAML::BeginMap << YAML::Key << "every" << YAML::Value << run.eval_every
    << YAML::Key << "prompts" << YAML::Value << run.eval.limit << YAML::Key << "samples" << YAML::Value
    << run.eval.samples << YAML::Key << "temperature" << YAML::Value << run.eval.temperature << YAML::Key
    << "max_tokens" << YAML::Value << run.eval.max_tokens << YAML::EndMap;
  e << YAML::Key << "run" << YAML::Value << YAML::BeginMap << YAML::Key << "steps" << YAML::Value << run.steps
    << YAML::Key << "checkpoint_every" << YAML::Value << run.checkpoint_every << YAML::Key << "samples_every"
    << YAML::Value << run.samples_every << YAML::Key << "samples_per_dump" << YAML::Value << run.samples_per_dump
    << YAML::Key << "tensorboard" << YAML::Value << run.tensorboard << YAML::Key << "seed" << YAML::Value << g.seed
    << YAML::Key << "out" << YAML::Value << run.out << YAML::EndMap;
  e << YAML::EndMap;
  return std::string(e.c_str()) + "\n";
}

Dataset load_data(const Recipe& r, LoadReport* train_report, LoadReport* eval_report) {
  if (r.task == "arithmetic")
    return split(arithmetic_problems(r.num_problems, r.difficulty, r.grpo.seed), r.test_fraction, r.grpo.seed);
  std::vector<Example> train = load_jsonl(r.data_path, r.jsonl, train_report);
  if (r.eval_path.empty()) return split(std::move(train), r.test_fraction, r.grpo.seed);
  // A separate eval file: the training file is only shuffled (by the stream), not split.
  Dataset d;
  d.train = std::move(train);
  d.test = load_jsonl(r.eval_path, r.jsonl, eval_report);
  return d;
}

std::shared_ptr<const text::Tokenizer> load_recipe_tokenizer(const Recipe& r, const model::ModelConfig& model) {
  if (!r.tokenizer.empty()) return text::load_tokenizer(r.tokenizer);
  if (!r.init_from.empty() && text::has_tokenizer_files(r.init_from)) return text::load_tokenizer(r.init_from);
  return text::make_byte_tokenizer(std::min<int64_t>(model.vocab_size, 256));
}

}  // namespace kiln::trainer
