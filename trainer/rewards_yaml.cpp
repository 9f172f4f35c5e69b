// A recipe's reward: section (a built-in, a worker or a weighted sum of parts) and the worker keys
// the reward and environment: sections share: read strictly (errors at file:line) and written back
// in the resolved recipe, in the same key order.
#include <yaml-cpp/yaml.h>

#include "core/yaml_util.h"
#include "trainer/rewards.h"

namespace kiln::trainer {

namespace {

// One reward and, for a sum, its parts (each its own mapping, finished on its own).
RewardSpec read_reward(yaml::MapReader& m) {
  RewardSpec spec;
  m.get_enum("type", spec.type, parse_reward_type, reward_type_name);
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
      read_yaml(m, spec.worker);
      break;
    case RewardType::kSum:
      for (yaml::MapReader& part : m.children("parts")) spec.parts.push_back(read_reward(part));
      if (spec.parts.empty()) m.fail("parts", "a sum needs at least one part");
      break;
  }
  m.finish();
  return spec;
}

void write_reward(YAML::Emitter& e, const RewardSpec& r) {
  e << YAML::Key << "type" << YAML::Value << reward_type_name(r.type);
  if (!r.name.empty()) e << YAML::Key << "name" << YAML::Value << r.name;
  e << YAML::Key << "weight" << YAML::Value << r.weight;
  switch (r.type) {
    case RewardType::kExactMatch:
      e << YAML::Key << "stops" << YAML::Value << YAML::Flow << YAML::BeginSeq;
      for (const auto& stop : r.exact_match.stops) e << YAML::DoubleQuoted << stop;
      e << YAML::EndSeq;
      e << YAML::Key << "normalize_whitespace" << YAML::Value << r.exact_match.normalize_whitespace;
      e << YAML::Key << "ignore_case" << YAML::Value << r.exact_match.ignore_case;
      break;
    case RewardType::kRegexFormat:
      e << YAML::Key << "pattern" << YAML::Value << YAML::DoubleQuoted << r.regex_format.pattern;
      break;
    case RewardType::kMath:
      e << YAML::Key << "last_number_fallback" << YAML::Value << r.math.last_number_fallback;
      break;
    case RewardType::kWorker:
      write_yaml(e, r.worker);
      break;
    case RewardType::kSum:
      e << YAML::Key << "parts" << YAML::Value << YAML::BeginSeq;
      for (const auto& part : r.parts) {
        e << YAML::BeginMap;
        write_reward(e, part);
        e << YAML::EndMap;
      }
      e << YAML::EndSeq;
      break;
  }
}

}  // namespace

void read_yaml(yaml::MapReader& m, WorkerSpec& w) {
  m.require("command", w.command);
  m.get("num_workers", w.num_workers);
  m.get("max_in_flight", w.max_in_flight);
  m.get("timeout_s", w.timeout_s);
  m.get("max_retries", w.max_retries);
  m.get("max_restarts", w.max_restarts);
  m.get("max_garbage_lines", w.max_garbage_lines);
  m.get("shutdown_grace_s", w.shutdown_grace_s);
  m.get("start_check_s", w.start_check_s);
  m.get_enum("on_failure", w.on_failure, parse_on_failure, on_failure_name);
  m.get("max_failure_fraction", w.max_failure_fraction);
}

void write_yaml(YAML::Emitter& e, const WorkerSpec& w) {
  e << YAML::Key << "command" << YAML::Value << YAML::Flow << w.command;
  e << YAML::Key << "num_workers" << YAML::Value << w.num_workers;
  e << YAML::Key << "max_in_flight" << YAML::Value << w.max_in_flight;
  e << YAML::Key << "timeout_s" << YAML::Value << w.timeout_s;
  e << YAML::Key << "max_retries" << YAML::Value << w.max_retries;
  e << YAML::Key << "max_restarts" << YAML::Value << w.max_restarts;
  e << YAML::Key << "max_garbage_lines" << YAML::Value << w.max_garbage_lines;
  e << YAML::Key << "shutdown_grace_s" << YAML::Value << w.shutdown_grace_s;
  e << YAML::Key << "start_check_s" << YAML::Value << w.start_check_s;
  e << YAML::Key << "on_failure" << YAML::Value << on_failure_name(w.on_failure);
  e << YAML::Key << "max_failure_fraction" << YAML::Value << w.max_failure_fraction;
}

void read_yaml(yaml::MapReader& m, RewardSpec& spec) {
  spec = read_reward(m);
  m.check("", [&] { spec.validate(); });
}

void write_yaml(YAML::Emitter& e, const RewardSpec& spec) { write_reward(e, spec); }

}  // namespace kiln::trainer
