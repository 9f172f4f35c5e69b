// Fuzz target: a training recipe (the strict YAML reader, then every section's keys, types,
// ranges and cross-checks, and the resolved recipe written back and read again). A model config
// the recipe names is written beside it from the shipped muse-tiny, so inputs reach past the
// model section. Only kiln::Error may come out.
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "fuzz/fuzz_input.h"
#include "trainer/recipe.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool config_written = [] {
    const std::string tiny =
        "name: muse-tiny\nvocab_size: 128\nhidden_size: 64\nlatent_size: 32\nnum_layers: 2\nnum_experts: 4\n"
        "top_k: 2\nexpert_ffn_size: 32\nnum_q_heads: 2\nnum_kv_heads: 1\nhead_dim: 32\nsliding_window: 16\n"
        "dtype: float32\n";
    kiln::fuzz::write_input("muse-tiny.yaml", reinterpret_cast<const uint8_t*>(tiny.data()), tiny.size());
    return true;
  }();
  (void)config_written;
  const std::string path = kiln::fuzz::write_input("recipe.yaml", data, size);
  try {
    const kiln::trainer::Recipe r = kiln::trainer::Recipe::from_yaml_file(path);
    const std::string again = r.to_yaml();
    (void)kiln::trainer::Recipe::from_yaml_file(
        kiln::fuzz::write_input("again.yaml", reinterpret_cast<const uint8_t*>(again.data()), again.size()));
  } catch (const kiln::Error&) {
  }
  return 0;
}
