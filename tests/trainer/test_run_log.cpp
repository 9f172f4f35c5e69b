// RunLog on a full disk: every metrics and sample write is checked, and the error names the file
// (/dev/full stands in for a full disk: opening works, every write fails with ENOSPC).
#include <gtest/gtest.h>

#include <filesystem>

#include "tests/test_util.h"
#include "trainer/run.h"

namespace kiln::trainer {
namespace {

TEST(RunLog, AFullDiskIsAnErrorNamingTheFile) {
  if (!std::filesystem::exists("/dev/full")) GTEST_SKIP() << "no /dev/full here";
  test::TempDir dir;
  std::filesystem::create_symlink("/dev/full", dir / "metrics.jsonl");
  RunLog log(dir.path(), /*tensorboard=*/false, /*resumed_at=*/1);
  StepMetrics m;
  m.step = 1;
  EXPECT_TRUE(test::throws_with([&] { log.step(m); }, {dir / "metrics.jsonl", "cannot write", "disk space"}));
  EvalMetrics e;
  EXPECT_TRUE(test::throws_with([&] { log.eval(e); }, {"metrics.jsonl", "cannot write"}));
  std::filesystem::create_symlink("/dev/full", dir / "samples.jsonl");
  GrpoTrainer::SampleRecord s;
  s.prompt = "1+1=";
  EXPECT_TRUE(test::throws_with([&] { log.samples(1, {s}); }, {"samples.jsonl", "cannot write"}));
}

}  // namespace
}  // namespace kiln::trainer
