// The crash report (core/crash.h): a child process that installs it and then faults, through a
// null data pointer and through a null function pointer, writes its rank, the signal and the
// faulting instruction to stderr and still dies by that signal.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "core/crash.h"

namespace kiln {
namespace {

struct Death {
  int signal = 0;
  std::string stderr_text;
};

// Runs `fault` in a child with the report installed as rank 7; what it wrote and how it died.
Death crash_child(void (*fault)()) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], STDERR_FILENO);
    close(fds[0]);
    install_crash_report(7);
    fault();
    _exit(0);  // not reached
  }
  close(fds[1]);
  Death d;
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) d.stderr_text.append(buf, size_t(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) d.signal = WTERMSIG(status);
  return d;
}

volatile int* volatile g_null_data = nullptr;
void (*volatile g_null_function)() = nullptr;

TEST(CrashReport, NamesTheRankSignalAndFaultingInstruction) {
  const Death d = crash_child([] { *g_null_data = 1; });
  EXPECT_EQ(d.signal, SIGSEGV);
  EXPECT_NE(d.stderr_text.find("kiln: rank 7: fatal signal 11 at address (nil)"), std::string::npos) << d.stderr_text;
  EXPECT_NE(d.stderr_text.find("rank 7: faulting instruction 0x"), std::string::npos) << d.stderr_text;
}

TEST(CrashReport, ACallThroughANullPointerNamesItsCaller) {
  const Death d = crash_child([] { g_null_function(); });
  EXPECT_EQ(d.signal, SIGSEGV);
  EXPECT_NE(d.stderr_text.find("rank 7: called from (a null function pointer) 0x"), std::string::npos)
      << d.stderr_text;
}

}  // namespace
}  // namespace kiln
