// The optimizer on CUDA parameters: state in CPU memory streamed through the GPU in chunks (two
// buffers, two copy streams), the CPU update, and NVMe, against the all-on-GPU update; and state
// saved from one placement restored into another; the multi-tensor AdamW kernel against the ATen
// update and float64, and the batched Newton-Schulz against the CPU's float64.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/adamw.h"
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
  c.state = where;
  c.nvme_dir = dir;
  c.moments = moments;
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

// float64 AdamW of one step from the given state (CPU tensors), for the kernel's accuracy bound.
void adamw_f64(at::Tensor& w, const at::Tensor& g, at::Tensor& m, at::Tensor& v, const AdamWConfig& c, int64_t step) {
  const double bc1 = 1 - std::pow(c.beta1, double(step)), bc2 = 1 - std::pow(c.beta2, double(step));
  w = w * (1 - c.lr * c.weight_decay);
  m = m + (1 - c.beta1) * (g - m);
  v = c.beta2 * v + (1 - c.beta2) * g * g;
  w = w - c.lr / bc1 * m / (v.sqrt() / std::sqrt(bc2) + c.eps);
}

// Every storage mix the optimizer hands the kernel, on odd sizes (a view at an odd offset takes the
// scalar path, 4097 and 100003 the vector path with a tail and several blocks), against the ATen
// update of the same state and against float64, in one launch.
TEST(CudaOptimizer, FusedAdamWMatchesTheAtenUpdateOnEveryStorageMix) {
  AdamWConfig c;
  c.lr = 1e-2, c.weight_decay = 0.1, c.eps = 1e-8;
  struct Mix {
    at::ScalarType w, g, mom;
    bool master;
  };
  const Mix mixes[] = {{at::kFloat, at::kFloat, at::kFloat, false},     {at::kFloat, at::kBFloat16, at::kFloat, true},
                       {at::kFloat, at::kBFloat16, at::kBFloat16, true}, {at::kBFloat16, at::kBFloat16, at::kFloat, false},
                       {at::kFloat, at::kHalf, at::kFloat, true},        {at::kHalf, at::kFloat, at::kBFloat16, false}};
  for (const Mix& mx : mixes) {
    at::manual_seed(3);
    std::vector<kernels::AdamWTensors> fused;
    struct Ref {
      at::Tensor w, g, m, v;
    };
    std::vector<Ref> refs, f64;
    std::vector<at::Tensor> params;  // the low-precision parameters written from the masters
    for (int64_t n : {1, 19, 111, 4097, 100003, 20}) {
      const bool odd_view = n == 20;  // elements [1, 20) of a 20-vector: no 16-byte alignment
      auto make = [&](at::ScalarType dt, double scale) {
        at::Tensor t = (at::randn({n}) * scale).to(at::kCUDA, dt);
        return odd_view ? t.narrow(0, 1, n - 1) : t;
      };
      at::Tensor w = make(mx.w, 1), g = make(mx.g, 1), m = make(mx.mom, 0.1), v = make(mx.mom, 0.1).abs();
      at::Tensor p = mx.master ? w.to(at::kBFloat16) : at::Tensor();
      refs.push_back({w.clone(), g.clone(), m.clone(), v.clone()});
      f64.push_back({w.cpu().to(at::kDouble), g.cpu().to(at::kDouble), m.cpu().to(at::kDouble), v.cpu().to(at::kDouble)});
      fused.push_back({w, g, m, v, p});
      ASSERT_TRUE(kernels::adamw_fused_supported(fused.back()));
    }
    const int64_t step = 3;
    kernels::adamw_fused(fused, {c.lr, c.beta1, c.beta2, c.eps, c.weight_decay, step});
    const std::string what = std::string("w ") + at::toString(mx.w) + ", g " + at::toString(mx.g) + ", moments " +
                             at::toString(mx.mom) + (mx.master ? ", bf16 parameter" : "");
    for (size_t i = 0; i < fused.size(); ++i) {
      Ref& r = refs[i];
      if (r.w.scalar_type() == at::kFloat) {
        adamw_update(r.w, r.g, r.m, r.v, c, step);
      } else {  // a low-precision parameter without a master: the optimizer updates an fp32 copy
        at::Tensor w32 = r.w.to(at::kFloat);
        adamw_update(w32, r.g, r.m, r.v, c, step);
        r.w.copy_(w32);
      }
      adamw_f64(f64[i].w, f64[i].g, f64[i].m, f64[i].v, c, step);
      const kernels::AdamWTensors& k = fused[i];
      // fp32 results within a few float roundings of ATen's (contractions into FMAs differ); stored
      // low-precision values within one step of their format.
      const bool f32w = mx.w == at::kFloat, f32m = mx.mom == at::kFloat;
      EXPECT_TRUE(test::all_close(k.w.cpu().to(at::kFloat), r.w.cpu().to(at::kFloat), f32w ? 1e-6 : 1e-2, f32w ? 1e-7 : 1e-3))
          << what << " n " << k.w.numel();
      EXPECT_TRUE(test::all_close(k.m.cpu().to(at::kFloat), r.m.cpu().to(at::kFloat), f32m ? 1e-5 : 1e-2, f32m ? 1e-8 : 1e-4))
          << what;
      EXPECT_TRUE(test::all_close(k.v.cpu().to(at::kFloat), r.v.cpu().to(at::kFloat), f32m ? 1e-5 : 1e-2, f32m ? 1e-9 : 1e-4))
          << what;
      EXPECT_TRUE(test::all_close(k.w.cpu().to(at::kDouble), f64[i].w, f32w ? 1e-6 : 1e-2, f32w ? 1e-6 : 1e-3)) << what;
      if (mx.master) EXPECT_TRUE(test::all_equal(k.p.cpu(), k.w.to(at::kBFloat16).cpu())) << what;
    }
  }
}

