// CUDA-graph decode for the rollout engine: one captured graph per (padded batch, block-table
// width) runs a whole decode step (forward over the paged cache, lm_head, sampling) in one launch.
// The engine owns the cache and the scheduling; this file only replays steps it is handed.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "model/muse.h"
#include "rollout/kv_cache.h"  // KvPools

namespace kiln::rollout {

// One decode step: a token per row, every row already holding blocks for its new position.
struct DecodeStep {
  struct Row {
    int64_t token = 0, position = 0;
    const std::vector<int64_t>* full_blocks = nullptr;  // logical block -> full-pool block
    const std::vector<int64_t>* ring = nullptr;         // ring slot -> window-pool block
    double temperature = 1.0;
    uint64_t stream_seed = 0;
  };
  std::vector<Row> rows;
};

struct DecodeResult {
  at::Tensor ids;        // [N] int64, CPU: the token drawn for each row (unfiltered sampling)
  at::Tensor logprobs;   // [N] fp32, CPU
  at::Tensor routing;    // [N, L, k] uint8, CPU
  at::Tensor logits;     // [>= N, V] fp32 on the GPU; valid until the next run
};

class DecodeGraphs {
 public:
  // Graphs need a CUDA build, a bf16 CUDA model on torch >= 2.8 (grouped GEMM: no host syncs in
  // the MoE) and a shape the paged-attention kernel handles.
  static bool available(const model::Muse& model);
  // fuse_rope_cache: RoPE and the KV-cache write as one kernel (kernels::rope_cache_write) rather
  // than four (off: tests compare).
  DecodeGraphs(const model::Muse& model, KvPools pools, int64_t max_rows, bool fuse_rope_cache = true);
  ~DecodeGraphs();
  DecodeResult run(const DecodeStep& step);
  int64_t num_graphs() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::rollout
