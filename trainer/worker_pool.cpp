// Worker pools: dispatch, poll() over every worker's pipes (worker_process.h runs each process),
// answers matched by id, timeouts, restarts, retries, the failure policy. One thread; nothing
// global or static.
#include "trainer/worker_pool.h"

#include <poll.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <optional>
#include <unordered_map>

#include "core/clock.h"
#include "core/error.h"
#include "trainer/worker_process.h"

namespace kiln::trainer {
namespace {

using Json = nlohmann::json;

constexpr size_t kQuoteBytes = 200;  // how much of a bad line an error quotes
constexpr int kWarningsPerCall = 3;  // protocol warnings printed per call; the rest are counted
constexpr double kStartPollS = 0.02;  // how often the start check looks for a worker that exited

std::string command_text(const std::vector<std::string>& argv) {
  std::string out;
  for (const std::string& a : argv) {
    if (!out.empty()) out += ' ';
    out += a.find_first_of(" \t'\"") == std::string::npos && !a.empty() ? a : "'" + a + "'";
  }
  return out;
}

// `"id": <integer>` at the top level of a line that is not valid JSON (Python writes NaN and
// Infinity), so that the request it names can fail rather than wait for its timeout. An "id" inside
// a nested object or in a string does not count.
std::optional<int64_t> scan_id(const std::string& line) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '{' || c == '[') {
      ++depth;
    } else if (c == '}' || c == ']') {
      --depth;
    } else if (c == '"') {
      if (depth == 1 && line.compare(i, 4, "\"id\"") == 0) {
        size_t k = i + 4;
        while (k < line.size() && (line[k] == ' ' || line[k] == '\t')) ++k;
        if (k < line.size() && line[k] == ':') {
          ++k;
          while (k < line.size() && (line[k] == ' ' || line[k] == '\t')) ++k;
          const char* begin = line.c_str() + k;
          char* stop = nullptr;
          errno = 0;
          const long long v = std::strtoll(begin, &stop, 10);
          if (stop == begin || errno != 0 || (*stop != ',' && *stop != '}' && *stop != ' ')) return std::nullopt;
          return int64_t(v);
        }
      }
      in_string = true;
    }
  }
  return std::nullopt;
}

std::optional<int64_t> json_id(const Json& j) {
  if (!j.is_object()) return std::nullopt;
  const auto it = j.find("id");
  if (it == j.end()) return std::nullopt;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_number_float()) {
    const double v = it->get<double>();
    if (std::isfinite(v) && v == std::trunc(v) && std::fabs(v) < 9.0e18) return int64_t(v);
  }
  return std::nullopt;
}

}  // namespace

std::string quote_for_error(const std::string& text) {
  std::string out = text.size() > kQuoteBytes ? text.substr(0, kQuoteBytes) + "..." : text;
  for (char& c : out)
    if (static_cast<unsigned char>(c) < 32) c = ' ';
  return out;
}

std::string quote_for_error(const Json& answer) {
  return quote_for_error(answer.dump(-1, ' ', true, Json::error_handler_t::replace));
}

nlohmann::ordered_json request_metadata(const std::string& text, const char* who, int64_t id) {
  if (text.empty()) return nlohmann::ordered_json::object();
  nlohmann::ordered_json m = nlohmann::ordered_json::parse(text, nullptr, false);
  KILN_CHECK(!m.is_discarded() && m.is_object(), who, ": request metadata is not a JSON object (id=", id,
             ", metadata=", quote_for_error(text), "); pass the dataset line's metadata object as JSON text, or \"{}\"");
  return m;
}

struct WorkerPool::Impl {
  struct InFlight {
    size_t index;  // into the call's requests
    Clock::time_point sent;
    uint64_t seq;  // send order
  };
  struct Slot {
    std::unique_ptr<WorkerProcess> proc;  // null when not running
    bool ever_started = false;
    std::unordered_map<int64_t, InFlight> in_flight;  // by request id
    bool isolated = false;  // holds a retried request alone; takes no other until it is answered
    int num_garbage = 0;    // garbage lines this call
    std::string last_garbage;
  };
  enum class Death { kCrash, kTimeout, kGarbage };

