// The GRPO step: rollout, rewards and advantages, lp_old under routing replay, mismatch metrics,
// policy-loss mini-steps with gradient accumulation and clipping, and weight sync to the engine.
#include "trainer/grpo.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/types.h>  // clip_grad.h uses torch::Tensor without including it
#include <torch/nn/utils/clip_grad.h>
#include <torch/serialize.h>
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <optional>

#include "core/checkpoint_dir.h"
#include "core/error.h"
#include "core/files.h"
#include "core/safetensors.h"
#include "parallel/zero3.h"
#include "model/checkpoint.h"
#include "model/expert_parallel.h"
#include "text/tokenizer.h"
#include "trainer/episodes.h"
#include "trainer/produced.h"
#include "trainer/rollout_link.h"
#include "trainer/scoring.h"
#include "trainer/update_guard.h"

namespace kiln::trainer {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Every rank's string, in rank order (collective).
std::vector<std::string> gather_strings(const comm::Group& g, const std::string& mine) {
  at::Tensor bytes = at::empty({int64_t(mine.size())}, at::kByte);
  if (!mine.empty()) std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  at::Tensor sizes = g.all_gather(at::tensor({int64_t(mine.size())}, at::kLong));
  at::Tensor all = g.all_gather_v(bytes);
  std::vector<std::string> out;
  int64_t at = 0;
  for (int64_t r = 0; r < sizes.numel(); ++r) {
    const int64_t n = sizes[r].item<int64_t>();
    out.emplace_back(reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + at, size_t(n));
    at += n;
  }
  return out;
}

// A sample is correct when its "correct" component, or without one its reward, is at least 0.5.
bool is_correct(const RewardResult& r) {
  for (const auto& [name, v] : r.components)
    if (name == "correct") return v >= 0.5;
  return r.reward >= 0.5;
}

// Sums under names that may differ between ranks (reward components, data sources): each rank's
// map, added up key by key over every rank (collective).
using KeyedSums = std::map<std::string, std::vector<double>>;
KeyedSums all_reduce_keyed(const comm::Group& g, const KeyedSums& mine) {
  KeyedSums all;
  for (const std::string& part : gather_strings(g, nlohmann::json(mine).dump()))
    for (const auto& [key, v] : nlohmann::json::parse(part).get<KeyedSums>()) {
      std::vector<double>& into = all[key];
      into.resize(std::max(into.size(), v.size()));
      for (size_t i = 0; i < v.size(); ++i) into[i] += v[i];
    }
  return all;
}

// Per-token data of every rank, for the global mismatch metrics.
struct Gathered {
  at::Tensor rollout_lp, mask, seq_ids;
  int64_t num_seqs = 0;
};

}  // namespace

struct GrpoTrainer::Impl {
  model::Muse& policy;
  GrpoConfig cfg;
  std::shared_ptr<const text::Tokenizer> tok;
  std::shared_ptr<Reward> reward;
  std::unique_ptr<Environment> env;  // multi-turn (grpo.environment); null: single-turn
  PrepareReport train_report, test_report;  // before `data`: prepared() fills them
  Dataset data;                    // prompts rendered and tokenized
  DataStream stream;
  std::unique_ptr<rollout::Engine> engine;  // serves `policy` (a full replica) or, sharded, `*shard`
  comm::Group group;               // every rank that trains: each holds its own share of the prompts
  // grpo.async.placement split: the link to the partner rank (rollout_link.h), and whether this
  // rank is the one that rolls out (it then has an engine but no optimizer).
  std::optional<RolloutLink> link;
  bool rollout_side = false;
  // The trained model under the layout (parallel/sharded_model.h), and short names for its parts:
  std::unique_ptr<parallel::ShardedModel> layout;
  comm::Group ep_group;            // ep > 1: the ranks whose expert shards make up one model
  comm::Group expert_dp;           // ep > 1: the ranks holding the same expert shard
  const model::ExpertDispatcher* dispatcher = nullptr;  // ep > 1: the trained model's expert exchange
  model::Muse* shard = nullptr;    // ep > 1 or ZeRO-3: the trained model (else `policy` trains)
  parallel::Zero3* zero3 = nullptr;    // parallel.dense zero3: the sharding of `shard`
  std::unique_ptr<parallel::Zero3> ref_zero3;  // ... and of `reference`
  std::vector<at::Tensor> params;  // all trained tensors: clipping, the gradient all-reduce, the broadcast
  std::vector<bool> is_expert;     // ep > 1: params[i] is an expert shard (not ZeRO-3's)
  std::unique_ptr<parallel::ZeroOne> zero;   // the optimizer, over the tensors this rank owns
  std::unique_ptr<parallel::OverlappedGradReducer> reducer;  // data parallel without expert shards
  std::unique_ptr<model::Muse> reference;  // frozen copy of the starting policy, when kl_coef != 0
  std::vector<SampleRecord> last;  // the last step's samples (this rank's), for sample dumps
  int64_t steps = 0;
  UpdateGuard guard;               // skips updates with a non-finite gradient norm
  std::vector<std::pair<std::string, double>> built_memory;  // GrpoTrainer::construction_memory
  // Records the memory allocated now, after the part `what` (CUDA only).
  void note_memory(const char* what) {
    if (policy.device().is_cuda()) built_memory.emplace_back(what, model::current_memory_gb(policy.device()));
  }

  Impl(model::Muse& p, GrpoConfig c, std::shared_ptr<const text::Tokenizer> t, Dataset d, const comm::Group& g,
       std::shared_ptr<Reward> r)
      : policy(p), cfg(std::move(c)), tok(std::move(t)), reward(std::move(r)), data(prepared(std::move(d))),
        stream(data.train, cfg.seed), group(role_group(g, cfg)) {
    cfg.validate();
    KILN_CHECK(!cfg.async_split || (cfg.parallel.ep == 1 && !cfg.parallel.zero3()), "grpo: async.placement split ",
               "sends whole weights from each trainer rank to its rollout rank, so every trainer must hold the whole ",
               "model: use parallel.ep 1 and dense replicated (got ep ", cfg.parallel.ep, ", dense ",
               parallel::dense_sharding_name(cfg.parallel.dense), ")");
    if (cfg.async_split) {
      const int T = g.size() / 2;
      rollout_side = g.rank() >= T;
      link.emplace(g, rollout_side ? g.rank() - T : g.rank() + T, !rollout_side);
    }
    guard.limit = cfg.stop_after_nonfinite;
    cfg.parallel.resolve(group.size(), policy.config().num_experts);
    KILN_CHECK(cfg.prompts_per_step >= group.size(), "grpo: prompts_per_step (", cfg.prompts_per_step,
               ") must be at least the number of ranks (", group.size(), "): a prompt's group stays on one rank");
    KILN_CHECK(!cfg.dynamic_sampling || (cfg.parallel.ep == 1 && !cfg.parallel.zero3()), "grpo: dynamic_sampling keeps ",
               "unequal numbers of groups per rank, which expert parallelism (parallel.ep=", cfg.parallel.ep,
               ") and ZeRO-3 (parallel.dense: ", parallel::dense_sharding_name(cfg.parallel.dense), ") cannot train yet; use ep 1 ",
               "and dense replicated");
    KILN_CHECK(tok->vocab_size() <= policy.config().vocab_size, "grpo: the tokenizer ", tok->name(), " has ",
               tok->vocab_size(), " ids but the model's vocab_size is ", policy.config().vocab_size,
               "; use a model config whose vocabulary covers the tokenizer");
    if (!reward) reward = make_reward(cfg.reward);
    KILN_CHECK(cfg.async_staleness < 0 || !cfg.parallel.sharded_rollout(), "grpo: async rollouts need a rollout that ",
               "serves the whole model on each rank (the expert-sharded one steps in lockstep with the trainer's ",
               "collectives); set parallel.rollout: replica");
    if (cfg.environment.enabled()) {
      KILN_CHECK(!cfg.parallel.sharded_rollout(), "grpo: multi-turn episodes (environment) need a rollout that serves ",
                 "the whole model on each rank, not the expert-sharded one (its ranks step in lockstep, episodes do ",
                 "not); set parallel.rollout: replica");
      env = std::make_unique<Environment>(cfg.environment);
      const int64_t longest = cfg.prompt.max_prompt_tokens + cfg.environment.max_episode_tokens;
      KILN_CHECK(cfg.prompt.max_prompt_tokens <= 0 || longest <= policy.config().max_position_embeddings,
                 "grpo: an episode may reach prompt.max_prompt_tokens + environment.max_episode_tokens = ", longest,
                 " tokens, beyond the model's max_position_embeddings (", policy.config().max_position_embeddings,
                 "); lower either");
    }
    const int64_t ep = cfg.parallel.ep;
    note_memory("policy");
    if (cfg.lora.enabled() && model::lora_rank(policy) == 0) {
      // A share's adapters are drawn for its own experts (the same values as the whole model's).
      const PolicyShare share = policy_share(policy.config(), policy.dtype(), cfg.parallel, group);
      const at::Tensor& experts = policy.weights().layers.front().expert_gate;
      const bool expert_shard = experts.defined() && experts.dim() == 3 && experts.size(0) < policy.config().num_experts;
      model::add_lora(policy, cfg.lora, cfg.seed,
                      expert_shard ? share.expert_rank * (policy.config().num_experts / share.expert_ranks) : 0);
    }
    if (ep > 1 || cfg.parallel.zero3())
      KILN_CHECK(cfg.prompts_per_step % group.size() == 0, "grpo: expert parallel and ZeRO-3 need prompts_per_step (",
                 cfg.prompts_per_step, ") divisible by the ranks (", group.size(),
                 "): every rank must run the same number of forwards, which exchange tokens or gather weights");
    layout = std::make_unique<parallel::ShardedModel>(policy, cfg.parallel, group);
    note_memory("adapters and shards");  // LoRA's adapters, an expert shard's or ZeRO-3's copies
    shard = layout->shard();
    zero3 = layout->zero3();
    dispatcher = layout->experts();
    ep_group = layout->ep_group();
    expert_dp = layout->expert_dp();
    rollout::EngineConfig ec = cfg.engine;
    if (cfg.parallel.sharded_rollout()) ec.expert_group = &ep_group;  // serves this rank's experts
    ec.share_weights = (lora() && !shard) || engine_serves_trained();
    // The engine's weights, fetched tensor by tensor where this rank holds a share. Under the split
    // placement only the rollout ranks have one, and nothing else: they do not train.
    if (rollout_side) {
      build_rollout_engine(ec);
      note_memory("engine");
      return;
    }
    if (!cfg.async_split) engine = std::make_unique<rollout::Engine>(trained(), ec, engine_source());
    note_memory("engine");
    // The KL reference: a frozen copy of what is trained (an expert shard under expert
    // parallelism); with LoRA the base itself, adapters disabled (no second copy).
    if (cfg.loss.kl_coef != 0 && !lora()) reference = std::make_unique<model::Muse>(trained().clone());
    if (reference) ref_zero3 = layout->shard_like(*reference);
    if (reference) note_memory("reference");
    trained().set_requires_grad(!lora());
    const auto named = lora() ? model::lora_parameters(trained()) : trained().named_parameters();
    for (auto& [name, t] : named) t.requires_grad_(true);
    for (auto& [name, t] : named) {
      params.push_back(t);
      is_expert.push_back(ep > 1 && model::is_expert_tensor(name));
    }
    optimizers::OptimizerConfig oc = cfg.optim;
    oc.fused = cfg.fused_kernels;
    zero = std::make_unique<parallel::ZeroOne>(named, is_expert, group, expert_dp, oc, zero3);
    note_memory("optimizer");
    if (!shard && group.size() > 1) reducer = std::make_unique<parallel::OverlappedGradReducer>(group, params);
    if (reducer) note_memory("gradient reducer");
  }

