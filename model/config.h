// ModelConfig: the dimensions of a Muse latent-MoE model (docs/MODEL.md §2), read from YAML or an
// HF-style config.json, validated, and counted (parameters by part, active per token, KV bytes).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/yaml_util.h"

namespace kiln::model {

// How router logits become expert scores: softmax (renormalised over the top-k) or sigmoid (with a
// per-expert selection bias). Named "softmax"/"sigmoid" in YAML and config.json.
enum class RouterScore { kSoftmax, kSigmoid };
RouterScore parse_router_score(const std::string& name);  // throws naming the accepted values
const char* router_score_name(RouterScore s);

struct ModelConfig {
  std::string name = "muse";
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;          // d
  int64_t latent_size = 0;          // d_l, the experts' width between pooler and unpooler
  int64_t num_layers = 0;           // L; every layer is a latent-MoE layer
  int64_t num_experts = 0;          // E
  int64_t top_k = 0;                // k
  int64_t expert_ffn_size = 0;      // I, each expert's SwiGLU width
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t sliding_window = 2048;    // W: a window layer's query i sees keys i-W < j <= i
  int64_t full_attention_period = 4;  // the last layer and every period-th before it are full
  int64_t max_position_embeddings = 1 << 20;
  double rope_theta = 500000.0;
  double rms_norm_eps = 1e-6;
  RouterScore router_score = RouterScore::kSoftmax;
  std::vector<int64_t> bf16_expert_layers;  // layers whose experts stay BF16 in NVFP4 checkpoints
  double init_std = 0.02;
  std::string dtype = "bfloat16";   // checkpoint dtype of every tensor but the router (always F32)

  // Throws naming the key (with its file:line when `where` knows it) for impossible values.
  void validate(const yaml::Locations& where = {}) const;

  bool is_full_attention(int64_t layer) const {
    return (num_layers - 1 - layer) % full_attention_period == 0;
  }
  int64_t num_full_layers() const;
  int64_t num_window_layers() const { return num_layers - num_full_layers(); }
  int64_t q_size() const { return num_q_heads * head_dim; }
  int64_t kv_size() const { return num_kv_heads * head_dim; }

  static ModelConfig from_yaml_file(const std::string& path);
  // Reads the keys of `reader` (a model mapping); unknown keys are errors.
  static ModelConfig from_yaml(yaml::MapReader& reader);
  static ModelConfig from_json_file(const std::string& path);  // HF-style config.json
  std::string to_json() const;                                 // HF-style config.json text
  std::string to_yaml() const;
};

// Parameter counts by part (docs/MODEL.md §2.3).
struct ParamCounts {
  int64_t embedding = 0;  // embed_tokens
  int64_t head = 0;       // lm_head (untied)
  int64_t attention = 0;  // q, k, v, o
  int64_t latent = 0;     // pooler + unpooler
  int64_t router = 0;
  int64_t experts = 0;    // gate, up, down of every routed expert
  int64_t norms = 0;      // sandwich norms, final norm, per-expert norms
  int64_t total() const { return embedding + head + attention + latent + router + experts + norms; }
  // Per token, the convention of docs/MODEL.md §2.3: attention + latent + router + k/E of the experts + norms.
  int64_t active_per_token = 0;
  int64_t active_expert_norms = 0;
};

ParamCounts count_parameters(const ModelConfig& cfg);

// KV-cache bytes per token of a sequence of `context` tokens: full layers keep every position,
// window layers the last W.
double kv_cache_bytes_per_token(const ModelConfig& cfg, int64_t context, int64_t bytes_per_value = 2);

}  // namespace kiln::model
