// AdamW against libtorch's torch::optim::AdamW, and Muon against a direct dense implementation,
// batched against per-matrix, and the singular values the quintic iteration must produce.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>

#include "model/muse.h"
#include "optimizers/muon.h"
#include "tests/model/reference.h"
#include "tests/test_util.h"

namespace kiln::optimizers {
namespace {

TEST(AdamW, EqualsLibtorchAdamWOver20Steps) {
  at::manual_seed(0);
  std::vector<at::Tensor> mine, theirs;
  for (auto shape : std::vector<std::vector<int64_t>>{{19}, {7, 11}, {3, 5, 4}}) {
    at::Tensor p = at::randn(shape);
    mine.push_back(p.clone().requires_grad_(true));
    theirs.push_back(p.clone().requires_grad_(true));
  }
  AdamWConfig cfg;
  cfg.lr = 0.01;
  cfg.weight_decay = 0.1;
  AdamW ours(mine, cfg);
  torch::optim::AdamW ref(theirs, torch::optim::AdamWOptions(cfg.lr).weight_decay(cfg.weight_decay));
  for (int step = 0; step < 20; ++step) {
    for (size_t i = 0; i < mine.size(); ++i) {
      at::Tensor g = at::randn(mine[i].sizes());
      mine[i].mutable_grad() = g.clone();
      theirs[i].mutable_grad() = g.clone();
    }
    ours.step();
    ref.step();
  }
  for (size_t i = 0; i < mine.size(); ++i)
    EXPECT_TRUE(test::all_close(mine[i].detach(), theirs[i].detach(), 1e-6, 1e-7)) << "parameter " << i;
}

// Muon written out directly, one matrix at a time, for the comparison.
at::Tensor dense_ns(at::Tensor g, int steps) {
  const bool tall = g.size(0) > g.size(1);
  at::Tensor x = g / (g.pow(2).sum().sqrt() + 1e-7);
  if (tall) x = x.t();
  for (int i = 0; i < steps; ++i) {
    at::Tensor a = x.mm(x.t());
    x = 3.4445 * x + (-4.7750 * a + 2.0315 * a.mm(a)).mm(x);
  }
  return tall ? x.t() : x;
}

TEST(Muon, EqualsADenseImplementationAndBatchedEqualsPerMatrix) {
  at::manual_seed(1);
  MuonConfig cfg;
  cfg.lr = 0.02;
  cfg.weight_decay = 0.01;
  cfg.ns_dtype = at::kFloat;
  at::Tensor w0 = at::randn({4, 19, 11});  // a stack of 4 "experts", tall matrices
  at::Tensor stacked = w0.clone().requires_grad_(true);
  std::vector<at::Tensor> singles;
  for (int64_t e = 0; e < 4; ++e) singles.push_back(w0[e].clone().requires_grad_(true));
  Muon batched({stacked}, cfg), per_matrix(singles, cfg);
  std::vector<at::Tensor> expect, buf;
  for (int64_t e = 0; e < 4; ++e) {
    expect.push_back(w0[e].clone());
    buf.push_back(at::zeros({19, 11}));
  }
  for (int step = 0; step < 3; ++step) {
    at::Tensor g = at::randn({4, 19, 11});
    stacked.mutable_grad() = g.clone();
    for (int64_t e = 0; e < 4; ++e) singles[e].mutable_grad() = g[e].clone();
    batched.step();
    per_matrix.step();
    for (int64_t e = 0; e < 4; ++e) {
      buf[e] = 0.95 * buf[e] + g[e];
      at::Tensor u = g[e] + 0.95 * buf[e];
      expect[e] = expect[e] * (1 - cfg.lr * cfg.weight_decay) - cfg.lr * 0.2 * std::sqrt(19.0) * dense_ns(u, 5);
    }
  }
  for (int64_t e = 0; e < 4; ++e) {
    EXPECT_TRUE(test::all_close(stacked.detach()[e], expect[e], 1e-5, 1e-6)) << "expert " << e;
    EXPECT_TRUE(test::all_close(singles[e].detach(), stacked.detach()[e], 1e-6, 1e-7)) << "expert " << e;
  }
}

TEST(Muon, SingularValuesFollowTheQuinticMap) {
  // Newton-Schulz acts on each singular value alone: sigma_i(NS(G)) = p^5(sigma_i(G) / |G|_F).
  at::manual_seed(2);
  for (auto [r, c] : std::vector<std::pair<int64_t, int64_t>>{{16, 48}, {111, 19}, {64, 64}}) {
    at::Tensor g = at::randn({r, c}, at::kDouble);
    at::Tensor s_in = std::get<1>(at::linalg_svd(g, false)) / at::linalg_norm(g, "fro");
    at::Tensor s_out = std::get<1>(at::linalg_svd(newton_schulz5(g, 5, at::kDouble), false));
    // The map is not monotonic, so compare the two sets sorted.
    std::vector<double> expect;
    for (int64_t i = 0; i < s_in.size(0); ++i) expect.push_back(newton_schulz5_scalar(s_in[i].item<double>()));
    std::sort(expect.rbegin(), expect.rend());
    for (int64_t i = 0; i < s_in.size(0); ++i)
      EXPECT_NEAR(s_out[i].item<double>(), expect[size_t(i)], 1e-6) << r << "x" << c << " sigma " << i;
    // The band: normalised singular values above ~1e-2 land in roughly [0.68, 1.13] (square
    // matrices have a tail of tiny ones, which the 5 steps cannot lift).
    if (r != c)
      for (int64_t i = 0; i < s_out.size(0); ++i) {
        EXPECT_GT(s_out[i].item<double>(), 0.6) << r << "x" << c;
        EXPECT_LT(s_out[i].item<double>(), 1.2) << r << "x" << c;
      }
  }
  // bf16 (the default) stays near the fp32 result.
  at::Tensor g = at::randn({32, 96});
  at::Tensor a = newton_schulz5(g, 5, at::kFloat), b = newton_schulz5(g);
  EXPECT_LT((a - b).abs().max().item<double>(), 0.1);
}

TEST(Muon, DefaultGroupsFollowMuseSection7) {
  model::Muse m = model::Muse::init(test::micro_config(), 0, at::kFloat, at::kCPU);
  int64_t muon = 0, adamw = 0;
  for (auto& [name, p] : m.named_parameters()) {
    const bool expect = name.find("_proj") != std::string::npos || name.find("pooler") != std::string::npos;
    EXPECT_EQ(default_uses_muon(name, p), expect) << name;
    (default_uses_muon(name, p) ? muon : adamw) += 1;
  }
  EXPECT_GT(muon, 0);
  EXPECT_GT(adamw, 0);
  EXPECT_TRUE(test::throws_with([] { Muon({at::zeros({3})}, MuonConfig{}); }, {"matrices or stacks", "AdamW"}));
}

}  // namespace
}  // namespace kiln::optimizers