  // A split rollout rank's engine, which holds the only copy of the weights: the policy becomes
  // zero-element placeholders (which weight syncs name but never fill), and the engine, built from
  // them, takes each weight from the old policy, which lets it go at once. So no more than one
  // copy and one tensor are ever held. LoRA's engine shares the frozen base instead.
  void build_rollout_engine(const rollout::EngineConfig& ec) {
    if (lora()) {
      engine = std::make_unique<rollout::Engine>(policy, ec);
      return;
    }
    std::map<std::string, at::Tensor> left;  // the last handles of the old policy's weights
    {
      const model::Muse whole = std::move(policy);
      policy = whole.clone([](const std::string&) { return false; });
      for (const auto& [name, t] : whole.named_parameters()) left.emplace(name, t);
    }
    const rollout::WeightSource hand_over = [&](const std::string& name, const at::Tensor&) {
      const auto it = left.find(name);
      KILN_CHECK(it != left.end(), "grpo: the rollout engine asked for ", name, ", which the policy does not hold");
      at::Tensor w = std::move(it->second);  // freed once the engine has its copy
      left.erase(it);
      return w;
    };
    engine = std::make_unique<rollout::Engine>(policy, ec, hand_over);
  }

  // Whether the engine serves the trained tensors themselves (no copy, nothing to sync), besides
  // LoRA's frozen base: synchronous full-parameter GRPO at the trained width. Its rollout runs
  // before the step changes the weights, and the optimizer (like a checkpoint's restore) writes
  // them in place, so the engine, its CUDA graphs included, always reads the trained weights.
  // Async rollouts need weights frozen while the trainer steps, a quantised engine its own codes,
  // a sharded layout an engine filled from every rank's share.
  bool engine_serves_trained() const {
    return !lora() && !shard && cfg.async_staleness < 0 && !cfg.async_split &&
           cfg.engine.quantization == rollout::Quantization::kNone;
  }

  // Under grpo.async.placement split, the half of `g` this rank is in (trainers first); else `g`.
  static comm::Group role_group(const comm::Group& g, const GrpoConfig& c) {
    if (!c.async_split) return g;
    KILN_CHECK(g.size() >= 2 && g.size() % 2 == 0, "grpo: async.placement split needs an even number of ranks, the ",
               "first half to train and the second to roll out (got ", g.size(), ")");
    return g.split(g.rank() < g.size() / 2 ? 0 : 1, g.rank());
  }

  // The dataset with its prompts rendered and tokenized (config.prompt); the reports say how many
  // were too long.
  Dataset prepared(Dataset d) {
    KILN_CHECK(tok, "grpo: no tokenizer given");
    train_report = prepare_prompts(d.train, *tok, cfg.prompt);
    test_report = prepare_prompts(d.test, *tok, cfg.prompt);
    KILN_CHECK(!d.train.empty(), "grpo: no training prompt is left after the length filter (", train_report.too_long,
               " longer than prompt.max_prompt_tokens=", cfg.prompt.max_prompt_tokens, "); raise the limit");
    return d;
  }

  // Log-probs (and own routing) of every target under `model` (the current policy, or the frozen
  // reference), micro-batched (trainer/scoring.h).
  model::Muse& trained() { return shard ? *shard : policy; }
  const model::Muse& trained() const { return shard ? *shard : policy; }
  // Where the engine gets what this rank holds only in part (rollout::WeightSource): ZeRO-3's
  // tensors from their owners, and for a replica every rank's experts. None without sharding.
  rollout::WeightSource engine_source() const {
    if (!shard) return {};
    return [this](const std::string& name, const at::Tensor& own) {
      return layout->whole_tensor(name, own, !cfg.parallel.sharded_rollout());
    };
  }
  // The ZeRO-3 sharding of the trained model or of the KL reference; null for any other model.
  const parallel::Zero3* zero_of(const model::Muse& m) const {
    return shard && &m == shard ? zero3 : &m == reference.get() ? ref_zero3.get() : nullptr;
  }
  bool lora() const { return cfg.lora.enabled(); }
  // Forward options of the trained model: the expert exchange under expert parallelism.
  model::ForwardOptions forward_options() const {
    model::ForwardOptions o;
    layout->apply(o);  // the expert exchange, ZeRO-3's gathers
    o.batch_invariant = cfg.engine.batch_invariant;  // rollout.numerics: bitwise
    o.use_fused = cfg.fused_kernels;
    o.recompute = cfg.recompute;
    o.load_balance = false;  // the GRPO loss has no balance term: its per-layer kernels would be waste
    return o;
  }
  Scored score(const std::vector<Trajectory>& trajs, bool replay) { return score(trained(), trajs, replay); }
  Scored score(const model::Muse& model, const std::vector<Trajectory>& trajs, bool replay, bool base_only = false) {
    model::ForwardOptions o = forward_options();
    o.gather = zero_of(model);
    o.disable_lora = base_only;
    return score_trajectories(model, trajs, replay, cfg.micro_batch_seqs, cfg.temperature, o);
  }

  // ---- the step, phase by phase ----

  // Refuses `what` on a rollout rank of async.placement split, which only serves rollouts.
  void trainer_only(const char* what) const {
    KILN_CHECK(!rollout_side, "grpo: this rank rolls out for trainer rank ", link ? link->peer() : -1,
               " (async.placement split); it serves rollouts and does not ", what);
  }

  StepMetrics step() {
    trainer_only("take steps");
    const auto t_step = Clock::now();
    const at::Device device = policy.device();
    // The peak of the phase that just ended, and a fresh count for the next.
    const auto phase_peak = [&] {
      const double gb = model::peak_memory_gb(device);
      model::reset_peak_memory(device);
      return gb;
    };
    model::reset_peak_memory(device);
    StepMetrics m;
    m.step = ++steps;
    Produced produced = cfg.async_staleness >= 0 ? take_produced(m) : produce(draw_prompts(steps), 0);
    Batch b = produced.batch;
    std::vector<Trajectory> trajs = finish_rewards(std::move(produced), m);
    if (cfg.dynamic_sampling) b = keep_informative_groups(trajs, m);
    m.rollout_peak_gb = phase_peak();
    auto t = Clock::now();
    OldLogprobs old = score_old(trajs, b, m);
    m.lp_old_seconds = seconds_since(t);
    m.lp_old_peak_gb = phase_peak();
    t = Clock::now();
    train(trajs, old, b, m);
    m.train_seconds = seconds_since(t);
    m.train_peak_gb = std::max({phase_peak(), m.backward_peak_gb, m.optimizer_peak_gb});  // train() reset the count
    sync_rollout(m);
    m.sync_peak_gb = phase_peak();
    m.step_seconds = seconds_since(t_step);
    m.tokens_per_second = double(m.tokens) / std::max(m.step_seconds, 1e-9);
    m.peak_memory_gb = std::max({m.rollout_peak_gb, m.lp_old_peak_gb, m.train_peak_gb, m.sync_peak_gb});
    m.memory_after_gb = model::current_memory_gb(device);
    return m;
  }

  // This step's prompts (trainer/produced.h).
  using Batch = PromptBatch;
  Batch draw_prompts(int64_t step) {
    std::vector<Example> all = stream.next(cfg.prompts_per_step);
    const int64_t P = int64_t(all.size()), R = group.size();
    const int64_t p0 = P * group.rank() / R, p1 = P * (group.rank() + 1) / R;
    return {std::vector<Example>(all.begin() + p0, all.begin() + p1), P, p0, step};
  }

  // Dynamic sampling: drops the flat groups of `trajs` (this rank's, group by group) and samples
  // more rounds until prompts_per_step groups are kept over all ranks or the rounds run out; then
  // trims to prompts_per_step in rank order (each rank keeping at least one group, flat if need
  // be, so that every rank trains). Returns the batch the kept trajectories form.
  Batch keep_informative_groups(std::vector<Trajectory>& trajs, StepMetrics& m) {
    const size_t n = size_t(cfg.samples_per_prompt);
    std::vector<Trajectory> kept, fallback;
    int64_t dropped = 0;
    auto take = [&](std::vector<Trajectory>& round) {
      for (size_t g = 0; g * n < round.size(); ++g) {
        const auto first_t = round.begin() + std::ptrdiff_t(g * n), end = first_t + std::ptrdiff_t(n);
        const bool flat = std::all_of(first_t, end, [&](const Trajectory& t) { return t.reward == first_t->reward; });
        if (flat && fallback.empty()) fallback.assign(first_t, end);
        if (flat) ++dropped;
        else kept.insert(kept.end(), std::make_move_iterator(first_t), std::make_move_iterator(end));
      }
    };
    take(trajs);
    int64_t rounds = 1;
    while (int64_t(group.all_reduce(double(kept.size() / n))) < cfg.prompts_per_step &&
           rounds <= cfg.max_sampling_rounds) {
      Batch more = draw_prompts(steps);
      StepMetrics scratch;  // the reward metrics and the sample dump stay the first round's
      auto dump = std::move(last);
      std::vector<Trajectory> round = finish_rewards(produce(more, rounds), scratch);
      last = std::move(dump);
      take(round);
      ++rounds;
    }
    // Each rank's share, in rank order of what each kept, from one gather of the counts. One group
    // at least per rank: a rank without trajectories would leave the others waiting in the step's
    // collectives. So a batch may pass prompts_per_step by up to the number of ranks less one.
    const at::Tensor counts = group.all_gather(at::tensor(std::vector<int64_t>{int64_t(kept.size() / n)}));
    Batch b;
    for (int64_t r = 0, before = 0; r < group.size(); ++r) {
      const int64_t had = counts[r].item<int64_t>(), keeps = std::max<int64_t>(1, std::min(had, cfg.prompts_per_step - before));
      if (r == group.rank()) {
        b.first = b.total;
        if (had > keeps) kept.resize(size_t(keeps) * n);
        if (kept.empty()) {
          kept = std::move(fallback);
          --dropped;
        }
      }
      b.total += keeps;
      before += had;
    }
    trajs = std::move(kept);
    m.sampling_rounds = rounds;
    m.groups_trained = b.total;
    m.groups_dropped = int64_t(group.all_reduce(double(dropped)));
    return b;
  }

