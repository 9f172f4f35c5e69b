// One worker process of a WorkerPool (worker_pool.h): posix_spawn with pipes, its own process
// group, non-blocking reads and writes, a bounded stderr tail, and kill and reap. Pure C++ (POSIX).
#pragma once
#include <signal.h>

#include <cstddef>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace kiln::trainer {

// The last lines a worker wrote to stderr, bounded in lines and bytes (50 lines, 16 KiB).
class StderrTail {
 public:
  void append(const char* data, size_t n);
  std::string text() const;
  std::string last_line() const;

 private:
  void push(std::string line);

  std::deque<std::string> lines_;
  size_t bytes_ = 0;
  std::string partial_;
};

// Writing to a worker that has died raises SIGPIPE, which would kill kiln. While a call runs,
// SIGPIPE is blocked in this thread (a thread-directed signal then stays pending on it), and one our
// write raised is taken off with sigtimedwait before the old mask comes back. Nothing process-wide.
class SigpipeBlock {
 public:
  SigpipeBlock();
  ~SigpipeBlock();
  SigpipeBlock(const SigpipeBlock&) = delete;
  SigpipeBlock& operator=(const SigpipeBlock&) = delete;
  void consume();  // takes off a SIGPIPE our write raised

 private:
  sigset_t pipe_, old_;
  bool was_pending_ = false;
};

// One worker process. Our ends of its pipes are non-blocking; it runs in its own process group so
// that a kill also reaches what it started (a `sh -c` wrapper's child).
class WorkerProcess {
 public:
  static constexpr size_t kMaxLineBytes = size_t(64) << 20;  // a longer stdout line without '\n' is garbage

  // Starts argv; nullptr with *error set when it cannot (no such command, no permission, no fds):
  // posix_spawnp reports the exec's errno itself, which *error gives with what to do about it.
  static std::unique_ptr<WorkerProcess> start(const std::vector<std::string>& argv, std::string* error);
  ~WorkerProcess() { stop(false); }
  WorkerProcess(const WorkerProcess&) = delete;
  WorkerProcess& operator=(const WorkerProcess&) = delete;

  int pid() const { return pid_; }
  int stdin_fd() const { return in_; }
  int stdout_fd() const { return out_; }
  int stderr_fd() const { return err_; }
  bool wants_write() const { return in_ >= 0 && written_ < outbox_.size(); }

  void queue(const std::string& line) { outbox_ += line; }
  // Writes what the pipe takes; false when the worker cannot be written to (it closed stdin or died).
  bool flush(SigpipeBlock& sigpipe);
  // Reads what stdout holds and appends its complete lines. False at EOF or on a line past
  // kMaxLineBytes (*too_long set): either way the worker is done for.
  bool read_stdout(std::vector<std::string>* lines, bool* too_long);
  // Reads what stderr holds into the tail; closes it at EOF (a worker may close stderr and go on).
  void read_stderr();
  void close_stdin();
  // How it ended, when it has, without reaping it: until it is reaped its pid stays ours, so a
  // kill of its process group cannot reach anyone else's.
  std::optional<std::string> exit_status() const;
  // Ends it: when `expect_exit` (it closed stdout), waits briefly for it to exit by itself; then
  // SIGKILLs its process group, drains stderr, reaps it and closes the pipes. Returns how it ended
  // by itself ("" when kiln killed it).
  std::string stop(bool expect_exit);

  const StderrTail& stderr_tail() const { return tail_; }

 private:
  WorkerProcess() = default;

  int pid_ = -1;
  int in_ = -1, out_ = -1, err_ = -1;
  bool reaped_ = true;
  std::string outbox_;  // bytes queued for stdin; written_ of them are out
  size_t written_ = 0;
  std::string inbox_;  // a partial stdout line
  StderrTail tail_;
};

}  // namespace kiln::trainer
