// ZeRO-3 over whole tensors: placeholders on the ranks that do not own a tensor, broadcasts from
// its owner where the forward reads it, and reductions of its gradient to the owner.
#include "parallel/zero3.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <numeric>

#include "core/error.h"

namespace kiln::parallel {
namespace {

// The per-layer tensors a layer's forward reads (its LoRA adapters and NVFP4 codes are not
// sharded and pass through gather_layer as they are).
constexpr at::Tensor model::LayerWeights::*kLayerTensors[] = {
    &model::LayerWeights::input_norm,  &model::LayerWeights::q_proj,         &model::LayerWeights::k_proj,
    &model::LayerWeights::v_proj,      &model::LayerWeights::o_proj,         &model::LayerWeights::post_attn_norm,
    &model::LayerWeights::pre_moe_norm, &model::LayerWeights::router,        &model::LayerWeights::router_bias,
    &model::LayerWeights::pooler,      &model::LayerWeights::expert_gate,    &model::LayerWeights::expert_up,
    &model::LayerWeights::expert_down, &model::LayerWeights::expert_norm,    &model::LayerWeights::unpooler,
    &model::LayerWeights::post_moe_norm};

// The backward of Zero3::gather: the gradient of the whole tensor, summed over the group on the
// owner, which alone passes it on to its tensor; the others return the placeholder's empty one.
struct ReduceToOwner : public torch::autograd::Node {
  const Zero3* zero = nullptr;
  const Zero3::Entry* entry = nullptr;

  std::string name() const override { return "kiln::parallel::ReduceToOwner"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const at::TensorOptions opts = entry->own.options();
    at::Tensor g = grads[0].defined() ? grads[0].contiguous() : at::zeros(entry->shape, opts);
    zero->group().reduce(g, entry->owner);
    return {zero->owns(*entry) ? g : at::zeros({0}, opts)};
  }
};

}  // namespace

std::vector<int> zero_owners(const std::vector<int64_t>& numels, int ranks) {
  std::vector<size_t> order(numels.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return numels[a] > numels[b]; });
  std::vector<int64_t> load(size_t(ranks), 0);
  std::vector<int> owner(numels.size(), 0);
  for (size_t i : order) {
    const int r = int(std::min_element(load.begin(), load.end()) - load.begin());
    owner[i] = r;
    load[size_t(r)] += numels[i];
  }
  return owner;
}

std::unordered_map<std::string, int> Zero3::owners(const model::Muse& whole, int ranks,
                                                   const std::function<bool(const std::string&)>& select) {
  std::vector<std::string> names;
  std::vector<int64_t> numels;
  for (const auto& [name, t] : whole.named_parameters())
    if (select(name)) names.push_back(name), numels.push_back(t.numel());
  const std::vector<int> owner = zero_owners(numels, ranks);
  std::unordered_map<std::string, int> out;
  for (size_t i = 0; i < names.size(); ++i) out[names[i]] = owner[i];
  return out;
}

Zero3::Zero3(model::Muse& m, const comm::Group& group, const std::function<bool(const std::string&)>& select,
             const model::Muse* whole)
    : group_(group) {
  const auto owner = owners(whole ? *whole : m, group_.size(), select);
  std::unordered_map<std::string, std::vector<int64_t>> shape;
  for (const auto& [name, t] : (whole ? *whole : m).named_parameters()) shape[name] = t.sizes().vec();
  // router_bias is a buffer (not in named_parameters): it stays whole on every rank.
  at::NoGradGuard no_grad;
  for (const auto& [name, t] : m.named_parameters()) {
    if (!select(name)) continue;
    KILN_CHECK(owner.count(name), "zero3: ", name, " is not in the whole model's shapes");
    KILN_CHECK(whole || t.numel() > 0, "zero3: ", name, " is empty: a model that holds placeholders needs the whole ",
               "model's shapes (model::Muse::shapes)");
    Entry e{name, shape.at(name), owner.at(name), t};
    if (owns(e)) {
      KILN_CHECK(t.sizes().vec() == e.shape, "zero3: rank ", group_.rank(), " owns ", name, " but holds it with shape ",
                 t.sizes(), ", not the whole ", at::IntArrayRef(e.shape), "; it is sharded already or was never loaded");
      KILN_CHECK(t.is_contiguous(), "zero3: ", name, " is not contiguous; its owner broadcasts its storage as it is");
    } else if (t.numel() > 0) {
      e.own.set_(at::empty({0}, e.own.options()));  // every handle of the model sees the placeholder
    }
    index_[e.own.unsafeGetTensorImpl()] = entries_.size();
    by_name_[e.name] = entries_.size();
    entries_.push_back(std::move(e));
  }
}