  // A batch rolled out and scored on this rank alone (trainer/produced.h).
  using Produced = ProducedBatch;

  Produced produce(const Batch& b, int64_t round) {
    const rollout::EngineStats before = engine->stats();
    engine->reset_peaks();  // this batch's peak, not the run's (evaluation included)
    Produced p = produce_rollout(b, round);
    const rollout::EngineStats after = engine->stats();
    p.preemptions = after.preemptions - before.preemptions;
    p.expert_overflow_steps = after.expert_overflow_steps - before.expert_overflow_steps;
    auto fraction = [](int64_t used, int64_t total) { return total > 0 ? double(used) / double(total) : 0.0; };
    p.kv_peak = std::max(fraction(after.peak_full_blocks, after.full_blocks_total),
                         fraction(after.peak_window_blocks, after.window_blocks_total));
    return p;
  }

  Produced produce_rollout(const Batch& b, int64_t round) {
    Produced p;
    p.batch = b;
    p.version = weight_version();
    auto t = Clock::now();
    if (env) {
      std::vector<const Example*> examples;
      for (const Example& ex : b.prompts) examples.push_back(&ex);
      const RewardStats before = env->stats();
      const auto eps = run_episodes(*engine, *env, *tok, examples, requests_for(b, round));
      p.rollout_seconds = seconds_since(t);
      t = Clock::now();
      collect_episodes(b, eps, p);
      p.worker = env->stats() - before;
      p.reward_seconds = seconds_since(t);
      return p;
    }
    auto outs = engine->generate(requests_for(b, round));
    p.rollout_seconds = seconds_since(t);
    t = Clock::now();
    score_samples(b, outs, p);
    p.reward_seconds = seconds_since(t);
    return p;
  }

  // ---- grpo.async: the producer thread ----
  // Batch i (the step it trains in) is sampled with the weights of update v(i) = max(0, i - 1 - k):
  // the producer waits for that version, and the trainer applies update t only once batch t + k,
  // the last that needs the version before it, is out. So staleness is exactly min(i - 1, k)
  // whatever the timing, at most k batches wait, and nothing the producer does is collective.
  struct Async {
    std::thread thread;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Produced> ready;
    int64_t produced = 0;  // batches made: 1 .. produced
    bool producing = false, stopping = false;
    std::exception_ptr error;
  } async;

  int64_t version_for(int64_t i) const { return std::max<int64_t>(0, i - 1 - cfg.async_staleness); }
  int64_t last_step = 0;  // set_last_step: the producer makes no batch past it (0: unknown)
  // The batches the sync of `step` waits for: through step + k, and none past the last step.
  int64_t needed_for(int64_t step) const {
    const int64_t made = step + std::max<int64_t>(0, cfg.async_staleness);
    return last_step > 0 ? std::min(made, last_step) : made;
  }
  // The update the engine's weights come from: its own count of updates, from where load() left it.
  int64_t version_base = 0;
  int64_t weight_version() const { return engine->weight_version() + version_base; }

  void produce_loop() {
    try {
      produce_batches();
    } catch (...) {  // nothing may leave a thread: the trainer rethrows it
      std::lock_guard<std::mutex> lk(async.mu);
      async.producing = false;
      async.error = std::current_exception();
    }
    async.cv.notify_all();
  }

  void produce_batches() {
    at::NoGradGuard no_grad;  // grad mode is per thread
#if KILN_WITH_CUDA
    // Its own stream, so that the rollout's kernels overlap the trainer's; a high-priority one: the
    // rollout's small decode kernels go ahead of the trainer's queued GEMM blocks, since the step
    // waits for the slower side and on one GPU that has been the rollout (docs/PERFORMANCE.md).
    std::optional<c10::cuda::CUDAStreamGuard> stream_guard;
    if (policy.device().is_cuda()) stream_guard.emplace(c10::cuda::getStreamFromPool(true, policy.device().index()));
#endif
    for (;;) {
      int64_t i = 0;
      const auto waiting = Clock::now();
      {
        std::unique_lock<std::mutex> lk(async.mu);
        async.cv.wait(lk, [&] {
          i = async.produced + 1;
          return async.stopping || ((last_step <= 0 || i <= last_step) && weight_version() >= version_for(i));
        });
        if (async.stopping) return;
        async.producing = true;
      }
      const double waited = seconds_since(waiting);
      Produced p = produce_next(i);
      p.wait_seconds = waited;
      {
        std::lock_guard<std::mutex> lk(async.mu);
        async.producing = false;
        async.ready.push_back(std::move(p));
        ++async.produced;
      }
      async.cv.notify_all();
    }
  }

  // Batch i, the next of the data stream, with the position it was drawn at.
  Produced produce_next(int64_t i) {
    const uint64_t position = stream.position();
    Produced p = produce(draw_prompts(i), 0);
    p.data_position = position;
    return p;
  }

  // The batch of this step, from the producer thread (started on first use; what stopped it is
  // rethrown) or from the rollout rank.
  Produced take_produced(StepMetrics& m) {
    const auto t = Clock::now();
    Produced p = link ? take_from_rollout_rank() : take_from_thread();
    m.async_wait_seconds = seconds_since(t);
    if (link) m.sync_check = p.sync_check;  // the check of the weights that sampled it
    m.staleness = (steps - 1) - p.version;
    // min(steps - 1, k) exactly, but fresher right after a resume (the loaded weights are all there is).
    KILN_CHECK(p.batch.step == steps && m.staleness >= 0 && m.staleness <= cfg.async_staleness,
               "grpo: internal error: step ", steps, " got batch ", p.batch.step, " of weight version ", p.version,
               " (max_staleness ", cfg.async_staleness, "); report this");
    return p;
  }

  Produced take_from_thread() {
    if (!async.thread.joinable()) {
      async.produced = steps - 1;  // the batches of the steps already trained
      async.thread = std::thread([this] { produce_loop(); });
    }
    std::unique_lock<std::mutex> lk(async.mu);
    async.cv.wait(lk, [&] { return !async.ready.empty() || async.error; });
    if (async.ready.empty()) std::rethrow_exception(async.error);
    Produced p = std::move(async.ready.front());
    async.ready.pop_front();
    return p;
  }

  // Runs fn while the producer is between batches and, when `made` > 0, once it has made that many
  // (the weight sync of update t waits for batch t + k). Without async, just fn.
  // A producer that failed is idle for good: fn runs anyway, and take_produced reports the error at
  // the step that needs its batch, as the synchronous step would.
  template <typename F>
  void with_producer_paused(int64_t made, const F& fn) {
    if (!async.thread.joinable()) return fn();
    std::unique_lock<std::mutex> lk(async.mu);
    async.cv.wait(lk, [&] { return async.error || (!async.producing && async.produced >= made); });
    struct Wake {  // the producer re-checks its condition however fn ends
      std::condition_variable& cv;
      ~Wake() { cv.notify_all(); }
    } wake{async.cv};
#if KILN_WITH_CUDA
    if (policy.device().is_cuda()) c10::cuda::device_synchronize();  // the producer's stream is done
#endif
    fn();
  }

  // Where a resumed run draws its next prompts: under grpo.async, before the oldest batch made but
  // not trained (it is sampled again after a resume), or where the producer will draw next.
  uint64_t data_position() {
    if (link) return split.ready.empty() ? stream.position() : split.ready.front().data_position;
    uint64_t position = 0;
    with_producer_paused(0, [&] {
      if (!async.ready.empty()) position = async.ready.front().data_position;
      else position = stream.position();
    });
    return position;
  }

  void stop_producer() {
    if (!async.thread.joinable()) return;
    {
      std::lock_guard<std::mutex> lk(async.mu);
      async.stopping = true;
    }
    async.cv.notify_all();
    async.thread.join();
    async.thread = std::thread();
    async.ready.clear();
    async.producing = async.stopping = false;
    async.error = nullptr;
  }

  ~Impl() {
    stop_producer();
    if (link && !rollout_side) close_link();
  }

  // ---- grpo.async.placement split: the trainer's end ----
  // The rollout rank runs the producer's schedule with what it was sent: batch i once it has the
  // weights of update v(i) and i is not past the last step it knows. The trainer knows what it sent,
  // so it knows every batch the rollout rank will make, and it receives them all before it sends
  // anything (drain): a rank never sends to one that is itself sending, which could block both.
  struct Split {
    bool started = false;
    // The rollout rank returned after an error (rollout_failed), or an exchange was cut short by
    // one: no further message may go either way.
    bool peer_gone = false, mid_exchange = false;
    bool broken() const { return peer_gone || mid_exchange; }
    int64_t received = 0;      // batches received: 1 .. received
    int64_t sent_version = 0;  // the weights the rollout rank has
    int64_t sent_last = 0;     // the last step it knows of (0: none)
    std::deque<Produced> ready;
  } split;

  // Marks a send or receive under way; an exception that leaves one leaves the link unusable.
  struct Exchange {
    Split& s;
    explicit Exchange(Split& split) : s(split) { s.mid_exchange = true; }
    void done() { s.mid_exchange = false; }
  };

