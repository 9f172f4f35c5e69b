// dp x ep (and cp) validation, bucketed gradient all-reduce, ZeRO-1 owners and the broadcast back.
#include "parallel/parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <map>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "parallel/zero3.h"

namespace kiln::parallel {

const char* dense_sharding_name(DenseSharding d) {
  switch (d) {
    case DenseSharding::kReplicated: return "replicated";
    case DenseSharding::kZero3: return "zero3";
    case DenseSharding::kTensor: return "tp";
  }
  return "?";
}

DenseSharding parse_dense_sharding(const std::string& name) {
  for (DenseSharding d : {DenseSharding::kReplicated, DenseSharding::kZero3, DenseSharding::kTensor})
    if (name == dense_sharding_name(d)) return d;
  KILN_FAIL("parallel: unknown dense sharding '", name, "'; expected replicated, zero3 or tp");
}

RolloutPlacement parse_rollout_placement(const std::string& name) {
  for (RolloutPlacement p : {RolloutPlacement::kAuto, RolloutPlacement::kReplica, RolloutPlacement::kSharded})
    if (name == rollout_placement_name(p)) return p;
  KILN_FAIL("parallel: rollout must be auto, replica or sharded (got '", name, "')");
}

const char* rollout_placement_name(RolloutPlacement p) {
  switch (p) {
    case RolloutPlacement::kAuto: return "auto";
    case RolloutPlacement::kSharded: return "sharded";
    default: return "replica";
  }
}

std::string ParallelConfig::describe() const {
  return str_cat("dp=", dp.value_or(0), " ep=", ep, cp > 1 ? str_cat(" cp=", cp) : std::string(), " tp=", tp,
                 " dense=", dense_sharding_name(dense),
                 ep > 1 ? str_cat(" rollout=", rollout_placement_name(rollout)) : std::string());
}

void ParallelConfig::resolve(int64_t world, int64_t num_experts) {
  const std::string given = str_cat("(given dp=", dp.value_or(0), ", ep=", ep, ", cp=", cp, ", tp=", tp, "; world size ", world,
                                    ", num_experts ", num_experts, ")");
  KILN_CHECK(tp == 1, "parallel: tp is reserved for later and must be 1 ", given);
  KILN_CHECK(dense != DenseSharding::kTensor, "parallel: dense tp is planned (kiln plan) but not implemented; use ",
             "replicated or zero3 ", given);
  KILN_CHECK(!sharded_rollout() || ep > 1, "parallel: rollout sharded needs ep > 1 ", given);
  KILN_CHECK(ep >= 1 && ep <= num_experts && num_experts % ep == 0,
             "parallel: ep must be at least 1, at most num_experts, and divide num_experts evenly ", given);
  KILN_CHECK(cp >= 1 && world % cp == 0, "parallel: cp must divide the world size (its groups are consecutive ranks) ",
             given);
  if (!dp) {
    KILN_CHECK(world % ep == 0, "parallel: the world size must be a multiple of ep ", given);
    dp = world / ep;
  }
  KILN_CHECK(*dp >= 1 && *dp * ep == world, "parallel: dp x ep must equal the world size ", given);
}

void all_reduce_grads(const comm::Group& group, const std::vector<at::Tensor>& params, int64_t bucket_bytes) {
  if (group.size() == 1) return;
  at::NoGradGuard no_grad;
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;  // a deterministic order on every rank
  for (const at::Tensor& p : params) {
    at::Tensor& g = p.mutable_grad();
    if (!g.defined()) g = at::zeros_like(p);
    by_dtype[g.scalar_type()].push_back(g);
  }
  for (auto& [dtype, grads] : by_dtype) {
    size_t i = 0;
    while (i < grads.size()) {
      std::vector<at::Tensor> bucket;
      int64_t bytes = 0;
      while (i < grads.size() && (bucket.empty() || bytes + int64_t(grads[i].nbytes()) <= bucket_bytes)) {
        bytes += int64_t(grads[i].nbytes());
        bucket.push_back(grads[i++]);
      }
      std::vector<at::Tensor> flat;
      for (const at::Tensor& g : bucket) flat.push_back(g.reshape(-1));
      at::Tensor buf = at::cat(flat);
      group.all_reduce(buf);
      int64_t off = 0;
      for (at::Tensor& g : bucket) {
        g.copy_(buf.narrow(0, off, g.numel()).view(g.sizes()));
        off += g.numel();
      }
    }
  }
}

OverlappedGradReducer::OverlappedGradReducer(const comm::Group& group, std::vector<at::Tensor> params,
                                             int64_t bucket_bytes)
    : group_(group), params_(std::move(params)), where_(params_.size()), seen_(params_.size(), false) {
  // Reverse order; a bucket holds one dtype and at most bucket_bytes (or one larger tensor).
  for (size_t k = params_.size(); k-- > 0;) {
    const at::Tensor& p = params_[k];
    const int64_t bytes = int64_t(p.numel()) * int64_t(p.element_size());
    if (buckets_.empty() || buckets_.back().flat.scalar_type() != p.scalar_type() ||
        (buckets_.back().flat.numel() > 0 &&
         (buckets_.back().flat.numel() * int64_t(p.element_size()) + bytes > bucket_bytes))) {
      buckets_.emplace_back();
      buckets_.back().flat = at::empty({0}, p.options());
    }
    Bucket& b = buckets_.back();
    where_[k] = {buckets_.size() - 1, b.members.size()};
    b.members.push_back(k);
    b.offsets.push_back(b.flat.numel());
    b.flat = at::empty({b.flat.numel() + p.numel()}, p.options());  // sized now, filled later
  }
}

OverlappedGradReducer::~OverlappedGradReducer() {
  if (group_.size() == 1) return;
  for (Bucket& b : buckets_) b.work.wait();  // never leave MPI writing into freed memory
  for (size_t k = 0; k < hooks_.size(); ++k) params_[k].remove_hook(hooks_[k]);
}

void OverlappedGradReducer::arm() {
  if (group_.size() == 1) return;
  KILN_CHECK(!armed_, "OverlappedGradReducer: arm() twice without finish()");
  armed_ = true;
  next_ = 0;
  started_in_backward_ = 0;
  std::fill(seen_.begin(), seen_.end(), false);
  for (Bucket& b : buckets_) b.ready = 0;
  hooks_.clear();
  for (size_t k = 0; k < params_.size(); ++k)
    hooks_.push_back(params_[k].register_hook([this, k](const at::Tensor& g) {
      on_grad(k, g);
      return at::Tensor();  // leave the gradient as it is
    }));
}

void OverlappedGradReducer::on_grad(size_t k, const at::Tensor& grad) {
  if (!armed_ || seen_[k]) return;
  seen_[k] = true;
  at::NoGradGuard no_grad;
  auto [bi, mi] = where_[k];
  Bucket& b = buckets_[bi];
  at::Tensor slot = b.flat.narrow(0, b.offsets[mi], params_[k].numel());
  const at::Tensor& earlier = params_[k].grad();  // earlier micro-batches of this step
  if (earlier.defined())
    at::add_out(slot, earlier.reshape(-1), grad.reshape(-1));
  else
    slot.copy_(grad.reshape(-1));
  ++b.ready;
  start_ready();
  started_in_backward_ = int64_t(next_);
}

void OverlappedGradReducer::start_ready() {
  while (next_ < buckets_.size() && buckets_[next_].ready == int64_t(buckets_[next_].members.size())) {
    buckets_[next_].work = group_.all_reduce_async(buckets_[next_].flat);
    ++next_;
  }
}

void OverlappedGradReducer::finish() {
  if (group_.size() == 1) return;
  KILN_CHECK(armed_, "OverlappedGradReducer: finish() without arm()");
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < hooks_.size(); ++k) params_[k].remove_hook(hooks_[k]);
  hooks_.clear();
  // Parameters that got no gradient in the last backward: their .grad so far, or zeros.
  for (size_t k = 0; k < params_.size(); ++k) {
    if (seen_[k]) continue;
    seen_[k] = true;
    auto [bi, mi] = where_[k];
    Bucket& b = buckets_[bi];
    at::Tensor slot = b.flat.narrow(0, b.offsets[mi], params_[k].numel());
    if (params_[k].grad().defined())
      slot.copy_(params_[k].grad().reshape(-1));
    else
      slot.zero_();
    ++b.ready;
  }
  start_ready();
  for (Bucket& b : buckets_) {
    b.work.wait();
    for (size_t m = 0; m < b.members.size(); ++m) {
      at::Tensor& p = params_[b.members[m]];
      at::Tensor sum = b.flat.narrow(0, b.offsets[m], p.numel()).view(p.sizes());
      if (p.grad().defined())
        p.mutable_grad().copy_(sum);
      else
        p.mutable_grad() = sum.clone();
    }
  }
  armed_ = false;
}

