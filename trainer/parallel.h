// Data parallelism for the trainers (issue 6): the dp x ep layout, gradient all-reduce in buckets,
// and ZeRO-1 ownership (each rank keeps the optimizer state of whole tensors, so Muon's matrices
// are never split) with the parameters broadcast from their owners after the step.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/comm.h"

namespace kiln::trainer {

struct ParallelConfig {
  int64_t dp = 0;  // data-parallel ranks; 0: world size / ep
  int64_t ep = 1;  // expert-parallel ranks
  int64_t tp = 1;  // reserved: must be 1
  // Fills dp and checks dp * ep == world, ep | num_experts, tp == 1. Errors list every value.
  void resolve(int64_t world, int64_t num_experts);
  std::string describe() const;
};

// Sums every gradient over `group` (undefined gradients count as zeros and become defined),
// flattened into buckets of at most bucket_bytes per dtype. A one-rank group does nothing.
void all_reduce_grads(const comm::Group& group, const std::vector<at::Tensor>& params,
                      int64_t bucket_bytes = 32ll << 20);

// The global gradient norm when expert shards differ between the ranks of `experts` (each expert
// counted once), and clipping of every gradient to max_norm (0: only measure). Returns the norm.
double clip_grads_expert_parallel(const std::vector<at::Tensor>& params, const std::vector<bool>& is_expert,
                                  const comm::Group& experts, double max_norm);

// The ZeRO-1 owner rank of each parameter: largest first, each to the least-loaded rank.
std::vector<int> zero_owners(const std::vector<at::Tensor>& params, int ranks);

// After the owners' optimizer steps: every rank gets every parameter from its owner.
void broadcast_from_owners(const comm::Group& group, const std::vector<at::Tensor>& params,
                           const std::vector<int>& owners);

}  // namespace kiln::trainer
