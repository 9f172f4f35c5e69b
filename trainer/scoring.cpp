// Trajectories packed for the trainer's forward, and their log-probs under a model.
#include "trainer/scoring.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>

namespace kiln::trainer {

Packed pack(const std::vector<Trajectory>& trajs, size_t begin, size_t end, at::Device device,
            at::ScalarType dtype) {
  Packed p;
  std::vector<std::vector<int64_t>> seqs;
  std::vector<int64_t> targets, seq_ids;
  std::vector<double> mask, loss_mask, lp, adv;
  std::vector<at::Tensor> routing;
  for (size_t i = begin; i < end; ++i) {
    const Trajectory& t = trajs[i];
    seqs.push_back(t.tokens);
    const int64_t n = int64_t(t.tokens.size());
    for (int64_t j = 0; j < n; ++j) {
      const bool response = j + 1 >= t.prompt_len && j + 1 < n &&
                            (t.sampled.empty() || t.sampled[size_t(j + 1 - t.prompt_len)] != 0);
      targets.push_back(j + 1 < n ? t.tokens[j + 1] : -100);
      mask.push_back(response ? 1.0 : 0.0);
      loss_mask.push_back(response && t.in_loss ? 1.0 : 0.0);
      lp.push_back(response ? t.rollout_lp[j + 1 - t.prompt_len] : 0.0);
      adv.push_back(t.advantage);
      seq_ids.push_back(int64_t(i - begin));
    }
    routing.push_back(t.routing);
  }
  p.batch = model::PackedBatch::from_sequences(seqs, device);
  auto opts = at::TensorOptions().dtype(dtype).device(device);
  p.targets = at::tensor(targets, at::kLong).to(device);
  p.mask = at::tensor(mask, at::kDouble).to(opts);
  p.loss_mask = at::tensor(loss_mask, at::kDouble).to(opts);
  p.seq_ids = at::tensor(seq_ids, at::kLong).to(device);
  p.rollout_lp = at::tensor(lp, at::kDouble).to(opts);
  p.advantages = at::tensor(adv, at::kDouble).to(opts);
  p.routing = at::cat(routing, 0);
  p.num_seqs = int64_t(end - begin);
  return p;
}

namespace {
// fn(packed micro-batch, forward options) for `trajs` in micro-batches of `micro_batch_seqs`, with
// the rollout's routing replayed when `replay`; no gradient.
template <typename F>
void for_each_micro_batch(const model::Muse& model, const std::vector<Trajectory>& trajs, int64_t micro_batch_seqs,
                          bool replay, const model::ForwardOptions& base, const F& fn) {
  at::NoGradGuard g;
  const size_t step = size_t(std::max<int64_t>(1, micro_batch_seqs));
  for (size_t b = 0; b < trajs.size(); b += step) {
    Packed p = pack(trajs, b, std::min(trajs.size(), b + step), model.device(), at::kDouble);
    model::ForwardOptions o = base;
    o.load_balance = false;
    if (replay) o.replay_routing = p.routing;
    fn(p, o);
  }
}
}  // namespace

SplitForward forward_split(const model::Muse& model, const Packed& p, model::ForwardOptions o,
                           const comm::Group* context) {
  SplitForward f;
  if (!context || context->size() == 1) {
    f.out = model.forward(p.batch, o);
    return f;
  }
  f.split = std::make_unique<parallel::ContextParallel>(*context, p.batch.cu_seqlens, model.config(), model.device());
  const parallel::ContextParallel& c = *f.split;
  if (o.targets.defined()) o.targets = c.local_rows(o.targets);
  if (o.replay_routing.defined()) o.replay_routing = c.local_rows(o.replay_routing);
  f.out = model.forward(c.local_batch(p.batch.tokens), f.split->options(o));
  if (f.out.logprobs.defined()) f.out.logprobs = c.gather(f.out.logprobs);
  if (f.out.routing.defined()) f.out.routing = c.gather(f.out.routing);
  return f;
}

Scored score_trajectories(const model::Muse& model, const std::vector<Trajectory>& trajs, bool replay,
                          int64_t micro_batch_seqs, double temperature, const model::ForwardOptions& base,
                          const comm::Group* context) {
  std::vector<at::Tensor> lps, routes;
  for_each_micro_batch(model, trajs, micro_batch_seqs, replay, base, [&](const Packed& p, model::ForwardOptions& o) {
    o.targets = p.targets;
    o.temperature = temperature;
    auto out = forward_split(model, p, o, context).out;
    lps.push_back(out.logprobs.to(at::kDouble));
    routes.push_back(out.routing.cpu());
  });
  return {at::cat(lps, 0), at::cat(routes, 0)};
}

at::Tensor token_entropies(const model::Muse& model, const std::vector<Trajectory>& trajs, int64_t micro_batch_seqs,
                           double temperature, const model::ForwardOptions& base) {
  std::vector<at::Tensor> out;
  for_each_micro_batch(model, trajs, micro_batch_seqs, /*replay=*/true, base,
                       [&](const Packed& p, model::ForwardOptions& o) {
    o.skip_head = true;
    const at::Tensor hidden = model.forward(p.batch, o).hidden;
    for (int64_t r = 0; r < hidden.size(0); r += 1024) {
      const at::Tensor rows = hidden.narrow(0, r, std::min<int64_t>(1024, hidden.size(0) - r));
      const at::Tensor logp = at::log_softmax(model.logits(rows).to(at::kDouble) / temperature, -1);
      out.push_back(-(logp.exp() * logp).sum(-1).cpu());
    }
  });
  return at::cat(out, 0);
}

}  // namespace kiln::trainer
