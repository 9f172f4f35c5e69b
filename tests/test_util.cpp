// Implementation of the shared test helpers.
#include "tests/test_util.h"

#include "core/error.h"
#include "core/files.h"

#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>

namespace kiln::test {

::testing::AssertionResult all_close(const at::Tensor& actual, const at::Tensor& expected,
                                     double rtol, double atol) {
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure()
           << "shape mismatch: actual " << actual.sizes() << " vs expected " << expected.sizes();
  }
  at::Tensor a = actual.detach().to(at::kCPU, at::kDouble).contiguous().reshape(-1);
  at::Tensor e = expected.detach().to(at::kCPU, at::kDouble).contiguous().reshape(-1);
  const double* pa = a.data_ptr<double>();
  const double* pe = e.data_ptr<double>();
  int64_t bad = 0, first = -1;
  double max_abs = 0, max_rel = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    double diff = std::abs(pa[i] - pe[i]);
    bool ok = !std::isnan(pa[i]) && !std::isnan(pe[i]) && diff <= atol + rtol * std::abs(pe[i]);
    if (std::isnan(pa[i]) || std::isnan(pe[i])) diff = INFINITY;
    max_abs = std::max(max_abs, diff);
    if (pe[i] != 0) max_rel = std::max(max_rel, diff / std::abs(pe[i]));
    if (!ok) {
      if (first < 0) first = i;
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << a.numel() << " elements differ (rtol=" << rtol << ", atol=" << atol
         << "); first at flat index " << first << ": actual " << pa[first] << " expected "
         << pe[first] << "; max abs err " << max_abs << ", max rel err " << max_rel;
}

::testing::AssertionResult all_equal(const at::Tensor& actual, const at::Tensor& expected) {
  if (actual.sizes() != expected.sizes() || actual.scalar_type() != expected.scalar_type()) {
    return ::testing::AssertionFailure()
           << "shape/dtype mismatch: actual " << actual.sizes() << " " << actual.scalar_type()
           << " vs expected " << expected.sizes() << " " << expected.scalar_type();
  }
  at::Tensor a = actual.detach().cpu().contiguous();
  at::Tensor e = expected.detach().cpu().contiguous();
  at::Tensor ne = a.ne(e).reshape(-1);
  int64_t bad = ne.sum().item<int64_t>();
  if (bad == 0) return ::testing::AssertionSuccess();
  int64_t first = ne.nonzero()[0][0].item<int64_t>();
  return ::testing::AssertionFailure() << bad << " of " << a.numel()
                                       << " elements differ; first at flat index " << first;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

::testing::AssertionResult throws_with(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts)
      if (msg.find(p) == std::string::npos)
        return ::testing::AssertionFailure() << "message lacks \"" << p << "\": " << msg;
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw something other than kiln::Error: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

TempDir::TempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "kiln-test-XXXXXX").string();
  char* made = mkdtemp(tmpl.data());
  if (!made) throw std::runtime_error("mkdtemp failed for " + tmpl);
  path_ = made;
}

TempDir::~TempDir() {
  try {
    remove_tree(path_);
  } catch (const Error&) {
  }
}

std::string source_path(const std::string& relative) {
  return std::string(KILN_SOURCE_DIR) + "/" + relative;
}

}  // namespace kiln::test