ZeroOne::ZeroOne(const std::vector<std::pair<std::string, at::Tensor>>& named, const std::vector<bool>& is_expert,
                 const comm::Group& all, const comm::Group& expert_copies, optimizers::OptimizerConfig cfg,
                 const Zero3* zero3) {
  kinds_[0].group = all;
  kinds_[1].group = expert_copies;
  kinds_[2].group = all;
  std::array<std::vector<size_t>, 3> index;
  for (size_t i = 0; i < named.size(); ++i) {
    const Zero3::Entry* z = zero3 ? zero3->find(named[i].second) : nullptr;
    const int k = z ? 2 : !is_expert.empty() && is_expert[i] ? 1 : 0;
    index[size_t(k)].push_back(i);
    kinds_[size_t(k)].params.push_back(named[i].second);
    if (z) kinds_[2].owners.push_back(z->owner);
  }
  std::vector<bool> mine(named.size(), false);
  for (size_t k = 0; k < 3; ++k) {
    Kind& kind = kinds_[k];
    if (k < 2) kind.owners = zero_owners(kind.params, kind.group.size());
    for (size_t j = 0; j < index[k].size(); ++j) mine[index[k][j]] = kind.owners[j] == kind.group.rank();
  }
  std::vector<std::pair<std::string, at::Tensor>> owned;
  for (size_t i = 0; i < named.size(); ++i)
    if (mine[i]) owned.push_back(named[i]);
  cfg.state_tag = "rank" + std::to_string(all.rank());  // NVMe state files of ranks sharing a directory
  if (!owned.empty()) opt_ = std::make_unique<optimizers::Optimizer>(owned, cfg);
}