  bool rollout_can_make(int64_t i) const {
    return (split.sent_last <= 0 || i <= split.sent_last) && split.sent_version >= version_for(i);
  }
  void drain() {
    while (rollout_can_make(split.received + 1)) receive_batch();
  }
  // The rollout rank's error, as this rank's.
  [[noreturn]] void rollout_failed(const RolloutLink::Message& msg) {
    split.peer_gone = true;
    ByteReader r = msg.body("the error from the rollout rank");
    KILN_FAIL("grpo: rollout rank ", link->peer(), " (async.placement split) stopped: ", r.get_string("the error"));
  }
  void receive_batch() {
    Exchange x(split);  // done once the batch is read: a batch that cannot be read leaves the link unused
    const RolloutLink::Message msg = link->recv();
    if (msg.kind == LinkKind::kError) rollout_failed(msg);
    KILN_CHECK(msg.kind == LinkKind::kBatch, "grpo: rollout rank ", link->peer(), " sent ", link_kind_name(msg.kind),
               " where batch ", split.received + 1, " was due; report this");
    ByteReader r = msg.body(str_cat("batch ", split.received + 1, " from rank ", link->peer()));
    Produced p = read_produced(r);
    r.expect_end();
    const int64_t i = ++split.received;
    KILN_CHECK(p.batch.step == i && p.data_position == stream.position(), "grpo: internal error: rollout rank ",
               link->peer(), " sent the batch of step ", p.batch.step, " from data position ", p.data_position,
               " where step ", i, " from ", stream.position(), " was due; report this");
    stream.next(cfg.prompts_per_step);  // this rank's stream follows the rollout rank's, for checkpoints
    split.ready.push_back(std::move(p));
    x.done();
  }

  // What a weight sync sends: the adapters (LoRA) or every trained tensor.
  NamedTensors synced_tensors() const {
    return lora() ? model::lora_parameters(trained()) : trained().named_parameters();
  }
  // A header (`version`, the last step, this rank's probe log-probs) and the weights.
  int64_t send_weights(LinkKind kind, const std::vector<int64_t>& head) {
    ByteWriter w;
    for (int64_t v : head) w.put(v);
    w.put(last_step);
    const std::vector<int64_t> probe = probe_tokens();
    w.put_tensor(probe.empty() ? at::Tensor() : own_probe_logprobs(probe));
    Exchange x(split);
    link->send(kind, w);
    const int64_t bytes = link->send_tensors(synced_tensors());
    x.done();
    split.sent_last = last_step;
    return bytes;
  }

  // A session: the rollout rank starts from this rank's data position and weights, those of
  // `trained` updates.
  void start_session(int64_t trained) {
    KILN_CHECK(!split.broken(), "grpo: an earlier error left rollout rank ", link->peer(),
               split.peer_gone ? " stopped" : " mid-exchange", "; build a new trainer to go on");
    if (split.started) return;
    split.ready.clear();
    split.received = split.sent_version = trained;
    send_weights(LinkKind::kStart, {trained, int64_t(stream.position())});
    split.started = true;
  }

  // The weight sync: after the batches made with the weights before (through step + k).
  void sync_split(StepMetrics& m) {
    if (!split.started) return;  // the next session starts from these weights
    drain();
    const auto t = Clock::now();
    m.sync_bytes = send_weights(LinkKind::kWeights, {steps});
    m.sync_seconds = seconds_since(t);
    split.sent_version = steps;
  }

  Produced take_from_rollout_rank() {
    start_session(steps - 1);  // the step under way has not updated the weights yet
    if (split.ready.empty() && last_step != split.sent_last) send_last_step();  // set_last_step moved it
    if (split.ready.empty()) {
      KILN_CHECK(rollout_can_make(split.received + 1), "grpo: internal error: step ", steps,
                 " waits for a batch the rollout rank cannot make (weights ", split.sent_version, ", last step ",
                 split.sent_last, "); report this");
      receive_batch();
    }
    Produced p = std::move(split.ready.front());
    split.ready.pop_front();
    return p;
  }

  // The last step, where the rollout rank knew another (a caller that extends or ends a run).
  void send_last_step() {
    drain();
    ByteWriter w;
    w.put(last_step);
    Exchange x(split);
    link->send(LinkKind::kLastStep, w);
    x.done();
    split.sent_last = last_step;
  }

  EvalMetrics evaluate_remote(const EvalConfig& ec) {
    ec.validate();
    start_session(steps);
    drain();
    ByteWriter w;
    w.put(steps);
    w.put(last_step);
    write_eval_config(w, ec);
    Exchange x(split);
    link->send(LinkKind::kEval, w);
    split.sent_last = last_step;
    const RolloutLink::Message msg = link->recv();
    if (msg.kind == LinkKind::kError) rollout_failed(msg);
    KILN_CHECK(msg.kind == LinkKind::kEvalResult, "grpo: rollout rank ", link->peer(), " sent ",
               link_kind_name(msg.kind), " where the evaluation was due; report this");
    ByteReader r = msg.body("the evaluation from rank " + std::to_string(link->peer()));
    EvalMetrics em = read_eval_metrics(r);
    r.expect_end();
    x.done();
    return em;
  }

  // Ends the session (a resume starts a new one from the checkpoint).
  void end_session() {
    if (!link || rollout_side || !split.started || split.broken()) return;
    drain();
    Exchange x(split);
    link->send(LinkKind::kStop);
    x.done();
    split.started = false;
    split.ready.clear();
  }

