// The GRPO step as a coordinator (docs/MODEL.md §6): take a rolled-out batch from the rollout
// source, turn its rewards into group advantages, score lp_old, train, and sync the weights back.
// The parts live in their own files: producer.h (rollout and rewards), rollout_source.h and
// split_rollout.h (where batches come from), learner.h (scoring, mini-steps, checkpoints) and
// weight_sync.h (the probe check).
#include "trainer/grpo.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <iterator>

#include "core/clock.h"
#include "core/error.h"
#include "model/checkpoint.h"
#include "text/tokenizer.h"
#include "trainer/batch_rewards.h"
#include "trainer/learner.h"
#include "trainer/producer.h"
#include "trainer/rollout_source.h"
#include "trainer/split_rollout.h"
#include "trainer/weight_sync.h"

namespace kiln::trainer {
namespace {

// Under grpo.async.placement split, the half of `g` this rank is in (trainers first); else `g`.
comm::Group role_group(const comm::Group& g, const GrpoConfig& c) {
  if (!c.split_placement()) return g;
  KILN_CHECK(g.size() >= 2 && g.size() % 2 == 0, "grpo: async.placement split needs an even number of ranks, the ",
             "first half to train and the second to roll out (got ", g.size(), ")");
  return g.split(g.rank() < g.size() / 2 ? 0 : 1, g.rank());
}

// The peak device memory of the phase that just ended, and a fresh count for the next.
struct PhasePeaks {
  at::Device device;
  explicit PhasePeaks(at::Device d) : device(d) { model::reset_peak_memory(device); }
  double next() const {
    const double gb = model::peak_memory_gb(device);
    model::reset_peak_memory(device);
    return gb;
  }
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
  comm::Group group;               // every rank that trains: each holds its own share of the prompts
  // grpo.async.placement split: this rank is one of the second half, which roll out.
  bool rollout_side = false;
  int partner = -1;                // ... and its trainer rank
  std::vector<std::pair<std::string, double>> built_memory;  // GrpoTrainer::construction_memory
  std::unique_ptr<Learner> learner;
  std::unique_ptr<ProbeCheck> probe;
  std::unique_ptr<rollout::Engine> engine;  // on a rank that rolls out
  std::unique_ptr<Producer> producer;       // ... over it
  std::unique_ptr<RolloutSource> source;    // a trainer's batches (destroyed first: it may run a thread)
  std::unique_ptr<RolloutServer> server;    // a split rollout rank's loop
  std::vector<SampleRecord> last;  // the last step's samples (this rank's), for sample dumps
  int64_t steps = 0;

  Impl(model::Muse& p, GrpoConfig c, std::shared_ptr<const text::Tokenizer> t, Dataset d, const comm::Group& g,
       std::shared_ptr<Reward> r)
      : policy(p), cfg(std::move(c)), tok(std::move(t)), reward(std::move(r)), data(prepared(std::move(d))),
        stream(data.train, cfg.seed), group(role_group(g, cfg)) {
    cfg.validate();
    rollout_side = cfg.split_placement() && g.rank() >= g.size() / 2;
    if (rollout_side) partner = g.rank() - g.size() / 2;
    cfg.parallel.resolve(group.size(), policy.config().num_experts);
    check_placement();
    if (!reward) reward = make_reward(cfg.reward);
    if (cfg.environment.enabled()) env = std::make_unique<Environment>(cfg.environment);
    if (!cfg.split_placement() || rollout_side) {  // the ranks that score: a worker that cannot run fails now
      reward->start();
      if (env) env->start();
    }
    const auto note = [this](const char* what) {
      if (policy.device().is_cuda()) built_memory.emplace_back(what, model::current_memory_gb(policy.device()));
    };
    note("policy");
    learner = std::make_unique<Learner>(policy, cfg, group, text::tokenizer_dir(*tok), note);
    probe = std::make_unique<ProbeCheck>(cfg, data, *tok);
    build_engine();
    note("engine");
    if (engine) producer = std::make_unique<Producer>(cfg, *engine, *tok, *reward, env.get(), stream, group);
    const int half = g.size() / 2;
    if (rollout_side) {
      server = std::make_unique<RolloutServer>(cfg, g, partner, *producer, learner->trained(), *probe, stream,
                                               data.test);
      return;
    }
    learner->prepare_training(note);
    if (cfg.split_placement())
      source = std::make_unique<RankRollout>(cfg, g, g.rank() + half, *learner, *probe, stream);
    else if (cfg.async)
      source = std::make_unique<ThreadedRollout>(cfg, *producer, *learner, *probe, stream, data.test);
    else
      source = std::make_unique<ColocatedRollout>(cfg, *producer, *learner, *probe, stream, data.test);
  }

