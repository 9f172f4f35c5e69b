// Shared test helpers: expect_close (|a-e| <= atol + rtol|e|, NaN fails) and temporary directories.
#pragma once
#include <ATen/core/Tensor.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

namespace kiln::test {

// Compares element-wise in float64 on the CPU. On failure reports the count of bad elements,
// the first bad index and the largest absolute and relative errors.
::testing::AssertionResult all_close(const at::Tensor& actual, const at::Tensor& expected,
                                     double rtol, double atol);

#define KILN_EXPECT_CLOSE(actual, expected, rtol, atol) \
  EXPECT_TRUE(::kiln::test::all_close((actual), (expected), (rtol), (atol)))

// Exact equality of shape, dtype and every element (indices, routing, bytes).
::testing::AssertionResult all_equal(const at::Tensor& actual, const at::Tensor& expected);

// The message of the kiln::Error `fn` throws, or "" when it throws none.
std::string error_of(const std::function<void()>& fn);

// Success when `fn` throws a kiln::Error whose message contains every one of `parts`.
::testing::AssertionResult throws_with(const std::function<void()>& fn, const std::vector<std::string>& parts);

// A fresh directory under the system temp dir, removed when the object goes away.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Path of a file under the source tree (configs/, recipes/), for tests that read shipped files.
std::string source_path(const std::string& relative);

}  // namespace kiln::test