  // The rollout rank returns from serving. Never throws: it runs in the destructor.
  void close_link() noexcept {
    if (split.broken()) return;
    try {
      if (split.started) drain();
      link->send(LinkKind::kExit);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "grpo: could not tell rollout rank %d to exit: %s\n", link->peer(), e.what());
    }
  }

  // ---- grpo.async.placement split: the rollout rank's end ----
  double last_sync_check = -1;  // the probe check of the weights it has

  void serve() {
    KILN_CHECK(rollout_side, "grpo: serve_rollouts is for the rollout ranks of async.placement split; this rank trains");
    try {
      serve_sessions();
    } catch (const std::exception& e) {
      try {  // the trainer reports it too, instead of waiting for a batch that will not come
        ByteWriter w;
        w.put(std::string(e.what()));
        link->send(LinkKind::kError, w);
      } catch (...) {
      }
      throw;
    }
  }

  void serve_sessions() {
    at::NoGradGuard no_grad;
    for (;;) {
      const RolloutLink::Message msg = link->recv();
      if (msg.kind == LinkKind::kExit) return;
      KILN_CHECK(msg.kind == LinkKind::kStart, "grpo: trainer rank ", link->peer(), " sent ",
                 link_kind_name(msg.kind), " before starting a session; report this");
      ByteReader r = msg.body("the start from rank " + std::to_string(link->peer()));
      steps = r.get<int64_t>("the step");
      stream.seek(uint64_t(r.get<int64_t>("the data position")));
      receive_weights(r, steps);
      if (!serve_session()) return;
    }
  }

  // Makes every batch it can, and between them answers the trainer; false once told to exit.
  bool serve_session() {
    int64_t next = steps + 1;
    double waited = 0;
    for (;;) {
      if ((last_step <= 0 || next <= last_step) && weight_version() >= version_for(next)) {
        Produced p = produce_next(next++);
        p.wait_seconds = waited;
        p.sync_check = last_sync_check;
        waited = 0;
        ByteWriter w;
        write_produced(w, p);
        link->send(LinkKind::kBatch, w);
        continue;
      }
      const auto t = Clock::now();
      const RolloutLink::Message msg = link->recv();
      waited += seconds_since(t);
      ByteReader r = msg.body(str_cat("the ", link_kind_name(msg.kind), " message from rank ", link->peer()));
      switch (msg.kind) {
        case LinkKind::kWeights:
          receive_weights(r, r.get<int64_t>("the weight version"));
          break;
        case LinkKind::kEval: {
          steps = r.get<int64_t>("the step");
          last_step = r.get<int64_t>("the last step");
          const EvalConfig ec = read_eval_config(r);
          r.expect_end();
          ByteWriter w;
          write_eval_metrics(w, evaluate_now(ec));
          link->send(LinkKind::kEvalResult, w);
          break;
        }
        case LinkKind::kLastStep:
          last_step = r.get<int64_t>("the last step");
          r.expect_end();
          break;
        case LinkKind::kStop:
          return true;
        case LinkKind::kExit:
          return false;
        default:
          KILN_FAIL("grpo: trainer rank ", link->peer(), " sent ", link_kind_name(msg.kind), " mid-session; report this");
      }
    }
  }

  // The rest of a start or weights header (the last step, the trainer's probe log-probs), then the
  // weights into this rank's model and the engine; the probe checks the engine against the trainer.
  void receive_weights(ByteReader& r, int64_t version) {
    steps = version;  // what the probe check's message names
    last_step = r.get<int64_t>("the last step");
    const at::Tensor theirs = r.get_tensor("the trainer's probe log-probs");
    r.expect_end();
    // Straight into the engine, one tensor at a time (this rank's own model holds none of them).
    const rollout::WeightSource next = [&](const std::string& name, const at::Tensor& own) {
      return link->recv_tensor(name, own);
    };
    if (lora()) engine->update_adapters(trained(), next);
    else engine->update_weights(trained(), next);
    version_base = version - engine->weight_version();
    last_sync_check = -1;
    if (theirs.defined()) last_sync_check = compare_probe(theirs, probe_logprobs(engine->model(), probe_tokens(), nullptr));
  }

  std::vector<rollout::Request> requests_for(const Batch& b, int64_t round) {
    std::vector<rollout::Request> reqs;
    for (size_t i = 0; i < b.prompts.size(); ++i) {
      rollout::Request r;
      r.prompt = b.prompts[i].prompt_ids;
      r.params.n = cfg.samples_per_prompt;
      r.params.max_tokens = cfg.max_tokens;
      r.params.stop_token_ids = tok->stop_ids();
      r.params.temperature = cfg.temperature;
      r.params.top_p = cfg.top_p;
      r.params.top_k = cfg.top_k;
      // Per (step, round, global prompt index): rounds of dynamic sampling draw fresh streams.
      r.params.seed = cfg.seed * 1000003ull + uint64_t(b.step) * 1009ull + uint64_t(round) * 7919ull * 1000003ull +
                      uint64_t(b.first + int64_t(i));
      reqs.push_back(std::move(r));
    }
    return reqs;
  }

  // The prompt's ids, then the response's; out of the loss when truncated under grpo.mask_truncated.
  Trajectory trajectory(const Example& ex, const std::vector<int64_t>& response, const std::vector<float>& logprobs,
                        const at::Tensor& routing, bool truncated) const {
    Trajectory t;
    t.tokens = ex.prompt_ids;
    t.prompt_len = int64_t(t.tokens.size());
    t.tokens.insert(t.tokens.end(), response.begin(), response.end());
    t.rollout_lp = logprobs;
    t.routing = routing;
    t.in_loss = !(cfg.mask_truncated && truncated);
    return t;
  }

  // Decodes and scores every sample (this rank's).
  void score_samples(const Batch& b, const std::vector<rollout::RequestOutput>& outs, Produced& p) {
    for (size_t i = 0; i < outs.size(); ++i) {
      for (const auto& s : outs[i].samples) {
        p.reqs.push_back(reward_request(b.prompts[i], s, int64_t(p.reqs.size())));
        p.trajs.push_back(trajectory(b.prompts[i], s.tokens, s.logprobs, s.routing, p.reqs.back().truncated));
        p.lengths.push_back(double(s.tokens.size()));
      }
    }
    const RewardStats before = reward->stats();
    p.results = reward->score(p.reqs);
    KILN_CHECK(p.results.size() == p.reqs.size(), "grpo: the reward returned ", p.results.size(), " results for ",
               p.reqs.size(), " samples");
    p.worker = reward->stats() - before;
  }

  // Episodes (grpo.environment) as trajectories: the ids the model saw, observation tokens out of
  // the loss, the environment's last reward.
  void collect_episodes(const Batch& b, const std::vector<std::vector<Episode>>& eps, Produced& p) {
    for (size_t i = 0; i < eps.size(); ++i)
      for (const Episode& e : eps[i]) {
        p.trajs.push_back(trajectory(b.prompts[i], e.response, e.logprobs, e.routing, e.truncated));
        p.trajs.back().sampled = e.sampled;
        RewardRequest r;  // what the sample dump and the metrics read
        r.id = int64_t(p.reqs.size());
        r.prompt = b.prompts[i].prompt_text;
        r.response = tok->decode(e.response);
        r.label = b.prompts[i].label;
        r.data_source = b.prompts[i].data_source;
        r.truncated = e.truncated;
        p.reqs.push_back(std::move(r));
        p.lengths.push_back(double(e.sampled_tokens));
        p.turns += double(e.turns.size());
        p.observed += double(int64_t(e.response.size()) - e.sampled_tokens);
      }
    p.results = episode_results(eps);
  }

  static std::vector<RewardResult> episode_results(const std::vector<std::vector<Episode>>& eps) {
    std::vector<RewardResult> out;
    for (const auto& request : eps)
      for (const Episode& e : request) {
        RewardResult r;
        r.reward = e.last.reward;
        r.components = e.last.components;
        r.failed = e.last.failed;
        r.error = e.last.error;
        out.push_back(std::move(r));
      }
    return out;
  }

  // Reward metrics (global: collective) and group advantages of a produced batch.
  std::vector<Trajectory> finish_rewards(Produced p, StepMetrics& m) {
    const Batch& b = p.batch;
    std::vector<Trajectory>& trajs = p.trajs;
    const std::vector<RewardRequest>& reqs = p.reqs;
    const std::vector<RewardResult>& results = p.results;
    const std::vector<double>& lengths = p.lengths;
    const RewardStats& worker = p.worker;
    m.rollout_seconds = p.rollout_seconds;
    m.reward_seconds = p.reward_seconds;
    {
      at::Tensor engine_sums = at::tensor({double(p.preemptions)}, at::kDouble);
      group.all_reduce(engine_sums);
      m.preemptions = int64_t(engine_sums.item<double>());
      m.kv_peak = group.all_reduce(p.kv_peak, comm::ReduceOp::kMax);
      m.expert_overflow_steps =
          int64_t(group.all_reduce(double(p.expert_overflow_steps), comm::ReduceOp::kMax));
      if (cfg.async_staleness >= 0) m.rollout_wait_seconds = group.all_reduce(p.wait_seconds, comm::ReduceOp::kMax);
    }
    if (env) {
      at::Tensor sums = at::tensor({p.turns, p.observed}, at::kDouble);
      group.all_reduce(sums);
      const double count = double(b.total * cfg.samples_per_prompt);
      m.episode_turns = sums[0].item<double>() / count;
      m.observation_tokens = sums[1].item<double>() / count;
    }
    double truncated = 0;
    for (const RewardRequest& r : reqs) truncated += r.truncated ? 1 : 0;
    std::vector<double> rewards, correct;
    double overlong = 0;  // sum of the over-long penalties added to the rewards
    int64_t failures = 0, solved_prompts = 0, flat_groups = 0;
    KeyedSums parts;  // component -> (sum, count)
    last.clear();
    for (size_t i = 0; i < results.size(); ++i) {
      const RewardResult& r = results[i];
      rewards.push_back(r.reward);
      correct.push_back(is_correct(r) ? 1.0 : 0.0);
      failures += r.failed ? 1 : 0;
      last.push_back({reqs[i].prompt, reqs[i].response, reqs[i].label, reqs[i].data_source, r.reward, {}, reqs[i].truncated});
      for (const auto& [name, v] : r.components) {
        std::vector<double>& p = parts[name];
        p.resize(2);
        p[0] += v, p[1] += 1;
        last.back().components[name] = v;
      }
    }
    const size_t n = size_t(cfg.samples_per_prompt);
    for (size_t g = 0; g * n < rewards.size(); ++g) {
      const auto first = rewards.begin() + std::ptrdiff_t(g * n), end = first + std::ptrdiff_t(n);
      flat_groups += std::all_of(first, end, [&](double v) { return v == *first; }) ? 1 : 0;
      solved_prompts += std::any_of(correct.begin() + std::ptrdiff_t(g * n), correct.begin() + std::ptrdiff_t((g + 1) * n),
                                    [](double c) { return c > 0; }) ? 1 : 0;
    }
    // The advantages see the shaped rewards; the reported reward stays the reward function's.
    std::vector<double> shaped = rewards;
    for (size_t i = 0; i < shaped.size(); ++i) {
      const double p = overlong_penalty(int64_t(lengths[i]), cfg.max_tokens, cfg.overlong_buffer, cfg.overlong_penalty);
      shaped[i] += p;
      overlong += p;
    }
    at::Tensor adv = group_advantages(at::tensor(shaped, at::kDouble), cfg.samples_per_prompt, cfg.std_normalize);
    for (size_t i = 0; i < trajs.size(); ++i) {
      trajs[i].reward = shaped[i];
      trajs[i].advantage = adv[int64_t(i)].item<double>();
    }
    // Every count and sum of the step in one reduction; min and max lengths in a second.
    at::Tensor sums = at::tensor({std::accumulate(rewards.begin(), rewards.end(), 0.0),
                                  std::accumulate(correct.begin(), correct.end(), 0.0),
                                  std::accumulate(lengths.begin(), lengths.end(), 0.0), double(solved_prompts),
                                  truncated, double(flat_groups), double(failures), double(worker.num_answered),
                                  double(worker.num_timeouts), double(worker.num_restarts), double(worker.num_retries),
                                  double(worker.num_garbage_lines), worker.total_seconds, overlong}, at::kDouble);
    group.all_reduce(sums);
    auto sum = [&](int64_t i) { return sums[i].item<double>(); };
    const double count = double(b.total * cfg.samples_per_prompt);  // every prompt has n samples
    m.reward = sum(0) / count;
    m.accuracy = sum(1) / count;
    m.response_length = sum(2) / count;
    m.pass_at_n = sum(3) / double(b.total);
    m.truncated_fraction = sum(4) / count;
    m.zero_variance_groups = sum(5) / double(b.total);
    m.reward_failures = int64_t(sum(6));
    m.reward_stats.num_requests = int64_t(count);
    m.reward_stats.num_failures = m.reward_failures;
    m.reward_stats.num_answered = int64_t(sum(7));
    m.reward_stats.num_timeouts = int64_t(sum(8));
    m.reward_stats.num_restarts = int64_t(sum(9));
    m.reward_stats.num_retries = int64_t(sum(10));
    m.reward_stats.num_garbage_lines = int64_t(sum(11));
    m.reward_stats.total_seconds = sum(12);
    m.overlong_penalty = sum(13) / count;
    // -min and max, so that one max-reduction gives both; a rank without samples adds nothing.
    at::Tensor mm = at::tensor({lengths.empty() ? -INFINITY : -*std::min_element(lengths.begin(), lengths.end()),
                                lengths.empty() ? -INFINITY : *std::max_element(lengths.begin(), lengths.end())},
                               at::kDouble);
    group.all_reduce(mm, comm::ReduceOp::kMax);
    m.response_length_min = -mm[0].item<double>();
    m.response_length_max = mm[1].item<double>();
    for (const auto& [name, sc] : all_reduce_keyed(group, parts)) m.reward_components[name] = sc[0] / std::max(sc[1], 1.0);
    return std::move(trajs);
  }

  RewardRequest reward_request(const Example& ex, const rollout::Sample& s, int64_t id) const {
    RewardRequest r;
    r.id = id;
    r.prompt = ex.prompt_text;
    // The response as sampled, less a special stop token that ended it (<|im_end|>): special
    // tokens sampled inside a response stay visible to the reward, and a textual stop such as the
    // byte tokenizer's '\n' stays part of the text.
    r.response = response_text(*tok, s.tokens, s.finish);
    r.label = ex.label;
    r.data_source = ex.data_source;
    r.metadata = ex.metadata.empty() ? "{}" : ex.metadata;
    r.truncated = s.finish == rollout::FinishReason::kLength;
    return r;
  }

  // lp_old (and lp_ref) for the loss, and the mismatch metrics over every rank's tokens.
  struct OldLogprobs {
    Scored old, ref;
    double total_tokens = 0;  // response tokens, all ranks
    // lp_old is the rollout's log-probs (lp_old_from_rollout); the first mini-step measures the
    // mismatch on `whole` (this rank's trajectories, packed on the CPU; sequence ids from seq_offset).
    bool from_rollout = false;
    Packed whole;
    int64_t seq_offset = 0, num_seqs = 0;
  };
  // Under batch-invariant numerics an on-policy batch's rollout log-probs are the trainer's bit
  // for bit (the engine records them as the trainer computes them): lp_old is taken from them
  // instead of a second forward, and the first mini-step's forward, which computes the same
  // log-probs with a graph, measures the mismatch. Not for a stale batch (other weights), nor
  // with mismatch_ab and replay off (the A/B needs lp_old's own routing), nor under score_lp_old,
  // nor for an fp64 policy (the rollout keeps its log-probs in fp32, the trainer's are fp64).
  bool lp_old_from_rollout(const StepMetrics& m) const {
    return cfg.engine.batch_invariant && m.staleness <= 0 && !(cfg.mismatch_ab && !cfg.routing_replay) &&
           !cfg.score_lp_old && policy.dtype() != at::kDouble;
  }
  OldLogprobs score_old(const std::vector<Trajectory>& trajs, const Batch& b, StepMetrics& m) {
    OldLogprobs o;
    Packed whole = pack(trajs, 0, trajs.size(), at::kCPU, at::kDouble);
    // The mismatch metrics see every rank's tokens (gathered; a copy on one rank).
    const int64_t n = b.total * cfg.samples_per_prompt;
    const int64_t seq_offset = b.first * cfg.samples_per_prompt;
    m.tokens = int64_t(group.all_reduce(double(whole.batch.num_tokens())));
    m.lp_old_from_rollout = o.from_rollout = lp_old_from_rollout(m);
    if (o.from_rollout) {
      o.old.logprobs = whole.rollout_lp;  // 0 off the responses; train() takes its own values there
      o.seq_offset = seq_offset;
      o.num_seqs = n;
    } else {
      o.old = score(trajs, cfg.routing_replay);
    }
    // The whole batch's tokens, gathered where this step's metrics read them here.
    Gathered all_tok;
    if (!o.from_rollout || cfg.mismatch_ab)
      all_tok = {group.all_gather_v(whole.rollout_lp), group.all_gather_v(whole.mask),
                 group.all_gather_v(whole.seq_ids + seq_offset), n};
    if (!o.from_rollout)
      m.mismatch = mismatch_metrics(group.all_gather_v(o.old.logprobs.cpu()), all_tok.rollout_lp, all_tok.mask,
                                    all_tok.seq_ids, all_tok.num_seqs);
    if (cfg.mismatch_ab) {
      Scored other = score(trajs, !cfg.routing_replay);
      const Scored& no_replay = cfg.routing_replay ? other : o.old;
      m.has_no_replay = true;
      m.mismatch_no_replay = mismatch_metrics(group.all_gather_v(no_replay.logprobs.cpu()), all_tok.rollout_lp,
                                              all_tok.mask, all_tok.seq_ids, all_tok.num_seqs);
      at::Tensor own = group.all_gather_v(no_replay.routing), replayed = group.all_gather_v(whole.routing);
      m.routing_disagreement = routing_disagreement(own, replayed, at::ones({own.size(0)}));
    }
    // lp_ref for the k3 KL term, with the same expert sets as lp_old.
    if (reference) o.ref = score(*reference, trajs, cfg.routing_replay);
    if (lora() && cfg.loss.kl_coef != 0) o.ref = score(trained(), trajs, cfg.routing_replay, /*base_only=*/true);
    o.total_tokens = group.all_reduce(whole.mask.sum().item<double>());
    if (o.from_rollout) o.whole = std::move(whole);
    return o;
  }

  // The mismatch of an lp_old taken from the rollout: the first mini-step's log-probs `lp` (this
  // rank's trajectories from `first`, on the CPU) against the rollout's, over every rank.
  void measure_mismatch(const OldLogprobs& o, const at::Tensor& lp, int64_t first_token, StepMetrics& m) {
    const int64_t n = lp.size(0);
    auto part = [&](const at::Tensor& t) { return group.all_gather_v(t.narrow(0, first_token, n)); };
    m.mismatch = mismatch_metrics(group.all_gather_v(lp), part(o.whole.rollout_lp), part(o.whole.mask),
                                  part(o.whole.seq_ids + o.seq_offset), o.num_seqs);
  }

  // Optimizer mini-steps: each over a disjoint slice of the trajectories, micro-batched.
  void train(const std::vector<Trajectory>& trajs, const OldLogprobs& o, const Batch& b, StepMetrics& m) {
    // Mini-step ms covers global trajectories [ms*per, (ms+1)*per); this rank holds [g0, g1).
    const int64_t N = b.total * cfg.samples_per_prompt, g0 = b.first * cfg.samples_per_prompt,
                  g1 = g0 + int64_t(trajs.size());
    const int64_t per_mini = (N + cfg.mini_steps - 1) / cfg.mini_steps;
    double loss_sum = 0, clip_sum = 0, kl_sum = 0, mis_sum = 0, loss_tokens = 0, norm_sum = 0;
    std::vector<int64_t> token_offsets = {0};
    for (const auto& t : trajs) token_offsets.push_back(token_offsets.back() + int64_t(t.tokens.size()));
    zero->set_lr_factor(cfg.schedule.factor(steps));
    m.lr = cfg.optim.adamw.lr * cfg.schedule.factor(steps);
    for (int64_t ms = 0; ms < cfg.mini_steps; ++ms) {
      int64_t gb = ms * per_mini, ge = std::min(N, (ms + 1) * per_mini);
      const size_t mb = size_t(std::clamp(gb, g0, g1) - g0), me = size_t(std::clamp(ge, g0, g1) - g0);
      if (gb >= ge) break;
      // Expert parallelism and ZeRO-3 exchange tokens or gather weights in every forward: a rank
      // with fewer micro-batches in this mini-step (none, where the mini-step does not reach its
      // trajectories) runs as many empty ones, a one-token forward whose loss is multiplied by 0,
      // so that every rank runs the same collectives and the mini-steps are one rank's.
      const int64_t micro = cfg.micro_batch_seqs, mine = (int64_t(me - mb) + micro - 1) / micro;
      const int64_t empty = shard ? int64_t(group.all_reduce(double(mine), comm::ReduceOp::kMax)) - mine : 0;
      const double local_tokens = mb < me ? pack(trajs, mb, me, at::kCPU, at::kDouble).loss_mask.sum().item<double>() : 0.0;
      const double slice_tokens = std::max(group.all_reduce(local_tokens), 1.0);
      for (at::Tensor& p : params) p.mutable_grad().reset();
      if (ms == 0) m.train_start_gb = model::current_memory_gb(policy.device());
      bool armed = false;
      std::vector<at::Tensor> first_lp;  // the first mini-step's log-probs (o.from_rollout)
      for (size_t mb0 = mb; mb0 < me; mb0 += size_t(cfg.micro_batch_seqs)) {
        const size_t e = std::min(me, mb0 + size_t(cfg.micro_batch_seqs));
        if (reducer && e == me) reducer->arm(), armed = true;  // the last backward overlaps the reduction
        // Masks and advantages in the loss dtype (fp32 for a bf16 policy, like its log-probs).
        Packed p = pack(trajs, mb0, e, policy.device(), model::router_dtype(policy.dtype()));
        model::ForwardOptions fo = forward_options();
        fo.targets = p.targets;
        fo.temperature = cfg.temperature;
        if (cfg.routing_replay) fo.replay_routing = p.routing;
        auto out = trained().forward(p.batch, fo);
        const int64_t t0 = token_offsets[mb0], nt = token_offsets[e] - token_offsets[mb0];
        PolicyLossInputs in;
        in.logprobs = out.logprobs;
        in.old_logprobs = o.old.logprobs.narrow(0, t0, nt).to(policy.device(), out.logprobs.scalar_type());
        if (o.from_rollout) {
          // Off the responses the rollout has no log-prob: the ratio is 1 there (masked anyway).
          in.old_logprobs = at::where(p.mask > 0, in.old_logprobs, out.logprobs.detach());
          if (ms == 0) first_lp.push_back(out.logprobs.detach().to(at::kCPU, at::kDouble));
        }
        in.advantages = p.advantages;
        in.mask = p.loss_mask;
        in.seq_ids = p.seq_ids;
        in.num_seqs = p.num_seqs;
        in.rollout_logprobs = p.rollout_lp;
        if (o.ref.logprobs.defined())
          in.ref_logprobs = o.ref.logprobs.narrow(0, t0, nt).to(policy.device(), out.logprobs.scalar_type());
        in.total_tokens = slice_tokens;
        in.total_seqs = double(ge - gb);
        auto lo = policy_loss(in, cfg.loss);
        lo.loss.backward();
        loss_sum += lo.loss.item<double>();
        const double tokens = p.loss_mask.sum().item<double>();  // what the fractions are over
        clip_sum += lo.clip_fraction * tokens;
        kl_sum += lo.kl * tokens;
        mis_sum += lo.mis_masked_fraction * tokens;
        loss_tokens += tokens;
      }
      for (int64_t i = 0; i < empty; ++i) {
        model::PackedBatch one = model::PackedBatch::from_sequences({{0}}, policy.device());
        model::ForwardOptions fo = forward_options();
        fo.targets = at::zeros({1}, one.tokens.options());
        (trained().forward(one, fo).logprobs.sum() * 0.0).backward();
      }
      m.backward_peak_gb = std::max(m.backward_peak_gb, model::peak_memory_gb(policy.device()));
      model::reset_peak_memory(policy.device());
      // Sum the ranks' gradients, then global grad-norm clipping (an infinite bound when off still
      // reports the norm); the owners step and broadcast.
      double norm = 0;
      if (shard) {
        zero->all_reduce_grads();
        norm = parallel::clip_grads_expert_parallel(params, is_expert, ep_group, cfg.grad_clip, zero3);
      } else {
        if (reducer) {
          if (!armed) reducer->arm();  // no trajectories here in this mini-step: still joins in
          reducer->finish();
        }
        norm = torch::nn::utils::clip_grad_norm_(params, cfg.grad_clip > 0 ? cfg.grad_clip : INFINITY);
      }
      // A non-finite global norm (the same on every rank) skips this update everywhere.
      if (guard.admit(norm, loss_sum, "grpo", steps)) {
        norm_sum += norm;
        zero->step();
      } else {
        ++m.skipped_updates;
      }
      m.optimizer_peak_gb = std::max(m.optimizer_peak_gb, model::peak_memory_gb(policy.device()));
      model::reset_peak_memory(policy.device());
      // Once every rank's exchanges and reductions of the mini-step are done, so that the gathers line up.
      if (o.from_rollout && ms == 0)
        measure_mismatch(o, first_lp.empty() ? at::zeros({0}, at::kDouble) : at::cat(first_lp),
                         token_offsets[mb], m);
    }
    at::Tensor loss_parts = at::tensor({loss_sum, clip_sum, kl_sum, mis_sum, loss_tokens}, at::kDouble);
    group.all_reduce(loss_parts);
    const double in_loss = std::max(loss_parts[4].item<double>(), 1.0);
    m.loss = loss_parts[0].item<double>() / double(cfg.mini_steps);
    m.clip_fraction = loss_parts[1].item<double>() / in_loss;
    m.kl = loss_parts[2].item<double>() / in_loss;
    m.mis_masked_fraction = loss_parts[3].item<double>() / in_loss;
    const int64_t applied = cfg.mini_steps - m.skipped_updates;
    m.grad_norm = applied > 0 ? norm_sum / double(applied) : std::nan("");
  }

  // 6. The weight sync to the rollout engine, timed: adapters only (LoRA); or every weight, where a
  // sharded engine shares the trained tensors and a replica under expert parallelism gathers every
  // rank's experts. Then the probe check.
  // Under grpo.async the producer is paused between batches for it, once the batches that need the
  // weights before this update are out.
  void sync_rollout(StepMetrics& m) {
    if (link) return sync_split(m);
    with_producer_paused(needed_for(steps), [&] { sync_engine(m); });
  }

  // The trained weights into the engine: the adapters alone under LoRA, nothing where the engine
  // reads the trained tensors themselves. Returns the bytes copied.
  int64_t push_to_engine() {
    if (lora()) return engine->update_adapters(trained(), engine_source());
    if (engine_serves_trained()) return 0;
    return engine->update_weights(trained(), engine_source());
  }

  void sync_engine(StepMetrics& m) {
#if KILN_WITH_CUDA
    if (policy.device().is_cuda()) c10::cuda::device_synchronize();  // the optimizer's kernels are not the sync's
#endif
    const auto t = Clock::now();
    // Tensor by tensor: ZeRO-3's from their owners, a replica's experts (or their adapters) from
    // every rank; a sharded engine takes its own experts.
    m.sync_bytes = push_to_engine();
    m.weights_shared = engine_serves_trained();
#if KILN_WITH_CUDA
    if (policy.device().is_cuda()) c10::cuda::device_synchronize();
#endif
    m.sync_seconds = seconds_since(t);
    m.sync_check = check_sync();
  }

  // Trainer and rollout score the same probe (a training prompt and its answer); returns the mean
  // |log-prob difference|, or -1 when not checked. Under expert parallelism both forwards exchange
  // tokens, so every rank of the group runs them together.
  double check_sync() {
    const std::vector<int64_t> probe = probe_tokens();
    if (probe.empty()) return -1;
    const at::Tensor mine = own_probe_logprobs(probe);
    return compare_probe(mine, probe_logprobs(engine->model(), probe, cfg.parallel.sharded_rollout() ? dispatcher : nullptr));
  }

  // The probe: the first training prompt and its answer, at most sync_check_tokens; empty when
  // not checked.
  std::vector<int64_t> probe_tokens() const {
    if (cfg.sync_check_tokens == 0 || data.train.empty()) return {};
    std::vector<int64_t> probe = data.train[0].prompt_ids;
    if (!data.train[0].label.empty()) {
      const std::vector<int64_t> label = tok->encode(data.train[0].label);
      probe.insert(probe.end(), label.begin(), label.end());
    }
    if (int64_t(probe.size()) > cfg.sync_check_tokens) probe.resize(size_t(cfg.sync_check_tokens));
    if (probe.size() < 2) return {};
    return probe;
  }

  // Each probe token's log-prob given the ones before it, in fp64 on the CPU.
  at::Tensor probe_logprobs(const model::Muse& m, const std::vector<int64_t>& probe,
                            const model::ExpertDispatcher* experts) const {
    at::NoGradGuard g;
    model::PackedBatch b = model::PackedBatch::from_sequences({probe}, m.device());
    model::ForwardOptions o;
    o.load_balance = false;
    o.experts = experts;
    o.gather = zero_of(m);
    o.batch_invariant = cfg.engine.batch_invariant;
    o.targets = at::cat({b.tokens.narrow(0, 1, b.num_tokens() - 1), at::full({1}, -100L, b.tokens.options())});
    return m.forward(b, o).logprobs.narrow(0, 0, b.num_tokens() - 1).to(at::kDouble).cpu();
  }

  // The trained model's probe log-probs; non-finite ones are divergence, not a bad sync: said so.
  at::Tensor own_probe_logprobs(const std::vector<int64_t>& probe) const {
    const at::Tensor mine = probe_logprobs(trained(), probe, dispatcher);
    KILN_CHECK(at::isfinite(mine).all().item<bool>(), "grpo: after step ", steps,
               " the policy's own log-probs are not finite: the weights hold NaN or inf (the run diverged); lower "
               "the lr and resume from the last checkpoint");
    return mine;
  }

  // The mean |difference| of the trainer's and the rollout's probe log-probs, checked against the
  // threshold.
  double compare_probe(const at::Tensor& mine, const at::Tensor& theirs) const {
    const double diff = (mine - theirs).abs().mean().item<double>();
    const double limit = cfg.sync_check_threshold >= 0 ? cfg.sync_check_threshold
                                                       : cfg.engine.quantization == rollout::Quantization::kNone ? 1e-3 : 1.0;
    KILN_CHECK(std::isfinite(diff) && diff <= limit, "grpo: weight sync check failed after step ", steps,
               ": trainer and rollout log-probs differ by ", diff, " (mean over ", mine.numel(),
               " probe tokens; threshold ", limit, "); the rollout's weights are not the trainer's");
    return diff;
  }

  // A whole `policy` from the trained shards (sync_policy); a share is the trained model itself.
  void gather_experts() { layout->update_policy(); }

  // Held-out evaluation: each rank samples and scores its share of the prompts; the scores are
  // gathered per data_source.
  EvalMetrics evaluate(const EvalConfig& ec) {
    if (link) return evaluate_remote(ec);
    EvalMetrics em;
    with_producer_paused(0, [&] { em = evaluate_now(ec); });
    return em;
  }

  EvalMetrics evaluate_now(const EvalConfig& ec) {
    ec.validate();
    EvalMetrics em;
    em.step = steps;
    em.k = ec.temperature == 0 ? 1 : ec.samples;
    const int64_t count = std::min<int64_t>(ec.limit, int64_t(data.test.size()));
    const int64_t e0 = count * group.rank() / group.size(), e1 = count * (group.rank() + 1) / group.size();
    std::vector<rollout::Request> reqs;
    for (int64_t i = e0; i < e1; ++i) {
      rollout::Request r;
      r.prompt = data.test[size_t(i)].prompt_ids;
      r.params.n = em.k;
      r.params.max_tokens = ec.max_tokens > 0 ? ec.max_tokens : cfg.max_tokens;
      r.params.stop_token_ids = tok->stop_ids();
      r.params.temperature = ec.temperature;
      r.params.top_p = cfg.top_p;
      r.params.top_k = cfg.top_k;
      r.params.seed = cfg.seed * 7919ull + uint64_t(steps) * 104729ull + uint64_t(i);
      reqs.push_back(std::move(r));
    }
    std::vector<RewardResult> results;
    if (env) {  // episodes, scored by the environment
      std::vector<const Example*> examples;
      for (int64_t i = e0; i < e1; ++i) examples.push_back(&data.test[size_t(i)]);
      results = episode_results(run_episodes(*engine, *env, *tok, examples, std::move(reqs)));
    } else {
      auto outs = engine->generate(reqs);
      std::vector<RewardRequest> rr;
      for (int64_t i = e0; i < e1; ++i)
        for (const auto& s : outs[size_t(i - e0)].samples)
          rr.push_back(reward_request(data.test[size_t(i)], s, int64_t(rr.size())));
      results = reward->score(rr);
    }
    // Per data_source: prompts, correct samples, prompts with one correct, reward sum.
    KeyedSums mine;
    for (int64_t i = e0; i < e1; ++i) {
      double right = 0, rewards = 0;
      for (int64_t j = 0; j < em.k; ++j) {
        const RewardResult& r = results[size_t((i - e0) * em.k + j)];
        right += is_correct(r) ? 1 : 0;
        rewards += r.reward;
      }
      std::vector<double>& e = mine[data.test[size_t(i)].data_source];
      e.resize(4);
      e[0] += 1;
      e[1] += right;
      e[2] += right > 0 ? 1 : 0;
      e[3] += rewards;
    }
    const KeyedSums sums = all_reduce_keyed(group, mine);
    double all[4] = {0, 0, 0, 0};
    for (const auto& [source, v] : sums)
      for (size_t q = 0; q < 4; ++q) all[q] += v[q];
    auto score_of = [&](const double* v) {
      EvalScore s;
      s.prompts = int64_t(v[0]);
      if (v[0] > 0) {
        s.mean_at_k = v[1] / (v[0] * double(em.k));
        s.pass_at_k = v[2] / v[0];
        s.reward = v[3] / (v[0] * double(em.k));
      }
      return s;
    };
    em.all = score_of(all);
    for (const auto& [source, v] : sums) em.by_source[source] = score_of(v.data());
    return em;
  }

  // ---- checkpoints ----

  // A cheap identity of the frozen base (LoRA checkpoints store the adapters only and check that
  // they resume on the same base): the sum of its elements in fp64. Each tensor (each expert) is
  // summed by the one rank that writes it and the sums are added in one order, so that a share
  // gives what the whole policy gives. Collective.
  double base_fingerprint() const {
    at::NoGradGuard g;
    const int64_t E = trained().config().num_experts, ep = cfg.parallel.ep;
    const bool first_copy = ep > 1 ? expert_dp.rank() == 0 : group.rank() == 0;
    std::vector<at::Tensor> sums;
    for (const auto& [name, t] : trained().named_parameters()) {
      const bool expert = model::is_expert_tensor(name);
      at::Tensor part = at::zeros({expert ? E : 1}, at::kDouble);
      const parallel::Zero3::Entry* e = zero3 ? zero3->find(name) : nullptr;
      if (e ? zero3->owns(*e) : first_copy) {
        const at::Tensor w = t.detach();
        if (!expert) part.fill_(w.sum(at::kDouble).item<double>());
        else if (w.size(0) == E) part.copy_(w.flatten(1).sum(1, false, at::kDouble).cpu());
        else part.narrow(0, ep_group.rank() * w.size(0), w.size(0)).copy_(w.flatten(1).sum(1, false, at::kDouble).cpu());
      }
      sums.push_back(part);
    }
    at::Tensor all = at::cat(sums);
    if (group.size() > 1) group.all_reduce(all);
    return all.sum().item<double>();
  }

  // The trained adapters of the whole model (collective): under expert parallelism every rank's
  // expert adapters gathered, in a view that shares everything else.
  model::Muse whole_adapters() const {
    model::Weights w = trained().weights();
    if (cfg.parallel.ep > 1)
      for (model::LayerWeights& l : w.layers)
        for (at::Tensor* t : {&l.lora.gate_a, &l.lora.gate_b, &l.lora.up_a, &l.lora.up_b, &l.lora.down_a, &l.lora.down_b})
          if (t->defined()) *t = ep_group.all_gather(t->detach());
    return model::Muse(trained().config(), std::move(w));
  }

  // Before a sharded save (collective): LoRA's base is frozen, so only full-parameter runs check.
  void check_finite(const std::string& dir) const {
    if (!lora()) layout->check_finite(str_cat("step ", steps, " into ", dir));
  }

  // The trained weights into `out` (collective): with LoRA the PEFT adapter (rank 0), otherwise
  // the weights and the tokenizer's files, so that the folder loads on its own.
  void write_model(const std::string& out) const {
    if (lora()) {
      const model::Muse adapters = whole_adapters();
      if (group.rank() == 0) model::save_peft_adapter(adapters, out);
      return;
    }
    layout->write(trained(), zero3, out);
    const std::string tokenizer_files = text::tokenizer_dir(*tok);
    if (group.rank() == 0 && !tokenizer_files.empty()) text::copy_tokenizer_files(tokenizer_files, out);
  }

  // The adapters of `dir`/adapter into the trained ones in place (the optimizer holds them); an
  // expert shard takes its slice.
  void restore_adapters(const std::string& dir) {
    KILN_CHECK(std::filesystem::exists(dir + "/adapter/adapter_config.json"), "grpo: checkpoint ", dir,
               " has no adapter/ but the recipe trains LoRA adapters; resume with the recipe the run was started with");
    model::Muse saved(trained().config(), trained().weights());  // a view: load_peft_adapter replaces its adapters
    model::load_peft_adapter(saved, dir + "/adapter");
    auto mine = model::lora_parameters(trained()), theirs = model::lora_parameters(saved);
    KILN_CHECK(mine.size() == theirs.size(), "grpo: checkpoint ", dir, "/adapter holds ", theirs.size(),
               " adapters, the run trains ", mine.size());
    at::NoGradGuard g;
    for (size_t i = 0; i < mine.size(); ++i) {
      at::Tensor t = theirs[i].second;
      if (model::is_expert_tensor(mine[i].first) && t.size(0) != mine[i].second.size(0))  // this rank's experts
        t = t.narrow(0, ep_group.rank() * mine[i].second.size(0), mine[i].second.size(0));
      KILN_CHECK(mine[i].first == theirs[i].first && mine[i].second.sizes() == t.sizes(), "grpo: checkpoint ", dir,
                 "/adapter: ", theirs[i].first, " ", t.sizes(), " does not fit ", mine[i].first, " ",
                 mine[i].second.sizes());
      mine[i].second.copy_(t);
    }
  }
};

