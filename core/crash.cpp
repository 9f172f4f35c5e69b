// The crash report: formatted into a stack buffer and written with write(2), async-signal-safe
// enough for a dying process. The faulting instruction comes from the signal's context, since an
// unwinder may not get past the signal frame; then whatever backtrace() finds.
#include "core/crash.h"

#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>

namespace kiln {
namespace {

int g_rank = -1;

void say(const char* what, void* at) {
  char line[512];
  Dl_info where{};
  const bool named = at != nullptr && dladdr(at, &where) != 0;
  const uintptr_t base = named ? reinterpret_cast<uintptr_t>(where.dli_fbase) : 0;
  const int len = std::snprintf(line, sizeof line, "rank %d: %s %p = %s+0x%zx (%s)\n", g_rank, what, at,
                                named && where.dli_fname ? where.dli_fname : "?",
                                size_t(reinterpret_cast<uintptr_t>(at) - base),
                                named && where.dli_sname ? where.dli_sname : "no symbol");
  if (len > 0) (void)!write(STDERR_FILENO, line, size_t(std::min<int>(len, int(sizeof line) - 1)));
}

void on_crash(int sig, siginfo_t* info, void* context) {
  alarm(10);  // a report that deadlocks (a crash inside malloc, the loader's lock) still ends the process
  void* pc = nullptr;
  void* caller = nullptr;
#if defined(__x86_64__)
  const auto& regs = static_cast<ucontext_t*>(context)->uc_mcontext.gregs;
  pc = reinterpret_cast<void*>(regs[REG_RIP]);
  // A call through a null pointer faults at address 0 with the return address on top of the stack.
  if (pc == nullptr) caller = *reinterpret_cast<void* const*>(regs[REG_RSP]);
#else
  (void)context;
#endif
  char line[160];
  const int len = std::snprintf(line, sizeof line, "kiln: rank %d: fatal signal %d at address %p\n", g_rank, sig,
                                info ? info->si_addr : nullptr);
  if (len > 0) (void)!write(STDERR_FILENO, line, size_t(len));
  say("faulting instruction", pc);
  if (caller != nullptr) say("called from (a null function pointer)", caller);
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
  signal(sig, SIG_DFL);
  raise(sig);
}

}  // namespace

void install_crash_report(int rank) {
  g_rank = rank;
  void* warm[1];
  backtrace(warm, 1);  // loads the unwinder now: a handler must not be the first to (it allocates)
  // Its own stack, so that a stack overflow is reported too (this thread's; others use their own).
  static char alt_stack[1 << 16];
  stack_t ss{};
  ss.ss_sp = alt_stack;
  ss.ss_size = sizeof alt_stack;
  sigaltstack(&ss, nullptr);
  struct sigaction action {};
  action.sa_sigaction = on_crash;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGABRT}) sigaction(sig, &action, nullptr);
}

}  // namespace kiln
