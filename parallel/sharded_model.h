// The trained model under a parallel layout (issue 21): from a whole policy or a rank's share of
// it, this rank's trained copy (its expert shard; under ZeRO-3 only the tensors it owns), the
// groups and the expert exchange, and what moves between the share and the whole: single tensors
// fetched whole, a whole policy brought up to date, checkpoints written and read by share.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>

#include "core/comm.h"
#include "parallel/parallel.h"
#include "parallel/zero3.h"
#include "model/expert_parallel.h"
#include "model/muse.h"

namespace kiln::parallel {

// What one rank holds of the policy under a layout (parallel.ep, parallel.dense): its expert shard
// (expert_rank of expert_ranks) and under ZeRO-3 only the tensors `keep` selects (the dense ones
// it owns; its experts too at ep 1), the others zero-element placeholders. A policy built this way
// (Muse::init_owned, model::load_checkpoint_owned) never exists whole on any rank.
struct PolicyShare {
  int expert_rank = 0, expert_ranks = 1;
  std::function<bool(const std::string&)> keep;  // by Muse::named_parameters name; empty: every tensor
  bool whole() const { return expert_ranks == 1 && !keep; }
};
// `parallel` as in the recipe (resolved here against the group's size and the model's experts).
PolicyShare policy_share(const model::ModelConfig& model, at::ScalarType dtype, ParallelConfig parallel,
                         const comm::Group& group = comm::Group::world());

class ShardedModel {
 public:
  // `policy`: the whole model (copied where the layout shards it) or this rank's share
  // (policy_share: trained in place). Its LoRA adapters, if any, are on it already. `parallel` is
  // resolved; `policy` and `group` outlive this object.
  ShardedModel(model::Muse& policy, const ParallelConfig& parallel, const comm::Group& group);

  bool sharded() const { return shard_ != nullptr; }  // ep > 1 or ZeRO-3
  bool whole_policy() const { return whole_; }
  model::Muse& trained() { return shard_ ? *shard_ : policy_; }
  const model::Muse& trained() const { return shard_ ? *shard_ : policy_; }
  model::Muse* shard() const { return shard_.get(); }
  Zero3* zero3() const { return zero3_.get(); }
  const model::ExpertDispatcher* experts() const { return dispatcher_.get(); }
  const comm::Group& ep_group() const { return ep_group_; }
  const comm::Group& expert_dp() const { return expert_dp_; }
  // The trained model's forward options: the expert exchange, ZeRO-3's gathers.
  void apply(model::ForwardOptions& o) const;
  // ZeRO-3's sharding of another model of the trained one's shapes (a frozen KL reference).
  std::unique_ptr<Zero3> shard_like(model::Muse& m) const;
  // `name`'s whole tensor (collective, every rank in the same order): a ZeRO-3 tensor from its
  // owner, with `experts` an expert shard gathered over the ep group; undefined when `own` is whole.
  at::Tensor whole_tensor(const std::string& name, const at::Tensor& own, bool experts) const;
  // A whole policy brought up to date from the trained shards, adapters included (collective); a
  // share is the trained model itself and needs nothing.
  void update_policy();
  // A sharded save writes each rank's tensors: a NaN one rank holds must stop every rank before
  // any writes. Collective; `what` names the save in the error.
  void check_finite(const std::string& what) const;
  // `m` (the trained model, or one sharded like it by `z`) into the checkpoint folder `out`
  // (collective). Sharded, each rank writes its own tensors (its experts by the first copy of each
  // expert shard, ZeRO-3's by their owners, the rest by rank 0) and rank 0 joins the indexes: no
  // tensor moves between ranks. Otherwise rank 0 writes it.
  void write(const model::Muse& m, const Zero3* z, const std::string& out) const;
  // The folder `dir` as one kill-safe unit (collective): every rank's `fill(tmp)` writes its part
  // into dir.tmp, then rank 0 syncs it and renames it over `dir`, so a kill leaves the old `dir`
  // or the whole new one, never half of it.
  void write_folder(const std::string& dir, const std::function<void(const std::string& tmp)>& fill) const;
  // `sub` of the checkpoint `dir` into `into` in place: each rank only the tensors it holds.
  void restore(model::Muse& into, const std::string& dir, const std::string& sub) const;

 private:
  model::Muse& policy_;
  ParallelConfig parallel_;
  comm::Group group_, ep_group_, expert_dp_;
  bool whole_ = true;
  std::unique_ptr<model::AllToAllDispatcher> dispatcher_;
  std::unique_ptr<model::Muse> shard_;
  std::unique_ptr<model::Muse> shapes_;  // the trained model's whole shapes (ZeRO-3), on the meta device
  std::unique_ptr<Zero3> zero3_;
};

}  // namespace kiln::parallel
