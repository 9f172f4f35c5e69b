// Reward workers: persistent scorer processes (any language) that kiln feeds JSONL over pipes
// through a WorkerPool. Pure C++ (POSIX); no torch headers.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "trainer/rewards.h"
#include "trainer/worker_pool.h"

namespace kiln::trainer {

// The protocol, over a WorkerPool (trainer/worker_pool.h: the transport, timeouts, restarts,
// retries and failure policy). kiln writes one line per request to a worker's stdin:
//   {"id": 7, "prompt": "...", "response": "...", "label": "...", "data_source": "...",
//    "metadata": {...}, "truncated": false}
// and the worker answers each with one line on stdout, in any order, flushed:
//   {"id": 7, "reward": 1.0, "components": {"correct": 1, "format": 1}}   (components optional)
//   {"id": 7, "error": "why it could not be scored"}
// A reward that is not a finite number, or components that are not an object of finite numbers,
// fail the request at once. A failure scores 0 with failed = true (on_failure: zero) or throws
// (on_failure: stop).
class WorkerReward final : public Reward {
 public:
  explicit WorkerReward(WorkerSpec spec);  // validates; starts nothing yet
  ~WorkerReward() override;                // closes stdin, waits shutdown_grace_s, then SIGKILLs
  WorkerReward(const WorkerReward&) = delete;
  WorkerReward& operator=(const WorkerReward&) = delete;

  void start() override;  // starts the pool and checks its workers stay up (worker_pool.h)
  std::vector<RewardResult> score(const std::vector<RewardRequest>& requests) override;
  RewardStats stats() const override;

  // Process ids of the workers alive now (tests use them to check for leaks and zombies).
  std::vector<int> worker_pids() const;

 private:
  std::unique_ptr<WorkerPool> pool_;
};

// The JSON line (without '\n') written for `request`. Invalid UTF-8 in the texts becomes U+FFFD;
// metadata must be a JSON object as text ("" reads as {}).
std::string worker_request_line(const RewardRequest& request);

}  // namespace kiln::trainer
