// Environments: the request line, the reading of an answer (done, reward, observation text or ids)
// and the spec's checks, over a WorkerPool.
#include "trainer/environment.h"

#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include <cmath>

#include "core/error.h"
#include "core/yaml_util.h"

namespace kiln::trainer {
namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

// Why the answer cannot be used ("" when it can), filling `step`.
std::string read_answer(const Json& j, EnvStep& step) {
  const auto done = j.find("done");
  if (done == j.end() || !done->is_boolean()) return str_cat("\"done\" is missing or not true/false (answer=", quote_for_error(j), ")");
  step.done = done->get<bool>();
  if (const auto r = j.find("reward"); r != j.end()) {
    if (!r->is_number() || !std::isfinite(r->get<double>()))
      return str_cat("\"reward\" is not a finite number (answer=", quote_for_error(j), ")");
    step.reward = r->get<double>();
  }
  if (const auto comps = j.find("components"); comps != j.end() && !comps->is_null()) {
    if (!comps->is_object()) return str_cat("\"components\" is not an object (answer=", quote_for_error(j), ")");
    for (const auto& [name, value] : comps->items()) {
      if (!value.is_number() || !std::isfinite(value.get<double>()))
        return str_cat("component \"", name, "\" is not a finite number (answer=", quote_for_error(j), ")");
      step.components.emplace_back(name, value.get<double>());
    }
  }
  if (step.done) return "";
  const auto text = j.find("observation"), ids = j.find("observation_ids");
  const bool has_text = text != j.end() && !text->is_null(), has_ids = ids != j.end() && !ids->is_null();
  if (has_text == has_ids)
    return str_cat("an episode that goes on (done: false) needs exactly one of \"observation\" and ",
                   "\"observation_ids\" (answer=", quote_for_error(j), ")");
  if (has_text) {
    if (!text->is_string()) return str_cat("\"observation\" is not a string (answer=", quote_for_error(j), ")");
    step.observation = text->get<std::string>();
    if (step.observation.empty()) return str_cat("\"observation\" is empty (answer=", quote_for_error(j), ")");
    return "";
  }
  if (!ids->is_array() || ids->empty()) return str_cat("\"observation_ids\" is not a non-empty array (answer=", quote_for_error(j), ")");
  for (size_t i = 0; i < ids->size(); ++i) {
    const Json& v = (*ids)[i];
    if (!v.is_number_integer() || v.get<int64_t>() < 0)
      return str_cat("\"observation_ids\"[", i, "] is not a token id >= 0 (answer=", quote_for_error(j), ")");
    step.observation_ids.push_back(v.get<int64_t>());
  }
  step.has_ids = true;
  return "";
}

// Why a demonstration cannot be used ("" when it can), filling `demo`.
std::string read_demo(const Json& j, EnvDemo& demo) {
  demo = EnvDemo();
  const auto turns = j.find("turns");
  if (turns == j.end() || !turns->is_array())
    return str_cat("\"turns\" is missing or not an array (answer=", quote_for_error(j), ")");
  for (size_t i = 0; i < turns->size(); ++i) {
    const Json& t = (*turns)[i];
    const bool last = i + 1 == turns->size();
    if (!t.is_object() || !t.contains("response") || !t["response"].is_string())
      return str_cat("turns[", i, "] has no \"response\" string (answer=", quote_for_error(j), ")");
    EnvTurn turn;
    turn.response = t["response"].get<std::string>();
    const bool has_text = t.contains("observation") && !t["observation"].is_null();
    const bool has_ids = t.contains("observation_ids") && !t["observation_ids"].is_null();
    if (last && (has_text || has_ids))
      return str_cat("the last turn (turns[", i, "]) has an observation; the episode must end on a response (answer=",
                     quote_for_error(j), ")");
    if (!last && has_text == has_ids)
      return str_cat("turns[", i, "] needs exactly one of \"observation\" and \"observation_ids\" (answer=",
                     quote_for_error(j), ")");
    if (has_text) {
      if (!t["observation"].is_string() || t["observation"].get<std::string>().empty())
        return str_cat("turns[", i, "].observation is not a non-empty string (answer=", quote_for_error(j), ")");
      turn.observation = t["observation"].get<std::string>();
    } else if (has_ids) {
      const Json& ids = t["observation_ids"];
      if (!ids.is_array() || ids.empty())
        return str_cat("turns[", i, "].observation_ids is not a non-empty array (answer=", quote_for_error(j), ")");
      for (const Json& v : ids) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0)
          return str_cat("turns[", i, "].observation_ids holds something other than a token id >= 0 (answer=",
                         quote_for_error(j), ")");
        turn.observation_ids.push_back(v.get<int64_t>());
      }
    }
    demo.turns.push_back(std::move(turn));
  }
  return "";
}

}  // namespace

