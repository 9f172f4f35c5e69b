// Naming shared inside model/: per-layer tensor suffixes, shapes, slots and dtypes of the
// checkpoints, and the table of linears that NVFP4 quantises and LoRA adapts. Internal.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/safetensors.h"
#include "model/muse.h"

namespace kiln::model::detail {

// The seed of the random stream of tensor `name` under a run seed (init, LoRA init).
uint64_t stream_seed(uint64_t seed, const std::string& name);
// The layer tensor stored under `suffix` (e.g. "self_attn.q_proj.weight"), or nullptr.
at::Tensor* layer_slot(LayerWeights& l, const std::string& suffix);
// "mlp.experts.*": stacked [E, ...] in memory, one tensor per expert on disk.
bool is_expert_stack(const std::string& suffix);
// Shapes of one layer's tensors (experts stacked), by suffix.
std::vector<std::pair<std::string, std::vector<int64_t>>> layer_shapes(const ModelConfig& c);
// "<prefix>mlp.experts.gate_proj.weight" -> "<prefix>mlp.experts.<e>.gate_proj.weight".
std::string expert_name(const std::string& layer_prefix, int64_t e, const std::string& suffix);
// The router is fp32 (fp64 in fp64 runs); every other tensor has the model dtype.
at::ScalarType tensor_dtype(const std::string& suffix, at::ScalarType dtype);

// One linear of a layer that NVFP4 quantises and LoRA adapts: its HF module suffix, its LoRA target
// name, and the members holding its dense weight, NVFP4 copy and adapter pair.
struct LinearSlot {
  const char* module;  // "self_attn.q_proj"; experts "mlp.experts.gate_proj" (stacked, one module per expert)
  const char* kind;    // "q_proj", ..., "gate_proj": the LoRA target_modules name
  at::Tensor LayerWeights::*dense;
  kernels::Nvfp4Tensor LayerWeights::Nvfp4::*q;
  at::Tensor LayerWeights::Lora::*a;
  at::Tensor LayerWeights::Lora::*b;
  bool expert;
};
// Every such linear, in this order.
enum LinearIndex { kQProj, kKProj, kVProj, kOProj, kPooler, kUnpooler, kGateProj, kUpProj, kDownProj };
const std::vector<LinearSlot>& linear_slots();
// "model.layers.<layer>." and the HF module of a slot there (expert `e` of an expert slot):
// "model.layers.2.self_attn.q_proj", "model.layers.2.mlp.experts.5.up_proj".
std::string layer_prefix(int64_t layer);
std::string linear_module(int64_t layer, const LinearSlot& s, int64_t e);

// The experts [first, first + count) of every layer: an expert-parallel rank's shard. count < 0: all.
struct ExpertRange {
  int64_t first = 0, count = -1;
  int64_t size(const ModelConfig& cfg) const { return count < 0 ? cfg.num_experts : count; }
};
// The range of rank `rank` of `size`, checked (E must split evenly).
ExpertRange expert_shard(const ModelConfig& cfg, int rank, int size);

// Loads every tensor the config names from `ckpt` into a model of `dtype` on `device`, except those
// `skip(layer, suffix)` selects (left undefined); `extra` are further names the checkpoint must
// hold. Of the experts only `experts` are read (each expert is its own tensor in the file, so a
// shard reads only its share), and with `keep` only the tensors it selects by in-memory name (the
// others become zero-element placeholders, though the file must still hold them). Errors name
// missing, unexpected and misshapen tensors.
Muse load_tensors(const ModelConfig& cfg, const safetensors::Checkpoint& ckpt, at::ScalarType dtype, at::Device device,
                  const std::function<bool(int64_t, const std::string&)>& skip, const std::set<std::string>& extra,
                  ExpertRange experts = {}, const std::function<bool(const std::string&)>& keep = {});

}  // namespace kiln::model::detail
