// NVFP4 Muse models (docs/MODEL.md §4): which linears are quantised, quantising a model for serving,
// re-quantising after a weight sync, dequantising for training, activation calibration, and
// ModelOpt-compatible checkpoints (U8 codes, F8_E4M3 block scales, F32 scales, hf_quant_config.json).
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "model/muse.h"

namespace kiln::model {

// Layer i's experts are NVFP4 unless i is one of the config's bf16_expert_layers. Attention
// projections, pooler and unpooler are NVFP4 in every layer; router, norms, embeddings and lm_head
// never are.
bool experts_quantized(const ModelConfig& cfg, int64_t layer);
// HF module names kept out of quantisation (hf_quant_config.json's exclude_modules).
std::vector<std::string> nvfp4_exclude_modules(const ModelConfig& cfg);

// What `kiln quantize` writes for `cfg`, counted from the config alone: the parameters stored as
// NVFP4 codes, those kept at their own width (BF16; the router FP32), and the bytes of all the
// checkpoint's tensors (codes, E4M3 block scales, FP32 tensor scales, and FP32 input scales when
// `input_scales`). The rollout engine holds the same bytes.
struct Nvfp4Footprint {
  int64_t quantized_params = 0;
  int64_t kept_params = 0;
  int64_t bytes = 0;
};
Nvfp4Footprint nvfp4_footprint(const ModelConfig& cfg, bool input_scales = true);

// Quantises every quantisable linear from its dense weight into LayerWeights::nvfp4 (the kernel
// layout when `kernel_layout`). With `drop_dense` the dense copies are released, so the forward
// serves NVFP4; linears that already hold NVFP4 weights and no dense ones are left as they are.
void quantize_model(Muse& m, bool kernel_layout, bool drop_dense);
// quantize_model for one linear, by its Muse::named_parameters name: quantises it afresh from its
// dense weight when it is one that NVFP4 serves and returns true; false for every other tensor.
bool quantize_linear(Muse& m, const std::string& name, bool kernel_layout, bool drop_dense);
// A weight sync into an NVFP4-serving model: when `name` (a Muse::named_parameters name) is a
// linear served from NVFP4, quantises `dense` into its storage in place (addresses unchanged, so
// captured CUDA graphs stay valid) and returns true; false for every other tensor. Calibrated
// input scales stay as they were (W4A4 keeps the step-0 activation ranges).
bool requantize(Muse& m, const std::string& name, const at::Tensor& dense);
// Dense weights (`dtype`, on the model's device) from the NVFP4 copies, for the linears that have
// them: the trainer's BF16 view of an NVFP4 checkpoint. The NVFP4 copies stay (the engine takes them).
void dequantize_model(Muse& m, at::ScalarType dtype);

// Static activation scales (ModelOpt's input_scale = amax / (6 * 448)) for every NVFP4 linear,
// from a forward over `batch` (for experts, over the rows routed to each; experts that get no rows
// take their layer's largest).
void calibrate_input_scales(Muse& m, const PackedBatch& batch);

// True when `dir` holds an NVFP4 checkpoint (hf_quant_config.json with quant_algo NVFP4).
bool is_nvfp4_checkpoint(const std::string& dir);
// Writes config.json (with quantization_config), hf_quant_config.json and the safetensors:
// `<linear>.weight` U8 [N, K/2], `.weight_scale` F8_E4M3 [N, K/16], `.weight_scale_2` F32 [],
// `.input_scale` F32 [] (when calibrated); every other tensor as save_checkpoint writes it.
void save_nvfp4_checkpoint(const Muse& m, const std::string& dir, uint64_t max_shard_bytes = 5ull << 30);
// Reads an NVFP4 checkpoint: NVFP4 copies on `device` (ModelOpt layout) plus dense weights in
// `dtype` dequantised from them. Errors name the file, the tensor and the expected shape. With
// size > 1 only rank `rank`'s experts (model/expert_parallel.h's split) are read, dense and NVFP4.
Muse load_nvfp4_checkpoint(const std::string& dir, at::ScalarType dtype, at::Device device, int rank = 0,
                           int size = 1);

}  // namespace kiln::model
