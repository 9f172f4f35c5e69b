// LoRA's settings as a recipe's lora: section: read (strict, errors at file:line) and written back
// in the resolved recipe, in the same key order.
#include <yaml-cpp/yaml.h>

#include "core/yaml_util.h"
#include "model/lora.h"

namespace kiln::model {

void read_yaml(yaml::MapReader& m, std::optional<LoraConfig>& c) {
  LoraConfig l = c.value_or(LoraConfig{});
  m.get("rank", l.rank);
  m.get("alpha", l.alpha);
  m.get("targets", l.targets);
  m.finish();
  m.check("rank", [&] { KILN_CHECK(l.rank >= 0, "lora: rank must be >= 0 (got ", l.rank, ")"); });
  if (l.rank == 0) {  // no adapters; alpha and targets are not checked
    c.reset();
    return;
  }
  try {
    l.validate();
  } catch (const Error& e) {  // named at the key the check is about
    const std::string what = e.what();
    m.fail(what.find("target") != std::string::npos  ? "targets"
           : what.find("alpha") != std::string::npos ? "alpha"
                                                     : "rank",
           what);
  }
  c = l;
}

void write_yaml(YAML::Emitter& e, const std::optional<LoraConfig>& c) {
  const LoraConfig l = c.value_or(LoraConfig{});
  e << YAML::Key << "rank" << YAML::Value << (c ? l.rank : 0);
  e << YAML::Key << "alpha" << YAML::Value << l.alpha;
  e << YAML::Key << "targets" << YAML::Value << YAML::Flow << l.targets;
}

}  // namespace kiln::model
