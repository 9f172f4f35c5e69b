// Learning-rate schedules: warmup, then constant / linear / cosine decay.
#include "trainer/schedule.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/yaml_util.h"

namespace kiln::trainer {

LrDecay parse_lr_decay(const std::string& name) {
  if (name == "constant") return LrDecay::kConstant;
  if (name == "linear") return LrDecay::kLinear;
  if (name == "cosine") return LrDecay::kCosine;
  KILN_FAIL("lr schedule: unknown lr_decay '", name, "'; use constant, linear or cosine");
}

const char* lr_decay_name(LrDecay d) {
  return d == LrDecay::kLinear ? "linear" : d == LrDecay::kCosine ? "cosine" : "constant";
}

void LrSchedule::validate() const {
  KILN_CHECK(warmup_steps >= 0, "lr schedule: warmup_steps must be >= 0 (got ", warmup_steps, ")");
  KILN_CHECK(min_ratio >= 0 && min_ratio <= 1, "lr schedule: min_lr_ratio must be in [0, 1] (got ", min_ratio, ")");
}

double LrSchedule::factor(int64_t step) const {
  if (warmup_steps > 0 && step <= warmup_steps) return double(step) / double(warmup_steps);
  if (decay == LrDecay::kConstant || total_steps <= warmup_steps) return 1.0;
  const double p = std::clamp(double(step - warmup_steps) / double(total_steps - warmup_steps), 0.0, 1.0);
  const double shape = decay == LrDecay::kLinear ? 1.0 - p : 0.5 * (1.0 + std::cos(M_PI * p));
  return min_ratio + (1.0 - min_ratio) * shape;
}

void read_yaml(yaml::MapReader& m, LrSchedule& s) {
  m.get("warmup_steps", s.warmup_steps);
  m.get_enum("lr_decay", s.decay, parse_lr_decay, lr_decay_name);
  m.get("min_lr_ratio", s.min_ratio);
}

void write_yaml(YAML::Emitter& e, const LrSchedule& s) {
  e << YAML::Key << "warmup_steps" << YAML::Value << s.warmup_steps;
  e << YAML::Key << "lr_decay" << YAML::Value << lr_decay_name(s.decay);
  e << YAML::Key << "min_lr_ratio" << YAML::Value << s.min_ratio;
}

}  // namespace kiln::trainer
