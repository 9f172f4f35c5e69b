// Tests of core/hdf5_io: datasets of every supported dtype (nested groups, scalars, empty) round trip;
// an uncommitted Writer leaves nothing behind; reading a missing file or dataset names it.
#include "core/hdf5_io.h"

#include <ATen/ATen.h>

#include <filesystem>

#include "core/error.h"
#include "tests/test_util.h"

namespace kiln::hdf5 {
namespace {

namespace fs = std::filesystem;
using kiln::test::all_equal;
using kiln::test::TempDir;

// Passes when fn throws kiln::Error whose message contains every one of `parts`.
using kiln::test::throws_with;

TEST(Hdf5, DatasetsRoundTrip) {
  at::manual_seed(11);
  TempDir dir;
  const std::string path = dir / "out.h5";
  auto ints = at::TensorOptions().dtype(at::kLong);
  const std::vector<std::pair<std::string, at::Tensor>> same_type = {
      {"u8", at::randint(0, 256, {19}, ints).to(at::kByte)},
      {"i8", at::randint(-128, 128, {111}, ints).to(at::kChar)},
      {"i16", at::randint(-32768, 32768, {3, 7}, ints).to(at::kShort)},
      {"i32", at::randint(-(1ll << 31), (1ll << 31) - 1, {1}, ints).to(at::kInt)},
      {"i64", at::randint(-(1ll << 50), 1ll << 50, {3, 4097}, ints)},
      {"f16", at::randn({19}).to(at::kHalf)},
      {"f32", at::randn({2, 3, 5})},
      {"f64", at::randn({111}, at::TensorOptions().dtype(at::kDouble))},
      {"rollout/step_0/logprobs", at::randn({4, 19})},
      {"rollout/step_0/tokens", at::randint(0, 1000, {4, 19}, ints)},
      {"rollout/step_1/logprobs", at::randn({2})},
      {"scalar", at::scalar_tensor(3.25)},
      {"empty", at::empty({0, 5})},
      {"strided", at::randn({5, 7}).t()},
  };
  at::Tensor mask = at::randint(0, 2, {19}, ints).to(at::kBool);
  at::Tensor bf16 = at::randn({3, 19}).to(at::kBFloat16);
  {
    Writer w(path);
    EXPECT_TRUE(fs::exists(path + ".tmp"));
    for (const auto& [name, t] : same_type) w.write(name, t);
    w.write("mask", mask);
    w.write("bf16", bf16);
    w.attribute("model", "muse-debug");
    w.attribute("model", "muse-debug-2");  // replaces
    w.attribute("config", std::string(5000, 'x'));
    EXPECT_FALSE(fs::exists(path));
    w.commit();
    EXPECT_TRUE(throws_with([&] { w.write("late", at::ones({1})); }, {"after commit", path, "late"}));
  }
  ASSERT_TRUE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  for (const auto& [name, t] : same_type) {
    at::Tensor r = read(path, name);
    EXPECT_TRUE(all_equal(r, t)) << name;
  }
  EXPECT_EQ(read(path, "scalar").dim(), 0);
  EXPECT_TRUE(all_equal(read(path, "mask"), mask.to(at::kByte)));    // bool is stored as uint8
  EXPECT_TRUE(all_equal(read(path, "bf16"), bf16.to(at::kFloat)));  // bf16 as float32, exactly
}

TEST(Hdf5, UncommittedWriterLeavesNoFile) {
  TempDir dir;
  const std::string path = dir / "never.h5";
  {
    Writer w(path);
    w.write("a/b", at::ones({3}));
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

TEST(Hdf5, ErrorsNameTheFileAndDataset) {
  TempDir dir;
  const std::string path = dir / "out.h5";
  {
    Writer w(path);
    w.write("group/x", at::ones({2}));
    EXPECT_TRUE(throws_with([&] { w.write("group/x", at::ones({2})); }, {path, "dataset=group/x"}));
    EXPECT_TRUE(throws_with([&] { w.write("group/x/y", at::ones({2})); }, {path, "dataset=group/x/y"}));
    EXPECT_TRUE(throws_with([&] { w.write("c", at::ones({2}, at::kComplexFloat)); },
                            {path, "dataset=c", "unsupported"}));
    w.commit();
  }
  EXPECT_TRUE(throws_with([&] { read(path, "group/missing"); },
                          {"no such dataset", "file=" + path, "dataset=group/missing"}));
  EXPECT_TRUE(throws_with([&] { read(path, "nope/deeper/x"); }, {path, "dataset=nope/deeper/x"}));
  EXPECT_TRUE(throws_with([&] { read(dir / "absent.h5", "x"); }, {"cannot open", "absent.h5"}));
  EXPECT_TRUE(throws_with([&] { Writer w(dir / "no/such/dir/out.h5"); }, {"no/such/dir/out.h5"}));
  EXPECT_TRUE(all_equal(read(path, "group/x"), at::ones({2})));
}

}  // namespace
}  // namespace kiln::hdf5
