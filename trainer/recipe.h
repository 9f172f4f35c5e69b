// A GRPO recipe (YAML): where the model comes from, the task data, the GRPO/loss/optimizer/rollout
// settings and the run length. Unknown keys and impossible values are errors with file:line.
#pragma once
#include <cstdint>
#include <string>

#include "trainer/grpo.h"
#include "trainer/sft.h"

namespace kiln::trainer {

struct Recipe {
  // model
  std::string model_config;       // a model YAML (random init), relative to the recipe's folder or cwd
  std::string init_from;          // or a checkpoint directory
  uint64_t model_seed = 0;
  std::string dtype = "fp32";
  std::string device = "cpu";
  // data
  std::string task = "arithmetic"; // arithmetic | jsonl
  std::string data_path;           // jsonl
  int difficulty = 1;
  int64_t num_problems = 100;
  double test_fraction = 0.2;
  // run
  int64_t steps = 20;
  int64_t eval_every = 10;         // 0 = only at the end
  int64_t eval_problems = 100;
  int64_t checkpoint_every = 0;    // resumable checkpoint in <out>/checkpoint; 0 = only at the end
  std::string out = "runs/grpo";
  GrpoConfig grpo;
  SftConfig sft;                   // the warm start run by `kiln sft`

  static Recipe from_yaml_file(const std::string& path);
  std::string to_yaml() const;     // the resolved recipe, written next to every run
  // The lr schedules decay over the run's steps: call again after overriding steps.
  void sync_schedules() {
    grpo.schedule.total_steps = steps;
    sft.schedule.total_steps = sft.steps;
  }
};

}  // namespace kiln::trainer
