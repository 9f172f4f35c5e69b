// Muse checkpoints on disk: HF tensor names (docs/MODEL.md §3.2) in safetensors plus config.json.
// Experts are stacked [E, ...] in memory and stored one tensor per expert.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "model/muse.h"

namespace kiln::model {

// Every tensor under its HF checkpoint name (experts split per expert), in checkpoint dtype:
// the config's dtype, the router in F32. Tensors may stay on the model's device.
// For an expert shard: its experts are numbered from `first_expert`; `dense` false leaves out the rest.
// keep (if given) selects tensors by in-memory name, before `dense` applies.
std::vector<std::pair<std::string, at::Tensor>> hf_tensors(const Muse& model, int64_t first_expert = 0,
                                                           bool dense = true,
                                                           const std::function<bool(const std::string&)>& keep = {});

// Writes config.json and model.safetensors (sharded above max_shard_bytes) into `dir`.
void save_checkpoint(const Muse& model, const std::string& dir, uint64_t max_shard_bytes = 5ull << 30);
// Rank `rank` of `size`'s part of a checkpoint written by every expert-parallel rank at once: its
// experts under their global indices (and, with_dense, the rest and config.json; exactly one rank
// says so). Once all have written, one rank calls safetensors::merge_checkpoint_index(dir); the
// directory then loads like save_checkpoint's, whole or by shard. No tensor moves between ranks.
void save_checkpoint_part(const Muse& shard, const std::string& dir, int rank, int size, bool with_dense,
                          uint64_t max_shard_bytes = 5ull << 30);
// Writer `writer` of `writers`' part when each writes the tensors it owns (ZeRO-3, parallel/zero3.h):
// those `keep` selects by in-memory name (Muse::named_parameters), stacked experts numbered from
// first_expert, in files stemmed model-rank<writer>-of-<writers>; config.json too when
// with_config (exactly one writer). Merged and loaded as save_checkpoint_part's.
void save_checkpoint_owned(const Muse& part, const std::string& dir, int writer, int writers, int64_t first_expert,
                           const std::function<bool(const std::string&)>& keep, bool with_config,
                           uint64_t max_shard_bytes = 5ull << 30);

// Reads `dir` (config.json + safetensors) into a model of `dtype` on `device`. Errors name the
// file and tensor for missing, unexpected or wrongly shaped tensors. An NVFP4 checkpoint
// (model/nvfp4_model.h) loads dequantised to `dtype`, its NVFP4 copies kept for the rollout engine.
Muse load_checkpoint(const std::string& dir, at::ScalarType dtype, at::Device device);
// The experts of rank `rank` of `size` (model/expert_parallel.h's shard_experts of the whole model)
// and everything else, reading only those experts' tensors: a rank's host and device memory hold
// its share. NVFP4 checkpoints are still read whole, then cut.
Muse load_checkpoint_shard(const std::string& dir, at::ScalarType dtype, at::Device device, int rank, int size);
// The same shard holding only the tensors `keep` selects by in-memory name (a ZeRO-3 rank's
// share, parallel/zero3.h); the others are zero-element placeholders and are not read. NVFP4
// checkpoints are read as the shard, then cut.
Muse load_checkpoint_owned(const std::string& dir, at::ScalarType dtype, at::Device device, int rank, int size,
                           const std::function<bool(const std::string&)>& keep);

// "bf16" / "bfloat16" / "fp32" / "float32" / "fp64" / "float64" -> torch dtype.
at::ScalarType parse_dtype(const std::string& name);

// "cpu", "cuda" or "cuda:N" -> a device this process can use; otherwise an error that starts with
// `where` (the option or recipe key) and says what is missing (no CUDA build, no such GPU).
at::Device parse_device(const std::string& name, const std::string& where);

// The GPU a rank uses when the recipe says "cuda" without an index: its local rank modulo the
// devices it can see. Under `srun --gpus-per-task=1` each rank sees one device (index 0) while its
// local rank counts the node's ranks. visible must be positive.
int64_t device_for_rank(int64_t local_rank, int64_t visible);
// `device` for a rank of a job of `ranks`: with more than one rank, "cuda" without an index
// becomes the rank's GPU (device_for_rank), made the current device; anything else as given.
at::Device rank_device(at::Device device, int64_t local_rank, int64_t ranks);

// Peak memory allocated on a CUDA device since the last reset, in GB; 0 on the CPU.
void reset_peak_memory(at::Device device);
double peak_memory_gb(at::Device device);
// Memory allocated on a CUDA device now, in GB; 0 on the CPU.
double current_memory_gb(at::Device device);
// The device's total memory in bytes (cudaMemGetInfo); 0 on the CPU.
double device_memory_bytes(at::Device device);
// Waits for the device's queued work (a no-op on the CPU): what a host clock around GPU work needs.
void synchronize(at::Device device);

}  // namespace kiln::model
