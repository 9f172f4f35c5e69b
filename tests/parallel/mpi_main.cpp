// GoogleTest main for the MPI tests: every rank runs every test; a failure on any rank makes that
// rank exit non-zero, and so mpirun. Only rank 0 prints the per-test lines; the other ranks print
// their failures, each line prefixed with the rank. An exception that
// escapes a test body ends the whole job at once: the other ranks would otherwise wait in their
// next collective until ctest's timeout. A crash prints its rank and a symbolised backtrace
// (core/crash.h; the binary exports its symbols).
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "core/comm.h"
#include "core/crash.h"

namespace {

class AbortOnEscapedException : public ::testing::EmptyTestEventListener {
  // The test's name is kept here: UnitTest::current_test_info() takes the lock gtest holds while it
  // reports a result, so asking for it in OnTestPartResult deadlocks.
  void OnTestStart(const ::testing::TestInfo& t) override { name_ = std::string(t.test_suite_name()) + "." + t.name(); }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    const std::string message = r.message() ? r.message() : "";
    const int rank = kiln::comm::Group::world().rank();
    if (r.failed() && rank != 0)  // rank 0's printer says its own; the others' failures are said here
      std::fprintf(stderr, "rank %d: %s failed at %s:%d: %s\n", rank, name_.c_str(), r.file_name() ? r.file_name() : "?",
                   r.line_number(), message.c_str());
    if (!r.failed() || message.find("thrown in the test body") == std::string::npos) return;
    std::fprintf(stderr, "rank %d: %s: %s\nrank %d: aborting the job so that no rank waits for this one\n", rank,
                 name_.c_str(), message.c_str(), rank);
    std::fflush(stderr);
    kiln::comm::abort_job(4);
  }
  std::string name_;
};

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  kiln::comm::init(&argc, &argv);
  kiln::install_crash_report(kiln::comm::Group::world().rank());  // after MPI's own handlers
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (kiln::comm::Group::world().rank() != 0) delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new AbortOnEscapedException);
  const int rc = RUN_ALL_TESTS();
  kiln::comm::finalize();
  return rc;
}