  // What the layout, the placement and the model allow together.
  void check_placement() const {
    KILN_CHECK(!cfg.split_placement() || (cfg.parallel.ep == 1 && !cfg.parallel.zero3()), "grpo: async.placement split ",
               "sends whole weights from each trainer rank to its rollout rank, so every trainer must hold the whole ",
               "model: use parallel.ep 1 and dense replicated (got ep ", cfg.parallel.ep, ", dense ",
               parallel::dense_sharding_name(cfg.parallel.dense), ")");
    KILN_CHECK(cfg.prompts_per_step >= group.size(), "grpo: prompts_per_step (", cfg.prompts_per_step,
               ") must be at least the number of ranks (", group.size(), "): a prompt's group stays on one rank");
    KILN_CHECK(!cfg.dynamic_sampling || (cfg.parallel.ep == 1 && !cfg.parallel.zero3()), "grpo: dynamic_sampling ",
               "keeps unequal numbers of groups per rank, which expert parallelism (parallel.ep=", cfg.parallel.ep,
               ") and ZeRO-3 (parallel.dense: ", parallel::dense_sharding_name(cfg.parallel.dense),
               ") cannot train yet; use ep 1 and dense replicated");
    KILN_CHECK(tok->vocab_size() <= policy.config().vocab_size, "grpo: the tokenizer ", tok->name(), " has ",
               tok->vocab_size(), " ids but the model's vocab_size is ", policy.config().vocab_size,
               "; use a model config whose vocabulary covers the tokenizer");
    KILN_CHECK(!cfg.async || !cfg.parallel.sharded_rollout(), "grpo: async rollouts need a rollout ",
               "that serves the whole model on each rank (the expert-sharded one steps in lockstep with the ",
               "trainer's collectives); set parallel.rollout: replica");
    if (cfg.environment.enabled()) {
      KILN_CHECK(!cfg.parallel.sharded_rollout(), "grpo: multi-turn episodes (environment) need a rollout that ",
                 "serves the whole model on each rank, not the expert-sharded one (its ranks step in lockstep, ",
                 "episodes do not); set parallel.rollout: replica");
      const int64_t longest = cfg.prompt.max_prompt_tokens.value_or(0) + cfg.environment.max_episode_tokens;
      KILN_CHECK(!cfg.prompt.max_prompt_tokens || longest <= policy.config().max_position_embeddings,
                 "grpo: an episode may reach prompt.max_prompt_tokens + environment.max_episode_tokens = ", longest,
                 " tokens, beyond the model's max_position_embeddings (", policy.config().max_position_embeddings,
                 "); lower either");
    }
    if (cfg.parallel.cp > 1) {
      // A micro-batch holds at least one trajectory of its prompt and one sampled token.
      size_t shortest = SIZE_MAX;
      for (const Example& e : data.train) shortest = std::min(shortest, e.prompt_ids.size());
      KILN_CHECK(int64_t(shortest) + 1 >= cfg.parallel.cp, "grpo: parallel.cp ", cfg.parallel.cp, " splits each ",
                 "micro-batch's tokens over ", cfg.parallel.cp, " ranks, but the shortest prompt has ", shortest,
                 " tokens, so a micro-batch may hold fewer tokens than ranks; lower parallel.cp (it is for long ",
                 "sequences)");
    }
    if (cfg.parallel.ep > 1 || cfg.parallel.zero3())
      KILN_CHECK(cfg.prompts_per_step % group.size() == 0, "grpo: expert parallel and ZeRO-3 need prompts_per_step (",
                 cfg.prompts_per_step, ") divisible by the ranks (", group.size(),
                 "): every rank must run the same number of forwards, which exchange tokens or gather weights");
  }