// More tensors than one launch's argument block holds (40), and the Optimizer's fused path
// against its ATen path over several steps, with Muon tensors in between.
TEST(CudaOptimizer, FusedOptimizerStepMatchesTheAtenStep) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    Named a = params(dtype), b = params(dtype);
    for (int64_t i = 0; i < 50; ++i) {
      at::manual_seed(500 + i);
      at::Tensor t = at::randn({1 + 37 * i}).to(at::kCUDA, dtype);
      a.emplace_back("extra" + std::to_string(i) + ".bias", t);
      b.emplace_back("extra" + std::to_string(i) + ".bias", t.clone());
    }
    OptimizerConfig fast = config(Placement::kDevice, at::kFloat, ""), slow = fast;
    slow.fused = false;
    Optimizer oa(a, fast), ob(b, slow);
    run(oa, a, 0, 4);
    run(ob, b, 0, 4);
    EXPECT_TRUE(same(a, b, dtype == at::kFloat ? 1e-6 : 1e-2)) << at::toString(dtype);
  }
}

// The GPU's batched iteration (bf16 or fp32 GEMMs with the scaled sums in their epilogues) against
// the CPU's float64 Eigen loop, on tall, wide and square stacks and a single odd matrix.
TEST(CudaOptimizer, NewtonSchulzOnTheGpuMatchesFloat64) {
  at::manual_seed(11);
  for (auto shape : std::vector<std::vector<int64_t>>{{19, 111}, {3, 111, 19}, {4, 64, 64}, {2, 1, 97}}) {
    at::Tensor g = at::randn(shape);
    at::Tensor want = newton_schulz5(g.to(at::kDouble), 5, at::kDouble);
    at::Tensor f32 = newton_schulz5(g.cuda(), 5, at::kFloat).cpu().to(at::kDouble);
    at::Tensor bf16 = newton_schulz5(g.cuda(), 5, at::kBFloat16).cpu().to(at::kDouble);
    EXPECT_EQ(f32.sizes(), g.sizes());
    EXPECT_TRUE(test::all_close(f32, want, 1e-4, 1e-5)) << at::IntArrayRef(shape);
    // bf16 rounds every iterate: within a few bf16 steps of the orthogonalised matrix's entries.
    EXPECT_LT((bf16 - want).abs().max().item<double>(), 0.05) << at::IntArrayRef(shape);
  }
}

}  // namespace
}  // namespace kiln::optimizers