namespace {
// This rank's shard of the optimizer state in a checkpoint.
std::string optimizer_file(const comm::Group& g) {
  return g.size() == 1 ? "optimizer.safetensors"
                       : str_cat("optimizer-rank", g.rank(), "-of-", g.size(), ".safetensors");
}
}  // namespace

void GrpoTrainer::save(const std::string& dir) const {
  impl_->trainer_only("save checkpoints");
  const comm::Group& g = impl_->group;
  const CheckpointDir ck(dir);  // written as dir.tmp, state.json last, then swapped in
  const std::string tmp = ck.tmp();
  impl_->check_finite(dir);
  const double fingerprint = impl_->lora() ? impl_->base_fingerprint() : 0.0;
  if (g.rank() == 0) ck.begin();
  g.barrier();  // dir.tmp exists for every rank's files
  // LoRA: the frozen base is the recipe's; only its fingerprint goes with the adapters.
  impl_->write_model(tmp + (impl_->lora() ? "/adapter" : "/model"));
  if (impl_->reference) impl_->layout->write(*impl_->reference, impl_->ref_zero3.get(), tmp + "/reference");
  g.barrier();
  if (auto* opt = impl_->zero->optimizer()) opt->save(tmp + "/" + optimizer_file(g));  // each rank its own shard
  g.barrier();
  // state.json last: it marks the checkpoint complete; the old one goes only once the new one is in place.
  if (g.rank() == 0) {
    ck.write_marker(nlohmann::json{{"step", impl_->steps},
                                   {"data_position", impl_->data_position()},
                                   {"seed", impl_->cfg.seed},
                                   {"world", g.size()},
                                   {"ep", impl_->cfg.parallel.ep},
                                   {"lora_rank", impl_->cfg.lora.rank},
                                   {"lora_alpha", impl_->cfg.lora.alpha},
                                   {"base_fingerprint", fingerprint}}
                        .dump(2) + "\n");
    ck.commit();
  }
  g.barrier();
}

