// A GRPO recipe (YAML): where the model and its tokenizer come from, the data and how prompts are
// rendered, the reward, the GRPO/loss/optimizer/rollout settings, evaluation and the run. Unknown
// keys and impossible values are errors with file:line.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/kernel_choice.h"
#include "trainer/grpo.h"
#include "trainer/run.h"
#include "trainer/sft.h"

namespace kiln::model {
struct ModelConfig;
}

namespace kiln::trainer {

// data.task: where the examples come from.
enum class Task {
  kArithmetic,  // generated arithmetic problems (trainer/tasks.h)
  kJsonl,       // JSONL files (data.path, data.eval_path)
};
Task parse_task(const std::string& name);  // "arithmetic" | "jsonl"; throws otherwise
const char* task_name(Task t);

struct Recipe {
  // model
  std::string model_config;       // a model YAML (random init), relative to the recipe's folder or cwd
  std::string init_from;          // or a checkpoint directory
  uint64_t model_seed = 0;
  std::string dtype = "fp32";
  std::string device = "cpu";
  // A model directory or tokenizer.json / *.tiktoken; empty: the files beside init_from when it
  // has them, else the byte tokenizer (ids = bytes, for muse-tiny).
  std::string tokenizer;
  // data
  Task task = Task::kArithmetic;
  std::string data_path;           // jsonl: the training file
  std::string eval_path;           // jsonl: a separate eval file; empty = test_fraction of data_path
  JsonlOptions jsonl;              // keys, bad-line policy, default data_source
  int difficulty = 1;
  int64_t num_problems = 100;
  double test_fraction = 0.2;
  // run (steps, eval cadence and settings, checkpoints, logs, the run directory)
  RunConfig run;
  GrpoConfig grpo;
  SftConfig sft;                   // the warm start run by `kiln sft`
  kernels::KernelChoice kernels;   // GEMM kernels where more than one could run (kernels/kernel_choice.h)

  static Recipe from_yaml_file(const std::string& path);
  std::string to_yaml() const;     // the resolved recipe, written next to every run
  // The lr schedules decay over the run's steps: call again after overriding steps.
  void sync_schedules() {
    grpo.schedule.total_steps = run.steps;
    sft.schedule.total_steps = sft.steps;
  }
};

// The recipe's data: the arithmetic task, or JSONL files (train, and eval or a split of train).
// `train_report`/`eval_report` (may be null) say how many lines were read and skipped.
Dataset load_data(const Recipe& recipe, LoadReport* train_report = nullptr, LoadReport* eval_report = nullptr);

// The recipe's tokenizer (see Recipe::tokenizer); the byte tokenizer covers min(vocab_size, 256).
std::shared_ptr<const text::Tokenizer> load_recipe_tokenizer(const Recipe& recipe, const model::ModelConfig& model);

}  // namespace kiln::trainer
