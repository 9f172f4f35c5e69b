// The parallel layout as a recipe's parallel: section: read (strict, errors at file:line) and
// written back in the resolved recipe, in the same key order.
#include <yaml-cpp/yaml.h>

#include <cmath>

#include "core/yaml_util.h"
#include "parallel/parallel.h"

namespace kiln::parallel {

void read_yaml(yaml::MapReader& m, ParallelConfig& c) {
  int64_t dp = c.dp.value_or(0);  // 0: unset, world size / ep (a negative one fails in resolve)
  m.get("dp", dp);
  c.dp = dp != 0 ? std::optional<int64_t>(dp) : std::nullopt;
  m.get("ep", c.ep);
  m.get("cp", c.cp);
  if (c.cp < 1) m.fail("cp", "must be at least 1 (1: no context parallelism)");
  m.get("tp", c.tp);
  m.get("collective_timeout_s", c.collective_timeout_s);
  if (!std::isfinite(c.collective_timeout_s) || c.collective_timeout_s < 0)
    m.fail("collective_timeout_s", "must be a number of seconds >= 0 (0: no timeout)");
  m.get_enum("dense", c.dense, parse_dense_sharding, dense_sharding_name);
  m.get_enum("rollout", c.rollout, parse_rollout_placement, rollout_placement_name);
  m.finish();
}

void write_yaml(YAML::Emitter& e, const ParallelConfig& c) {
  e << YAML::Key << "dp" << YAML::Value << c.dp.value_or(0);
  e << YAML::Key << "ep" << YAML::Value << c.ep;
  e << YAML::Key << "cp" << YAML::Value << c.cp;
  e << YAML::Key << "tp" << YAML::Value << c.tp;
  e << YAML::Key << "rollout" << YAML::Value << rollout_placement_name(c.rollout);
  e << YAML::Key << "dense" << YAML::Value << dense_sharding_name(c.dense);
  e << YAML::Key << "collective_timeout_s" << YAML::Value << c.collective_timeout_s;
}

}  // namespace kiln::parallel
