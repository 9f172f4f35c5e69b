// The update arithmetic: AdamW against libtorch's torch::optim::AdamW and the fused CPU loop against
// the ATen one, Muon against a direct dense implementation, batched against per-matrix, and the
// singular values the quintic iteration must produce.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>

#include "model/muse.h"
#include "optimizers/optimizer.h"
#include "tests/model/reference.h"
#include "tests/test_util.h"

namespace kiln::optimizers {
namespace {

std::vector<std::pair<std::string, at::Tensor>> named(const std::vector<at::Tensor>& ts) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < ts.size(); ++i) out.emplace_back("p" + std::to_string(i), ts[i]);
  return out;
}

OptimizerConfig all_muon(double lr, double wd) {
  OptimizerConfig cfg;
  cfg.rules = {GroupRule{"*", 2, 3, Kind::kMuon}};
  cfg.muon.lr = lr;
  cfg.muon.weight_decay = wd;
  cfg.muon.ns_dtype = at::kFloat;
  return cfg;
}

TEST(AdamW, EqualsLibtorchAdamWOver20Steps) {
  at::manual_seed(0);
  std::vector<at::Tensor> mine, theirs;
  for (auto shape : std::vector<std::vector<int64_t>>{{19}, {7, 11}, {3, 5, 4}}) {
    at::Tensor p = at::randn(shape);
    mine.push_back(p.clone().requires_grad_(true));
    theirs.push_back(p.clone().requires_grad_(true));
  }
  OptimizerConfig cfg;
  cfg.use_muon = false;
  cfg.adamw.lr = 0.01;
  cfg.adamw.weight_decay = 0.1;
  Optimizer ours(named(mine), cfg);
  torch::optim::AdamW ref(theirs, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
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
  const OptimizerConfig ocfg = all_muon(0.02, 0.01);
  const MuonConfig& cfg = ocfg.muon;
  at::Tensor w0 = at::randn({4, 19, 11});  // a stack of 4 "experts", tall matrices
  at::Tensor stacked = w0.clone().requires_grad_(true);
  std::vector<at::Tensor> singles;
  for (int64_t e = 0; e < 4; ++e) singles.push_back(w0[e].clone().requires_grad_(true));
  Optimizer batched(named({stacked}), ocfg), per_matrix(named(singles), ocfg);
  EXPECT_EQ(batched.kind_of("p0"), Kind::kMuon);
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

// The fused Eigen loop against the ATen arithmetic at odd sizes, fp32 and bf16 moments.
TEST(AdamW, FusedCpuLoopEqualsAtenWithinRounding) {
  AdamWConfig cfg;
  cfg.lr = 3e-3;
  cfg.weight_decay = 0.05;
  for (int64_t n : {1, 19, 111, 4097}) {
    for (at::ScalarType mt : {at::kFloat, at::kBFloat16}) {
      at::manual_seed(n);
      at::Tensor w = at::randn({n}), m = at::zeros({n}, mt), v = at::zeros({n}, mt);
      at::Tensor w2 = w.clone(), m2 = m.clone(), v2 = v.clone();
      for (int64_t step = 1; step <= 5; ++step) {
        at::Tensor g = at::randn({n});
        adamw_update(w, g, m, v, cfg, step);
        adamw_update_cpu(w2.data_ptr<float>(), g.data_ptr<float>(), m2.data_ptr(), v2.data_ptr(),
                         mt == at::kBFloat16, n, cfg, step);
      }
      EXPECT_TRUE(test::all_close(w2, w, 1e-6, 1e-7)) << n << " " << mt;
      // bf16 moments may round to neighbouring values; fp32 ones agree to float rounding.
      const double tol = mt == at::kFloat ? 1e-6 : 1e-2;
      EXPECT_TRUE(test::all_close(m2.to(at::kFloat), m.to(at::kFloat), tol, 1e-7)) << n << " " << mt;
      EXPECT_TRUE(test::all_close(v2.to(at::kFloat), v.to(at::kFloat), tol, 1e-9)) << n << " " << mt;
    }
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
  // A rule may not give Muon to a vector.
  OptimizerConfig bad;
  bad.rules = {GroupRule{"*.bias", 0, 64, Kind::kMuon}};
  EXPECT_TRUE(test::throws_with([&] { Optimizer({{"out.bias", at::zeros({3})}}, bad); },
                                {"out.bias", "Muon needs a matrix", "min_dim"}));
}

TEST(Groups, RulesMatchByGlobAndShapeBeforeTheDefault) {
  EXPECT_TRUE(glob_match("layers.*.mlp.experts.*", "layers.3.mlp.experts.up_proj"));
  EXPECT_TRUE(glob_match("*norm?weight", "layers.0.input_norm.weight"));
  EXPECT_FALSE(glob_match("layers.*.attn.*", "layers.3.mlp.router.weight"));
  EXPECT_TRUE(glob_match("*", ""));
  EXPECT_FALSE(glob_match("a*b", "a"));
  const at::Tensor matrix = at::zeros({4, 8}), stack = at::zeros({2, 4, 8}), vec = at::zeros({8});
  // By name: experts go to AdamW; by shape: every other matrix goes to Muon.
  std::vector<GroupRule> rules = {{"*experts*", 0, 64, Kind::kAdamW}, {"*", 2, 2, Kind::kMuon}};
  EXPECT_EQ(assign(rules, true, "layers.0.mlp.experts.up_proj", stack), Kind::kAdamW);
  EXPECT_EQ(assign(rules, true, "lm_head.weight", matrix), Kind::kMuon);
  EXPECT_EQ(assign(rules, true, "embed_tokens.weight", stack), Kind::kAdamW);  // no rule matches: the default
  EXPECT_EQ(assign(rules, true, "final_norm.weight", vec), Kind::kAdamW);
  EXPECT_EQ(assign({}, true, "layers.0.attn.q_proj.weight", matrix), Kind::kMuon);
  EXPECT_EQ(assign({}, false, "layers.0.attn.q_proj.weight", matrix), Kind::kAdamW);
  EXPECT_EQ(parse_kind("muon"), Kind::kMuon);
  EXPECT_TRUE(test::throws_with([] { parse_kind("sgd"); }, {"sgd", "muon or adamw"}));
}

}  // namespace
}  // namespace kiln::optimizers
