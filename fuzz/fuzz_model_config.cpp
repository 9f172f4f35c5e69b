// Fuzz target: a model config as YAML (the strict reader, then validation and the parameter
// counts) and as HF config.json. Only kiln::Error may come out.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "fuzz/fuzz_input.h"
#include "model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kiln::model::ModelConfig;
  const std::string yaml = kiln::fuzz::write_input("config.yaml", data, size);
  try {
    const ModelConfig c = ModelConfig::from_yaml_file(yaml);
    (void)kiln::model::count_parameters(c);
    (void)ModelConfig::from_yaml_file(kiln::fuzz::write_input("again.yaml", reinterpret_cast<const uint8_t*>(c.to_yaml().data()),
                                                              c.to_yaml().size()));
  } catch (const kiln::Error&) {
  }
  const std::string json = kiln::fuzz::write_input("config.json", data, size);
  try {
    (void)kiln::model::count_parameters(ModelConfig::from_json_file(json));
  } catch (const kiln::Error&) {
  }
  return 0;
}
