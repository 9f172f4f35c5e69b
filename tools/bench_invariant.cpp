// `kiln bench invariant`: the batch-invariant bf16 GEMMs (rollout.numerics: bitwise) on mma.sync and
// on wgmma, against cuBLAS (and torch's grouped GEMM for the experts) in the same run, at the shapes
// of a model's GRPO training step and of decode steps; says whether the two give the same bits.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/torch_version.h"
#include "kernels/invariant.h"
#include "model/config.h"
#include "tools/bench_util.h"

namespace kiln::tools {
namespace {

struct GemmCase {
  std::string name;
  int64_t rows, n, k, groups;  // groups 0: dense
};

// The linears a token passes, at `rows` tokens; the experts grouped over rows x top_k slots.
std::vector<GemmCase> model_cases(const model::ModelConfig& c, int64_t rows, const std::string& tag) {
  const int64_t slots = rows * c.top_k;
  return {{tag + " q_proj", rows, c.q_size(), c.hidden_size, 0},
          {tag + " k_proj", rows, c.kv_size(), c.hidden_size, 0},
          {tag + " o_proj", rows, c.hidden_size, c.q_size(), 0},
          {tag + " pooler", rows, c.latent_size, c.hidden_size, 0},
          {tag + " unpooler", rows, c.hidden_size, c.latent_size, 0},
          {tag + " experts up", slots, c.expert_ffn_size, c.latent_size, c.num_experts},
          {tag + " experts down", slots, c.latent_size, c.expert_ffn_size, c.num_experts},
          {tag + " lm_head", rows, c.vocab_size, c.hidden_size, 0}};
}

}  // namespace

// Puts the process's GEMM choice back however the benchmark ends.
struct RestoreGemm {
  std::string name = kernels::invariant_gemm();
  ~RestoreGemm() {
    if (name == "mma" || name == "wgmma") kernels::set_invariant_gemm(name);
  }
};

void bench_invariant(at::Device device, const std::string& config, int64_t tokens) {
  KILN_CHECK(device.is_cuda(), "bench invariant: needs --device cuda (the CUDA kernels are the subject)");
  const model::ModelConfig cfg = model::ModelConfig::from_yaml_file(config);
  const RestoreGemm restore;
  const bool wgmma = kernels::invariant_wgmma_available();
  fmt::print("invariant GEMMs, bf16, {}: TFLOP/s of cuBLAS (experts: torch's grouped GEMM, else one cuBLAS GEMM over "
             "all rows), mma.sync and wgmma{}; speed ratios (a / b: b's time over a's); process default {}\n",
             cfg.name, wgmma ? "" : " (not on this GPU or build: n/a)", restore.name);
  fmt::print("{:>22} {:>7} {:>6} {:>6} {:>8} {:>8} {:>8} {:>11} {:>13} {:>10} {:>10}\n", "case", "rows", "N", "K",
             "cuBLAS", "mma", "wgmma", "mma/cuBLAS", "wgmma/cuBLAS", "wgmma/mma", "same bits");
  std::vector<GemmCase> cases = model_cases(cfg, tokens, "train");
  for (int64_t rows : {64, 512})
    for (const GemmCase& g : model_cases(cfg, rows, "decode " + std::to_string(rows))) cases.push_back(g);
  const auto opt = at::TensorOptions().dtype(at::kBFloat16).device(device);
  double total[3] = {0, 0, 0};
  for (const GemmCase& g : cases) {
    at::Tensor x = at::randn({g.rows, g.k}, opt);
    at::Tensor w = at::randn(g.groups ? std::vector<int64_t>{g.groups, g.n, g.k} : std::vector<int64_t>{g.n, g.k}, opt) /
                   std::sqrt(double(g.k));
    // Each group an equal share of the rows (the last takes the rest).
    std::vector<int64_t> ends(size_t(g.groups) + 1, 0);
    for (int64_t e = 1; e <= g.groups; ++e) ends[size_t(e)] = e == g.groups ? g.rows : g.rows / g.groups * e;
    at::Tensor offsets = at::tensor(ends, at::kLong).to(device);
    std::function<at::Tensor()> invariant = [&] {
      return g.groups ? kernels::invariant_grouped_linear_cuda(x, w, offsets) : kernels::invariant_linear_cuda(x, w);
    };
    std::function<void()> baseline = [&] { at::linear(x, g.groups ? w[0] : w); };
#if KILN_TORCH_AT_LEAST(2, 8)
    at::Tensor ends32 = offsets.narrow(0, 1, g.groups).to(at::kInt);
    if (g.groups && g.k % 8 == 0 && g.n % 8 == 0) baseline = [&] { at::_grouped_mm(x, w.transpose(1, 2), ends32); };
#endif
    double t[3] = {0, 0, 0};
    at::Tensor y[2];
    t[0] = time_it(device, baseline);
    for (int i = 0; i < (wgmma ? 2 : 1); ++i) {
      kernels::set_invariant_gemm(i == 0 ? "mma" : "wgmma");
      y[i] = invariant();
      t[i + 1] = time_it(device, [&] { invariant(); });
    }
    const double flops = 2.0 * double(g.rows) * double(g.n) * double(g.k);
    for (int i = 0; i < 3; ++i) total[i] += t[i];
    auto tflops = [&](double secs) { return wgmma ? fmt::format("{:.1f}", flops / secs / 1e12) : std::string("n/a"); };
    auto ratio = [&](double v) { return wgmma ? fmt::format("{:.2f}x", v) : std::string("n/a"); };
    fmt::print("{:>22} {:>7} {:>6} {:>6} {:>8.1f} {:>8.1f} {:>8} {:>10.2f}x {:>13} {:>10} {:>10}\n", g.name, g.rows, g.n,
               g.k, flops / t[0] / 1e12, flops / t[1] / 1e12, tflops(t[2]), t[0] / t[1], ratio(t[0] / t[2]),
               ratio(t[1] / t[2]), wgmma ? (at::equal(y[0], y[1]) ? "yes" : "no") : "n/a");
  }
  fmt::print("all cases: cuBLAS {:.2f} ms, mma {:.2f} ms ({:.2f}x cuBLAS's speed)", total[0] * 1e3, total[1] * 1e3,
             total[0] / total[1]);
  if (wgmma)
    fmt::print(", wgmma {:.2f} ms ({:.2f}x cuBLAS's speed, {:.2f}x mma's)", total[2] * 1e3, total[0] / total[2],
               total[1] / total[2]);
  fmt::print("\n");
}

}  // namespace kiln::tools