  WorkerSpec spec;
  std::string what;  // the pool's name in errors
  std::string command;
  std::vector<Slot> slots;
  RewardStats stats;
  bool started = false;  // start_all() has passed: every worker stayed up for start_check_s

  // The call in progress.
  const std::vector<int64_t>* ids = nullptr;
  std::vector<WorkerOutcome>* results = nullptr;
  const Accept* accept = nullptr;
  std::vector<std::string> lines;
  std::vector<int> attempts;  // per request: attempts that ended in a dead or hung worker
  std::vector<uint8_t> settled;  // per request: answered or failed (a later answer is a second one)
  std::unordered_map<int64_t, size_t> index_of;
  std::deque<size_t> fresh, retries;
  size_t num_done = 0;
  uint64_t num_sent = 0;
  int restarts_left = 0;
  std::string start_error;  // set when the command could not be started: nothing more is tried this call
  std::string last_death;   // the last worker failure, for requests left when the restarts run out
  std::string last_stderr;
  int warnings_left = 0;        // protocol warnings this call may still print
  int64_t warnings_held = 0;    // ... and those it counted instead

  void start_all();
  void check_started(Slot& slot, bool stdout_closed);
  void begin_call(const std::vector<int64_t>& request_ids, const std::vector<std::string>& request_lines,
                  std::vector<WorkerOutcome>* out);
  void end_call();
  void run(SigpipeBlock& sigpipe);
  void dispatch();
  bool try_start(Slot& slot);
  void send(Slot& slot, size_t index, bool isolated);
  void poll_once(SigpipeBlock& sigpipe);
  void handle_line(Slot& slot, const std::string& line);
  void garbage(Slot& slot, const std::string& why, const std::string& line);
  void stray_answer(Slot& slot, int64_t id, const std::string& line);
  void violation(const std::string& why, const std::string& line);
  void drain_idle(Slot& slot);
  void answered(Slot& slot, int64_t id, size_t* index);
  void kill_slot(Slot& slot, Death death, const std::string& reason, const std::vector<int64_t>& culprits);
  void fail(size_t index, const std::string& why, const std::string& stderr_text);
  void finish(size_t index);
  void shutdown();
};

// Starts every worker that is not running and watches them for start_check_s. posix_spawnp itself
// reports a command that cannot be executed (not found, not executable: its errno); a worker that
// exits or closes its stdout within the window, before any request, is a command that runs but
// cannot serve (a missing script or module, a bad argument). Either stops the run whatever
// on_failure says: retrying cannot help, and scoring every sample 0 would train on nothing. A
// worker that fails later than the window is the restart limit's and the step's failure budget's.
void WorkerPool::Impl::start_all() {
  for (Slot& s : slots) {
    if (s.proc) continue;
    std::string error;
    s.proc = WorkerProcess::start(spec.command, &error);
    KILN_CHECK(s.proc, what, ": cannot start the command (command=", command, ", error=", error, ")");
    s.ever_started = true;
  }
  const Clock::time_point t0 = Clock::now();
  while (spec.start_check_s > 0) {
    // stdout is watched for its hang-up only (no POLLIN): what a worker says before any request
    // stays in the pipe for the first call to read.
    std::vector<pollfd> fds;
    for (const Slot& s : slots) {
      fds.push_back({s.proc->stdout_fd(), 0, 0});
      fds.push_back({s.proc->stderr_fd(), POLLIN, 0});  // -1 once closed: poll skips it
    }
    const double left = spec.start_check_s - seconds_since(t0);
    poll(fds.data(), nfds_t(fds.size()), std::max(0, int(std::ceil(std::min(left, kStartPollS) * 1000))));
    for (size_t k = 0; k < slots.size(); ++k) {
      if (fds[2 * k + 1].revents != 0) slots[k].proc->read_stderr();
      check_started(slots[k], (fds[2 * k].revents & (POLLHUP | POLLERR)) != 0);
    }
    if (left <= 0) break;
  }
  started = true;
}

