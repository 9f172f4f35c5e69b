// ModelConfig parsing (YAML and config.json), validation and parameter counting.
#include "model/config.h"

#include <nlohmann/json.hpp>

#include "core/json_file.h"

namespace kiln::model {
namespace {

std::string locate(const yaml::Locations& where, const std::string& key) {
  auto it = where.find(key);
  return it == where.end() ? "model config: " + key : "model config: " + it->second;
}

}  // namespace

RouterScore parse_router_score(const std::string& name) {
  if (name == "softmax") return RouterScore::kSoftmax;
  if (name == "sigmoid") return RouterScore::kSigmoid;
  KILN_FAIL("router_score must be softmax or sigmoid (got '", name, "')");
}

const char* router_score_name(RouterScore s) { return s == RouterScore::kSigmoid ? "sigmoid" : "softmax"; }

int64_t ModelConfig::num_full_layers() const {
  int64_t n = 0;
  for (int64_t i = 0; i < num_layers; ++i) n += is_full_attention(i) ? 1 : 0;
  return n;
}

void ModelConfig::validate(const yaml::Locations& where) const {
  auto positive = [&](const char* key, int64_t v) {
    KILN_CHECK(v > 0, locate(where, key), ": must be a positive integer (", key, "=", v, ")");
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("latent_size", latent_size);
  positive("num_layers", num_layers);
  positive("num_experts", num_experts);
  positive("top_k", top_k);
  positive("expert_ffn_size", expert_ffn_size);
  positive("num_q_heads", num_q_heads);
  positive("num_kv_heads", num_kv_heads);
  positive("head_dim", head_dim);
  positive("sliding_window", sliding_window);
  positive("full_attention_period", full_attention_period);
  positive("max_position_embeddings", max_position_embeddings);
  // Far beyond any real model, and small enough that every count (docs/MODEL.md §2.3) fits int64.
  auto at_most = [&](const char* key, int64_t v, int64_t limit) {
    KILN_CHECK(v <= limit, locate(where, key), ": ", v, " is beyond what kiln supports (at most ", limit, ")");
  };
  at_most("vocab_size", vocab_size, int64_t(1) << 31);
  at_most("num_layers", num_layers, 4096);
  for (const auto& [key, v] : {std::pair<const char*, int64_t>{"hidden_size", hidden_size}, {"latent_size", latent_size},
                               {"expert_ffn_size", expert_ffn_size}, {"head_dim", head_dim}})
    at_most(key, v, int64_t(1) << 20);
  at_most("num_q_heads", num_q_heads, 4096);
  at_most("num_kv_heads", num_kv_heads, 4096);
  at_most("max_position_embeddings", max_position_embeddings, int64_t(1) << 31);
  KILN_CHECK(num_experts <= 256, locate(where, "num_experts"),
             ": routing ids are stored as uint8, so at most 256 experts (num_experts=", num_experts, ")");
  KILN_CHECK(top_k <= num_experts, locate(where, "top_k"), ": must not exceed num_experts (top_k=",
             top_k, ", num_experts=", num_experts, ")");
  KILN_CHECK(num_q_heads % num_kv_heads == 0, locate(where, "num_kv_heads"),
             ": num_q_heads must be a multiple of num_kv_heads (num_q_heads=", num_q_heads,
             ", num_kv_heads=", num_kv_heads, ")");
  KILN_CHECK(head_dim % 2 == 0, locate(where, "head_dim"), ": RoPE needs an even head_dim (head_dim=",
             head_dim, ")");
  KILN_CHECK(rope_theta > 0, locate(where, "rope_theta"), ": must be positive (rope_theta=", rope_theta, ")");
  KILN_CHECK(rms_norm_eps > 0 && rms_norm_eps < 1, locate(where, "rms_norm_eps"),
             ": must be in (0, 1) (rms_norm_eps=", rms_norm_eps, ")");
  KILN_CHECK(init_std > 0, locate(where, "init_std"), ": must be positive (init_std=", init_std, ")");
  KILN_CHECK(dtype == "bfloat16" || dtype == "float32", locate(where, "dtype"),
             ": must be bfloat16 or float32 (dtype=", dtype, ")");
  for (int64_t l : bf16_expert_layers) {
    KILN_CHECK(l >= 0 && l < num_layers, locate(where, "bf16_expert_layers"),
               ": layer index out of range (layer=", l, ", num_layers=", num_layers, ")");
  }
}

ModelConfig ModelConfig::from_yaml(yaml::MapReader& r) {
  ModelConfig c;
  r.get("name", c.name);
  r.require("vocab_size", c.vocab_size);
  r.require("hidden_size", c.hidden_size);
  r.require("latent_size", c.latent_size);
  r.require("num_layers", c.num_layers);
  r.require("num_experts", c.num_experts);
  r.require("top_k", c.top_k);
  r.require("expert_ffn_size", c.expert_ffn_size);
  r.require("num_q_heads", c.num_q_heads);
  r.require("num_kv_heads", c.num_kv_heads);
  r.require("head_dim", c.head_dim);
  r.get("sliding_window", c.sliding_window);
  r.get("full_attention_period", c.full_attention_period);
  r.get("max_position_embeddings", c.max_position_embeddings);
  r.get("rope_theta", c.rope_theta);
  r.get("rms_norm_eps", c.rms_norm_eps);
  std::string score = router_score_name(c.router_score);
  r.get("router_score", score);
  r.get("bf16_expert_layers", c.bf16_expert_layers);
  r.get("init_std", c.init_std);
  r.get("dtype", c.dtype);
  r.finish();
  yaml::Locations where;
  for (const auto& [key, loc] : r.locations()) {
    // Validation names keys relative to the model mapping.
    std::string rel = key.substr(key.rfind('.') == std::string::npos ? 0 : key.rfind('.') + 1);
    where[rel] = loc;
  }
  try {
    c.router_score = parse_router_score(score);
  } catch (const Error& e) {
    KILN_FAIL(locate(where, "router_score"), ": ", e.what());
  }
  c.validate(where);
  return c;
}

ModelConfig ModelConfig::from_yaml_file(const std::string& path) {
  yaml::MapReader r(yaml::load_file(path), path, "");
  return from_yaml(r);
}

std::string ModelConfig::to_json() const {
  nlohmann::ordered_json j;
  j["architectures"] = {"MuseForCausalLM"};
  j["model_type"] = "muse";
  j["name"] = name;
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["latent_size"] = latent_size;
  j["num_hidden_layers"] = num_layers;
  j["num_experts"] = num_experts;
  j["num_experts_per_tok"] = top_k;
  j["expert_ffn_size"] = expert_ffn_size;
  j["num_attention_heads"] = num_q_heads;
  j["num_key_value_heads"] = num_kv_heads;
  j["head_dim"] = head_dim;
  j["sliding_window"] = sliding_window;
  j["full_attention_period"] = full_attention_period;
  j["max_position_embeddings"] = max_position_embeddings;
  j["rope_theta"] = rope_theta;
  j["rms_norm_eps"] = rms_norm_eps;
  j["router_score"] = router_score_name(router_score);
  j["bf16_expert_layers"] = bf16_expert_layers;
  j["initializer_range"] = init_std;
  j["torch_dtype"] = dtype;
  j["tie_word_embeddings"] = false;
  return j.dump(2) + "\n";
}

ModelConfig ModelConfig::from_json_file(const std::string& path) {
  nlohmann::json j = read_json_file(path, "model config", "a checkpoint directory needs config.json");
  KILN_CHECK(j.is_object(), "model config: ", path, ": expected a JSON object of keys to values, got a ", j.type_name());
  ModelConfig c;
  auto need = [&](const char* key, auto& out) {
    KILN_CHECK(j.contains(key), "model config: ", path, ": missing key ", key);
    try {
      j.at(key).get_to(out);
    } catch (const nlohmann::json::exception& e) {
      KILN_FAIL("model config: ", path, ": key ", key, " has the wrong type (", e.what(), ")");
    }
  };
  auto opt = [&](const char* key, auto& out) {
    if (j.contains(key)) need(key, out);
  };
  const nlohmann::json type = j.contains("model_type") ? j.at("model_type") : nlohmann::json("<none>");
  KILN_CHECK(type == "muse", "model config: ", path, ": model_type must be \"muse\" (got ", type.dump(), ")");
  opt("name", c.name);
  need("vocab_size", c.vocab_size);
  need("hidden_size", c.hidden_size);
  need("latent_size", c.latent_size);
  need("num_hidden_layers", c.num_layers);
  need("num_experts", c.num_experts);
  need("num_experts_per_tok", c.top_k);
  need("expert_ffn_size", c.expert_ffn_size);
  need("num_attention_heads", c.num_q_heads);
  need("num_key_value_heads", c.num_kv_heads);
  need("head_dim", c.head_dim);
  opt("sliding_window", c.sliding_window);
  opt("full_attention_period", c.full_attention_period);
  opt("max_position_embeddings", c.max_position_embeddings);
  opt("rope_theta", c.rope_theta);
  opt("rms_norm_eps", c.rms_norm_eps);
  std::string score = router_score_name(c.router_score);
  opt("router_score", score);
  try {
    c.router_score = parse_router_score(score);
  } catch (const Error& e) {
    KILN_FAIL("model config: ", path, ": key router_score: ", e.what());
  }
  opt("bf16_expert_layers", c.bf16_expert_layers);
  opt("initializer_range", c.init_std);
  opt("torch_dtype", c.dtype);
  yaml::Locations where;
  c.validate(where);
  return c;
}

std::string ModelConfig::to_yaml() const {
  YAML::Emitter out;
  out << YAML::BeginMap;
  out << YAML::Key << "name" << YAML::Value << name;
  out << YAML::Key << "vocab_size" << YAML::Value << vocab_size;
  out << YAML::Key << "hidden_size" << YAML::Value << hidden_size;
  out << YAML::Key << "latent_size" << YAML::Value << latent_size;
  out << YAML::Key << "num_layers" << YAML::Value << num_layers;
  out << YAML::Key << "num_experts" << YAML::Value << num_experts;
  out << YAML::Key << "top_k" << YAML::Value << top_k;
  out << YAML::Key << "expert_ffn_size" << YAML::Value << expert_ffn_size;
  out << YAML::Key << "num_q_heads" << YAML::Value << num_q_heads;
  out << YAML::Key << "num_kv_heads" << YAML::Value << num_kv_heads;
  out << YAML::Key << "head_dim" << YAML::Value << head_dim;
  out << YAML::Key << "sliding_window" << YAML::Value << sliding_window;
  out << YAML::Key << "full_attention_period" << YAML::Value << full_attention_period;
  out << YAML::Key << "max_position_embeddings" << YAML::Value << max_position_embeddings;
  out << YAML::Key << "rope_theta" << YAML::Value << rope_theta;
  out << YAML::Key << "rms_norm_eps" << YAML::Value << rms_norm_eps;
  out << YAML::Key << "router_score" << YAML::Value << router_score_name(router_score);
  out << YAML::Key << "bf16_expert_layers" << YAML::Value << YAML::Flow << bf16_expert_layers;
  out << YAML::Key << "init_std" << YAML::Value << init_std;
  out << YAML::Key << "dtype" << YAML::Value << dtype;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

ParamCounts count_parameters(const ModelConfig& c) {
  ParamCounts p;
  const int64_t L = c.num_layers, d = c.hidden_size, dl = c.latent_size, E = c.num_experts;
  p.embedding = c.vocab_size * d;
  p.head = c.vocab_size * d;
  p.attention = L * (2 * d * c.q_size() + 2 * d * c.kv_size());
  p.latent = L * 2 * d * dl;
  p.router = L * E * d;
  p.experts = L * E * 3 * c.expert_ffn_size * dl;
  const int64_t layer_norms = L * 4 * d + d;
  p.norms = layer_norms + L * E * dl;
  p.active_expert_norms = L * c.top_k * dl;
  p.active_per_token = p.attention + p.latent + p.router + p.experts / E * c.top_k + layer_norms +
                       p.active_expert_norms;
  return p;
}

double kv_cache_bytes_per_token(const ModelConfig& c, int64_t context, int64_t bytes_per_value) {
  const double per_layer_token = 2.0 * c.kv_size() * bytes_per_value;  // K and V
  const double kept = c.num_full_layers() * double(context) +
                      c.num_window_layers() * double(std::min(context, c.sliding_window));
  return kept * per_layer_token / double(context);
}

}  // namespace kiln::model
