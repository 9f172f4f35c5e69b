// The rollout engine's settings as a recipe's rollout: section: read (strict, errors at file:line)
// and written back in the resolved recipe, in the same key order.
#include <yaml-cpp/yaml.h>

#include <cmath>

#include "core/yaml_util.h"
#include "rollout/engine.h"

namespace kiln::rollout {

namespace {
constexpr double kMiB = double(1 << 20);
}  // namespace

void read_yaml(yaml::MapReader& m, EngineConfig& c) {
  double mb = double(c.kv_cache_bytes) / kMiB;
  m.get("kv_cache_mb", mb);
  c.kv_cache_bytes = int64_t(mb * kMiB);
  m.get("block_size", c.block_size);
  m.get("max_num_seqs", c.max_num_seqs);
  int64_t max_model_len = c.max_model_len.value_or(0);
  m.get("max_model_len", max_model_len);
  if (max_model_len < 0) m.fail("max_model_len", "expected tokens >= 0 (0: sequences of any length)");
  c.max_model_len = max_model_len > 0 ? std::optional<int64_t>(max_model_len) : std::nullopt;
  m.get("max_batch_tokens", c.max_batch_tokens);
  m.get("prefill_chunk", c.prefill_chunk);
  m.get("cuda_graphs", c.cuda_graphs);
  m.get("expert_capacity", c.expert_capacity);
  if (!std::isfinite(c.expert_capacity) || c.expert_capacity < 0)
    m.fail("expert_capacity", "expected a finite number >= 0 (0: the worst case, no overflow)");
  m.get_enum("quantization", c.quantization, parse_quantization, quantization_name);
  std::string numerics = model::numerics_name(c.numerics);
  m.get("numerics", numerics);
  if (numerics != "standard" && numerics != "bitwise")
    m.fail("numerics", "expected standard or bitwise (got '" + numerics + "')");
  c.numerics = model::parse_numerics(numerics);
}

void write_yaml(YAML::Emitter& e, const EngineConfig& c) {
  e << YAML::Key << "kv_cache_mb" << YAML::Value << double(c.kv_cache_bytes) / kMiB;
  e << YAML::Key << "block_size" << YAML::Value << c.block_size;
  e << YAML::Key << "max_num_seqs" << YAML::Value << c.max_num_seqs;
  e << YAML::Key << "max_model_len" << YAML::Value << c.max_model_len.value_or(0);
  e << YAML::Key << "max_batch_tokens" << YAML::Value << c.max_batch_tokens;
  e << YAML::Key << "prefill_chunk" << YAML::Value << c.prefill_chunk;
  e << YAML::Key << "cuda_graphs" << YAML::Value << c.cuda_graphs;
  e << YAML::Key << "expert_capacity" << YAML::Value << c.expert_capacity;
  e << YAML::Key << "quantization" << YAML::Value << quantization_name(c.quantization);
  e << YAML::Key << "numerics" << YAML::Value << model::numerics_name(c.numerics);
}

}  // namespace kiln::rollout
