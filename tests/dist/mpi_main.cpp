// GoogleTest main for the MPI tests: every rank runs every test; a failure on any rank makes that
// rank exit non-zero, and so mpirun. Only rank 0 prints the per-test lines.
#include <gtest/gtest.h>

#include "core/comm.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  kiln::comm::init(&argc, &argv);
  if (kiln::comm::Group::world().rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  kiln::comm::finalize();
  return rc;
}