void EnvironmentSpec::validate(const std::string& path) const {
  worker.validate(path);
  KILN_CHECK(max_turns >= 1, path, ".max_turns: below 1 (max_turns=", max_turns, "); allow one turn at least");
  KILN_CHECK(max_episode_tokens >= 1, path, ".max_episode_tokens: below 1 (max_episode_tokens=", max_episode_tokens,
             "); give the tokens an episode may add after its prompt");
  KILN_CHECK(max_observation_tokens >= 1, path, ".max_observation_tokens: below 1 (max_observation_tokens=",
             max_observation_tokens, ")");
}

std::string environment_request_line(const EnvRequest& r) {
  OrderedJson metadata = request_metadata(r.metadata, "environment", r.id);
  OrderedJson history = OrderedJson::array();
  for (const EnvTurn& t : r.history)
    history.push_back(OrderedJson{{"response", t.response},
                                  {"response_ids", t.response_ids},
                                  {"observation", t.observation},
                                  {"observation_ids", t.observation_ids}});
  OrderedJson j;
  j["id"] = r.id;
  j["turn"] = r.turn;
  j["prompt"] = r.prompt;
  j["label"] = r.label;
  j["data_source"] = r.data_source;
  j["metadata"] = std::move(metadata);
  j["history"] = std::move(history);
  j["response"] = r.response;
  j["response_ids"] = r.response_ids;
  j["truncated"] = r.truncated;
  return j.dump(-1, ' ', true, OrderedJson::error_handler_t::replace);
}

std::string environment_demo_line(const EnvDemoRequest& r) {
  OrderedJson j;
  j["id"] = r.id;
  j["demonstrate"] = true;
  j["prompt"] = r.prompt;
  j["label"] = r.label;
  j["data_source"] = r.data_source;
  j["metadata"] = request_metadata(r.metadata, "environment", r.id);
  return j.dump(-1, ' ', true, OrderedJson::error_handler_t::replace);
}

Environment::Environment(EnvironmentSpec spec) : spec_(std::move(spec)) {
  spec_.validate();
  pool_ = std::make_unique<WorkerPool>(spec_.worker, "environment");
}

namespace {
// One pool call: a line per request, each answer read into its slot (read returns why it cannot
// be used, or ""), and a failed request's slot made by failed(error).
template <typename Answer, typename Request, typename Line, typename Read, typename Failed>
std::vector<Answer> ask(WorkerPool& pool, const std::vector<Request>& requests, Line line, Read read, Failed failed) {
  std::vector<int64_t> ids;
  std::vector<std::string> lines;
  for (const Request& r : requests) {
    ids.push_back(r.id);
    lines.push_back(line(r));
  }
  std::vector<Answer> answers(requests.size());
  const std::vector<WorkerOutcome> outcomes =
      pool.call(ids, lines, [&](size_t i, const Json& j) { return read(j, answers[i]); });
  for (size_t i = 0; i < outcomes.size(); ++i)
    if (outcomes[i].failed) answers[i] = failed(outcomes[i].error);
  return answers;
}
}  // namespace

std::vector<EnvStep> Environment::step(const std::vector<EnvRequest>& requests) {
  return ask<EnvStep>(*pool_, requests, environment_request_line, read_answer, [](const std::string& error) {
    EnvStep s;
    s.done = s.failed = true;
    s.error = error;
    return s;
  });
}

std::vector<EnvDemo> Environment::demonstrate(const std::vector<EnvDemoRequest>& requests) {
  return ask<EnvDemo>(*pool_, requests, environment_demo_line, read_demo,
                      [](const std::string& error) { return EnvDemo{{}, true, error}; });
}

void Environment::start() { pool_->start(); }

RewardStats Environment::stats() const { return pool_->stats(); }

std::vector<int> Environment::worker_pids() const { return pool_->worker_pids(); }

void read_yaml(yaml::MapReader& m, EnvironmentSpec& spec) {
  read_yaml(m, spec.worker);
  m.get("max_turns", spec.max_turns);
  m.get("max_episode_tokens", spec.max_episode_tokens);
  m.get("max_observation_tokens", spec.max_observation_tokens);
  m.finish();
  m.check("", [&] { spec.validate("environment"); });
}

void write_yaml(YAML::Emitter& e, const EnvironmentSpec& spec) {
  write_yaml(e, spec.worker);
  e << YAML::Key << "max_turns" << YAML::Value << spec.max_turns;
  e << YAML::Key << "max_episode_tokens" << YAML::Value << spec.max_episode_tokens;
  e << YAML::Key << "max_observation_tokens" << YAML::Value << spec.max_observation_tokens;
}

}  // namespace kiln::trainer