const Zero3::Entry* Zero3::find(const at::Tensor& own) const {
  if (!own.defined()) return nullptr;
  auto it = index_.find(own.unsafeGetTensorImpl());
  return it == index_.end() ? nullptr : &entries_[it->second];
}

const Zero3::Entry* Zero3::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

at::Tensor Zero3::whole(const Entry& e) const {
  // The owner's tensor was checked whole and contiguous when sharded; updates are in place.
  at::Tensor t = owns(e) ? e.own.detach() : at::empty(e.shape, e.own.options());
  group_.broadcast(t, e.owner);
  return t;
}

at::Tensor Zero3::gather(const at::Tensor& own) const {
  const Entry* e = find(own);
  if (!e) return own;
  at::Tensor t = whole(*e);
  if (!torch::autograd::GradMode::is_enabled() || !own.requires_grad()) return t;
  auto node = std::shared_ptr<ReduceToOwner>(new ReduceToOwner(), torch::autograd::deleteNode);
  node->zero = this;
  node->entry = e;
  node->set_next_edges(torch::autograd::collect_next_edges(own));
  torch::autograd::set_history(t, node);
  return t;
}

model::LayerWeights Zero3::gather_layer(int64_t i, const model::LayerWeights& own) const {
  model::LayerWeights w = own;
  const bool grad = torch::autograd::GradMode::is_enabled();
  for (auto m : kLayerTensors) {
    const Entry* e = find(own.*m);
    if (!e) continue;
    at::Tensor t = whole(*e);
    w.*m = grad && (own.*m).requires_grad() ? t.detach().requires_grad_(true) : t;
  }
  return w;
}

void Zero3::finish_layer(int64_t i, const model::LayerWeights& gathered, const model::LayerWeights& own) const {
  at::NoGradGuard no_grad;
  for (auto m : kLayerTensors) {
    const Entry* e = find(own.*m);
    if (!e || !(gathered.*m).requires_grad()) continue;
    const at::Tensor& leaf = gathered.*m;
    at::Tensor g = leaf.grad().defined() ? leaf.grad().contiguous() : at::zeros(e->shape, e->own.options());
    group_.reduce(g, e->owner);
    if (!owns(*e)) continue;
    at::Tensor& acc = e->own.mutable_grad();
    if (acc.defined())
      acc.add_(g);
    else
      acc = g;
  }
}

void Zero3::gather_into(model::Muse& full) const {
  at::NoGradGuard no_grad;
  std::unordered_map<std::string, at::Tensor> dst;
  for (auto& [name, t] : full.named_parameters()) dst.emplace(name, t);
  for (const Entry& e : entries_) {
    auto it = dst.find(e.name);
    KILN_CHECK(it != dst.end() && it->second.sizes().vec() == e.shape, "zero3: the whole model has no tensor ",
               e.name, " of shape ", at::IntArrayRef(e.shape));
    it->second.copy_(whole(e));
  }
}

void Zero3::take_from(const model::Muse& full) const {
  at::NoGradGuard no_grad;
  std::unordered_map<std::string, at::Tensor> src;
  for (const auto& [name, t] : full.named_parameters()) src.emplace(name, t);
  for (const Entry& e : entries_) {
    if (!owns(e)) continue;
    auto it = src.find(e.name);
    KILN_CHECK(it != src.end() && it->second.sizes().vec() == e.shape, "zero3: the whole model has no tensor ",
               e.name, " of shape ", at::IntArrayRef(e.shape));
    e.own.detach().copy_(it->second);
  }
}

}  // namespace kiln::parallel
