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

#include "core/comm.h"
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

// How a DecodeGraphs runs its steps.
struct DecodeGraphOptions {
  // RoPE and the KV-cache write as one kernel (kernels::rope_cache_write) rather than four (off:
  // tests compare).
  bool fuse_rope_cache = true;
  // The model is an expert shard of this group: each step's exchange has a fixed shape, and every
  // rank of the group must run a step of the same bucket rows at the same time (the engine
  // agrees on it). Each rank sends each rank `capacity` rows (model::AllToAllDispatcher): for
  // bucket rows R, top_k k and S ranks, the mean per rank is m = R k / S, and the capacity is
  // min(R k, ceil(f m + 4 sqrt(f m))) with f = expert_capacity (0: R k, the worst case, which
  // never overflows). A step some slot of which did not fit says so (DecodeResult::overflowed).
  const comm::Group* expert_group = nullptr;
  double expert_capacity = 2.0;
  // false: the same steps run without a graph, on any device and dtype (the CPU tests the graph
  // path's logic this way).
  bool capture = true;
  // rollout.numerics: bitwise: the forward's batch-invariant numerics, each row's attention the
  // trainer's ranged attention over its keys' cache rows, found on the device.
  model::Numerics numerics = model::Numerics::kStandard;
  bool bitwise() const { return numerics == model::Numerics::kBitwise; }
};

struct DecodeResult {
  at::Tensor ids;        // [N] int64, CPU: the token drawn for each row (unfiltered sampling);
  at::Tensor logprobs;   // [N] fp32, CPU; both undefined for steps run without capture
  at::Tensor routing;    // [N, L, k] uint8, CPU
  at::Tensor logits;     // [>= N, V] fp32 on the model's device; valid until the next run
  bool overflowed = false;  // an expert shard's exchange dropped a slot: redo the step (every rank)
  bool may_overflow = false;  // the step's capacity is below the worst case (the same on every rank)
};

// Padded row counts of the decode buckets: small batches exactly by powers of two, then steps of 16.
int64_t decode_bucket_rows(int64_t n);

class DecodeGraphs {
 public:
  // Capture needs a CUDA build, a bf16 CUDA model on torch >= 2.8 with expert widths of 8k
  // (grouped GEMMs: no host syncs in the MoE), a shape the paged-attention kernel handles (batch-
  // invariant steps: the ranged attention's) and, for an expert group of more than one, NCCL.
  static bool available(const model::Muse& model, const comm::Group* expert_group = nullptr,
                        model::Numerics numerics = model::Numerics::kStandard);
  DecodeGraphs(const model::Muse& model, KvPools pools, int64_t max_rows, DecodeGraphOptions options = {});
  ~DecodeGraphs();
  // One step of the bucket for max(rows, min_rows) rows (min_rows: the group's widest; a rank of
  // an expert group with nothing to decode runs zero rows, all padding, and gets empty results).
  // Without capture the result has no ids and log-probs (the caller samples from the logits).
  DecodeResult run(const DecodeStep& step, int64_t min_rows = 0);
  int64_t num_graphs() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::rollout
