// Environments for multi-turn episodes: worker processes (any language, over a WorkerPool) that
// answer each sampled turn with an observation to append, the episode's reward so far, and whether
// it is over. Pure C++ (POSIX); no torch headers. The GRPO step drives them (grpo.environment).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "trainer/rewards.h"
#include "trainer/worker_pool.h"

namespace kiln::trainer {

// The protocol. After every sampled turn kiln writes one line to a worker's stdin:
//   {"id": 3, "turn": 0, "prompt": "...", "label": "...", "data_source": "...", "metadata": {...},
//    "history": [{"response": "...", "response_ids": [...], "observation": "...",
//                 "observation_ids": [...]}, ...],
//    "response": "...", "response_ids": [...], "truncated": false}
// history holds the episode's earlier turns, each with the observation that followed it, so a
// worker keeps no state between requests (any worker may get any episode's next turn, and a
// restarted one loses nothing). The worker answers with one line:
//   {"id": 3, "done": false, "observation": "text to append", "reward": 0.0}
//   {"id": 3, "done": false, "observation_ids": [17, 4, 9]}      (ids appended as given)
//   {"id": 3, "done": true, "reward": 1.0, "components": {"correct": 1}}
//   {"id": 3, "error": "why"}
// "done" is required; "reward" (default 0) is the episode's reward so far, and the last answer's is
// the episode's; "components" optional. An episode that goes on needs exactly one of "observation"
// (text: kiln tokenizes it once, and the ids are what the model and the trainer see) and
// "observation_ids". Anything else fails the request; a failure ends the episode with reward 0
// (on_failure: zero) or stops the run (on_failure: stop). Transport failures (crash, hang,
// garbage) are the WorkerPool's.
struct EnvironmentSpec {
  WorkerSpec worker;                    // worker.command empty: no environment (single-turn)
  int64_t max_turns = 4;                // sampled turns per episode; the last is truncated if not done
  int64_t max_episode_tokens = 1024;    // sampled + observation tokens after the prompt
  int64_t max_observation_tokens = 256; // one observation; a longer one ends the episode, truncated
  bool enabled() const { return !worker.command.empty(); }
  void validate(const std::string& path = "environment") const;
};

// A recipe's environment: section (trainer/environment.cpp, docs/CONFIG.md): the worker keys and
// the episode limits, finished, then validate(), a bad value named at the section's file and line.
void read_yaml(yaml::MapReader& m, EnvironmentSpec& spec);
void write_yaml(YAML::Emitter& e, const EnvironmentSpec& spec);

struct EnvTurn {
  std::string response, observation;
  std::vector<int64_t> response_ids, observation_ids;
};

struct EnvRequest {
  int64_t id = 0;                       // unique within a call
  int64_t turn = 0;                     // the turn just sampled, from 0
  std::string prompt, label, data_source;
  std::string metadata;                 // a JSON object as text ("" reads as {})
  std::vector<EnvTurn> history;         // earlier turns, each with the observation that followed it
  std::string response;                 // the turn just sampled, decoded
  std::vector<int64_t> response_ids;    // as sampled
  bool truncated = false;               // it hit the per-turn token limit without a stop token
};

struct EnvStep {
  bool done = false;
  double reward = 0;
  std::vector<std::pair<std::string, double>> components;
  std::string observation;              // text, when the answer gave text
  std::vector<int64_t> observation_ids; // ids, when the answer gave ids (has_ids)
  bool has_ids = false;
  bool failed = false;                  // the request failed (on_failure: zero): the episode ends
  std::string error;
};

// Demonstrations for the supervised warm start (sft.demonstrations: environment). For each training
// example kiln sft writes
//   {"id": 3, "demonstrate": true, "prompt": "...", "label": "...", "data_source": "...", "metadata": {...}}
// and the worker answers with the turns of one episode to imitate, each but the last followed by
// the observation it would get:
//   {"id": 3, "turns": [{"response": "calc 12+34", "observation": "=46\n"}, {"response": "46"}]}
// or "turns": [] when it has none (the label is then the answer, as without an environment). A
// response is a turn's text without its stop token (kiln appends the tokenizer's stop, as the
// engine samples it); an observation is text or "observation_ids", taken as episodes take it and
// left out of the loss. A malformed answer fails the request (on_failure applies).
struct EnvDemoRequest {
  int64_t id = 0;                       // unique within a call
  std::string prompt, label, data_source;
  std::string metadata;                 // a JSON object as text
};
struct EnvDemo {
  std::vector<EnvTurn> turns;           // response and observation texts (or observation ids); empty: none
  bool failed = false;
  std::string error;
};

class Environment {
 public:
  explicit Environment(EnvironmentSpec spec);  // validates; starts nothing yet
  // Starts the workers and checks they stay up (worker_pool.h): a command that cannot run is an
  // error before the first step; step() and demonstrate() start what is not running.
  void start();
  // One answer per request, same order.
  std::vector<EnvStep> step(const std::vector<EnvRequest>& requests);
  std::vector<EnvDemo> demonstrate(const std::vector<EnvDemoRequest>& requests);
  RewardStats stats() const;
  std::vector<int> worker_pids() const;
  const EnvironmentSpec& spec() const { return spec_; }

 private:
  EnvironmentSpec spec_;
  std::unique_ptr<WorkerPool> pool_;
};

// The JSON line (without '\n') written for `request`; invalid UTF-8 becomes U+FFFD.
std::string environment_request_line(const EnvRequest& request);
std::string environment_demo_line(const EnvDemoRequest& request);

}  // namespace kiln::trainer
