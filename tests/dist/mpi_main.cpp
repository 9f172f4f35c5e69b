// GoogleTest main for the MPI tests: every rank runs every test; a failure on any rank makes that
// rank exit non-zero, and so mpirun. Only rank 0 prints the per-test lines. An exception that
// escapes a test body ends the whole job at once: the other ranks would otherwise wait in their
// next collective until ctest's timeout. A crash prints its rank and a symbolised backtrace
// (the binary exports its symbols), since the machines that run these may have no debugger.
#include <dlfcn.h>
#include <execinfo.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "core/comm.h"

namespace {

class AbortOnEscapedException : public ::testing::EmptyTestEventListener {
  // The test's name is kept here: UnitTest::current_test_info() takes the lock gtest holds while it
  // reports a result, so asking for it in OnTestPartResult deadlocks.
  void OnTestStart(const ::testing::TestInfo& t) override { name_ = std::string(t.test_suite_name()) + "." + t.name(); }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    const std::string message = r.message() ? r.message() : "";
    if (!r.failed() || message.find("thrown in the test body") == std::string::npos) return;
    const int rank = kiln::comm::Group::world().rank();
    std::fprintf(stderr, "rank %d: %s: %s\nrank %d: aborting the job so that no rank waits for this one\n", rank,
                 name_.c_str(), message.c_str(), rank);
    std::fflush(stderr);
    kiln::comm::abort_job(4);
  }
  std::string name_;
};

int crash_rank = -1;

// Async-signal-safe enough for a dying process: formatted into a stack buffer, written with
// write(2). The faulting instruction comes from the signal's context (an unwinder may not get past
// the signal frame), named through dladdr, then whatever backtrace() finds.
void on_crash(int sig, siginfo_t* info, void* context) {
  char line[512];
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
  const auto say = [&](const char* what, void* at) {
    Dl_info where{};
    const bool named = at != nullptr && dladdr(at, &where) != 0;
    const uintptr_t base = named ? reinterpret_cast<uintptr_t>(where.dli_fbase) : 0;
    const int len = std::snprintf(line, sizeof line, "rank %d: %s %p = %s+0x%zx (%s)\n", crash_rank, what, at,
                                  named && where.dli_fname ? where.dli_fname : "?",
                                  size_t(reinterpret_cast<uintptr_t>(at) - base),
                                  named && where.dli_sname ? where.dli_sname : "no symbol");
    if (len > 0) (void)!write(STDERR_FILENO, line, size_t(std::min<int>(len, int(sizeof line) - 1)));
  };
  const int len = std::snprintf(line, sizeof line, "rank %d: fatal signal %d at address %p\n", crash_rank, sig,
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

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  kiln::comm::init(&argc, &argv);
  crash_rank = kiln::comm::Group::world().rank();
  struct sigaction action {};
  action.sa_sigaction = on_crash;
  action.sa_flags = SA_SIGINFO;
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGABRT}) sigaction(sig, &action, nullptr);  // after MPI's own handlers
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (kiln::comm::Group::world().rank() != 0) delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new AbortOnEscapedException);
  const int rc = RUN_ALL_TESTS();
  kiln::comm::finalize();
  return rc;
}
