// SIGTERM / SIGUSR1 handlers that only record the signal (async-signal-safe) and restore the
// default action, so a second signal ends the process as it normally would.
#include "core/stop_signal.h"

#include <csignal>
#include <cstdio>
#include <initializer_list>

namespace kiln::stop_signal {
namespace {

volatile std::sig_atomic_t g_received = 0;

void on_signal(int sig) {
  g_received = sig;
  std::signal(sig, SIG_DFL);
}

}  // namespace

void install() {
  for (int sig : {SIGTERM, SIGUSR1}) {
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;  // blocking reads and waits resume; the loop looks at the flag
    sigaction(sig, &sa, nullptr);
  }
}

int received() { return int(g_received); }

const char* name(int signal) {
  if (signal == SIGTERM) return "SIGTERM";
  if (signal == SIGUSR1) return "SIGUSR1";
  static thread_local char buf[32];
  std::snprintf(buf, sizeof buf, "signal %d", signal);
  return buf;
}

}  // namespace kiln::stop_signal