// Throws when the worker has exited or closed its stdout (during the start check).
void WorkerPool::Impl::check_started(Slot& slot, bool stdout_closed) {
  if (!stdout_closed && !slot.proc->exit_status()) return;
  const std::string status = slot.proc->stop(true);
  const std::string tail = slot.proc->stderr_tail().text();
  slot.proc.reset();
  KILN_FAIL(what, ": the worker ", status.empty() ? "closed its stdout" : status,
            " right after it started, before any request (command=", command, ", start_check_s=", spec.start_check_s,
            "); check the command, its arguments and what it loads (a script's path, its modules)",
            tail.empty() ? "; it wrote nothing to stderr" : "; its stderr ends:\n" + tail);
}

void WorkerPool::Impl::begin_call(const std::vector<int64_t>& request_ids, const std::vector<std::string>& request_lines,
                                  std::vector<WorkerOutcome>* out) {
  ids = &request_ids;
  results = out;
  lines.clear();
  index_of.clear();
  const size_t n = request_ids.size();
  KILN_CHECK(request_lines.size() == n, what, ": ", n, " request ids but ", request_lines.size(), " lines");
  for (size_t i = 0; i < n; ++i) {
    KILN_CHECK(index_of.emplace(request_ids[i], i).second, what, ": request id used twice in one call (id=",
               request_ids[i], ", positions ", index_of[request_ids[i]], " and ", i, "); give each request its own id");
    KILN_CHECK(request_lines[i].find('\n') == std::string::npos, what, ": request line ", i,
               " holds a newline; a request is one line");
    lines.push_back(request_lines[i] + "\n");
  }
  attempts.assign(n, 0);
  settled.assign(n, 0);
  fresh.clear();
  retries.clear();
  for (size_t i = 0; i < n; ++i) fresh.push_back(i);
  num_done = 0;
  restarts_left = spec.max_restarts;
  start_error.clear();
  warnings_left = kWarningsPerCall;
  warnings_held = 0;
  for (Slot& s : slots) {
    s.num_garbage = 0;
    s.isolated = false;
    if (s.proc) drain_idle(s);
    // A worker that died while idle is replaced now rather than found dead with requests on it.
    if (s.proc && s.proc->exit_status()) {
      last_death = "worker " + s.proc->stop(true) + " while idle";
      last_stderr = s.proc->stderr_tail().text();
      s.proc.reset();
    }
  }
  stats.num_requests += int64_t(n);
}

// What a worker wrote while it had no request (a repeat of an answer, an answer to a request it
// was never sent) is read before this call's requests go out, so that it cannot pass for the
// answer to one of them with the same id: a protocol violation when it names an id, else garbage.
void WorkerPool::Impl::drain_idle(Slot& slot) {
  std::vector<std::string> got;
  bool too_long = false;
  const bool open = slot.proc->read_stdout(&got, &too_long);
  for (const std::string& line : got) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const Json j = Json::parse(line, nullptr, false);
    const std::optional<int64_t> id = j.is_discarded() ? scan_id(line) : json_id(j);
    if (id) violation(str_cat("an answer to id ", *id, " written while the worker had no request (a repeat?)"), line);
    else ++stats.num_garbage_lines;
  }
  if (open) return;
  const std::string status = slot.proc->stop(true);
  last_death = str_cat(too_long ? "worker wrote an over-long stdout line" : "worker closed its stdout", " while idle",
                       status.empty() ? "" : " (worker " + status + ")");
  last_stderr = slot.proc->stderr_tail().text();
  slot.proc.reset();
}

