// `kiln train --dry-run` / `kiln sft --dry-run`: checks a recipe before a job spends a cluster on it
// (the model config and checkpoint index, the tokenizer and chat template, a sample of the data,
// every worker with one probe request, the memory plan of the launch), one line per check.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::trainer {

struct Recipe;

struct DryRunOptions {
  bool sft = false;                // check what `kiln sft` needs (its demonstrations) rather than GRPO's
  int64_t ranks = 1;               // the launch's ranks (its world size)
  int64_t nodes = 0;               // > 0: plan for this many nodes of gpus_per_node GPUs instead of the launch
  int64_t gpus_per_node = 8;
  double gpu_bytes = 0;            // per GPU; 0: this process's device (a CUDA recipe), else no plan
  int64_t samples = 8;             // examples rendered and probed
};

struct DryRunCheck {
  std::string name;    // "model", "checkpoint", "tokenizer", "data", "reward", "environment", "plan"
  bool ok = false;
  bool skipped = false;  // not run: a check it needs failed (not a failure of its own)
  std::string detail;    // what it found, why it failed, or which check it waited for
};

// Runs every check that applies to `recipe` (each catches its own error, so one failure does not
// hide the others) and returns them in order. Allocates no model weights: the checkpoint check
// reads its index and tensor headers only.
std::vector<DryRunCheck> dry_run(const Recipe& recipe, const DryRunOptions& options);

}  // namespace kiln::trainer
