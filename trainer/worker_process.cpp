// WorkerProcess, StderrTail and SigpipeBlock (worker_process.h): the pipes, the reads and writes, the
// stderr tail, and kill and reap of one worker.
#include "trainer/worker_process.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

#include "core/clock.h"
#include "core/error.h"

extern char** environ;

namespace kiln::trainer {
namespace {

constexpr size_t kStderrMaxLines = 50;
constexpr size_t kStderrMaxBytes = 16 * 1024;
constexpr double kExitWaitS = 0.2;   // how long a worker that closed stdout gets to report its exit status
constexpr double kDrainWaitS = 0.2;  // how long stderr is drained after a kill (a traceback may be on its way)

void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

void close_fd(int& fd) {
  if (fd >= 0) close(fd);
  fd = -1;
}

void wait_readable(int fd, double seconds) {
  if (fd < 0) return;
  pollfd p{fd, POLLIN, 0};
  poll(&p, 1, std::max(0, int(std::ceil(seconds * 1000))));
}

// What to do about a command posix_spawnp could not execute (its errno).
std::string spawn_hint(int error) {
  switch (error) {
    case ENOENT:
      return "; check the path (a name without '/' is looked up on PATH; a script's #! line must name an "
             "interpreter that exists)";
    case EACCES: return "; make it executable (chmod +x) or name its interpreter first, e.g. [python3, worker.py]";
    case ENOEXEC: return "; it is neither a program nor a script with a #! line: name its interpreter first";
    default: return "";
  }
}

}  // namespace

void StderrTail::append(const char* data, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (data[i] == '\n' || partial_.size() >= kStderrMaxBytes) {
      push(std::move(partial_));
      partial_.clear();
      if (data[i] == '\n') continue;
    }
    partial_ += data[i];
  }
}

std::string StderrTail::text() const {
  std::string out;
  for (const std::string& line : lines_) out += line + "\n";
  return out + partial_;
}

std::string StderrTail::last_line() const {
  if (!partial_.empty()) return partial_;
  return lines_.empty() ? std::string() : lines_.back();
}

void StderrTail::push(std::string line) {
  bytes_ += line.size();
  lines_.push_back(std::move(line));
  while (lines_.size() > kStderrMaxLines || bytes_ > kStderrMaxBytes) {
    bytes_ -= lines_.front().size();
    lines_.pop_front();
  }
}

SigpipeBlock::SigpipeBlock() {
  sigemptyset(&pipe_);
  sigaddset(&pipe_, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  sigset_t pending;
  sigpending(&pending);
  was_pending_ = sigismember(&pending, SIGPIPE) == 1;
}

SigpipeBlock::~SigpipeBlock() { pthread_sigmask(SIG_SETMASK, &old_, nullptr); }

void SigpipeBlock::consume() {
  if (was_pending_) return;  // someone else's; leave it
  const timespec zero{0, 0};
  while (sigtimedwait(&pipe_, nullptr, &zero) == SIGPIPE) {
  }
}

bool WorkerProcess::flush(SigpipeBlock& sigpipe) {
  while (wants_write()) {
    const ssize_t n = write(in_, outbox_.data() + written_, outbox_.size() - written_);
    if (n > 0) {
      written_ += size_t(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      break;
    } else {
      if (errno == EPIPE) sigpipe.consume();
      return false;
    }
  }
  if (written_ == outbox_.size()) outbox_.clear(), written_ = 0;
  return true;
}

bool WorkerProcess::read_stdout(std::vector<std::string>* lines, bool* too_long) {
  char buf[65536];
  for (;;) {
    const ssize_t n = read(out_, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (n <= 0) return false;
    size_t begin = 0;
    for (size_t i = 0; i < size_t(n); ++i) {
      if (buf[i] != '\n') continue;
      inbox_.append(buf + begin, i - begin);
      lines->push_back(std::move(inbox_));
      inbox_.clear();
      begin = i + 1;
    }
    inbox_.append(buf + begin, size_t(n) - begin);
    if (inbox_.size() > kMaxLineBytes) {
      *too_long = true;
      return false;
    }
  }
}

void WorkerProcess::read_stderr() {
  char buf[65536];
  while (err_ >= 0) {
    const ssize_t n = read(err_, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {
      close_fd(err_);
      return;
    }
    tail_.append(buf, size_t(n));
  }
}

void WorkerProcess::close_stdin() { close_fd(in_); }

std::optional<std::string> WorkerProcess::exit_status() const {
  siginfo_t info{};
  if (reaped_ || waitid(P_PID, pid_t(pid_), &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid == 0)
    return std::nullopt;
  if (info.si_code == CLD_EXITED) return str_cat("exited with status ", info.si_status);
  return str_cat("was killed by signal ", info.si_status, " (", strsignal(info.si_status), ")");
}

std::string WorkerProcess::stop(bool expect_exit) {
  if (reaped_) return "";
  close_stdin();
  std::optional<std::string> status = exit_status();
  for (const Clock::time_point t0 = Clock::now(); expect_exit && !status && seconds_since(t0) < kExitWaitS;) {
    wait_readable(err_, 0.005);
    read_stderr();
    status = exit_status();
  }
  kill(-pid_, SIGKILL);
  for (const Clock::time_point t0 = Clock::now(); err_ >= 0 && seconds_since(t0) < kDrainWaitS;) {
    wait_readable(err_, kDrainWaitS - seconds_since(t0));
    read_stderr();
  }
  int st = 0;
  while (waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
  }
  reaped_ = true;
  close_fd(out_);
  close_fd(err_);
  return status.value_or("");
}

std::unique_ptr<WorkerProcess> WorkerProcess::start(const std::vector<std::string>& argv, std::string* error) {
  int in[2] = {-1, -1}, out[2] = {-1, -1}, err[2] = {-1, -1};
  // O_CLOEXEC: the worker gets only the three ends dup2'ed onto 0, 1 and 2.
  if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) {
    *error = str_cat("cannot make pipes: ", std::strerror(errno));
    for (int* p : {in, out, err}) close_fd(p[0]), close_fd(p[1]);
    return nullptr;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in[0], 0);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  posix_spawn_file_actions_adddup2(&actions, err[1], 2);
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 34))
  posix_spawn_file_actions_addclosefrom_np(&actions, 3);  // fds others opened without O_CLOEXEC (MPI, ...)
#endif
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, defaults;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);  // not our blocked SIGPIPE
  sigemptyset(&defaults);
  for (int sig : {SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD, SIGUSR1, SIGUSR2, SIGALRM})
    sigaddset(&defaults, sig);
  posix_spawnattr_setsigdefault(&attr, &defaults);  // not an ignore kiln or MPI set
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETPGROUP);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, args[0], &actions, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  close_fd(in[0]);
  close_fd(out[1]);
  close_fd(err[1]);
  if (rc != 0) {
    *error = str_cat(std::strerror(rc), " (errno ", rc, ")", spawn_hint(rc));
    close_fd(in[1]);
    close_fd(out[0]);
    close_fd(err[0]);
    return nullptr;
  }
  std::unique_ptr<WorkerProcess> w(new WorkerProcess());
  w->pid_ = pid;
  w->reaped_ = false;
  w->in_ = in[1];
  w->out_ = out[0];
  w->err_ = err[0];
  for (int fd : {w->in_, w->out_, w->err_}) set_nonblocking(fd);
  return w;
}

}  // namespace kiln::trainer
