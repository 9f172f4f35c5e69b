// Reward workers: a pool of persistent scorer processes (any language) that kiln feeds JSONL over
// pipes, with timeouts, restarts, retries and a failure policy. Pure C++ (POSIX); no torch headers.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "trainer/rewards.h"

namespace kiln::trainer {

// The protocol. kiln writes one line per request to a worker's stdin:
//   {"id": 7, "prompt": "...", "response": "...", "label": "...", "data_source": "...",
//    "metadata": {...}, "truncated": false}
// and the worker answers each with one line on stdout, in any order, flushed:
//   {"id": 7, "reward": 1.0, "components": {"correct": 1, "format": 1}}   (components optional)
//   {"id": 7, "error": "why it could not be scored"}
// Lines are ASCII (other characters come JSON-escaped). stderr is free for logs; kiln keeps each
// worker's last 50 lines (16 KiB) for error messages.
// A worker should read until EOF on stdin and then exit. Up to max_in_flight requests are written
// to a worker before its answers arrive, so it may batch them.
//
// Failures. A worker that exits, closes stdout or holds a request past timeout_s is killed
// (SIGKILL to its process group) and reaped. Its in-flight requests are sent again, each alone to
// a fresh worker so that a request that kills workers is found out; one charged more than
// max_retries times fails. A crash charges every request on the worker; a timeout only the oldest
// on it (a worker that answers in order is stuck on that one; the others are re-sent uncharged).
// timeout_s runs from when a request is written, so it must cover the wait behind the
// max_in_flight - 1 requests written before it. An answer naming a request in flight but with an
// error, a reward that is not a finite number, or unreadable JSON fails that request at once (a
// scorer's verdict, not a crash). A line that names no request in flight on that worker (not
// JSON, no id, unknown or repeated id) counts as garbage; past max_garbage_lines in one call the
// worker is restarted as if it had crashed. Past max_restarts in one call the requests left fail.
// A failure scores 0 with failed = true (on_failure: zero) or throws kiln::Error naming the
// command, the request id, what went wrong and the worker's recent stderr (on_failure: stop).
// Under MPI each rank makes its own pool; nothing here is shared or static.
class WorkerReward final : public Reward {
 public:
  explicit WorkerReward(WorkerSpec spec);  // validates; starts nothing yet
  ~WorkerReward() override;                // closes stdin, waits shutdown_grace_s, then SIGKILLs
  WorkerReward(const WorkerReward&) = delete;
  WorkerReward& operator=(const WorkerReward&) = delete;

  std::vector<RewardResult> score(const std::vector<RewardRequest>& requests) override;
  RewardStats stats() const override;

  // Process ids of the workers alive now (tests use them to check for leaks and zombies).
  std::vector<int> worker_pids() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The JSON line (without '\n') written for `request`. Invalid UTF-8 in the texts becomes U+FFFD;
// metadata must be a JSON object as text ("" reads as {}).
std::string worker_request_line(const RewardRequest& request);

}  // namespace kiln::trainer
