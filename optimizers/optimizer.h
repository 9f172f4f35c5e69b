// The trainer's optimizer (docs/MODEL.md §7, issue 5): parameters split into Muon and AdamW groups by
// rules, fp32 master weights for low-precision parameters, fp32 or bf16 moments, and the state
// placed on the parameters' device, in CPU memory, or in files on an NVMe disk, updated in chunks.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/yaml_fwd.h"
#include "optimizers/groups.h"
#include "optimizers/updates.h"

namespace kiln::optimizers {

// Where the state lives and where the update runs.
enum class Placement {
  kDevice,   // with the parameters (the GPU when there is one); whole-tensor updates
  kHost,     // CPU memory; chunks streamed to the parameters' device, updated, streamed back
             // (double-buffered on CUDA streams from pinned memory; on a CPU model, in place)
  kHostCpu,  // CPU memory; updated on the CPU (AdamW: fused Eigen loop on ATen's threads)
  kNvme,     // files under nvme_dir, read and written in chunks while the previous chunk computes;
             // updated on the parameters' device (on the CPU with the Eigen loop for CPU models)
};
const char* placement_name(Placement p);
Placement parse_placement(const std::string& name);  // device | cpu | cpu_update | nvme

struct OptimizerConfig {
  AdamWConfig adamw;
  MuonConfig muon;
  bool use_muon = true;                   // false: AdamW for everything
  std::vector<GroupRule> rules;           // tried before the default assignment
  Placement state = Placement::kDevice;   // where the state lives and the update runs
  std::string nvme_dir;                   // kNvme
  int64_t chunk_bytes = 64ll << 20;       // state bytes per chunk (rounded to whole Muon matrices);
                                          // the recipe's chunk_mb x 2^20
  bool master_weights = true;             // fp32 master copies of bf16/fp16 parameters
  at::ScalarType moments = at::kFloat;    // the moments' dtype: fp32 or bf16
  bool fused = true;  // AdamW on CUDA state: one multi-tensor kernel (false: ATen ops, the reference)
  std::string state_tag = "rank0";        // distinguishes the state files of ranks sharing nvme_dir
  void validate() const;
};

// The optimizer's keys of a recipe's optim: and sft: sections (optimizers/optimizer_yaml.cpp,
// docs/CONFIG.md): muon for use_muon (muon names the Muon settings here), the muon_* keys for
// those settings, state by name, chunk_mb in MiB, moments fp32 | bf16; then validate(), a bad value
// named at its key's file and line. The sections also hold the trainer's own keys, so the caller
// reads those and finishes the section.
void read_yaml(yaml::MapReader& m, OptimizerConfig& c);
void write_yaml(YAML::Emitter& e, const OptimizerConfig& c);

class Optimizer {
 public:
  // `params` are updated in place and must stay alive (names are the checkpoint's names).
  Optimizer(std::vector<std::pair<std::string, at::Tensor>> params, OptimizerConfig config);
  ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One step on the parameters' .grad(); parameters without a gradient are skipped.
  void step();
  void zero_grad();
  // Scales both base learning rates (the schedule's factor).
  void set_lr_factor(double factor);
  int64_t steps() const;
  Kind kind_of(const std::string& name) const;
  const OptimizerConfig& config() const;
  int64_t state_bytes() const;  // master weights and moments, all parameters
  std::string summary() const;  // groups and placement, for logs

  // The state as a safetensors file: "<param>.exp_avg" / ".exp_avg_sq" / ".momentum" / ".master",
  // with the step and a fingerprint of the parameter names, shapes and groups in the metadata.
  // Written atomically. load() accepts a file from any placement, moment dtype or master setting,
  // and rejects truncated files and files of another model or grouping before changing anything.
  void save(const std::string& path) const;
  void load(const std::string& path);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::optimizers
