// The batch-invariant CUDA kernels (kernels/invariant.h): the GEMM and the ranged attention against
// float64 on odd sizes in bf16, fp32 and fp64, and each row's bits the same whatever batch it runs in;
// the GEMMs on both instruction sets (mma.sync and wgmma).
#include <ATen/ATen.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/invariant.h"
#include "model/batch_invariant.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

const at::Device kCuda(at::kCUDA, 0);

// max |a - b| over max |ref| (a and b compared in float64 on the CPU).
double relative_error(const at::Tensor& a, const at::Tensor& ref) {
  at::Tensor r = ref.to(at::kCPU, at::kDouble);
  return (a.to(at::kCPU, at::kDouble) - r).abs().max().item<double>() / std::max(1e-30, r.abs().max().item<double>());
}

double tolerance(at::ScalarType t) { return t == at::kBFloat16 ? 1e-2 : t == at::kFloat ? 1e-5 : 1e-12; }

// The GEMM tests run on both instruction sets (kernels::invariant_gemm); this puts one in place
// and the process's choice back after.
struct GemmChoice {
  std::string before;
  explicit GemmChoice(const std::string& name) : before(kernels::set_invariant_gemm(name)) {}
  ~GemmChoice() { kernels::set_invariant_gemm(before); }
};
const char* const kGemms[] = {"mma", "wgmma"};

// The process's choice: auto (wgmma where it runs, else mma) unless kiln_test_cuda was given
// --bitwise-gemm (ctest kiln_cuda_bitwise_mma); the setter changes it and puts it back, and refuses
// other names without changing it.
TEST(CudaInvariant, GemmChoiceFollowsTheSettingAndTheSetter) {
  const std::string setting = kernels::set_invariant_gemm("auto");
  kernels::set_invariant_gemm(setting);
  const std::string start = setting != "auto" ? setting : kernels::invariant_wgmma_available() ? "wgmma" : "mma";
  EXPECT_EQ(kernels::invariant_gemm(), start);
  {
    GemmChoice other(start == "mma" ? "wgmma" : "mma");
    EXPECT_NE(kernels::invariant_gemm(), start);
    EXPECT_THROW(kernels::set_invariant_gemm("cublas"), std::exception);
    EXPECT_NE(kernels::invariant_gemm(), start);
  }
  EXPECT_EQ(kernels::invariant_gemm(), start);
  // On a compute capability 9.0 GPU wgmma must be there, or the tests below would skip it unseen.
  int device = 0, major = 0, minor = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (major == 9 && minor == 0) {
    EXPECT_TRUE(kernels::invariant_wgmma_available()) << "built without sm_90a code?";
  }
}

// Under the instructions `gemm`: each shape against float64, and rows in other batches the same bits.
void check_linear(const char* gemm) {
  SCOPED_TRACE(gemm);
  if (std::string(gemm) == "wgmma" && !kernels::invariant_wgmma_available()) return;
  GemmChoice choice(gemm);
  // (N, K): tensor cores (K % 8 == 0, tails in N and K; wgmma's pipeline of 64-wide steps at 1 to 9
  // steps), and CUDA cores (K odd). On 132 SMs the whole batch takes the 128 x 128 tile at N 1100
  // and 4097, the 64 x 128 one at N 300, the 64 x 64 one at N 130, and the parts 64 x 32 ones: the
  // bits must not differ (on wgmma the widths are m64n128k16, m64n64k16 and m64n32k16).
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{19, 64},   {111, 200}, {130, 520}, {7, 19},  {4097, 24},
                                                           {1100, 520}, {64, 128},  {33, 136},  {300, 72}};
  for (at::ScalarType dt : {at::kBFloat16, at::kFloat, at::kDouble})
    for (auto [N, K] : shapes) {
      const int64_t M = 4097;
      at::Tensor x = at::randn({M, K}, at::TensorOptions().dtype(at::kDouble)).to(kCuda, dt);
      at::Tensor w = (at::randn({N, K}, at::TensorOptions().dtype(at::kDouble)) / std::sqrt(double(K))).to(kCuda, dt);
      at::Tensor y = kernels::invariant_linear_cuda(x, w);
      ASSERT_EQ(y.scalar_type(), dt);
      EXPECT_LT(relative_error(y, at::linear(x.to(at::kCPU, at::kDouble), w.to(at::kCPU, at::kDouble))), tolerance(dt))
          << "N " << N << " K " << K << " " << dt;
      // Rows alone, or in batches of 19 and 111 at other offsets, in fresh tensors: the same bits.
      for (auto [first, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {4096, 1}, {5, 19}, {3000, 111}}) {
        at::Tensor part = kernels::invariant_linear_cuda(x.narrow(0, first, n).clone(), w);
        EXPECT_TRUE(at::equal(part, y.narrow(0, first, n))) << "rows " << first << "+" << n << " N " << N << " K "
                                                            << K << " " << dt;
      }
    }
}

TEST(CudaInvariant, LinearMatchesFloat64AndRowsDoNotDependOnTheBatch) {
  at::manual_seed(7);
  for (const char* gemm : kGemms) check_linear(gemm);
}

