// GRPO's learner: the layout and optimizer built, lp_old scored, the policy-loss mini-steps.
#include "trainer/learner.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/types.h>  // clip_grad.h uses torch::Tensor without including it
#include <torch/nn/utils/clip_grad.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "model/checkpoint.h"
#include "model/expert_parallel.h"
#include "model/lora.h"
#include "trainer/losses.h"
#include "trainer/weight_sync.h"

namespace kiln::trainer {

Learner::Learner(model::Muse& policy, const GrpoConfig& cfg, const comm::Group& group, std::string tokenizer_files,
                 const MemoryNote& note)
    : policy_(policy), cfg_(cfg), group_(group), tokenizer_files_(std::move(tokenizer_files)) {
  guard_.limit = cfg.stop_after_nonfinite;
  cp_group_ = parallel::context_group(group, cfg.parallel.cp);
  data_group_ = cfg.parallel.cp > 1 ? group.split(int(group.rank() % cfg.parallel.cp), group.rank()) : group;
  if (lora() && model::lora_rank(policy) == 0) {
    // A share's adapters are drawn for its own experts (the same values as the whole model's).
    const parallel::PolicyShare share = parallel::policy_share(policy.config(), policy.dtype(), cfg.parallel, group);
    const at::Tensor& experts = policy.weights().layers.front().expert_gate;
    const bool expert_shard = experts.defined() && experts.dim() == 3 && experts.size(0) < policy.config().num_experts;
    model::add_lora(policy, *cfg.lora, cfg.seed,
                    expert_shard ? share.expert_rank * (policy.config().num_experts / share.expert_ranks) : 0);
  }
  layout_ = std::make_unique<parallel::ShardedModel>(policy, cfg.parallel, group);
  note("adapters and shards");  // LoRA's adapters, an expert shard's or ZeRO-3's copies
}

Learner::~Learner() = default;

void Learner::prepare_training(const MemoryNote& note) {
  // The KL reference: a frozen copy of what is trained (an expert shard under expert
  // parallelism); with LoRA the base itself, adapters disabled (no second copy).
  if (cfg_.loss.kl_coef != 0 && !lora()) reference_ = std::make_unique<model::Muse>(trained().clone());
  if (reference_) ref_zero3_ = layout_->shard_like(*reference_);
  if (reference_) note("reference");
  trained().set_requires_grad(!lora());
  const auto named = lora() ? model::lora_parameters(trained()) : trained().named_parameters();
  for (auto& [name, t] : named) t.requires_grad_(true);
  for (auto& [name, t] : named) {
    params_.push_back(t);
    is_expert_.push_back(cfg_.parallel.ep > 1 && model::is_expert_tensor(name));
  }
  optimizers::OptimizerConfig oc = cfg_.optim;
  oc.fused = cfg_.fused_kernels;
  zero_ = std::make_unique<parallel::ZeroOne>(named, is_expert_, group_, layout_->expert_dp(), oc, layout_->zero3());
  note("optimizer");
  // A cp group's backward exchanges gradients of keys and values: the overlapped reducer's
  // all-reduces would interleave with them (parallel.h), so cp reduces after the backward.
  if (!layout_->sharded() && group_.size() > 1 && cfg_.parallel.cp == 1)
    reducer_ = std::make_unique<parallel::OverlappedGradReducer>(group_, params_);
  if (reducer_) note("gradient reducer");
}

// ---- scoring ----

const parallel::Zero3* Learner::zero_of(const model::Muse& m) const {
  const model::Muse* shard = layout_->shard();
  return shard && &m == shard ? layout_->zero3() : &m == reference_.get() ? ref_zero3_.get() : nullptr;
}

model::ForwardOptions Learner::forward_options() const {
  model::ForwardOptions o;
  layout_->apply(o);  // the expert exchange, ZeRO-3's gathers
  o.numerics = cfg_.engine.numerics;  // rollout.numerics: bitwise
  o.kernel_path = cfg_.fused_kernels ? model::KernelPath::kFused : model::KernelPath::kGroupedMm;
  o.recompute = cfg_.recompute;
  o.load_balance = false;  // the GRPO loss has no balance term: its per-layer kernels would be waste
  return o;
}

// Log-probs (and own routing) of every target under `model` (the trained policy, or the frozen
// reference), micro-batched (trainer/scoring.h).
Scored Learner::score(const model::Muse& model, const std::vector<Trajectory>& trajs, bool replay,
                      bool base_only) const {
  model::ForwardOptions o = forward_options();
  o.gather = zero_of(model);
  o.disable_lora = base_only;
  return score_trajectories(model, trajs, replay, cfg_.micro_batch_seqs, cfg_.temperature, o, &cp_group_);
}

// Under batch-invariant numerics an on-policy batch's rollout log-probs are the trainer's bit
// for bit (the engine records them as the trainer computes them): lp_old is taken from them
// instead of a second forward, and the first mini-step's forward, which computes the same
// log-probs with a graph, measures the mismatch. Not for a stale batch (other weights), nor
// with mismatch_ab and replay off (the A/B needs lp_old's own routing), nor under score_lp_old,
// nor for an fp64 policy (the rollout keeps its log-probs in fp32, the trainer's are fp64).
bool Learner::lp_old_from_rollout(const StepMetrics& m) const {
  return cfg_.engine.bitwise() && m.staleness <= 0 && !(cfg_.mismatch_ab && !cfg_.routing_replay) &&
         !cfg_.score_lp_old && policy_.dtype() != at::kDouble;
}

void Learner::share_context(std::vector<Trajectory>& trajs, PromptBatch& b) const {
  if (cp_group_.size() == 1) return;
  ByteWriter w;
  w.put(int64_t(trajs.size()));
  for (const Trajectory& t : trajs) write_trajectory(w, t);
  const at::Tensor mine = w.tensor();
  const at::Tensor sizes = cp_group_.all_gather(at::tensor(std::vector<int64_t>{mine.numel(), b.first}));
  const at::Tensor all = cp_group_.all_gather_v(mine);
  std::vector<Trajectory> shared;
  int64_t at = 0;
  for (int r = 0; r < cp_group_.size(); ++r) {
    const int64_t n = sizes[2 * r].item<int64_t>();
    ByteReader rd(all.data_ptr<uint8_t>() + at, size_t(n), str_cat("the trajectories of cp rank ", r));
    const int64_t count = rd.get<int64_t>("the trajectory count");
    for (int64_t i = 0; i < count; ++i) shared.push_back(read_trajectory(rd));
    at += n;
  }
  b.first = sizes[1].item<int64_t>();  // cp rank 0's: the group's trajectories follow on from it
  trajs = std::move(shared);
}

OldLogprobs Learner::score_old(const std::vector<Trajectory>& trajs, const PromptBatch& b, StepMetrics& m) {
  OldLogprobs o;
  Packed whole = pack(trajs, 0, trajs.size(), at::kCPU, at::kDouble);
  // The mismatch metrics see every rank's tokens (gathered; a copy on one rank).
  const int64_t n = b.total * cfg_.samples_per_prompt;
  const int64_t seq_offset = b.first * cfg_.samples_per_prompt;
  m.tokens = int64_t(data_group_.all_reduce(double(whole.batch.num_tokens())));
  m.lp_old_from_rollout = o.from_rollout = lp_old_from_rollout(m);
  if (o.from_rollout) {
    o.old.logprobs = whole.rollout_lp;  // 0 off the responses; train() takes its own values there
    o.seq_offset = seq_offset;
    o.num_seqs = n;
  } else {
    o.old = score(trained(), trajs, cfg_.routing_replay);
  }
  // The whole batch's tokens, gathered where this step's metrics read them here.
  at::Tensor all_lp, all_mask, all_seq;
  if (!o.from_rollout || cfg_.mismatch_ab) {
    all_lp = data_group_.all_gather_v(whole.rollout_lp);
    all_mask = data_group_.all_gather_v(whole.mask);
    all_seq = data_group_.all_gather_v(whole.seq_ids + seq_offset);
  }
  if (!o.from_rollout)
    m.mismatch = mismatch_metrics(data_group_.all_gather_v(o.old.logprobs.cpu()), all_lp, all_mask, all_seq, n);
  if (cfg_.mismatch_ab) {
    Scored other = score(trained(), trajs, !cfg_.routing_replay);
    const Scored& no_replay = cfg_.routing_replay ? other : o.old;
    m.has_no_replay = true;
    m.mismatch_no_replay =
        mismatch_metrics(data_group_.all_gather_v(no_replay.logprobs.cpu()), all_lp, all_mask, all_seq, n);
    at::Tensor own = data_group_.all_gather_v(no_replay.routing), replayed = data_group_.all_gather_v(whole.routing);
    m.routing_disagreement = routing_disagreement(own, replayed, at::ones({own.size(0)}));
  }
  // lp_ref for the k3 KL term, with the same expert sets as lp_old.
  if (reference_) o.ref = score(*reference_, trajs, cfg_.routing_replay);
  if (lora() && cfg_.loss.kl_coef != 0) o.ref = score(trained(), trajs, cfg_.routing_replay, /*base_only=*/true);
  if (o.from_rollout) o.whole = std::move(whole);
  return o;
}

// The mismatch of an lp_old taken from the rollout: the first mini-step's log-probs `lp` (this
// rank's trajectories from `first_token`, on the CPU) against the rollout's, over every rank.
void Learner::measure_mismatch(const OldLogprobs& o, const at::Tensor& lp, int64_t first_token,
                               StepMetrics& m) const {
  const int64_t n = lp.size(0);
  auto part = [&](const at::Tensor& t) { return data_group_.all_gather_v(t.narrow(0, first_token, n)); };
  m.mismatch = mismatch_metrics(data_group_.all_gather_v(lp), part(o.whole.rollout_lp), part(o.whole.mask),
                                part(o.whole.seq_ids + o.seq_offset), o.num_seqs);
}

// ---- training ----

// One mini-step's slice: global trajectories [gb, ge), of which this rank holds [mb, me) of its
// own, and the sums the step's metrics are made of.
struct Learner::MiniStep {
  int64_t index = 0, gb = 0, ge = 0;
  size_t mb = 0, me = 0;
  const std::vector<int64_t>* token_offsets = nullptr;
  double loss_sum = 0, clip_sum = 0, kl_sum = 0, mis_sum = 0, loss_tokens = 0, norm_sum = 0;
};

void Learner::train(const std::vector<Trajectory>& trajs, const OldLogprobs& o, const PromptBatch& b, int64_t step,
                    StepMetrics& m) {
  // Mini-step ms covers global trajectories [ms*per, (ms+1)*per); this rank holds [g0, g1).
  const int64_t N = b.total * cfg_.samples_per_prompt, g0 = b.first * cfg_.samples_per_prompt,
                g1 = g0 + int64_t(trajs.size());
  const int64_t per_mini = (N + cfg_.mini_steps - 1) / cfg_.mini_steps;
  std::vector<int64_t> token_offsets = {0};
  for (const auto& t : trajs) token_offsets.push_back(token_offsets.back() + int64_t(t.tokens.size()));
  zero_->set_lr_factor(cfg_.schedule.factor(step));
  m.lr = cfg_.optim.adamw.lr * cfg_.schedule.factor(step);
  MiniStep ms;
  ms.token_offsets = &token_offsets;
  for (ms.index = 0; ms.index < cfg_.mini_steps; ++ms.index) {
    ms.gb = ms.index * per_mini, ms.ge = std::min(N, (ms.index + 1) * per_mini);
    ms.mb = size_t(std::clamp(ms.gb, g0, g1) - g0), ms.me = size_t(std::clamp(ms.ge, g0, g1) - g0);
    if (ms.gb >= ms.ge) break;
    mini_step(ms, trajs, o, step, m);
  }
  at::Tensor loss_parts = at::tensor({ms.loss_sum, ms.clip_sum, ms.kl_sum, ms.mis_sum, ms.loss_tokens}, at::kDouble);
  data_group_.all_reduce(loss_parts);  // a cp group's ranks computed the same sums
  const double in_loss = std::max(loss_parts[4].item<double>(), 1.0);
  m.loss = loss_parts[0].item<double>() / double(cfg_.mini_steps);
  m.clip_fraction = loss_parts[1].item<double>() / in_loss;
  m.kl = loss_parts[2].item<double>() / in_loss;
  m.mis_masked_fraction = loss_parts[3].item<double>() / in_loss;
  const int64_t applied = cfg_.mini_steps - m.skipped_updates;
  m.grad_norm = applied > 0 ? ms.norm_sum / double(applied) : std::nan("");
}

void Learner::mini_step(MiniStep& ms, const std::vector<Trajectory>& trajs, const OldLogprobs& o, int64_t step,
                        StepMetrics& m) {
  const std::vector<int64_t>& token_offsets = *ms.token_offsets;
  const at::Device device = policy_.device();
  // Expert parallelism and ZeRO-3 exchange tokens or gather weights in every forward: a rank
  // with fewer micro-batches in this mini-step (none, where the mini-step does not reach its
  // trajectories) runs as many empty ones, a one-token forward whose loss is multiplied by 0,
  // so that every rank runs the same collectives and the mini-steps are one rank's.
  const int64_t micro = cfg_.micro_batch_seqs, mine = (int64_t(ms.me - ms.mb) + micro - 1) / micro;
  const int64_t empty =
      layout_->sharded() ? int64_t(group_.all_reduce(double(mine), comm::ReduceOp::kMax)) - mine : 0;
  const double local_tokens =
      ms.mb < ms.me ? pack(trajs, ms.mb, ms.me, at::kCPU, at::kDouble).loss_mask.sum().item<double>() : 0.0;
  const double slice_tokens = std::max(data_group_.all_reduce(local_tokens), 1.0);
  for (at::Tensor& p : params_) p.mutable_grad().reset();
  if (ms.index == 0) m.train_start_gb = model::current_memory_gb(device);
  bool armed = false;
  std::vector<at::Tensor> first_lp;  // the first mini-step's log-probs (o.from_rollout)
  for (size_t mb0 = ms.mb; mb0 < ms.me; mb0 += size_t(micro)) {
    const size_t e = std::min(ms.me, mb0 + size_t(micro));
    if (reducer_ && e == ms.me) reducer_->arm(), armed = true;  // the last backward overlaps the reduction
    // Masks and advantages in the loss dtype (fp32 for a bf16 policy, like its log-probs).
    Packed p = pack(trajs, mb0, e, device, model::router_dtype(policy_.dtype()));
    model::ForwardOptions fo = forward_options();
    fo.targets = p.targets;
    fo.temperature = cfg_.temperature;
    if (cfg_.routing_replay) fo.replay_routing = p.routing;
    const SplitForward f = forward_split(trained(), p, fo, &cp_group_);
    const model::ForwardOutput& out = f.out;
    const int64_t t0 = token_offsets[mb0], nt = token_offsets[e] - token_offsets[mb0];
    PolicyLossInputs in;
    in.logprobs = out.logprobs;
    in.old_logprobs = o.old.logprobs.narrow(0, t0, nt).to(device, out.logprobs.scalar_type());
    if (o.from_rollout) {
      // Off the responses the rollout has no log-prob: the ratio is 1 there (masked anyway).
      in.old_logprobs = at::where(p.mask > 0, in.old_logprobs, out.logprobs.detach());
      if (ms.index == 0) first_lp.push_back(out.logprobs.detach().to(at::kCPU, at::kDouble));
    }
    in.advantages = p.advantages;
    in.mask = p.loss_mask;
    in.seq_ids = p.seq_ids;
    in.num_seqs = p.num_seqs;
    in.rollout_logprobs = p.rollout_lp;
    if (o.ref.logprobs.defined())
      in.ref_logprobs = o.ref.logprobs.narrow(0, t0, nt).to(device, out.logprobs.scalar_type());
    in.total_tokens = slice_tokens;
    in.total_seqs = double(ms.ge - ms.gb);
    auto lo = policy_loss(in, cfg_.loss);
    // Each rank of a cp group computes the whole micro-batch's loss; the gather's backward adds
    // their gradients, so each carries its share.
    (cp_group_.size() > 1 ? lo.loss / double(cp_group_.size()) : lo.loss).backward();
    ms.loss_sum += lo.loss.item<double>();
    const double tokens = p.loss_mask.sum().item<double>();  // what the fractions are over
    ms.clip_sum += lo.clip_fraction * tokens;
    ms.kl_sum += lo.kl * tokens;
    ms.mis_sum += lo.mis_masked_fraction * tokens;
    ms.loss_tokens += tokens;
  }
  for (int64_t i = 0; i < empty; ++i) {
    model::PackedBatch one = model::PackedBatch::from_sequences({{0}}, device);
    model::ForwardOptions fo = forward_options();
    fo.targets = at::zeros({1}, one.tokens.options());
    (trained().forward(one, fo).logprobs.sum() * 0.0).backward();
  }
  m.backward_peak_gb = std::max(m.backward_peak_gb, model::peak_memory_gb(device));
  model::reset_peak_memory(device);
  const double norm = reduce_and_clip(armed);
  // A non-finite global norm (the same on every rank) skips this update everywhere.
  if (guard_.admit(norm, ms.loss_sum, "grpo", step)) {
    ms.norm_sum += norm;
    zero_->step();
  } else {
    ++m.skipped_updates;
  }
  m.optimizer_peak_gb = std::max(m.optimizer_peak_gb, model::peak_memory_gb(device));
  model::reset_peak_memory(device);
  // Once every rank's exchanges and reductions of the mini-step are done, so that the gathers line up.
  if (o.from_rollout && ms.index == 0)
    measure_mismatch(o, first_lp.empty() ? at::zeros({0}, at::kDouble) : at::cat(first_lp), token_offsets[ms.mb], m);
}

// Sums the ranks' gradients, then global grad-norm clipping (an infinite bound when off still
// reports the norm); returns the norm. `armed`: the reducer was armed by this rank's last backward.
double Learner::reduce_and_clip(bool armed) {
  if (layout_->sharded()) {
    zero_->all_reduce_grads();
    return parallel::clip_grads_expert_parallel(params_, is_expert_, layout_->ep_group(), cfg_.grad_clip,
                                                layout_->zero3());
  }
  if (reducer_) {
    if (!armed) reducer_->arm();  // no trajectories here in this mini-step: still joins in
    reducer_->finish();
  } else {
    parallel::all_reduce_grads(group_, params_);  // a cp layout (a one-rank group does nothing)
  }
  return torch::nn::utils::clip_grad_norm_(params_, cfg_.grad_clip > 0 ? cfg_.grad_clip : INFINITY);
}

// ---- the rollout's weights ----

rollout::WeightSource Learner::engine_source() const {
  if (!layout_->sharded()) return {};
  return [this](const std::string& name, const at::Tensor& own) {
    return layout_->whole_tensor(name, own, !cfg_.parallel.sharded_rollout());
  };
}

// Besides LoRA's frozen base, an engine reads the trained tensors in synchronous full-parameter
// GRPO at the trained width: its rollout runs before the step changes the weights, and the
// optimizer (like a checkpoint's restore) writes them in place, so the engine, its CUDA graphs
// included, always reads the trained weights. Async rollouts need weights frozen while the trainer
// steps, a quantised engine its own codes, a sharded layout an engine filled from every rank's share.
bool Learner::engine_reads_trained() const {
  return !lora() && !layout_->sharded() && !cfg_.async &&
         cfg_.engine.quantization == rollout::Quantization::kNone;
}

int64_t Learner::push_to(rollout::Engine& engine) const {
  if (lora()) return engine.update_adapters(trained(), engine_source());
  if (engine_reads_trained()) return 0;
  return engine.update_weights(trained(), engine_source());
}

std::vector<std::pair<std::string, at::Tensor>> Learner::synced_tensors() const {
  return lora() ? model::lora_parameters(trained()) : trained().named_parameters();
}

at::Tensor Learner::own_probe_logprobs(const std::vector<int64_t>& probe, int64_t step) const {
  const at::Tensor mine = probe_logprobs(trained(), probe, dispatcher(), zero_of(trained()), cfg_.engine.numerics);
  KILN_CHECK(at::isfinite(mine).all().item<bool>(), "grpo: after step ", step,
             " the policy's own log-probs are not finite: the weights hold NaN or inf (the run diverged); lower "
             "the lr and resume from the last checkpoint");
  return mine;
}

}  // namespace kiln::trainer
