// Recipe parsing with strict keys (core/yaml_util.h) and its resolved YAML form: the recipe's own
// model: and data: sections here, every other section through the reader and writer beside its
// struct (docs/CONFIG.md lists them all), then the settings derived across sections and the paths.
#include "trainer/recipe.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>

#include "core/error.h"
#include "core/yaml_util.h"
#include "model/config.h"
#include "text/tokenizer.h"
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

// model: where the weights come from (exactly one of config and init_from) and the tokenizer.
void read_model(yaml::MapReader& m, Recipe& r) {
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

void write_model(YAML::Emitter& e, const Recipe& r) {
  if (!r.model_config.empty()) e << YAML::Key << "config" << YAML::Value << r.model_config;
  if (!r.init_from.empty()) e << YAML::Key << "init_from" << YAML::Value << r.init_from;
  e << YAML::Key << "seed" << YAML::Value << r.model_seed;
  e << YAML::Key << "dtype" << YAML::Value << r.dtype;
  e << YAML::Key << "device" << YAML::Value << r.device;
  if (!r.tokenizer.empty()) e << YAML::Key << "tokenizer" << YAML::Value << r.tokenizer;
}

// data: the task (arithmetic problems or JSONL files) and, for JSONL, how lines are read.
void read_data(yaml::MapReader& d, Recipe& r) {
  std::string task = task_name(r.task);
  d.get("task", task);
  d.get("path", r.data_path);
  d.get("eval_path", r.eval_path);
  d.get("difficulty", r.difficulty);
  d.get("num_problems", r.num_problems);
  d.get("test_fraction", r.test_fraction);
  read_yaml(d, r.jsonl);
  d.finish();
  if (!r.eval_path.empty() && task != "jsonl") d.fail("eval_path", "eval_path needs task jsonl");
  d.check("task", [&] { r.task = parse_task(task); });
  if (r.task == Task::kJsonl && r.data_path.empty()) d.fail("path", "task jsonl needs data.path");
  if (!(r.test_fraction >= 0 && r.test_fraction < 1)) d.fail("test_fraction", "must be in [0, 1)");
}

void write_data(YAML::Emitter& e, const Recipe& r) {
  e << YAML::Key << "task" << YAML::Value << task_name(r.task);
  if (!r.data_path.empty()) e << YAML::Key << "path" << YAML::Value << r.data_path;
  if (!r.eval_path.empty()) e << YAML::Key << "eval_path" << YAML::Value << r.eval_path;
  e << YAML::Key << "difficulty" << YAML::Value << r.difficulty;
  e << YAML::Key << "num_problems" << YAML::Value << r.num_problems;
  e << YAML::Key << "test_fraction" << YAML::Value << r.test_fraction;
  write_yaml(e, r.jsonl);
}

}  // namespace

Task parse_task(const std::string& name) {
  if (name == "arithmetic") return Task::kArithmetic;
  if (name == "jsonl") return Task::kJsonl;
  KILN_FAIL("must be arithmetic or jsonl (got ", name, ")");
}

const char* task_name(Task t) { return t == Task::kJsonl ? "jsonl" : "arithmetic"; }

Recipe Recipe::from_yaml_file(const std::string& path) {
  Recipe r;
  GrpoConfig& g = r.grpo;
  yaml::MapReader top(yaml::load_file(path), path, "");
  auto model = top.child("model");
  read_model(model, r);
  auto data = top.child("data");
  read_data(data, r);
  read_yaml(top, g);  // prompt, grpo, loss, optim, parallel, rollout, lora, reward, environment
  r.sft.prompt = g.prompt;
  auto sft = top.child("sft");
  read_yaml(sft, r.sft, g.environment.enabled());
  auto run = top.child("run");
  read_yaml(run, r.run, g.seed);
  auto eval = top.child("eval");
  read_eval_yaml(eval, r.run);
  auto kernels = top.child("kernels");
  read_yaml(kernels, r.kernels);
  top.finish();
  r.sft.seed = g.seed;
  r.sync_schedules();
  // rollout.max_model_len left unset is known when prompts are capped and every sample is one turn:
  // the engine's window pool then holds what such sequences touch (rollout/kv_cache.h).
  if (!g.engine.max_model_len && g.prompt.max_prompt_tokens && !g.environment.enabled())
    g.engine.max_model_len =
        *g.prompt.max_prompt_tokens + std::max(g.max_tokens, r.run.eval.max_tokens.value_or(g.max_tokens));
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
  e << YAML::BeginMap;
  yaml::write_map(e, "model", [&] { write_model(e, *this); });
  yaml::write_map(e, "data", [&] { write_data(e, *this); });
  write_yaml(e, grpo);  // prompt, grpo, loss, optim, parallel, rollout, lora, reward, environment
  yaml::write_map(e, "sft", [&] { write_yaml(e, sft); });
  yaml::write_map(e, "eval", [&] { write_eval_yaml(e, run); });
  yaml::write_map(e, "run", [&] { write_yaml(e, run, grpo.seed); });
  yaml::write_map(e, "kernels", [&] { write_yaml(e, kernels); });
  e << YAML::EndMap;
  return std::string(e.c_str()) + "\n";
}

Dataset load_data(const Recipe& r, LoadReport* train_report, LoadReport* eval_report) {
  if (r.task == Task::kArithmetic)
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
