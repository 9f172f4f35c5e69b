// Checkpoint naming shared by the BF16 and NVFP4 checkpoint code (model/weights.cpp,
// model/nvfp4_model.cpp): per-layer tensor suffixes, their shapes, slots and dtypes. Internal.
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

// Loads every tensor the config names from `ckpt` into a model of `dtype` on `device`, except those
// `skip(layer, suffix)` selects (left undefined); `extra` are further names the checkpoint must
// hold. Errors name missing, unexpected and misshapen tensors.
Muse load_tensors(const ModelConfig& cfg, const safetensors::Checkpoint& ckpt, at::ScalarType dtype, at::Device device,
                  const std::function<bool(int64_t, const std::string&)>& skip, const std::set<std::string>& extra);

}  // namespace kiln::model::detail