  // The engine where this rank rolls out: on every rank, except a trainer of the split placement.
  // Its weights are fetched tensor by tensor where this rank holds a share.
  void build_engine() {
    rollout::EngineConfig ec = cfg.engine;
    if (cfg.parallel.sharded_rollout()) ec.expert_group = &learner->layout().ep_group();  // this rank's experts
    ec.share_weights = (cfg.lora && !learner->layout().sharded()) || learner->engine_reads_trained();
    if (rollout_side) build_rollout_engine(ec);
    else if (!cfg.split_placement()) engine = std::make_unique<rollout::Engine>(learner->trained(), ec, learner->engine_source());
  }

  // A split rollout rank's engine, which holds the only copy of the weights: the policy becomes
  // zero-element placeholders (which weight syncs name but never fill), and the engine, built from
  // them, takes each weight from the old policy, which lets it go at once. So no more than one
  // copy and one tensor are ever held. LoRA's engine shares the frozen base instead.
  void build_rollout_engine(const rollout::EngineConfig& ec) {
    if (cfg.lora) {
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

  // The dataset with its prompts rendered and tokenized (config.prompt); the reports say how many
  // were too long.
  Dataset prepared(Dataset d) {
    KILN_CHECK(tok, "grpo: no tokenizer given");
    train_report = prepare_prompts(d.train, *tok, cfg.prompt);
    test_report = prepare_prompts(d.test, *tok, cfg.prompt);
    KILN_CHECK(!d.train.empty(), "grpo: no training prompt is left after the length filter (", train_report.too_long,
               " longer than prompt.max_prompt_tokens=", cfg.prompt.max_prompt_tokens.value_or(0), "); raise the limit");
    return d;
  }

  // Refuses `what` on a rollout rank of async.placement split, which only serves rollouts.
  void trainer_only(const char* what) const {
    KILN_CHECK(!rollout_side, "grpo: this rank rolls out for trainer rank ", partner,
               " (async.placement split); it serves rollouts and does not ", what);
  }

  // ---- the step ----

  StepMetrics step() {
    trainer_only("take steps");
    const auto t_step = Clock::now();
    const PhasePeaks peaks(policy.device());
    StepMetrics m;
    m.step = ++steps;
    ProducedBatch produced = take_batch(m);
    PromptBatch b = produced.batch;
    std::vector<Trajectory> trajs = finish_rewards(std::move(produced), cfg, group, m, last);
    if (cfg.dynamic_sampling) b = keep_informative_groups(trajs, m);
    learner->share_context(trajs, b);  // parallel.cp: the group trains its ranks' trajectories together
    m.rollout_peak_gb = peaks.next();
    auto t = Clock::now();
    const OldLogprobs old = learner->score_old(trajs, b, m);
    m.lp_old_seconds = seconds_since(t);
    m.lp_old_peak_gb = peaks.next();
    t = Clock::now();
    learner->train(trajs, old, b, steps, m);
    m.train_seconds = seconds_since(t);
    m.train_peak_gb = std::max({peaks.next(), m.backward_peak_gb, m.optimizer_peak_gb});  // train() reset the count
    source->sync_weights(steps, m);
    m.sync_peak_gb = peaks.next();
    m.step_seconds = seconds_since(t_step);
    m.tokens_per_second = double(m.tokens) / std::max(m.step_seconds, 1e-9);
    m.peak_memory_gb = std::max({m.rollout_peak_gb, m.lp_old_peak_gb, m.train_peak_gb, m.sync_peak_gb});
    m.memory_after_gb = model::current_memory_gb(policy.device());
    return m;
  }

  // This step's batch; under grpo.async made ahead, exactly min(steps - 1, k) updates stale.
  ProducedBatch take_batch(StepMetrics& m) {
    if (!cfg.async) return source->take(steps, m);
    const auto t = Clock::now();
    ProducedBatch p = source->take(steps, m);
    m.async_wait_seconds = seconds_since(t);
    m.staleness = (steps - 1) - p.version;
    // min(steps - 1, k) exactly, but fresher right after a resume (the loaded weights are all there is).
    KILN_CHECK(p.batch.step == steps && m.staleness >= 0 && m.staleness <= cfg.async->max_staleness,
               "grpo: internal error: step ", steps, " got batch ", p.batch.step, " of weight version ", p.version,
               " (max_staleness ", cfg.async->max_staleness, "); report this");
    return p;
  }

  // Dynamic sampling: drops the flat groups of `trajs` (this rank's, group by group) and samples
  // more rounds until prompts_per_step groups are kept over all ranks or the rounds run out; then
  // trims to prompts_per_step in rank order (each rank keeping at least one group, flat if need
  // be, so that every rank trains). Returns the batch the kept trajectories form.
  PromptBatch keep_informative_groups(std::vector<Trajectory>& trajs, StepMetrics& m) {
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
    Producer* local = source->local();
    KILN_CHECK(local, "grpo: internal error: dynamic_sampling without a synchronous rollout; report this");
    while (int64_t(group.all_reduce(double(kept.size() / n))) < cfg.prompts_per_step &&
           rounds <= cfg.max_sampling_rounds) {
      const PromptBatch more = local->draw_prompts(steps);
      StepMetrics scratch;  // the reward metrics and the sample dump stay the first round's
      std::vector<SampleRecord> ignored;
      std::vector<Trajectory> round = finish_rewards(local->produce(more, rounds), cfg, group, scratch, ignored);
      take(round);
      ++rounds;
    }
    // Each rank's share, in rank order of what each kept, from one gather of the counts. One group
    // at least per rank: a rank without trajectories would leave the others waiting in the step's
    // collectives. So a batch may pass prompts_per_step by up to the number of ranks less one.
    const at::Tensor counts = group.all_gather(at::tensor(std::vector<int64_t>{int64_t(kept.size() / n)}));
    PromptBatch b;
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

  EvalMetrics evaluate(const EvalConfig& ec) {
    trainer_only("evaluate (its trainer asks it to)");
    return source->evaluate(ec, steps);
  }

  // The batches a checkpoint kept, made ahead of step `steps` + 1 on: trained first, so that the
  // resumed run is the uninterrupted one. Made under another max_staleness they do not fit this
  // run's schedule; then they go and the run samples again from the oldest one's prompts.
  void resume_ahead(BatchesAhead ahead, const std::string& dir) {
    if (ahead.max_staleness != cfg.async->max_staleness) {
      std::fprintf(stderr, "grpo: %s holds %zu batches made ahead under async.max_staleness %lld; this run's is %lld, "
                   "so they are sampled again\n", dir.c_str(), ahead.batches.size(),
                   static_cast<long long>(ahead.max_staleness), static_cast<long long>(cfg.async->max_staleness));
      return;
    }
    for (size_t j = 0; j < ahead.batches.size(); ++j)
      KILN_CHECK(ahead.batches[j].batch.step == steps + 1 + int64_t(j), "grpo: checkpoint ", dir,
                 ": batch ", j + 1, " made ahead is for step ", ahead.batches[j].batch.step, " where step ",
                 steps + 1 + int64_t(j), " was due; the checkpoint is damaged");
    stream.seek(ahead.next_position);
    source->preload(std::move(ahead.batches));
  }

  // A failed step leaves the weight versions out of step with the producer's schedule (grpo.async):
  // it would wait for an update that never comes. The batches made ahead go; the engine's weights
  // start the next schedule. A rollout rank starts a new session from the weights there are (unless
  // the link itself failed; then only a new trainer goes on).
  void recover_from_failed_step() noexcept {
    if (!source) return;
    try {
      source->stop();
      source->restart(steps, /*push=*/false);
    } catch (const std::exception&) {
    }
  }
};

GrpoTrainer::GrpoTrainer(model::Muse& policy, GrpoConfig config, std::shared_ptr<const text::Tokenizer> tokenizer,
                         Dataset data, const comm::Group& group, std::shared_ptr<Reward> reward)
    : impl_(std::make_unique<Impl>(policy, std::move(config), std::move(tokenizer), std::move(data), group,
                                   std::move(reward))) {}
GrpoTrainer::~GrpoTrainer() = default;

StepMetrics GrpoTrainer::step() {
  try {
    return impl_->step();
  } catch (...) {
    impl_->recover_from_failed_step();
    throw;
  }
}

EvalMetrics GrpoTrainer::evaluate(const EvalConfig& config) { return impl_->evaluate(config); }

void GrpoTrainer::set_last_step(int64_t step) {
  if (impl_->source) impl_->source->set_last_step(step);
}

// Under grpo.async the batches made ahead go with the checkpoint: they were sampled with weights
// older than its own, which a resumed run no longer has.
void GrpoTrainer::save(const std::string& dir) const {
  impl_->trainer_only("save checkpoints");
  const BatchesAhead ahead = impl_->source->ahead();
  const uint64_t oldest = ahead.batches.empty() ? ahead.next_position : ahead.batches.front().data_position;
  impl_->learner->save(dir, impl_->steps, oldest, impl_->cfg.async ? &ahead : nullptr);
}

void GrpoTrainer::save_model(const std::string& dir) const {
  impl_->trainer_only("save models (its policy is placeholders)");
  impl_->learner->save_model(dir, impl_->steps);
}

void GrpoTrainer::load(const std::string& dir) {
  impl_->trainer_only("load checkpoints");
  impl_->source->stop();  // its batches were drawn from the old position with the old weights
  TrainedState st = impl_->learner->load(dir);
  impl_->steps = st.step;
  impl_->stream.seek(st.data_position);
  if (st.ahead && impl_->cfg.async) impl_->resume_ahead(std::move(*st.ahead), dir);
  // LoRA's base is frozen (and checked): the engine keeps its (perhaps NVFP4) base and takes the
  // adapters. Under the split placement the next session sends the weights.
  impl_->source->restart(impl_->steps, /*push=*/true);
}

void GrpoTrainer::sync_policy() {
  impl_->trainer_only("gather the policy");
  impl_->learner->update_policy();
}

void GrpoTrainer::serve_rollouts() {
  KILN_CHECK(impl_->server, "grpo: serve_rollouts is for the rollout ranks of async.placement split; this rank trains");
  impl_->server->serve();
}

const PrepareReport& GrpoTrainer::train_prompts() const { return impl_->train_report; }
const PrepareReport& GrpoTrainer::test_prompts() const { return impl_->test_report; }
const std::vector<GrpoTrainer::SampleRecord>& GrpoTrainer::last_samples() const { return impl_->last; }
int64_t GrpoTrainer::steps_done() const { return impl_->steps; }
const DataStream& GrpoTrainer::stream() const { return impl_->stream; }
const comm::Group& GrpoTrainer::group() const { return impl_->group; }
const std::vector<std::pair<std::string, double>>& GrpoTrainer::construction_memory() const {
  return impl_->built_memory;
}
bool GrpoTrainer::serves_rollouts() const { return impl_->rollout_side; }

}  // namespace kiln::trainer
