// The dry run's checks (dry_run.h): each a function that returns what it found or throws why not.
#include "trainer/dry_run.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <functional>
#include <limits>
#include <memory>

#include "core/error.h"
#include "core/safetensors.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/nvfp4_model.h"
#include "parallel/parallel.h"
#include "text/tokenizer.h"
#include "trainer/dataset.h"
#include "trainer/environment.h"
#include "trainer/plan.h"
#include "trainer/recipe.h"
#include "trainer/rewards.h"

namespace kiln::trainer {
namespace {

// What the checks share: the model config and the rendered sample, once the checks that make them
// have passed.
struct Found {
  std::unique_ptr<model::ModelConfig> config;
  std::shared_ptr<const text::Tokenizer> tokenizer;
  std::vector<Example> sample;
};

std::string check_model(const Recipe& r, Found& f) {
  f.config = std::make_unique<model::ModelConfig>(r.init_from.empty()
                                                      ? model::ModelConfig::from_yaml_file(r.model_config)
                                                      : model::ModelConfig::from_json_file(r.init_from + "/config.json"));
  const model::ModelConfig& c = *f.config;
  return fmt::format("{} from {}: {} layers, {} experts (top {}), hidden {}, vocab {}", c.name,
                     r.init_from.empty() ? r.model_config : r.init_from + "/config.json", c.num_layers, c.num_experts,
                     c.top_k, c.hidden_size, c.vocab_size);
}

// The index and every tensor header, against the config's names and shapes; no tensor is read.
std::string check_checkpoint(const Recipe& r) {
  if (model::is_nvfp4_checkpoint(r.init_from)) {
    const safetensors::Checkpoint ckpt = safetensors::Checkpoint::open(r.init_from);
    return fmt::format("{}: an NVFP4 checkpoint of {} tensors (headers read)", r.init_from, ckpt.names().size());
  }
  // Every tensor a placeholder: the names and shapes are checked, no data is read.
  model::load_checkpoint_owned(r.init_from, at::kFloat, at::kCPU, 0, 1, [](const std::string&) { return false; });
  return fmt::format("{}: every tensor the config names, with its shape (headers read)", r.init_from);
}

std::string check_tokenizer(const Recipe& r, Found& f) {
  f.tokenizer = load_recipe_tokenizer(r, *f.config);
  const text::Tokenizer& t = *f.tokenizer;
  KILN_CHECK(t.vocab_size() <= f.config->vocab_size, "the tokenizer's ", t.vocab_size(), " ids exceed the model's ",
             "vocab_size ", f.config->vocab_size);
  return fmt::format("{}: {} ids, {}; stop ids {}", t.name().empty() ? "bytes" : t.name(), t.vocab_size(),
                     t.chat_template().empty() ? "no chat template" : "a chat template",
                     fmt::join(t.stop_ids(), ","));
}

std::string check_data(const Recipe& r, const DryRunOptions& o, Found& f) {
  LoadReport train_lines, eval_lines;
  Dataset d = load_data(r, &train_lines, &eval_lines);
  KILN_CHECK(!d.train.empty(), "no training examples", r.data_path.empty() ? "" : " in " + r.data_path);
  const int64_t n = std::min<int64_t>(o.samples, int64_t(d.train.size()));
  f.sample.assign(d.train.begin(), d.train.begin() + n);
  const PrepareReport rendered = prepare_prompts(f.sample, *f.tokenizer, r.grpo.prompt);
  KILN_CHECK(!f.sample.empty(), "every one of the ", n, " sampled prompts is longer than prompt.max_prompt_tokens");
  std::string skipped;
  if (train_lines.skipped > 0)
    skipped = fmt::format("; {} malformed line(s) skipped, first: {}", train_lines.skipped,
                          train_lines.examples.empty() ? "" : train_lines.examples.front());
  return fmt::format("{} train / {} test examples; {} of {} sampled prompts rendered ({} too long), longest {} "
                     "tokens, mean {:.0f}{}",
                     d.train.size(), d.test.size(), rendered.kept, n, rendered.too_long, rendered.max_tokens,
                     rendered.mean_tokens, skipped);
}

// Starts the reward's workers (if any) and scores one probe: the first sampled example's label as
// its response.
std::string check_reward(const Recipe& r, const Found& f) {
  std::unique_ptr<Reward> reward = make_reward(r.grpo.reward);
  reward->start();
  const Example& e = f.sample.front();
  RewardRequest q;
  q.prompt = e.prompt_text, q.response = e.label, q.label = e.label, q.data_source = e.data_source;
  q.metadata = e.metadata;
  const RewardResult got = reward->score({q}).front();
  KILN_CHECK(!got.failed, "the probe (", e.origin, ", its label as the response) failed: ", got.error);
  KILN_CHECK(std::isfinite(got.reward), "the probe scored ", got.reward);
  return fmt::format("the probe ({}, its label as the response) scored {}", e.origin, got.reward);
}

// Starts the environment's workers and sends one probe: an episode's first turn (the first sampled
// example's label as the response), or for kiln sft a demonstration request.
std::string check_environment(const Recipe& r, const DryRunOptions& o, const Found& f) {
  Environment env(r.grpo.environment);
  env.start();
  const Example& e = f.sample.front();
  if (o.sft && r.sft.demonstrations == Demonstrations::kEnvironment) {
    EnvDemoRequest q;
    q.prompt = e.prompt_text, q.label = e.label, q.data_source = e.data_source, q.metadata = e.metadata;
    const EnvDemo got = env.demonstrate({q}).front();
    KILN_CHECK(!got.failed, "the demonstration probe (", e.origin, ") failed: ", got.error);
    return fmt::format("the demonstration probe ({}) gave {} turn(s)", e.origin, got.turns.size());
  }
  EnvRequest q;
  q.prompt = e.prompt_text, q.label = e.label, q.data_source = e.data_source, q.metadata = e.metadata;
  q.response = e.label;
  q.response_ids = f.tokenizer->encode(e.label);
  const EnvStep got = env.step({q}).front();
  KILN_CHECK(!got.failed, "the probe (", e.origin, ", its label as turn 0) failed: ", got.error);
  return got.done ? fmt::format("the probe ({}, its label as turn 0) ended the episode with reward {}", e.origin,
                                got.reward)
                  : fmt::format("the probe ({}, its label as turn 0) answered an observation", e.origin);
}

// The memory plan of the launch: its ranks on one node (or the cluster the options name) with
// this process's GPU (or the options' size).
std::string check_plan(const Recipe& r, const DryRunOptions& o, const Found& f) {
  Cluster c;
  c.nodes = o.nodes > 0 ? o.nodes : 1;
  c.gpus_per_node = o.nodes > 0 ? o.gpus_per_node : o.ranks;
  c.gpu_bytes = o.gpu_bytes;
  c.host_bytes = c.nvme_bytes = std::numeric_limits<double>::infinity();  // not checked here
  const PlanJob job = plan_job(r.grpo, r.dtype);
  // Under grpo.async.placement split the first half of the ranks train: the first half of the
  // nodes, or half of one node's GPUs.
  Cluster trainers = c;
  if (job.rollout_split) {
    KILN_CHECK(c.nodes > 1 ? c.nodes % 2 == 0 : c.gpus_per_node % 2 == 0, "grpo.async.placement split needs an even ",
               c.nodes > 1 ? "number of nodes" : "number of ranks", " (got ", c.nodes > 1 ? c.nodes : c.gpus_per_node, ")");
    (c.nodes > 1 ? trainers.nodes : trainers.gpus_per_node) /= 2;
  }
  parallel::ParallelConfig par = r.grpo.parallel;
  par.resolve(trainers.world(), f.config->num_experts);
  const Plan plan = make_plan(*f.config, job, trainers, {*par.dp, par.ep, 1, par.dense, par.cp});
  KILN_CHECK(plan.fits(), "does not fit ", format_bytes(c.gpu_bytes), " GPUs as ", par.describe(), ": ",
             fmt::format("{}", fmt::join(plan.problems, "; ")), " (`kiln plan` prints the whole plan and searches layouts)");
  return fmt::format("{} on {} x {} GPUs of {}: {} of each GPU used, {} left for the KV cache", par.describe(), c.nodes,
                     c.gpus_per_node, format_bytes(c.gpu_bytes), format_bytes(plan.gpu_used),
                     format_bytes(plan.kv_left));
}

}  // namespace

std::vector<DryRunCheck> dry_run(const Recipe& r, const DryRunOptions& o) {
  std::vector<DryRunCheck> out;
  Found f;
  // Each check that applies runs when the checks it needs passed (else it is reported skipped); a
  // failed one is reported and the rest go on.
  auto run = [&](const char* name, bool applies, const char* needs, bool ready, const std::function<std::string()>& check) {
    if (!applies) return;
    if (!ready) {
      out.push_back({name, false, true, fmt::format("skipped: needs the {} check", needs)});
      return;
    }
    DryRunCheck line{name, false, false, ""};
    try {
      line.detail = check();
      line.ok = true;
    } catch (const std::exception& e) {
      line.detail = e.what();
    }
    out.push_back(std::move(line));
  };
  run("model", true, "", true, [&] { return check_model(r, f); });
  const bool model = f.config != nullptr;
  run("checkpoint", !r.init_from.empty(), "model", model, [&] { return check_checkpoint(r); });
  run("tokenizer", true, "model", model, [&] { return check_tokenizer(r, f); });
  run("data", true, "tokenizer", f.tokenizer != nullptr, [&] { return check_data(r, o, f); });
  const bool sampled = !f.sample.empty();
  const bool env_demos = o.sft && r.sft.demonstrations == Demonstrations::kEnvironment;
  run("reward", !o.sft, "data", sampled, [&] { return check_reward(r, f); });
  run("environment", r.grpo.environment.enabled() && (!o.sft || env_demos), "data", sampled,
      [&] { return check_environment(r, o, f); });
  const bool plan = o.nodes > 0 || o.gpu_bytes > 0;
  run("plan", !o.sft && plan, "model", model, [&] { return check_plan(r, o, f); });
  if (!o.sft && !plan)
    out.push_back({"plan", true, false, "not planned: the recipe runs on the CPU (pass --nodes, --gpus-per-node and "
                                        "--gpu-mem to plan a GPU launch)"});
  return out;
}

}  // namespace kiln::trainer
