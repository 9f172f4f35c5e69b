// The optimizer on CUDA parameters: state in CPU memory streamed through the GPU in chunks (two
// buffers, two copy streams), the CPU update, and NVMe, against the all-on-GPU update; and state
// saved from one placement restored into another.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "optimizers/optimizer.h"
#include "tests/test_util.h"

namespace kiln::optimizers {
namespace {

using Named = std::vector<std::pair<std::string, at::Tensor>>;

// Odd sizes (1, 19, 111, 4097) for AdamW; an expert stack and a matrix for Muon.
Named params(at::ScalarType dtype) {
  at::manual_seed(7);
  Named ps;
  for (int64_t n : {1, 19, 111, 4097}) ps.emplace_back("norm" + std::to_string(n) + ".weight", at::randn({n}));
  ps.emplace_back("layers.0.mlp.experts.up_proj", at::randn({3, 19, 111}));
  ps.emplace_back("layers.0.attn.q_proj.weight", at::randn({111, 19}));
  for (auto& [n, p] : ps) p = p.to(at::kCUDA, dtype);
  return ps;
}

void run(Optimizer& o, Named& ps, int64_t from, int64_t to) {
  for (int64_t s = from; s < to; ++s) {
    at::manual_seed(100 + s);
    for (auto& [n, p] : ps) p.mutable_grad() = at::randn(p.sizes()).to(p.options());
    o.step();
  }
}

OptimizerConfig config(Placement where, at::ScalarType moments, const std::string& dir) {
  OptimizerConfig c;
  c.placement = where;
  c.nvme_dir = dir;
  c.moment_dtype = moments;
  c.chunk_bytes = 2000;  // the 4097-vector and the expert stack each take several chunks
  c.adamw.lr = 1e-2;
  c.adamw.weight_decay = 0.01;
  c.muon.lr = 2e-2;
  c.muon.ns_dtype = at::kFloat;
  return c;
}

// `muon_tol` applies to the Muon parameters (names with "proj"), `tol` to the rest; 0 = bitwise.
::testing::AssertionResult same(const Named& a, const Named& b, double tol, double muon_tol = -1) {
  for (size_t i = 0; i < a.size(); ++i) {
    at::Tensor x = a[i].second.detach().cpu(), y = b[i].second.detach().cpu();
    const double t = muon_tol >= 0 && a[i].first.find("proj") != std::string::npos ? muon_tol : tol;
    auto r = t == 0 ? test::all_equal(x, y) : test::all_close(x, y, t, t * 0.1);
    if (!r) return r << " (" << a[i].first << ")";
  }
  return ::testing::AssertionSuccess();
}

TEST(CudaOptimizer, ChunkedHostAndNvmeStateMatchTheGpuUpdate) {
  test::TempDir dir;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16})
    for (at::ScalarType moments : {at::kFloat, at::kBFloat16}) {
      Named ref = params(dtype), host = params(dtype), cpu = params(dtype), nvme = params(dtype);
      Optimizer o_ref(ref, config(Placement::kDevice, moments, dir.path())),
          o_host(host, config(Placement::kHost, moments, dir.path())),
          o_cpu(cpu, config(Placement::kHostCpu, moments, dir.path())),
          o_nvme(nvme, config(Placement::kNvme, moments, dir.path()));
      run(o_ref, ref, 0, 4);
      run(o_host, host, 0, 4);
      run(o_cpu, cpu, 0, 4);
      run(o_nvme, nvme, 0, 4);
      const std::string what = std::string(at::toString(dtype)) + " params, " + at::toString(moments) + " moments";
      // The chunked GPU updates run the same elementwise kernels on slices: AdamW is bitwise.
      // Muon's batched matmuls may pick another algorithm for a smaller batch: 1e-6 in fp32, and
      // for bf16 weights one bf16 step (a master differing in the last bits can round the other way).
      EXPECT_TRUE(same(host, ref, 0, dtype == at::kFloat ? 1e-6 : 1e-2)) << what;
      EXPECT_TRUE(same(nvme, host, 0)) << what;
      // The CPU update: the fused Eigen AdamW and Muon on the CPU. bf16 moments or weights can
      // round to a neighbouring value, so those get the bf16 bound.
      const double cpu_tol = dtype == at::kFloat && moments == at::kFloat ? 1e-5 : 1e-2;
      EXPECT_TRUE(same(cpu, ref, cpu_tol)) << what;
    }
}

TEST(CudaOptimizer, GpuStateRestoresIntoEveryOtherPlacement) {
  test::TempDir dir;
  // AdamW with bf16 weights and fp32 masters: every placement is the same arithmetic, so bitwise.
  auto cfg = [&](Placement p) {
    OptimizerConfig c = config(p, at::kFloat, dir.path());
    c.use_muon = false;
    return c;
  };
  Named ref = params(at::kBFloat16);
  Optimizer o_ref(ref, cfg(Placement::kDevice));
  run(o_ref, ref, 0, 5);
  for (Placement to : {Placement::kHost, Placement::kNvme, Placement::kDevice}) {
    Named a = params(at::kBFloat16);
    Optimizer first(a, cfg(Placement::kDevice));
    run(first, a, 0, 3);
    first.save(dir / "gpu.safetensors");
    Named b;
    for (auto& [n, p] : a) b.emplace_back(n, p.detach().clone());
    Optimizer second(b, cfg(to));
    second.load(dir / "gpu.safetensors");
    run(second, b, 3, 5);
    EXPECT_TRUE(same(b, ref, 0)) << placement_name(to);
  }
}

}  // namespace
}  // namespace kiln::optimizers
