// Learning-rate schedules for SFT and GRPO: linear warmup from zero, then constant, linear or
// cosine decay to min_ratio * lr at the last step. A pure function of the step, so a resumed run
// needs no schedule state.
#pragma once
#include <cstdint>
#include <string>

#include "core/yaml_fwd.h"

namespace kiln::trainer {

// How the lr falls from its peak to min_ratio * lr over the run's steps after the warmup.
enum class LrDecay { kConstant, kLinear, kCosine };
LrDecay parse_lr_decay(const std::string& name);  // "constant" | "linear" | "cosine"; throws otherwise
const char* lr_decay_name(LrDecay d);

struct LrSchedule {
  int64_t warmup_steps = 0;
  LrDecay decay = LrDecay::kConstant;
  double min_ratio = 0.0;          // the decayed lr at total_steps, as a fraction of lr
  int64_t total_steps = 0;         // the decay's horizon: the run's steps (set from the recipe)
  void validate() const;
  // The multiplier of the base lr for optimizer step `step` (1-based).
  double factor(int64_t step) const;
};

// The schedule's keys of a recipe's optim: and sft: sections (trainer/schedule.cpp, docs/CONFIG.md):
// warmup_steps, lr_decay, min_lr_ratio. total_steps comes from the run's steps (Recipe::sync_schedules).
// The caller finishes the section.
void read_yaml(yaml::MapReader& m, LrSchedule& s);
void write_yaml(YAML::Emitter& e, const LrSchedule& s);

}  // namespace kiln::trainer
