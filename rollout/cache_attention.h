// The rollout engine's attention over its paged KV cache: a model::AttentionBackend that, for the
// step the scheduler planned, reads each item's cached keys and values (full-attention layers: all
// earlier positions; window layers: the last `window`), attends with the batch's new ones, and
// writes the new ones into the cache after every read of the layer.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "model/batch_invariant.h"
#include "model/muse.h"
#include "rollout/kv_cache.h"
#include "rollout/scheduler.h"

namespace kiln::rollout {

class CacheAttention : public model::AttentionBackend {
 public:
  // Bitwise numerics: each new query attends alone over exactly its keys (model::ranged_attention),
  // as the trainer's batch-invariant forward does.
  CacheAttention(KvCache& kv, const model::ModelConfig& cfg, model::Numerics numerics = model::Numerics::kStandard);
  // Routes the step's reads and writes: every cache row in few host-to-device copies, the decode
  // items (one new token each) as one padded batch, prefill pieces one by one. `work` gives each
  // item's rows in the packed batch; its sequences' blocks are writable for the new positions.
  // `work` is read again by attend(): it must live, unchanged, until the step's forward is done.
  void plan(const std::vector<Work>& work);
  // q [T, Hq, hd], k and v [T, Hkv, hd]: the planned step's new tokens (RoPE applied).
  at::Tensor attend(int64_t layer, bool full, const model::PackedBatch& batch, const at::Tensor& q,
                    const at::Tensor& k, const at::Tensor& v) override;

 private:
  // How one kind of layer (full or window) reads and writes the cache in a step. Decode items (one
  // new token each) run as one padded batch; prefill pieces run one by one.
  struct GroupPlan {
    at::Tensor decode_read;               // cache rows the decode items read, concatenated
    model::PaddedLayout decode;           // over cat(cache rows decode_read, the batch's new K/V)
    at::Tensor decode_out;                // batch rows of the decode items' queries
    std::vector<at::Tensor> piece_read;   // per work item: cache rows a prefill piece reads
    // Batch-invariant: every item's keys in position order in one key list (its cached rows, then
    // the step's new ones, read in place), and each query's range there (model::ranged_attention).
    model::KeyRanges ranges;
    at::Tensor write_rows;                // cache rows written this step
    at::Tensor write_src;                 // batch rows whose new K/V go there
  };

  void plan_group(int g);

  // The new queries' attention over the layer's cache kl, vl and the new keys k, v.
  at::Tensor attend_batched(const GroupPlan& p, bool full, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& kl, const at::Tensor& vl) const;

  KvCache& kv_;
  int64_t W_, group_;                    // window; query heads per KV head
  bool batch_invariant_;
  const std::vector<Work>* work_ = nullptr;  // the planned step (the caller's)
  GroupPlan plan_[2];                    // [0] full-attention layers, [1] window layers
};

}  // namespace kiln::rollout