// Leaves no request on any worker: after an error a late answer could otherwise meet a later call's
// request of the same id.
void WorkerPool::Impl::end_call() {
  if (warnings_held > 0)
    std::fprintf(stderr, "kiln: warning: %s: %lld more protocol violations in this call (command=%s)\n", what.c_str(),
                 (long long)warnings_held, command.c_str());
  warnings_held = 0;
  for (Slot& s : slots) {
    if (!s.in_flight.empty() && s.proc) s.proc->stop(false);
    if (!s.in_flight.empty()) s.proc.reset();
    s.in_flight.clear();
    s.isolated = false;
  }
  ids = nullptr;
  results = nullptr;
  accept = nullptr;
  fresh.clear();
  retries.clear();
}

void WorkerPool::Impl::run(SigpipeBlock& sigpipe) {
  while (num_done < ids->size()) {
    dispatch();
    if (num_done == ids->size()) break;
    poll_once(sigpipe);
  }
}

bool WorkerPool::Impl::try_start(Slot& slot) {
  if (!start_error.empty()) return false;
  if (slot.ever_started) {
    if (restarts_left <= 0) return false;
    --restarts_left;
    ++stats.num_restarts;
  }
  std::string error;
  slot.proc = WorkerProcess::start(spec.command, &error);
  slot.ever_started = true;
  slot.num_garbage = 0;
  slot.isolated = false;
  if (!slot.proc) start_error = str_cat("cannot start the command: ", error);
  return slot.proc != nullptr;
}

void WorkerPool::Impl::send(Slot& slot, size_t index, bool isolated) {
  slot.proc->queue(lines[index]);
  slot.in_flight[(*ids)[index]] = {index, Clock::now(), num_sent++};
  slot.isolated = isolated;
}

void WorkerPool::Impl::dispatch() {
  if (fresh.empty() && retries.empty()) return;
  for (Slot& s : slots)
    if (!s.proc) try_start(s);
  // A retried request goes alone to an idle worker, so that if it kills that one too it is known
  // to be the cause. Fresh requests wait meanwhile: otherwise a busy pool never has an idle worker.
  for (Slot& s : slots) {
    if (retries.empty()) break;
    if (s.proc && s.in_flight.empty()) {
      send(s, retries.front(), true);
      retries.pop_front();
    }
  }
  while (!fresh.empty() && retries.empty()) {
    Slot* best = nullptr;
    for (Slot& s : slots)
      if (s.proc && !s.isolated && int(s.in_flight.size()) < spec.max_in_flight &&
          (!best || s.in_flight.size() < best->in_flight.size()))
        best = &s;
    if (!best) break;
    send(*best, fresh.front(), false);
    fresh.pop_front();
  }
  const bool any_live = std::any_of(slots.begin(), slots.end(), [](const Slot& s) { return s.proc != nullptr; });
  if (any_live) return;
  // No worker runs and none may start: what is left fails.
  const std::string why = !start_error.empty()
                              ? start_error
                              : str_cat("restart limit reached (max_restarts=", spec.max_restarts,
                                        " per call); the last worker failure: ", last_death);
  std::vector<size_t> left(retries.begin(), retries.end());
  left.insert(left.end(), fresh.begin(), fresh.end());
  retries.clear();
  fresh.clear();
  std::sort(left.begin(), left.end());
  for (size_t index : left) fail(index, why, start_error.empty() ? last_stderr : "");
}

