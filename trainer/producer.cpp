// GRPO's rollout side: prompts to samples (or episodes) to scored trajectories, and evaluation.
#include "trainer/producer.h"

#include <algorithm>

#include "core/clock.h"
#include "core/error.h"
#include "text/tokenizer.h"
#include "trainer/batch_rewards.h"

namespace kiln::trainer {
namespace {
std::vector<RewardResult> episode_results(const std::vector<std::vector<Episode>>& eps) {
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
}  // namespace

Producer::Producer(const GrpoConfig& cfg, rollout::Engine& engine, const text::Tokenizer& tok, Reward& reward,
                   Environment* env, DataStream& stream, const comm::Group& group)
    : cfg_(cfg), engine_(engine), tok_(tok), reward_(reward), env_(env), stream_(stream), group_(group) {}

PromptBatch Producer::draw_prompts(int64_t step) {
  std::vector<Example> all = stream_.next(cfg_.prompts_per_step);
  const int64_t P = int64_t(all.size()), R = group_.size();
  const int64_t p0 = P * group_.rank() / R, p1 = P * (group_.rank() + 1) / R;
  return {std::vector<Example>(all.begin() + p0, all.begin() + p1), P, p0, step};
}

ProducedBatch Producer::produce(const PromptBatch& b, int64_t round) {
  const rollout::EngineStats before = engine_.stats();
  engine_.reset_peaks();  // this batch's peak, not the run's (evaluation included)
  ProducedBatch p = produce_rollout(b, round);
  const rollout::EngineStats after = engine_.stats();
  p.preemptions = after.preemptions - before.preemptions;
  p.expert_overflow_steps = after.expert_overflow_steps - before.expert_overflow_steps;
  auto fraction = [](int64_t used, int64_t total) { return total > 0 ? double(used) / double(total) : 0.0; };
  p.kv_peak = std::max(fraction(after.peak_full_blocks, after.full_blocks_total),
                       fraction(after.peak_window_blocks, after.window_blocks_total));
  return p;
}

ProducedBatch Producer::produce_next(int64_t step) {
  const uint64_t position = stream_.position();
  ProducedBatch p = produce(draw_prompts(step), 0);
  p.data_position = position;
  return p;
}

ProducedBatch Producer::produce_rollout(const PromptBatch& b, int64_t round) {
  ProducedBatch p;
  p.batch = b;
  p.version = weight_version();
  auto t = Clock::now();
  if (env_) {
    std::vector<const Example*> examples;
    for (const Example& ex : b.prompts) examples.push_back(&ex);
    const RewardStats before = env_->stats();
    const auto eps = run_episodes(engine_, *env_, tok_, examples, requests_for(b, round));
    p.rollout_seconds = seconds_since(t);
    t = Clock::now();
    collect_episodes(b, eps, p);
    p.worker = env_->stats() - before;
    p.reward_seconds = seconds_since(t);
    return p;
  }
  auto outs = engine_.generate(requests_for(b, round));
  p.rollout_seconds = seconds_since(t);
  t = Clock::now();
  score_samples(b, outs, p);
  p.reward_seconds = seconds_since(t);
  return p;
}

std::vector<rollout::Request> Producer::requests_for(const PromptBatch& b, int64_t round) const {
  std::vector<rollout::Request> reqs;
  for (size_t i = 0; i < b.prompts.size(); ++i) {
    rollout::Request r;
    r.prompt = b.prompts[i].prompt_ids;
    r.params.n = cfg_.samples_per_prompt;
    r.params.max_tokens = cfg_.max_tokens;
    r.params.stop_token_ids = tok_.stop_ids();
    r.params.temperature = cfg_.temperature;
    r.params.top_p = cfg_.top_p;
    r.params.top_k = cfg_.top_k;
    // Per (step, round, global prompt index): rounds of dynamic sampling draw fresh streams.
    r.params.seed = cfg_.seed * 1000003ull + uint64_t(b.step) * 1009ull + uint64_t(round) * 7919ull * 1000003ull +
                    uint64_t(b.first + int64_t(i));
    reqs.push_back(std::move(r));
  }
  return reqs;
}

// The prompt's ids, then the response's; out of the loss when truncated under grpo.mask_truncated.
Trajectory Producer::trajectory(const Example& ex, const std::vector<int64_t>& response,
                                const std::vector<float>& logprobs, const at::Tensor& routing, bool truncated) const {
  Trajectory t;
  t.tokens = ex.prompt_ids;
  t.prompt_len = int64_t(t.tokens.size());
  t.tokens.insert(t.tokens.end(), response.begin(), response.end());
  t.rollout_lp = logprobs;
  t.routing = routing;
  t.in_loss = !(cfg_.mask_truncated && truncated);
  return t;
}

// Decodes and scores every sample (this rank's).
void Producer::score_samples(const PromptBatch& b, const std::vector<rollout::RequestOutput>& outs,
                             ProducedBatch& p) {
  for (size_t i = 0; i < outs.size(); ++i) {
    for (const auto& s : outs[i].samples) {
      p.reqs.push_back(reward_request(b.prompts[i], s, int64_t(p.reqs.size())));
      p.trajs.push_back(trajectory(b.prompts[i], s.tokens, s.logprobs, s.routing, p.reqs.back().truncated));
      p.lengths.push_back(double(s.tokens.size()));
    }
  }
  const RewardStats before = reward_.stats();
  p.results = reward_.score(p.reqs);
  KILN_CHECK(p.results.size() == p.reqs.size(), "grpo: the reward returned ", p.results.size(), " results for ",
             p.reqs.size(), " samples");
  p.worker = reward_.stats() - before;
}

// Episodes (grpo.environment) as trajectories: the ids the model saw, observation tokens out of
// the loss, the environment's last reward.
void Producer::collect_episodes(const PromptBatch& b, const std::vector<std::vector<Episode>>& eps,
                                ProducedBatch& p) const {
  for (size_t i = 0; i < eps.size(); ++i)
    for (const Episode& e : eps[i]) {
      p.trajs.push_back(trajectory(b.prompts[i], e.response, e.logprobs, e.routing, e.truncated));
      p.trajs.back().sampled = e.sampled;
      RewardRequest r;  // what the sample dump and the metrics read
      r.id = int64_t(p.reqs.size());
      r.prompt = b.prompts[i].prompt_text;
      r.response = tok_.decode(e.response);
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

RewardRequest Producer::reward_request(const Example& ex, const rollout::Sample& s, int64_t id) const {
  RewardRequest r;
  r.id = id;
  r.prompt = ex.prompt_text;
  // The response as sampled, less a special stop token that ended it (<|im_end|>): special
  // tokens sampled inside a response stay visible to the reward, and a textual stop such as the
  // byte tokenizer's '\n' stays part of the text.
  r.response = response_text(tok_, s.tokens, s.finish);
  r.label = ex.label;
  r.data_source = ex.data_source;
  r.metadata = ex.metadata.empty() ? "{}" : ex.metadata;
  r.truncated = s.finish == rollout::FinishReason::kLength;
  return r;
}

// The test prompts [e0, e1), k samples each, scored by the training reward (episodes by the
// environment).
std::vector<RewardResult> Producer::sample_and_score(const std::vector<Example>& test, int64_t e0, int64_t e1,
                                                     int64_t k, const EvalConfig& ec, int64_t step) {
  std::vector<rollout::Request> reqs;
  for (int64_t i = e0; i < e1; ++i) {
    rollout::Request r;
    r.prompt = test[size_t(i)].prompt_ids;
    r.params.n = k;
    r.params.max_tokens = ec.max_tokens.value_or(cfg_.max_tokens);
    r.params.stop_token_ids = tok_.stop_ids();
    r.params.temperature = ec.temperature;
    r.params.top_p = cfg_.top_p;
    r.params.top_k = cfg_.top_k;
    r.params.seed = cfg_.seed * 7919ull + uint64_t(step) * 104729ull + uint64_t(i);
    reqs.push_back(std::move(r));
  }
  if (env_) {
    std::vector<const Example*> examples;
    for (int64_t i = e0; i < e1; ++i) examples.push_back(&test[size_t(i)]);
    return episode_results(run_episodes(engine_, *env_, tok_, examples, std::move(reqs)));
  }
  auto outs = engine_.generate(reqs);
  std::vector<RewardRequest> rr;
  for (int64_t i = e0; i < e1; ++i)
    for (const auto& s : outs[size_t(i - e0)].samples)
      rr.push_back(reward_request(test[size_t(i)], s, int64_t(rr.size())));
  return reward_.score(rr);
}

EvalMetrics Producer::evaluate(const EvalConfig& ec, const std::vector<Example>& test, int64_t step) {
  ec.validate();
  EvalMetrics em;
  em.step = step;
  em.k = ec.temperature == 0 ? 1 : ec.samples;
  const int64_t count = std::min<int64_t>(ec.prompts, int64_t(test.size()));
  const int64_t e0 = count * group_.rank() / group_.size(), e1 = count * (group_.rank() + 1) / group_.size();
  const std::vector<RewardResult> results = sample_and_score(test, e0, e1, em.k, ec, step);
  // Per data_source: prompts, correct samples, prompts with one correct, reward sum.
  KeyedSums mine;
  for (int64_t i = e0; i < e1; ++i) {
    double right = 0, rewards = 0;
    for (int64_t j = 0; j < em.k; ++j) {
      const RewardResult& r = results[size_t((i - e0) * em.k + j)];
      right += is_correct(r) ? 1 : 0;
      rewards += r.reward;
    }
    std::vector<double>& e = mine[test[size_t(i)].data_source];
    e.resize(4);
    e[0] += 1;
    e[1] += right;
    e[2] += right > 0 ? 1 : 0;
    e[3] += rewards;
  }
  const KeyedSums sums = all_reduce_keyed(group_, mine);
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

}  // namespace kiln::trainer
