// Reward workers: the request line and the reading of an answer's reward and components, over a
// WorkerPool (worker_pool.cpp runs the processes).
#include "trainer/reward_worker.h"

#include <nlohmann/json.hpp>

#include <cmath>

#include "core/error.h"

namespace kiln::trainer {
namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

}  // namespace

std::string worker_request_line(const RewardRequest& r) {
  OrderedJson metadata = request_metadata(r.metadata, "reward worker", r.id);  // errors before anything runs
  OrderedJson j;
  j["id"] = r.id;
  j["prompt"] = r.prompt;
  j["response"] = r.response;
  j["label"] = r.label;
  j["data_source"] = r.data_source;
  j["metadata"] = std::move(metadata);
  j["truncated"] = r.truncated;
  // Samples are model output: invalid UTF-8 becomes U+FFFD rather than an exception. ASCII with
  // JSON escapes, so that a worker's stdin decodes the same under any locale.
  return j.dump(-1, ' ', true, OrderedJson::error_handler_t::replace);
}

WorkerReward::WorkerReward(WorkerSpec spec) {
  spec.validate("reward.worker");
  pool_ = std::make_unique<WorkerPool>(std::move(spec), "reward worker");
}

WorkerReward::~WorkerReward() = default;

void WorkerReward::start() { pool_->start(); }

std::vector<RewardResult> WorkerReward::score(const std::vector<RewardRequest>& requests) {
  std::vector<int64_t> ids;
  std::vector<std::string> lines;
  for (const RewardRequest& r : requests) {
    ids.push_back(r.id);
    lines.push_back(worker_request_line(r));  // metadata errors surface before anything runs
  }
  std::vector<RewardResult> results(requests.size());
  const auto accept = [&](size_t index, const Json& j) -> std::string {
    const auto reward = j.find("reward");
    if (reward == j.end() || !reward->is_number() || !std::isfinite(reward->get<double>()))
      return str_cat("\"reward\" is missing or not a finite number (answer=", quote_for_error(j), ")");
    RewardResult& result = results[index];
    result.reward = reward->get<double>();
    if (const auto comps = j.find("components"); comps != j.end() && !comps->is_null()) {
      if (!comps->is_object()) return str_cat("\"components\" is not an object (answer=", quote_for_error(j), ")");
      for (const auto& [name, value] : comps->items()) {
        if (!value.is_number() || !std::isfinite(value.get<double>()))
          return str_cat("component \"", name, "\" is not a finite number (answer=", quote_for_error(j), ")");
        result.components.emplace_back(name, value.get<double>());
      }
    }
    return "";
  };
  const std::vector<WorkerOutcome> outcomes = pool_->call(ids, lines, accept);
  for (size_t i = 0; i < outcomes.size(); ++i)
    if (outcomes[i].failed) {
      results[i] = RewardResult();
      results[i].failed = true;
      results[i].error = outcomes[i].error;
    }
  return results;
}

RewardStats WorkerReward::stats() const { return pool_->stats(); }

std::vector<int> WorkerReward::worker_pids() const { return pool_->worker_pids(); }

}  // namespace kiln::trainer