void GrpoTrainer::save_model(const std::string& dir) const {
  impl_->trainer_only("save models (its policy is placeholders)");
  impl_->check_finite(dir);
  impl_->layout->write_folder(dir, [&](const std::string& tmp) { impl_->write_model(tmp); });
}

void GrpoTrainer::load(const std::string& dir) {
  impl_->trainer_only("load checkpoints");
  impl_->stop_producer();  // its batches were drawn from the old position with the old weights
  impl_->end_session();    // the same for a rollout rank's
  // Whatever interrupted the last save, the newest complete checkpoint is put in place first.
  int64_t found = 0;
  if (impl_->group.rank() == 0) found = CheckpointDir(dir).recover();
  KILN_CHECK(found >= 0, "grpo: no complete checkpoint at ", dir, " (nor ", dir, ".old or ", dir,
             ".tmp with a state.json); nothing to resume from");
  impl_->group.barrier();
  std::ifstream f(dir + "/state.json");
  KILN_CHECK(f.good(), "grpo: no checkpoint state at ", dir, "/state.json; expected a directory written by save()");
  nlohmann::json st;
  try {
    f >> st;
  } catch (const nlohmann::json::exception& e) {
    KILN_FAIL("grpo: ", dir, "/state.json: invalid JSON (", e.what(), ")");
  }
  KILN_CHECK(st.contains("step") && st.contains("data_position"), "grpo: ", dir,
             "/state.json lacks step or data_position");
  KILN_CHECK(st.value("world", 1) == impl_->group.size() && st.value("ep", int64_t(1)) == impl_->cfg.parallel.ep,
             "grpo: checkpoint ", dir, " was written by ", st.value("world", 1), " ranks with ep=", st.value("ep", int64_t(1)),
             "; this run has ", impl_->group.size(), " ranks with ep=", impl_->cfg.parallel.ep,
             ": resume with the same layout (each rank's optimizer shard belongs to it)");
  const auto& lc = impl_->cfg.lora;
  KILN_CHECK(st.value("lora_rank", int64_t(0)) == lc.rank &&
                 (lc.rank == 0 || st.value("lora_alpha", 0.0) == lc.alpha),
             "grpo: checkpoint ", dir, " was written with lora rank ", st.value("lora_rank", int64_t(0)), " alpha ",
             st.value("lora_alpha", 0.0), "; the recipe says rank ", lc.rank, " alpha ", lc.alpha,
             ": resume with the recipe the run was started with");
  KILN_CHECK(st.value("seed", uint64_t(0)) == impl_->cfg.seed, "grpo: checkpoint ", dir, " was made with seed ",
             st.value("seed", uint64_t(0)), " but the recipe says ", impl_->cfg.seed);
  if (impl_->lora()) {
    const double want = st.value("base_fingerprint", 0.0), have = impl_->base_fingerprint();
    KILN_CHECK(want == have, "grpo: checkpoint ", dir, " holds adapters for another base (fingerprint ", want,
               ", this model's ", have, "); resume from the base the run started with");
    impl_->restore_adapters(dir);
  } else {
    impl_->layout->restore(impl_->trained(), dir, "model");
  }
  if (impl_->reference) {
    KILN_CHECK(std::filesystem::exists(dir + "/reference/config.json"), "grpo: checkpoint ", dir,
               " has no reference/ policy but the recipe's kl_coef=", impl_->cfg.loss.kl_coef,
               " needs one; resume with the kl_coef the run was started with");
    impl_->layout->restore(*impl_->reference, dir, "reference");
  }
  // An optimizer file without master weights starts them from the parameters just read.
  if (auto* opt = impl_->zero->optimizer()) opt->load(dir + "/" + optimizer_file(impl_->group));
  impl_->steps = st["step"].get<int64_t>();
  impl_->stream.seek(st["data_position"].get<uint64_t>());
  // LoRA's base is frozen (and checked above): the engine keeps its (perhaps NVFP4) base. Under the
  // split placement the next session sends the weights.
  if (!impl_->engine) return;
  impl_->push_to_engine();
  impl_->version_base = impl_->steps - impl_->engine->weight_version();
}