void ZeroOne::all_reduce_grads() const {
  for (size_t k = 0; k < 2; ++k) parallel::all_reduce_grads(kinds_[k].group, kinds_[k].params);
}

void ZeroOne::step() {
  if (opt_) opt_->step();
  for (size_t k = 0; k < 2; ++k) broadcast_from_owners(kinds_[k].group, kinds_[k].params, kinds_[k].owners);
}

double clip_grads_expert_parallel(const std::vector<at::Tensor>& params, const std::vector<bool>& is_expert,
                                  const comm::Group& experts, double max_norm, const Zero3* zero3) {
  at::NoGradGuard no_grad;
  double replicated = 0, sharded = 0, owned = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& g = params[i].grad();
    if (!g.defined()) continue;
    const Zero3::Entry* z = zero3 ? zero3->find(params[i]) : nullptr;
    if (z && !zero3->owns(*z)) continue;
    (z ? owned : is_expert[i] ? sharded : replicated) += g.to(at::kDouble).pow(2).sum().item<double>();
  }
  double total = replicated + experts.all_reduce(sharded);
  if (zero3) total += zero3->group().all_reduce(owned);
  total = std::sqrt(total);
  const double coef = max_norm / (total + 1e-6);  // the rule of torch's clip_grad_norm_
  if (max_norm > 0 && coef < 1)
    for (const at::Tensor& p : params)
      if (p.grad().defined()) p.mutable_grad().mul_(coef);
  return total;
}

std::vector<int> zero_owners(const std::vector<at::Tensor>& params, int ranks) {
  std::vector<int64_t> numels;
  for (const at::Tensor& p : params) numels.push_back(p.numel());
  return zero_owners(numels, ranks);
}

void broadcast_from_owners(const comm::Group& group, const std::vector<at::Tensor>& params,
                           const std::vector<int>& owners) {
  if (group.size() == 1) return;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor t = params[i].detach();
    group.broadcast(t, owners[i]);
  }
}

}  // namespace kiln::parallel