void WorkerPool::Impl::poll_once(SigpipeBlock& sigpipe) {
  struct Watch {
    size_t slot;
    int which;  // 0 stdin, 1 stdout, 2 stderr
  };
  std::vector<pollfd> fds;
  std::vector<Watch> watches;
  double wait_s = 1.0;  // a ceiling, so that nothing waits forever on a missed event
  const Clock::time_point now = Clock::now();
  for (size_t k = 0; k < slots.size(); ++k) {
    const Slot& s = slots[k];
    if (!s.proc) continue;
    // Reads before writes: answers that arrived before a worker stopped reading still count.
    fds.push_back({s.proc->stdout_fd(), POLLIN, 0}), watches.push_back({k, 1});
    if (s.proc->stderr_fd() >= 0) fds.push_back({s.proc->stderr_fd(), POLLIN, 0}), watches.push_back({k, 2});
    if (s.proc->wants_write()) fds.push_back({s.proc->stdin_fd(), POLLOUT, 0}), watches.push_back({k, 0});
    for (const auto& entry : s.in_flight)
      wait_s = std::min(wait_s, spec.timeout_s - std::chrono::duration<double>(now - entry.second.sent).count());
  }
  KILN_CHECK(!fds.empty(), what, ": internal error: requests wait but no worker runs (command=", command,
             ", done=", num_done, ", requests=", ids->size(), "); report this");
  const int timeout_ms = std::max(0, int(std::ceil(wait_s * 1000)));
  if (poll(fds.data(), nfds_t(fds.size()), timeout_ms) < 0 && errno != EINTR)
    KILN_FAIL(what, ": poll failed (error=", std::strerror(errno), ", command=", command, "); report this");

  for (size_t f = 0; f < fds.size(); ++f) {
    Slot& s = slots[watches[f].slot];
    if (!s.proc || fds[f].revents == 0) continue;
    if (watches[f].which == 2) {
      s.proc->read_stderr();
    } else if (watches[f].which == 0) {
      if (!s.proc->flush(sigpipe)) kill_slot(s, Death::kCrash, "worker stopped reading its stdin", {});
    } else {
      std::vector<std::string> got;
      bool too_long = false;
      const bool open = s.proc->read_stdout(&got, &too_long);
      for (const std::string& line : got) {
        if (!s.proc) break;  // killed for garbage part way through
        handle_line(s, line);
      }
      if (!s.proc) continue;
      if (too_long)
        kill_slot(s, Death::kGarbage, str_cat("worker wrote a stdout line longer than ", WorkerProcess::kMaxLineBytes, " bytes"), {});
      else if (!open)
        kill_slot(s, Death::kCrash, "worker closed its stdout", {});
    }
  }
  // A hang: when the oldest request on a worker is late, it is taken for the cause (a worker that
  // answers in order is stuck on it, and the ones queued behind it are late only because of it).
  // The others go back uncharged; one that hangs by itself is caught on its next worker.
  for (Slot& s : slots) {
    if (!s.proc || s.in_flight.empty()) continue;
    auto oldest = s.in_flight.begin();
    for (auto it = s.in_flight.begin(); it != s.in_flight.end(); ++it)
      if (it->second.seq < oldest->second.seq) oldest = it;
    if (seconds_since(oldest->second.sent) >= spec.timeout_s)
      kill_slot(s, Death::kTimeout, str_cat("no answer within timeout_s=", spec.timeout_s, " s; worker killed"),
                {oldest->first});
  }
}

void WorkerPool::Impl::answered(Slot& slot, int64_t id, size_t* index) {
  const auto it = slot.in_flight.find(id);
  *index = it->second.index;
  stats.total_seconds += seconds_since(it->second.sent);
  ++stats.num_answered;
  slot.in_flight.erase(it);
  if (slot.in_flight.empty()) slot.isolated = false;
}

