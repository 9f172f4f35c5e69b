// Expert parallelism (issue 6): each rank of an expert group holds num_experts/ep consecutive
// experts of every layer; tokens travel to their experts' ranks by all-to-all-v and come back,
// and the exchange is differentiable (its backward is the reverse exchange).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/comm.h"
#include "model/muse.h"

namespace kiln::model {

// Whether a named parameter is one of the stacked expert tensors (sharded under expert parallelism).
inline bool is_expert_tensor(const std::string& name) { return name.find("mlp.experts.") != std::string::npos; }

// The experts [rank * E/size, (rank+1) * E/size) of every layer of `full` (and their LoRA
// adapters), copied; everything else shared with `full`. Forward it with ForwardOptions::experts
// set to an AllToAllDispatcher over a group of `size` ranks.
Muse shard_experts(const Muse& full, int rank, int size);

// Expert parallelism over `group` (rank r holds experts [r * local, (r + 1) * local)): each slot's
// row goes to its expert's rank by all-to-all-v and its output comes back the same way.
//
// Fixed shape (fixed_shape true): every rank sends each rank exactly `capacity` rows, its slots for
// that rank first and zero rows after, so that the exchange's sizes never depend on the routing
// and nothing is read back to the host: what a captured CUDA graph needs. The capacity is the
// most slots any rank of the group has (no slot is ever dropped), found by a host all-reduce per
// dispatch; set_capacity() fixes it (every rank alike) for a captured batch bucket, and then a
// dispatch makes no host call at all. A set capacity may be below the worst case, where all of a
// rank's slots go to one rank: slots beyond it for one rank are then not sent, their outputs are
// garbage, and overflow() counts the dispatches where that happened, so that the caller can redo
// the step with the variable exchange. The padding rows carry a spare expert id (Routed::spare):
// no expert runs them, their outputs are zero, and only masked or dropped slots read them.
class AllToAllDispatcher : public ExpertDispatcher {
 public:
  // `group` must outlive it.
  explicit AllToAllDispatcher(const comm::Group& group, bool fixed_shape = false)
      : group_(group), fixed_shape_(fixed_shape) {}
  int64_t ranks() const override { return group_.size(); }
  Routed dispatch(const at::Tensor& z, const at::Tensor& flat, int64_t k, int64_t local) const override;
  at::Tensor combine(const at::Tensor& y, const Routed& routed) const override;
  const comm::Group& group() const { return group_; }
  bool fixed_shape() const { return fixed_shape_; }
  // Rows each rank sends each rank under fixed_shape (0: every rank's most slots, found by an
  // all-reduce at each dispatch).
  void set_capacity(int64_t rows) { capacity_ = rows; }
  // Under fixed_shape: tokens whose entry is 0 in `mask` ([T] int64, on the slots' device, read at
  // each dispatch, so a captured step reads its current values) send nothing and get garbage
  // back: a decode bucket's padding rows, which would otherwise all pick the same experts and
  // crowd a few ranks' capacity. Undefined: every token sends.
  void set_row_mask(const at::Tensor& mask) { row_mask_ = mask; }
  // Under a set capacity: the dispatches since clear_overflow() that dropped a slot, an int32
  // scalar on the slots' device (undefined before the first); both are device ops a captured
  // step replays.
  const at::Tensor& overflow() const { return overflow_; }
  void clear_overflow() const {
    if (overflow_.defined()) overflow_.zero_();
  }

 private:
  Routed dispatch_fixed(const at::Tensor& z, const at::Tensor& flat, int64_t k, int64_t local) const;
  const comm::Group& group_;
  bool fixed_shape_ = false;
  int64_t capacity_ = 0;
  at::Tensor row_mask_;
  mutable at::Tensor overflow_;
};

// Rows [sum(send[:j]), +send[j]) of x go to rank j; returns the rows received, in rank order
// (recv[j] from rank j). Differentiable in x: the gradient goes back by the reverse exchange.
// Every rank of `group` must call it, and the backward runs on every rank, even with no rows.
// `known`: the senders agreed on recv beforehand (comm::Group::all_to_all_known); else the counts
// are exchanged and checked against recv.
at::Tensor exchange_rows(const comm::Group& group, const at::Tensor& x, const std::vector<int64_t>& send,
                         const std::vector<int64_t>& recv, bool known = false);

}  // namespace kiln::model
