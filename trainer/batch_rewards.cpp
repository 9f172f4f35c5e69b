// GRPO's rewards into advantages, and the reward metrics of a step over every rank.
#include "trainer/batch_rewards.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "core/error.h"
#include "trainer/losses.h"

namespace kiln::trainer {
namespace {

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

// The rollout engine's counters and, for episodes, turns and observation tokens, over every rank.
void reduce_rollout_counters(const ProducedBatch& p, const GrpoConfig& cfg, const comm::Group& group,
                             StepMetrics& m) {
  m.rollout_seconds = p.rollout_seconds;
  m.reward_seconds = p.reward_seconds;
  at::Tensor engine_sums = at::tensor({double(p.preemptions)}, at::kDouble);
  group.all_reduce(engine_sums);
  m.preemptions = int64_t(engine_sums.item<double>());
  m.kv_peak = group.all_reduce(p.kv_peak, comm::ReduceOp::kMax);
  m.expert_overflow_steps = int64_t(group.all_reduce(double(p.expert_overflow_steps), comm::ReduceOp::kMax));
  if (cfg.async) m.rollout_wait_seconds = group.all_reduce(p.wait_seconds, comm::ReduceOp::kMax);
  if (cfg.environment.enabled()) {
    at::Tensor sums = at::tensor({p.turns, p.observed}, at::kDouble);
    group.all_reduce(sums);
    const double count = double(p.batch.total * cfg.samples_per_prompt);
    m.episode_turns = sums[0].item<double>() / count;
    m.observation_tokens = sums[1].item<double>() / count;
  }
}

// This rank's sums of a batch's rewards, in the order reduce_reward_sums reads them.
struct RewardSums {
  std::vector<double> rewards, correct;
  double truncated = 0, overlong = 0;
  int64_t failures = 0, solved_prompts = 0, flat_groups = 0;
  KeyedSums parts;  // component -> (sum, count)
};

RewardSums sum_rewards(const ProducedBatch& p, int64_t n_per_prompt, std::vector<SampleRecord>& samples) {
  RewardSums s;
  for (const RewardRequest& r : p.reqs) s.truncated += r.truncated ? 1 : 0;
  samples.clear();
  for (size_t i = 0; i < p.results.size(); ++i) {
    const RewardResult& r = p.results[i];
    const RewardRequest& q = p.reqs[i];
    s.rewards.push_back(r.reward);
    s.correct.push_back(is_correct(r) ? 1.0 : 0.0);
    s.failures += r.failed ? 1 : 0;
    samples.push_back({q.prompt, q.response, q.label, q.data_source, r.reward, {}, q.truncated});
    for (const auto& [name, v] : r.components) {
      std::vector<double>& part = s.parts[name];
      part.resize(2);
      part[0] += v, part[1] += 1;
      samples.back().components[name] = v;
    }
  }
  const size_t n = size_t(n_per_prompt);
  for (size_t g = 0; g * n < s.rewards.size(); ++g) {
    const auto first = s.rewards.begin() + std::ptrdiff_t(g * n), end = first + std::ptrdiff_t(n);
    s.flat_groups += std::all_of(first, end, [&](double v) { return v == *first; }) ? 1 : 0;
    const auto c = s.correct.begin() + std::ptrdiff_t(g * n);
    s.solved_prompts += std::any_of(c, c + std::ptrdiff_t(n), [](double x) { return x > 0; }) ? 1 : 0;
  }
  return s;
}

// Every count and sum of the step in one reduction; min and max lengths in a second.
void reduce_reward_sums(const RewardSums& s, const ProducedBatch& p, const GrpoConfig& cfg, const comm::Group& group,
                        StepMetrics& m) {
  const std::vector<double>& lengths = p.lengths;
  const RewardStats& worker = p.worker;
  at::Tensor sums = at::tensor({std::accumulate(s.rewards.begin(), s.rewards.end(), 0.0),
                                std::accumulate(s.correct.begin(), s.correct.end(), 0.0),
                                std::accumulate(lengths.begin(), lengths.end(), 0.0), double(s.solved_prompts),
                                s.truncated, double(s.flat_groups), double(s.failures), double(worker.num_answered),
                                double(worker.num_timeouts), double(worker.num_restarts), double(worker.num_retries),
                                double(worker.num_garbage_lines), worker.total_seconds, s.overlong,
                                double(worker.num_protocol_violations)}, at::kDouble);
  group.all_reduce(sums);
  auto sum = [&](int64_t i) { return sums[i].item<double>(); };
  const double prompts = double(p.batch.total);
  const double count = prompts * double(cfg.samples_per_prompt);  // every prompt has n samples
  m.reward = sum(0) / count;
  m.accuracy = sum(1) / count;
  m.response_length = sum(2) / count;
  m.pass_at_n = sum(3) / prompts;
  m.truncated_fraction = sum(4) / count;
  m.zero_variance_groups = sum(5) / prompts;
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
  m.reward_stats.num_protocol_violations = int64_t(sum(14));
  // -min and max, so that one max-reduction gives both; a rank without samples adds nothing.
  at::Tensor mm = at::tensor({lengths.empty() ? -INFINITY : -*std::min_element(lengths.begin(), lengths.end()),
                              lengths.empty() ? -INFINITY : *std::max_element(lengths.begin(), lengths.end())},
                             at::kDouble);
  group.all_reduce(mm, comm::ReduceOp::kMax);
  m.response_length_min = -mm[0].item<double>();
  m.response_length_max = mm[1].item<double>();
  for (const auto& [name, sc] : all_reduce_keyed(group, s.parts))
    m.reward_components[name] = sc[0] / std::max(sc[1], 1.0);
}

// More failed samples in the batch than the recipe's max_failure_fraction allows stops the run,
// whatever on_failure says: a run that scores (nearly) every sample 0 trains on nothing. The counts
// are every rank's, so every rank raises the same error, with the first failure of the lowest rank
// that has one; none waits in a collective for another.
void check_failure_budget(const ProducedBatch& p, const GrpoConfig& cfg, const comm::Group& group,
                          int64_t failures) {
  const bool env = cfg.environment.enabled();
  const double limit = env ? cfg.environment.worker.max_failure_fraction : cfg.reward.max_failure_fraction();
  const int64_t samples = p.batch.total * cfg.samples_per_prompt;
  if (double(failures) <= limit * double(samples)) return;
  std::string mine;
  for (const RewardResult& r : p.results)
    if (r.failed) {
      mine = r.error.empty() ? "(no reason given)" : r.error;
      break;
    }
  const std::vector<std::string> all = gather_strings(group, mine);
  const auto first = std::find_if(all.begin(), all.end(), [](const std::string& e) { return !e.empty(); });
  const std::string where = first == all.end() ? "" : str_cat(" (rank ", first - all.begin(), ")");
  const char* key = env ? "environment.max_failure_fraction" : "reward.max_failure_fraction";
  KILN_FAIL("grpo: ", failures, " of the ", samples, env ? " episodes" : " samples", " of step ", p.batch.step,
            " failed (", env ? "environment" : "reward", " errors), more than ", key, "=", limit,
            " allows, whatever on_failure says; the first failure", where, ": ",
            first == all.end() ? "(none reported)" : *first, "; fix the ",
            env ? "environment" : "reward worker", ", or raise ", key, " (1: never stop)");
}

}  // namespace

bool is_correct(const RewardResult& r) {
  for (const auto& [name, v] : r.components)
    if (name == "correct") return v >= 0.5;
  return r.reward >= 0.5;
}

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

std::vector<Trajectory> finish_rewards(ProducedBatch p, const GrpoConfig& cfg, const comm::Group& group,
                                       StepMetrics& m, std::vector<SampleRecord>& samples) {
  reduce_rollout_counters(p, cfg, group, m);
  RewardSums s = sum_rewards(p, cfg.samples_per_prompt, samples);
  // The advantages see the shaped rewards; the reported reward stays the reward function's.
  std::vector<double> shaped = s.rewards;
  for (size_t i = 0; i < shaped.size(); ++i) {
    const double pen = overlong_penalty(int64_t(p.lengths[i]), cfg.max_tokens, cfg.overlong_buffer, cfg.overlong_penalty);
    shaped[i] += pen;
    s.overlong += pen;
  }
  at::Tensor adv = group_advantages(at::tensor(shaped, at::kDouble), cfg.samples_per_prompt, cfg.std_normalize);
  for (size_t i = 0; i < p.trajs.size(); ++i) {
    p.trajs[i].reward = shaped[i];
    p.trajs[i].advantage = adv[int64_t(i)].item<double>();
  }
  reduce_reward_sums(s, p, cfg, group, m);
  check_failure_budget(p, cfg, group, m.reward_failures);
  return std::move(p.trajs);
}

}  // namespace kiln::trainer