void WorkerPool::Impl::handle_line(Slot& slot, const std::string& line) {
  if (line.find_first_not_of(" \t\r") == std::string::npos) return;  // blank lines are harmless
  const Json j = Json::parse(line, nullptr, false);
  size_t index = 0;
  if (j.is_discarded()) {
    const std::optional<int64_t> id = scan_id(line);
    if (!id) return garbage(slot, "not JSON", line);
    if (!slot.in_flight.count(*id)) return stray_answer(slot, *id, line);
    answered(slot, *id, &index);
    return fail(index, str_cat("answer is not valid JSON (line=", quote_for_error(line), ")"), slot.proc->stderr_tail().text());
  }
  const std::optional<int64_t> id = json_id(j);
  if (!id) return garbage(slot, "no integer \"id\"", line);
  if (!slot.in_flight.count(*id)) return stray_answer(slot, *id, line);
  answered(slot, *id, &index);
  const std::string stderr_text = slot.proc->stderr_tail().text();
  if (const auto e = j.find("error"); e != j.end())
    return fail(index, str_cat("worker error: ", e->is_string() ? e->get<std::string>() : e->dump()), stderr_text);
  const std::string why = (*accept)(index, j);
  if (!why.empty()) return fail(index, why, stderr_text);
  finish(index);
}

void WorkerPool::Impl::garbage(Slot& slot, const std::string& why, const std::string& line) {
  ++stats.num_garbage_lines;
  ++slot.num_garbage;
  slot.last_garbage = str_cat(why, ": ", quote_for_error(line));
  if (slot.num_garbage > spec.max_garbage_lines)
    kill_slot(slot, Death::kGarbage,
              str_cat("worker wrote ", slot.num_garbage, " stdout lines that name no request in flight ",
                      "(max_garbage_lines=", spec.max_garbage_lines, "; the last: ", slot.last_garbage, ")"),
              {});
}

// An answer to an id not in flight on this worker breaks the protocol: each request is answered
// once, by the worker it was sent to. Counted, warned about and garbage; an error under
// on_failure: stop.
void WorkerPool::Impl::stray_answer(Slot& slot, int64_t id, const std::string& line) {
  const auto it = index_of.find(id);
  const std::string why = it == index_of.end()  ? str_cat("an answer to id ", id, ", which no request of this call has")
                          : settled[it->second] ? str_cat("a second answer to request id ", id)
                                                : str_cat("an answer to request id ", id, ", not sent to this worker");
  violation(why, line);
  garbage(slot, why, line);
}

void WorkerPool::Impl::violation(const std::string& why, const std::string& line) {
  ++stats.num_protocol_violations;
  const std::string text =
      str_cat(what, ": protocol violation: ", why, " (command=", command, ", line=", quote_for_error(line), ")");
  KILN_CHECK(spec.on_failure != OnFailure::kStop, text, "; a worker answers each request it was sent exactly once, ",
             "with its id: fix the worker, or set on_failure: zero to count such answers and go on");
  if (warnings_left <= 0) {
    ++warnings_held;
    return;
  }
  --warnings_left;
  std::fprintf(stderr, "kiln: warning: %s\n", text.c_str());
}

void WorkerPool::Impl::kill_slot(Slot& slot, Death death, const std::string& reason,
                                   const std::vector<int64_t>& culprits) {
  const std::string status = slot.proc->stop(death == Death::kCrash);
  const std::string what = !status.empty() ? str_cat(reason, " (worker ", status, ")") : reason;
  const std::string stderr_text = slot.proc->stderr_tail().text();
  last_death = what;
  last_stderr = stderr_text;
  std::vector<std::pair<size_t, int64_t>> victims;  // (index, id), in request order for determinism
  for (const auto& [id, f] : slot.in_flight) victims.emplace_back(f.index, id);
  std::sort(victims.begin(), victims.end());
  slot.in_flight.clear();
  slot.proc.reset();
  slot.isolated = false;
  // A crash or garbage has no known cause, so every request on the worker is charged an attempt
  // (and retried alone, which finds the cause out); after a timeout only the late ones are.
  std::vector<size_t> requeue;
  for (const auto& [index, id] : victims) {
    const bool culprit = std::find(culprits.begin(), culprits.end(), id) != culprits.end();
    if (culprit) ++stats.num_timeouts;
    if (death != Death::kTimeout || culprit) {
      if (++attempts[index] > spec.max_retries) {
        fail(index, str_cat(what, " (attempts=", attempts[index], ")"), stderr_text);
        continue;
      }
      retries.push_back(index);
    } else {
      requeue.push_back(index);
    }
    ++stats.num_retries;
  }
  fresh.insert(fresh.begin(), requeue.begin(), requeue.end());
}

