// The trained model under a parallel layout (sharded_model.h): building the rank's trained copy
// from a whole policy or a share, fetching single tensors whole, and checkpoints by share.
#include "parallel/sharded_model.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <set>

#include "core/checkpoint_dir.h"
#include "core/error.h"
#include "core/files.h"
#include "core/safetensors.h"
#include "model/checkpoint.h"
#include "model/lora.h"

namespace kiln::parallel {
namespace {

// What ZeRO-3 shards: the dense part, and at ep 1 the experts too.
std::function<bool(const std::string&)> zero3_selection(int64_t ep) {
  return [ep](const std::string& name) { return ep == 1 || !model::is_expert_tensor(name); };
}

// Every tensor present (no placeholder) and every expert of every layer.
bool holds_whole(const model::Muse& m) {
  for (const auto& [name, t] : m.named_parameters())
    if (t.numel() == 0) return false;
  const at::Tensor& experts = m.weights().layers.front().expert_gate;
  return !experts.defined() || experts.size(0) == m.config().num_experts;
}

// A policy that is not whole must be exactly this rank's share: its expert shard, and every tensor
// the share keeps present.
void check_share(const model::Muse& m, const PolicyShare& share) {
  const int64_t E = m.config().num_experts, per = E / share.expert_ranks;
  const at::Tensor& experts = m.weights().layers.front().expert_gate;
  KILN_CHECK(!experts.defined() || experts.numel() == 0 || experts.size(0) == per, "parallel: the policy holds ",
             experts.size(0), " experts per layer, neither all ", E, " nor this rank's shard of ", per,
             " (parallel.ep=", share.expert_ranks, "); build it with parallel::policy_share");
  for (const auto& [name, t] : m.named_parameters())
    KILN_CHECK(t.numel() > 0 || (share.keep && !share.keep(name)), "parallel: the policy is a share of the model but ",
               "holds no ", name, ", which this rank keeps (expert shard ", share.expert_rank, " of ",
               share.expert_ranks, "); build it with parallel::policy_share for the recipe's parallel layout");
}

}  // namespace

PolicyShare policy_share(const model::ModelConfig& model, at::ScalarType dtype, ParallelConfig parallel,
                         const comm::Group& group) {
  parallel.resolve(group.size(), model.num_experts);
  PolicyShare s;
  s.expert_ranks = int(parallel.ep);
  s.expert_rank = int(group.rank() % parallel.ep);
  if (parallel.zero3()) {  // what Zero3 will give this rank: the same selection and owners
    const int64_t ep = parallel.ep;
    const auto owner = Zero3::owners(model::Muse::shapes(model, dtype, model.num_experts / ep), group.size(),
                                     zero3_selection(ep));
    s.keep = [owner, rank = group.rank()](const std::string& name) {
      const auto it = owner.find(name);
      return it == owner.end() || it->second == rank;
    };
  }
  return s;
}

ShardedModel::ShardedModel(model::Muse& policy, const ParallelConfig& parallel, const comm::Group& group)
    : policy_(policy), parallel_(parallel), group_(group) {
  const int64_t ep = parallel.ep;
  const bool z3 = parallel.zero3();
  const PolicyShare share = policy_share(policy.config(), policy.dtype(), parallel, group);
  whole_ = holds_whole(policy);
  if (!whole_) check_share(policy, share);
  if (ep == 1 && !z3) return;  // replicated: the policy itself trains
  const int e = int(group.rank() % ep), d = int(group.rank() / ep);
  if (ep > 1) {
    ep_group_ = group.split(d, e);
    expert_dp_ = group.split(e, d);  // its own split call: colours need not differ from ep_group's
    dispatcher_ = std::make_unique<model::AllToAllDispatcher>(ep_group_);
  }
  if (!whole_) {
    shard_ = std::make_unique<model::Muse>(policy);  // the share trains in place
  } else {
    // This rank's experts (the rest shared with `policy`); under ZeRO-3 a copy of only what this
    // rank will own, so that releasing the others leaves the whole policy as it is.
    shard_ = std::make_unique<model::Muse>(ep > 1 ? model::shard_experts(policy, e, int(ep)) : policy);
    if (z3) *shard_ = shard_->clone(share.keep);
  }
  if (z3) {
    shapes_ = std::make_unique<model::Muse>(
        model::Muse::shapes(policy.config(), policy.dtype(), policy.config().num_experts / ep));
    for (model::LayerWeights& l : shard_->weights().layers) l.nvfp4 = {};  // dense weights train and serve it
    // The dense part (at ep = 1 every tensor) whole on one rank each; LoRA's adapters stay replicated.
    zero3_ = std::make_unique<Zero3>(*shard_, group_, zero3_selection(ep), shapes_.get());
  }
}

void ShardedModel::apply(model::ForwardOptions& o) const {
  o.experts = dispatcher_.get();
  o.gather = zero3_.get();
}

std::unique_ptr<Zero3> ShardedModel::shard_like(model::Muse& m) const {
  return zero3_ ? std::make_unique<Zero3>(m, group_, zero3_selection(parallel_.ep), shapes_.get()) : nullptr;
}

at::Tensor ShardedModel::whole_tensor(const std::string& name, const at::Tensor& own, bool experts) const {
  if (zero3_)
    if (const Zero3::Entry* e = zero3_->find(name)) return zero3_->whole(*e);
  if (experts && parallel_.ep > 1 && model::is_expert_tensor(name)) return ep_group_.all_gather(own.detach());
  return {};
}

void ShardedModel::update_policy() {
  if (!shard_ || !whole_) return;
  at::NoGradGuard no_grad;
  auto f = policy_.named_parameters(), p = shard_->named_parameters();
  const auto fl = model::lora_parameters(policy_), pl = model::lora_parameters(*shard_);
  f.insert(f.end(), fl.begin(), fl.end());
  p.insert(p.end(), pl.begin(), pl.end());
  KILN_CHECK(f.size() == p.size(), "parallel: the full model and its shard hold different tensors");
  for (size_t i = 0; i < f.size(); ++i) {
    at::Tensor &full = f[i].second, &mine = p[i].second;
    if (full.is_same(mine)) continue;
    const at::Tensor w = whole_tensor(f[i].first, mine, true);
    full.copy_(w.defined() ? w : mine.detach());
  }
}

void ShardedModel::check_finite(const std::string& what) const {
  if (!shard_) return;
  at::NoGradGuard no_grad;
  double bad = 0;
  for (const auto& [name, t] : trained().named_parameters())
    if (t.numel() > 0) bad += at::isfinite(t.detach()).logical_not().sum().item<double>();
  const double all_bad = group_.all_reduce(bad);
  KILN_CHECK(all_bad == 0, "parallel: refusing to write ", what, ": the weights hold ", int64_t(all_bad),
             " NaN/inf value(s) (", int64_t(bad), " on rank ", group_.rank(),
             "); the run has diverged: resume from the last checkpoint with a lower lr");
}

void ShardedModel::write(const model::Muse& m, const Zero3* z, const std::string& out) const {
  const int64_t ep = parallel_.ep;
  const int rank = group_.rank();
  if (!shard_) {
    if (rank == 0) model::save_checkpoint(m, out);
    return;
  }
  const bool my_experts = ep > 1 ? expert_dp_.rank() == 0 : rank == 0;
  if (z) {
    const int64_t first_expert = ep > 1 ? (rank % ep) * (m.config().num_experts / ep) : 0;
    model::save_checkpoint_owned(m, out, rank, group_.size(), first_expert, [&](const std::string& name) {
      if (const Zero3::Entry* e = z->find(name)) return z->owns(*e);
      return model::is_expert_tensor(name) ? my_experts : rank == 0;  // buffers (router_bias): rank 0
    }, rank == 0);
  } else if (my_experts) {
    model::save_checkpoint_part(m, out, int(rank % ep), int(ep), rank == 0);
  }
  group_.barrier();
  if (rank == 0) safetensors::merge_checkpoint_index(out);
}

void ShardedModel::write_folder(const std::string& dir, const std::function<void(const std::string&)>& fill) const {
  const std::string tmp = dir + ".tmp";
  if (group_.rank() == 0) remove_tree(tmp);
  group_.barrier();
  fill(tmp);
  group_.barrier();
  if (group_.rank() == 0) {
    sync_tree(tmp);
    remove_tree(dir);
    std::error_code ec;
    std::filesystem::rename(tmp, dir, ec);
    KILN_CHECK(!ec, "parallel: cannot rename ", tmp, " to ", dir, " (", ec.message(), ")");
    sync_parent(dir);
  }
  group_.barrier();
}

void ShardedModel::restore(model::Muse& into, const std::string& dir, const std::string& sub) const {
  const int64_t ep = parallel_.ep;
  std::set<std::string> held;
  for (const auto& [name, t] : into.named_parameters())
    if (t.numel() > 0) held.insert(name);
  model::Muse saved = model::load_checkpoint_owned(dir + "/" + sub, into.dtype(), into.device(), int(group_.rank() % ep),
                                                   int(ep), [&](const std::string& name) { return held.count(name) > 0; });
  at::NoGradGuard g;
  auto mine = into.named_parameters(), theirs = saved.named_parameters();
  KILN_CHECK(mine.size() == theirs.size(), "parallel: checkpoint ", dir, "/", sub, " holds a different model");
  for (size_t i = 0; i < mine.size(); ++i) {
    if (!held.count(mine[i].first)) continue;
    KILN_CHECK(mine[i].second.sizes() == theirs[i].second.sizes(), "parallel: checkpoint ", dir, "/", sub, " tensor ",
               mine[i].first, " has shape ", theirs[i].second.sizes(), ", the model ", mine[i].second.sizes());
    mine[i].second.copy_(theirs[i].second);
  }
}

}  // namespace kiln::parallel
