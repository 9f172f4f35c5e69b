// LoRA's settings as a recipe's lora: section: read (strict, errors at file:line) and written back
// in the resolved recipe, in the same key order.
#include <yaml-cpp/yaml.h>

#include "core/yaml_util.h"
#include "model/lora.h"

namespace kiln::model {

void read_yaml(yaml::MapReader& m, LoraConfig& c) {
  m.get("rank", c.rank);
  m.get("alpha", c.alpha);
  m.get("targets", c.targets);
  m.finish();
  try {
    c.validate();
  } catch (const Error& e) {  // named at the key the check is about
    const std::string what = e.what();
    m.fail(what.find("target") != std::string::npos  ? "targets"
           : what.find("alpha") != std::string::npos ? "alpha"
                                                     : "rank",
           what);
  }
}

void write_yaml(YAML::Emitter& e, const LoraConfig& c) {
  e << YAML::Key << "rank" << YAML::Value << c.rank;
  e << YAML::Key << "alpha" << YAML::Value << c.alpha;
  e << YAML::Key << "targets" << YAML::Value << YAML::Flow << c.targets;
}

}  // namespace kiln::model