// The grouped GEMM under `gemm`: each group's rows get the bits the dense GEMM gives them alone with
// the group's weight. Groups this large take the 128-row tile, the rows alone the 64-row one; empty
// groups and a group of one row are skipped or served like the rest.
void check_grouped(const char* gemm) {
  SCOPED_TRACE(gemm);
  if (std::string(gemm) == "wgmma" && !kernels::invariant_wgmma_available()) return;
  GemmChoice choice(gemm);
  const int64_t N = 1536, K = 200;
  const std::vector<int64_t> ends = {0, 1, 1501, 1501, 3201};
  const int64_t rows = ends.back(), groups = int64_t(ends.size()) - 1;
  at::Tensor x = at::randn({rows, K}, at::TensorOptions().dtype(at::kDouble)).to(kCuda, at::kBFloat16);
  at::Tensor w = (at::randn({groups, N, K}, at::TensorOptions().dtype(at::kDouble)) / std::sqrt(double(K)))
                     .to(kCuda, at::kBFloat16);
  const at::Tensor y = kernels::invariant_grouped_linear_cuda(x, w, at::tensor(ends, at::kLong).to(kCuda));
  for (int64_t e = 0; e < groups; ++e) {
    const int64_t lo = ends[size_t(e)], n = ends[size_t(e) + 1] - lo;
    if (n == 0) continue;
    const at::Tensor rows_e = x.narrow(0, lo, n);
    EXPECT_TRUE(at::equal(y.narrow(0, lo, n), kernels::invariant_linear_cuda(rows_e.clone(), w[e]))) << "group " << e;
    EXPECT_LT(relative_error(y.narrow(0, lo, n), at::linear(rows_e.to(at::kCPU, at::kDouble), w[e].to(at::kCPU, at::kDouble))),
              tolerance(at::kBFloat16))
        << "group " << e;
    // One row of the group alone: the same bits again.
    EXPECT_TRUE(at::equal(y.narrow(0, lo + n - 1, 1), kernels::invariant_linear_cuda(x.narrow(0, lo + n - 1, 1).clone(), w[e])))
        << "group " << e << ", its last row alone";
  }
}

TEST(CudaInvariant, GroupedLinearRowsAreTheDenseGemmsOfTheirGroup) {
  at::manual_seed(11);
  for (const char* gemm : kGemms) check_grouped(gemm);
}

TEST(CudaInvariant, RangedAttentionMatchesFloat64AndQueriesDoNotDependOnTheBatch) {
  at::manual_seed(8);
  for (at::ScalarType dt : {at::kBFloat16, at::kFloat, at::kDouble})
    for (int64_t hd : {16, 64, 96}) {
      const int64_t n = 111, m = 4097, Hq = 6, Hkv = 2;
      auto opts = at::TensorOptions().dtype(at::kDouble);
      at::Tensor q = at::randn({n, Hq, hd}, opts).to(kCuda, dt), k = at::randn({m, Hkv, hd}, opts).to(kCuda, dt),
                 v = at::randn({m, Hkv, hd}, opts).to(kCuda, dt);
      model::KeyRanges r;
      for (int64_t i = 0; i < n; ++i) {  // lengths 1, 19, 111, 4097 and others
        const int64_t c = i == 0 ? 1 : i == 1 ? 19 : i == 2 ? 111 : i == 3 ? m : 1 + (i * 37) % 300;
        r.count.push_back(c);
        r.begin.push_back((i * 101) % (m - c + 1));
      }
      at::Tensor o = model::ranged_attention(q, k, v, {}, {}, r);
      // float64 on the CPU, query by query.
      at::Tensor qd = q.to(at::kCPU, at::kDouble), kd = k.to(at::kCPU, at::kDouble), vd = v.to(at::kCPU, at::kDouble);
      at::Tensor ref = model::ranged_attention(qd, kd, vd, {}, {}, r);
      EXPECT_LT(relative_error(o, ref), tolerance(dt) * 2) << "hd " << hd << " " << dt;
      // Queries alone, their keys read through a table from two other buffers (the engine's cache
      // rows and new rows, here reversed halves): the same bits.
      for (int64_t i : {0, 1, 2, 3}) {
        const int64_t b = r.begin[size_t(i)], c = r.count[size_t(i)], half = c / 2;
        at::Tensor main_k = k.narrow(0, b, half).flip(0).contiguous(), main_v = v.narrow(0, b, half).flip(0).contiguous();
        at::Tensor fresh_k = k.narrow(0, b + half, c - half).flip(0).contiguous(),
                   fresh_v = v.narrow(0, b + half, c - half).flip(0).contiguous();
        model::KeyRanges one;
        one.begin = {0};
        one.count = {c};
        for (int64_t j = 0; j < half; ++j) one.table.push_back(half - 1 - j);
        for (int64_t j = 0; j < c - half; ++j) one.table.push_back(-1 - (c - half - 1 - j));
        at::Tensor alone = model::ranged_attention(q.narrow(0, i, 1).clone(), main_k, main_v, fresh_k, fresh_v, one);
        EXPECT_TRUE(at::equal(alone, o.narrow(0, i, 1))) << "query " << i << " hd " << hd << " " << dt;
      }
    }
}

}  // namespace
}  // namespace kiln
