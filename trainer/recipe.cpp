// Recipe parsing with strict keys (core/yaml_util.h) and its resolved YAML form.
#include "trainer/recipe.h"

#include <filesystem>

#include "core/error.h"
#include "core/yaml_util.h"

namespace kiln::trainer {
namespace {

// A path in a recipe is taken relative to the current directory when it exists there, else
// relative to the recipe's folder.
std::string resolve(const std::string& path, const std::string& recipe) {
  if (path.empty() || std::filesystem::exists(path)) return path;
  auto beside = std::filesystem::path(recipe).parent_path() / path;
  return std::filesystem::exists(beside) ? beside.string() : path;
}

// The optimizer keys shared by the optim (GRPO) and sft sections.
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
    m.finish();
    if (r.model_config.empty() == r.init_from.empty())
      m.fail("config", "give exactly one of model.config (random init) and model.init_from (a checkpoint)");
  }
  {
    auto d = top.child("data");
    d.get("task", r.task);
    d.get("path", r.data_path);
    d.get("difficulty", r.difficulty);
    d.get("num_problems", r.num_problems);
    d.get("test_fraction", r.test_fraction);
    d.finish();
    if (r.task != "arithmetic" && r.task != "jsonl") d.fail("task", "must be arithmetic or jsonl (got " + r.task + ")");
    if (r.task == "jsonl" && r.data_path.empty()) d.fail("path", "task jsonl needs data.path");
    if (!(r.test_fraction >= 0 && r.test_fraction < 1)) d.fail("test_fraction", "must be in [0, 1)");
  }
  GrpoConfig& g = r.grpo;
  {
    auto s = top.child("grpo");
    s.get("prompts_per_step", g.prompts_per_step);
    s.get("samples_per_prompt", g.samples_per_prompt);
    s.get("max_tokens", g.max_tokens);
    s.get("temperature", g.temperature);
    s.get("top_p", g.top_p);
    s.get("top_k", g.top_k);
    s.get("std_normalize", g.std_normalize);
    s.get("routing_replay", g.routing_replay);
    s.get("mismatch_ab", g.mismatch_ab);
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
    p.get("rollout", g.parallel.rollout);
    p.finish();
  }
  {
    auto ro = top.child("rollout");
    double mb = double(g.engine.kv_cache_bytes) / double(1 << 20);
    ro.get("kv_cache_mb", mb);
    g.engine.kv_cache_bytes = int64_t(mb * double(1 << 20));
    ro.get("block_size", g.engine.block_size);
    ro.get("max_num_seqs", g.engine.max_num_seqs);
    ro.get("max_batch_tokens", g.engine.max_batch_tokens);
    ro.get("prefill_chunk", g.engine.prefill_chunk);
    ro.get("cuda_graphs", g.engine.cuda_graphs);
    ro.get("quantization", g.engine.quantization);
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
  {
    auto w = top.child("reward");
    w.get("correct", g.reward.correct);
    w.get("format", g.reward.format);
    w.finish();
  }
  {
    auto s = top.child("sft");
    s.get("steps", r.sft.steps);
    s.get("batch_size", r.sft.batch_size);
    read_optim(s, r.sft.optim);
    s.get("grad_clip", r.sft.grad_clip);
    s.get("warmup_steps", r.sft.schedule.warmup_steps);
    s.get("lr_decay", r.sft.schedule.decay);
    s.get("min_lr_ratio", r.sft.schedule.min_ratio);
    s.finish();
    try {
      r.sft.validate();
    } catch (const Error& e) {
      s.fail("", e.what());
    }
  }
  {
    auto run = top.child("run");
    run.get("steps", r.steps);
    run.get("eval_every", r.eval_every);
    run.get("eval_problems", r.eval_problems);
    run.get("checkpoint_every", r.checkpoint_every);
    run.get("seed", g.seed);
    run.get("out", r.out);
    run.finish();
    if (r.steps < 0) run.fail("steps", "must be >= 0");
  }
  top.finish();
  r.sft.seed = g.seed;
  r.sync_schedules();
  try {
    g.validate();
  } catch (const Error& e) {
    KILN_FAIL("recipe ", path, ": ", e.what());
  }
  r.model_config = resolve(r.model_config, path);
  r.init_from = resolve(r.init_from, path);
  r.data_path = resolve(r.data_path, path);
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
    << YAML::Key << "device" << YAML::Value << device << YAML::EndMap;
  e << YAML::Key << "data" << YAML::Value << YAML::BeginMap << YAML::Key << "task" << YAML::Value << task;
  if (!data_path.empty()) e << YAML::Key << "path" << YAML::Value << data_path;
  e << YAML::Key << "difficulty" << YAML::Value << difficulty << YAML::Key << "num_problems" << YAML::Value
    << num_problems << YAML::Key << "test_fraction" << YAML::Value << test_fraction << YAML::EndMap;
  e << YAML::Key << "grpo" << YAML::Value << YAML::BeginMap << YAML::Key << "prompts_per_step" << YAML::Value
    << g.prompts_per_step << YAML::Key << "samples_per_prompt" << YAML::Value << g.samples_per_prompt
    << YAML::Key << "max_tokens" << YAML::Value << g.max_tokens << YAML::Key << "temperature" << YAML::Value
    << g.temperature << YAML::Key << "top_p" << YAML::Value << g.top_p << YAML::Key << "top_k" << YAML::Value
    << g.top_k << YAML::Key << "std_normalize" << YAML::Value << g.std_normalize << YAML::Key << "routing_replay"
    << YAML::Value << g.routing_replay << YAML::Key << "mismatch_ab" << YAML::Value << g.mismatch_ab << YAML::EndMap;
  e << YAML::Key << "loss" << YAML::Value << YAML::BeginMap << YAML::Key << "eps_low" << YAML::Value
    << g.loss.eps_low << YAML::Key << "eps_high" << YAML::Value << g.loss.eps_high << YAML::Key << "aggregation"
    << YAML::Value
    << (g.loss.aggregation == Aggregation::kTokenMean ? "token-mean" : "seq-mean-token-mean") << YAML::Key
    << "kl_coef" << YAML::Value << g.loss.kl_coef << YAML::Key << "tis" << YAML::Value << g.loss.tis << YAML::Key
    << "tis_cap" << YAML::Value << g.loss.tis_cap << YAML::Key << "gspo" << YAML::Value << g.loss.gspo
    << YAML::EndMap;
  e << YAML::Key << "optim" << YAML::Value << YAML::BeginMap;
  emit_optim(e, g.optim);
  e << YAML::Key << "grad_clip" << YAML::Value
    << g.grad_clip << YAML::Key << "mini_steps" << YAML::Value << g.mini_steps << YAML::Key << "micro_batch_seqs"
    << YAML::Value << g.micro_batch_seqs << YAML::Key << "warmup_steps" << YAML::Value << g.schedule.warmup_steps
    << YAML::Key << "lr_decay" << YAML::Value << g.schedule.decay << YAML::Key << "min_lr_ratio" << YAML::Value
    << g.schedule.min_ratio << YAML::EndMap;
  e << YAML::Key << "parallel" << YAML::Value << YAML::BeginMap << YAML::Key << "dp" << YAML::Value << g.parallel.dp
    << YAML::Key << "ep" << YAML::Value << g.parallel.ep << YAML::Key << "tp" << YAML::Value << g.parallel.tp
    << YAML::Key << "rollout" << YAML::Value << g.parallel.rollout
    << YAML::EndMap;
  e << YAML::Key << "rollout" << YAML::Value << YAML::BeginMap << YAML::Key << "kv_cache_mb" << YAML::Value
    << double(g.engine.kv_cache_bytes) / double(1 << 20) << YAML::Key << "block_size" << YAML::Value
    << g.engine.block_size << YAML::Key << "max_num_seqs" << YAML::Value << g.engine.max_num_seqs << YAML::Key
    << "max_batch_tokens" << YAML::Value << g.engine.max_batch_tokens << YAML::Key << "prefill_chunk"
    << YAML::Value << g.engine.prefill_chunk << YAML::Key << "cuda_graphs" << YAML::Value << g.engine.cuda_graphs
    << YAML::Key << "quantization" << YAML::Value << g.engine.quantization << YAML::Key << "sync_check_tokens"
    << YAML::Value << g.sync_check_tokens << YAML::Key << "sync_check_threshold" << YAML::Value
    << g.sync_check_threshold << YAML::EndMap;
  e << YAML::Key << "lora" << YAML::Value << YAML::BeginMap << YAML::Key << "rank" << YAML::Value << g.lora.rank
    << YAML::Key << "alpha" << YAML::Value << g.lora.alpha << YAML::Key << "targets" << YAML::Value << YAML::Flow
    << g.lora.targets << YAML::EndMap;
  e << YAML::Key << "reward" << YAML::Value << YAML::BeginMap << YAML::Key << "correct" << YAML::Value
    << g.reward.correct << YAML::Key << "format" << YAML::Value << g.reward.format << YAML::EndMap;
  e << YAML::Key << "sft" << YAML::Value << YAML::BeginMap << YAML::Key << "steps" << YAML::Value << sft.steps
    << YAML::Key << "batch_size" << YAML::Value << sft.batch_size;
  emit_optim(e, sft.optim);
  e << YAML::Key << "grad_clip" << YAML::Value
    << sft.grad_clip << YAML::Key << "warmup_steps" << YAML::Value << sft.schedule.warmup_steps << YAML::Key
    << "lr_decay" << YAML::Value << sft.schedule.decay << YAML::Key << "min_lr_ratio" << YAML::Value
    << sft.schedule.min_ratio << YAML::EndMap;
  e << YAML::Key << "run" << YAML::Value << YAML::BeginMap << YAML::Key << "steps" << YAML::Value << steps
    << YAML::Key << "eval_every" << YAML::Value << eval_every << YAML::Key << "eval_problems" << YAML::Value
    << eval_problems << YAML::Key << "checkpoint_every" << YAML::Value << checkpoint_every << YAML::Key << "seed" << YAML::Value << g.seed << YAML::Key << "out" << YAML::Value << out
    << YAML::EndMap;
  e << YAML::EndMap;
  return std::string(e.c_str()) + "\n";
}

}  // namespace kiln::trainer