void WorkerPool::Impl::fail(size_t index, const std::string& why, const std::string& stderr_text) {
  const int64_t id = (*ids)[index];
  ++stats.num_failures;
  if (spec.on_failure == OnFailure::kStop) {
    const std::string tail = stderr_text.empty() ? "(the worker wrote nothing to stderr)"
                                                 : "the worker's stderr ends:\n" + stderr_text;
    KILN_FAIL(what, ": request failed (command=", command, ", id=", id, ", error=", why,
              "); fix the worker, or set on_failure: zero to score such requests 0 and go on; ", tail);
  }
  WorkerOutcome r;
  r.failed = true;
  std::string last;
  for (size_t end = stderr_text.size(); end > 0 && last.empty();) {  // the last non-empty stderr line
    const size_t begin = stderr_text.rfind('\n', end - 1);
    last = stderr_text.substr(begin == std::string::npos ? 0 : begin + 1,
                              end - (begin == std::string::npos ? 0 : begin + 1));
    end = begin == std::string::npos ? 0 : begin;
  }
  r.error = last.empty() ? why : str_cat(why, "; stderr: ", quote_for_error(last));
  (*results)[index] = std::move(r);
  settled[index] = 1;
  ++num_done;
}

void WorkerPool::Impl::finish(size_t index) {
  (*results)[index] = WorkerOutcome();
  settled[index] = 1;
  ++num_done;
}

void WorkerPool::Impl::shutdown() {
  // Closing stdin asks each worker to finish; the ones still running after the grace period are killed.
  for (Slot& s : slots)
    if (s.proc) s.proc->close_stdin();
  const Clock::time_point t0 = Clock::now();
  for (;;) {
    bool running = false;
    for (Slot& s : slots) {
      if (!s.proc || s.proc->exit_status()) continue;
      running = true;
      std::vector<std::string> discard;
      bool too_long = false;
      s.proc->read_stdout(&discard, &too_long);  // so that a worker writing on its way out is not blocked
      s.proc->read_stderr();
    }
    if (!running || seconds_since(t0) >= spec.shutdown_grace_s) break;
    usleep(2000);
  }
  for (Slot& s : slots) {
    if (s.proc) s.proc->stop(false);
    s.proc.reset();
  }
}

WorkerPool::WorkerPool(WorkerSpec spec, std::string what) : impl_(std::make_unique<Impl>()) {
  impl_->what = std::move(what);
  impl_->command = command_text(spec.command);
  impl_->slots.resize(size_t(spec.num_workers));
  impl_->spec = std::move(spec);
}

WorkerPool::~WorkerPool() { impl_->shutdown(); }

std::vector<WorkerOutcome> WorkerPool::call(const std::vector<int64_t>& ids, const std::vector<std::string>& lines,
                                            const Accept& accept) {
  std::vector<WorkerOutcome> results(ids.size());
  if (ids.empty()) return results;
  SigpipeBlock sigpipe;
  struct EndCall {
    Impl* impl;
    ~EndCall() { impl->end_call(); }
  } end_call{impl_.get()};
  impl_->begin_call(ids, lines, &results);
  if (!impl_->started) impl_->start_all();
  impl_->accept = &accept;
  impl_->run(sigpipe);
  return results;
}

void WorkerPool::start() {
  if (!impl_->started) impl_->start_all();
}

RewardStats WorkerPool::stats() const { return impl_->stats; }

const std::string& WorkerPool::command() const { return impl_->command; }

std::vector<int> WorkerPool::worker_pids() const {
  std::vector<int> pids;
  for (const Impl::Slot& s : impl_->slots)
    if (s.proc) pids.push_back(s.proc->pid());
  return pids;
}

}  // namespace kiln::trainer
