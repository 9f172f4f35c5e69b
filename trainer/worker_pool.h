// A pool of persistent worker processes (any language) that kiln feeds JSON lines over pipes and
// that answer each line by its id: timeouts, restarts, retries and a failure policy. Reward workers
// (reward_worker.h) and environments (environment.h) speak their protocols through it. Pure C++
// (POSIX); no torch headers.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "trainer/rewards.h"  // WorkerSpec, RewardStats

namespace kiln::trainer {

struct WorkerOutcome {
  bool failed = false;
  std::string error;  // why, with the worker's last stderr line (failed only)
};

// The transport. kiln writes one line per request to a worker's stdin, each a JSON object with an
// integer "id" unique in the call, and the worker answers each with one line on stdout, in any
// order, flushed: a JSON object with the same "id", either with "error" (the request fails: a
// verdict, not a crash) or whatever the protocol on top wants. Lines are ASCII (other characters
// come JSON-escaped). stderr is free for logs; the pool keeps each worker's last 50 lines (16 KiB)
// for error messages. A worker should read until EOF on stdin and then exit. Up to max_in_flight
// requests are written to a worker before its answers arrive, so it may batch them.
//
// Starting. start() (else the first call) starts every worker and watches them for start_check_s:
// a command that cannot be executed (posix_spawnp's errno) or a worker that exits or closes its
// stdout in that time, before any request, throws kiln::Error naming the pool, the command, the
// errno or exit status and the worker's stderr, whatever on_failure says.
//
// Failures. A worker that exits, closes stdout or holds a request past timeout_s is killed
// (SIGKILL to its process group) and reaped. Its in-flight requests are sent again, each alone to
// a fresh worker so that a request that kills workers is found out; one charged more than
// max_retries times fails. A crash charges every request on the worker; a timeout only the oldest
// on it (a worker that answers in order is stuck on that one; the others are re-sent uncharged).
// timeout_s runs from when a request is written, so it must cover the wait behind the
// max_in_flight - 1 requests written before it. An answer naming a request in flight but with an
// error, one the protocol rejects, or unreadable JSON fails that request at once. A line that names
// no request in flight on that worker (not JSON, no id, unknown or repeated id) counts as garbage;
// past max_garbage_lines in one call the worker is restarted as if it had crashed. One with an id
// (an id no request has, a second answer, an answer to a request sent elsewhere, or anything a
// worker wrote between calls) is also a protocol violation: counted, printed as a warning on
// stderr naming the pool, the command and the id (3 a call; the rest counted), and under
// on_failure: stop an error (a repeat that reaches kiln only after the next call's requests went out
// passes for an answer when ids recur between calls). Past max_restarts in one call the requests
// left fail. A failure is reported (on_failure: zero) or
// throws kiln::Error naming the pool, the command, the request id, what went wrong and the worker's
// recent stderr (on_failure: stop). Under MPI each rank makes its own pool; nothing is shared.
// Text for an error message: at most 200 bytes of it, control characters as spaces.
std::string quote_for_error(const std::string& text);
// The same for an answer: its JSON, ASCII with escapes (invalid UTF-8 as U+FFFD).
std::string quote_for_error(const nlohmann::json& answer);

// A request's metadata (a JSON object as text; "" reads as {}) for its line; throws naming `who`,
// the request id and the text when it is not an object.
nlohmann::ordered_json request_metadata(const std::string& text, const char* who, int64_t id);

class WorkerPool {
 public:
  // `what` names the pool in errors ("reward worker", "environment"). `spec` must be validated.
  WorkerPool(WorkerSpec spec, std::string what);
  ~WorkerPool();  // closes stdin, waits shutdown_grace_s, then SIGKILLs
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Accepts an answer without "error" to request `index`: "" when it is usable (the callback keeps
  // what it needs), else why not (the request fails with that reason).
  using Accept = std::function<std::string(size_t index, const nlohmann::json& answer)>;
  // Starts the workers not running now and checks them (above); a pool that has passed does nothing.
  void start();
  // Sends lines[i] (a JSON object without '\n' whose "id" is ids[i]) and waits for every answer.
  std::vector<WorkerOutcome> call(const std::vector<int64_t>& ids, const std::vector<std::string>& lines,
                                  const Accept& accept);
  RewardStats stats() const;
  // Process ids of the workers alive now (tests use them to check for leaks and zombies).
  std::vector<int> worker_pids() const;
  const std::string& command() const;  // the argv as one shell-quoted line

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::trainer
