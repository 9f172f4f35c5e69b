// LoRA adapters on the Muse linears (docs/MODEL.md §5): W' = W + (alpha / r) B A on attention q/k/v/o,
// the latent pooler and unpooler, and every routed expert's gate/up/down (per-expert adapters,
// stacked). Applied unmerged in the forward (on a dense or an NVFP4 base); PEFT import/export;
// merging into the base.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/yaml_fwd.h"
#include "model/muse.h"

namespace kiln::model {

// Adapters of rank r. A job without adapters has none (std::optional<LoraConfig> unset).
struct LoraConfig {
  int64_t rank = 32;       // r >= 1
  double alpha = 64;
  // Module kinds that get adapters: q_proj k_proj v_proj o_proj pooler unpooler gate_proj up_proj
  // down_proj (the last three: every routed expert).
  std::vector<std::string> targets = {"q_proj", "k_proj", "v_proj", "o_proj", "pooler",
                                      "unpooler", "gate_proj", "up_proj", "down_proj"};
  double scale() const { return alpha / double(rank); }
  void validate() const;   // rank >= 1, alpha > 0, known targets
};

// A recipe's lora: section (model/lora_yaml.cpp, docs/CONFIG.md), which turns adapters on: reads
// rank, alpha and targets over `c` (unset: LoraConfig's defaults, rank 32), finishes the section
// and validates, a bad value named at its key's file and line. rank 0 turns them off again (`c`
// unset). Calling it only when the section is there is the caller's.
void read_yaml(yaml::MapReader& m, std::optional<LoraConfig>& c);
// Writes the section; without adapters rank 0 and LoraConfig's other defaults.
void write_yaml(YAML::Emitter& e, const std::optional<LoraConfig>& c);

// Adds adapters to `m`: A [r, in] Kaiming-uniform (bound 1/sqrt(in)) from a stream seeded by
// (seed, name), B [out, r] zeros, in the model's dtype on its device. Experts get [E, r, in] and
// [E, out, r] for the E experts `m` holds: an expert shard's are experts first_expert.. (the same
// values as the whole model's, sliced). Replaces adapters already there.
void add_lora(Muse& m, const LoraConfig& cfg, uint64_t seed, int64_t first_expert = 0);
// Replaces every adapter of `m` by a copy of its own: for a view that shares a frozen base with
// the trainer but not the adapters it updates (the rollout engine's, EngineConfig::share_weights).
void copy_adapters(Muse& m);
// The adapter parameters add_lora creates for `model` (rank r: r * (in + out) per adapted matrix,
// per expert for the expert targets), counted from the config alone.
int64_t lora_parameter_count(const ModelConfig& model, const LoraConfig& cfg);
// The adapters under their in-memory names ("model.layers.0.self_attn.q_proj.lora_A",
// "model.layers.0.mlp.experts.gate_proj.lora_B" stacked [E, out, r]); empty without adapters.
std::vector<std::pair<std::string, at::Tensor>> lora_parameters(const Muse& m);
int64_t lora_rank(const Muse& m);  // 0 without adapters

// W += (alpha / r) B A for every adapted linear (in fp32, then the weight's dtype), and the
// adapters removed. Needs dense weights (dequantise an NVFP4 base first).
void merge_lora(Muse& m);

// PEFT layout: adapter_model.safetensors (base_model.model.<module>.lora_A.weight [r, in] and
// lora_B.weight [out, r], one pair per expert) and adapter_config.json, written atomically.
void save_peft_adapter(const Muse& m, const std::string& dir);
// Reads a PEFT adapter into `m` (replacing its adapters); errors name the file, the tensor and
// the expected shape, or the adapter_config.json key.
void load_peft_adapter(Muse& m, const std::string& dir);

}  // namespace kiln::model
