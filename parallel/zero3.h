// ZeRO-3 for the dense part (issue 21): every sharded tensor lives whole on one owner rank (Muon
// never sees a slice) and the other ranks keep an empty placeholder in its place. The forward
// gathers a layer at a time and the gradients go back to their owners (model::WeightGather).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/comm.h"
#include "model/muse.h"

namespace kiln::parallel {

class Zero3 : public model::WeightGather {
 public:
  // Shards the tensors of `m` that `select` picks by name over `group`: each goes whole to an owner
  // (largest first, to the least-loaded rank), and every other rank's copy is released in place
  // (its storage becomes a zero-element tensor; the handle, dtype, device and requires_grad stay).
  // `m` must outlive this object and keep its tensors (update them in place only). With `whole`
  // (the whole model's shapes, e.g. model::Muse::shapes on the meta device) `m` may already hold
  // placeholders where other ranks own (model::Muse::init_owned with owners()'s choice).
  Zero3(model::Muse& m, const comm::Group& group, const std::function<bool(const std::string&)>& select,
        const model::Muse* whole = nullptr);
  // The owner of each tensor `select` picks (by name), over `ranks` ranks, from the whole model's
  // shapes: what a Zero3 over that model chooses, known before any weight exists.
  static std::unordered_map<std::string, int> owners(const model::Muse& whole, int ranks,
                                                     const std::function<bool(const std::string&)>& select);

  struct Entry {
    std::string name;            // Muse::named_parameters name
    std::vector<int64_t> shape;  // the whole tensor's
    int owner = 0;               // rank in the group
    at::Tensor own;              // this rank's handle: the whole tensor on its owner, a placeholder elsewhere
  };
  const std::vector<Entry>& entries() const { return entries_; }
  const comm::Group& group() const { return group_; }
  // The entry of a tensor of the model (by handle, or by its Muse::named_parameters name), or
  // nullptr when it is not sharded.
  const Entry* find(const at::Tensor& own) const;
  const Entry* find(const std::string& name) const;
  bool owns(const Entry& e) const { return e.owner == group_.rank(); }

  // Every sharded tensor into the same-named tensor of `full` (a whole model: the engine's replica,
  // a checkpoint's), from its owner. Collective.
  void gather_into(model::Muse& full) const;
  // The reverse: each owner copies its tensors from `full` (a whole model read from a checkpoint).
  void take_from(const model::Muse& full) const;

  model::LayerWeights gather_layer(int64_t i, const model::LayerWeights& own) const override;
  void finish_layer(int64_t i, const model::LayerWeights& gathered, const model::LayerWeights& own) const override;
  at::Tensor gather(const at::Tensor& own) const override;
  // The whole tensor on every rank, broadcast from its owner (no graph; the owner's own storage
  // on the owner). Collective.
  at::Tensor whole(const Entry& e) const;

 private:

  comm::Group group_;
  std::vector<Entry> entries_;
  std::unordered_map<const void*, size_t> index_;  // TensorImpl -> entry
  std::unordered_map<std::string, size_t> by_name_;
};

// The rank of each tensor's owner over `ranks` ranks, by size (largest first, each to the
// least-loaded rank): ZeRO-1 and ZeRO-3 split whole tensors the same way.
std::vector<int> zero_owners(const std::vector<int64_t>& numels, int ranks);

}  // namespace kiln::parallel