GrpoTrainer::GrpoTrainer(model::Muse& policy, GrpoConfig config, std::shared_ptr<const text::Tokenizer> tokenizer,
                         Dataset data, const comm::Group& group, std::shared_ptr<Reward> reward)
    : impl_(std::make_unique<Impl>(policy, std::move(config), std::move(tokenizer), std::move(data), group,
                                   std::move(reward))) {}
GrpoTrainer::~GrpoTrainer() = default;
void GrpoTrainer::set_last_step(int64_t step) {
  {
    std::lock_guard<std::mutex> lk(impl_->async.mu);
    impl_->last_step = step;
  }
  impl_->async.cv.notify_all();
}

StepMetrics GrpoTrainer::step() {
  try {
    return impl_->step();
  } catch (...) {
    // A step that failed part way leaves the weight versions out of step with the producer's
    // schedule (grpo.async): it would wait for an update that never comes. Stop it; a caller that
    // goes on gets a fresh one.
    impl_->stop_producer();
    if (impl_->engine) impl_->version_base = impl_->steps - impl_->engine->weight_version();  // the engine's weights start the next schedule
    // The same for a rollout rank: a new session from the weights there are (unless the link
    // itself failed; then only a new trainer goes on).
    try {
      impl_->end_session();
    } catch (const std::exception&) {
    }
    throw;
  }
}
EvalMetrics GrpoTrainer::evaluate(const EvalConfig& config) {
  impl_->trainer_only("evaluate (its trainer asks it to)");
  return impl_->evaluate(config);
}
const PrepareReport& GrpoTrainer::train_prompts() const { return impl_->train_report; }
const PrepareReport& GrpoTrainer::test_prompts() const { return impl_->test_report; }
const std::vector<GrpoTrainer::SampleRecord>& GrpoTrainer::last_samples() const { return impl_->last; }
int64_t GrpoTrainer::steps_done() const { return impl_->steps; }
void GrpoTrainer::sync_policy() {
  impl_->trainer_only("gather the policy");
  impl_->gather_experts();
}
const DataStream& GrpoTrainer::stream() const { return impl_->stream; }
const comm::Group& GrpoTrainer::group() const { return impl_->group; }
const std::vector<std::pair<std::string, double>>& GrpoTrainer::construction_memory() const {
  return impl_->built_memory;
}
bool GrpoTrainer::serves_rollouts() const { return impl_->rollout_side; }
void GrpoTrainer::serve_rollouts() { impl_->serve(); }

}  // namespace kiln::trainer
