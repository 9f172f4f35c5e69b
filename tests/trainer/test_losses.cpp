// GRPO advantages, the policy loss (clip, aggregation, KL, TIS, MIS, GSPO, micro-batch
// normalisers), the over-long penalty, mismatch metrics and routing disagreement against direct
// computations written in the test.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

#include "trainer/losses.h"
#include "trainer/schedule.h"
#include "tests/test_util.h"

namespace kiln::trainer {
namespace {

at::Tensor d(std::vector<double> v) { return at::tensor(v, at::kDouble); }
at::Tensor l(std::vector<int64_t> v) { return at::tensor(v, at::kLong); }

TEST(Advantages, GroupNormalisedAndPlain) {
  at::Tensor r = d({1, 0, 0, 1, 0.5, 0.5, 0.5, 0.5});
  at::Tensor a = group_advantages(r, 4, true);
  const double sd = std::sqrt((4 * 0.25) / 3.0);  // unbiased std of {1,0,0,1}
  KILN_EXPECT_CLOSE(a, d({0.5 / (sd + 1e-6), -0.5 / (sd + 1e-6), -0.5 / (sd + 1e-6), 0.5 / (sd + 1e-6), 0, 0, 0, 0}),
                    1e-12, 1e-12);
  KILN_EXPECT_CLOSE(group_advantages(r, 2, false), d({0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0}), 1e-12, 1e-12);
  EXPECT_TRUE(test::throws_with([&] { group_advantages(r, 1, true); }, {"group_size >= 2"}));
  EXPECT_TRUE(test::throws_with([&] { group_advantages(r, 3, false); }, {"num_groups * group_size"}));
}

// Two sequences: tokens 0-2 (seq 0; token 0 is prompt) and 3-6 (seq 1).
PolicyLossInputs inputs() {
  PolicyLossInputs in;
  in.logprobs = d({-1.0, -0.5, -2.0, -0.1, -0.3, -1.2, -0.9}).requires_grad_(true);
  in.old_logprobs = d({-1.0, -0.9, -1.6, -0.2, -0.3, -0.7, -1.5});
  in.advantages = d({1.0, 1.0, 1.0, -0.5, -0.5, -0.5, -0.5});
  in.mask = d({0, 1, 1, 1, 1, 1, 1});
  in.seq_ids = l({0, 0, 0, 1, 1, 1, 1});
  in.num_seqs = 2;
  return in;
}

// The per-token PPO-clip term written out directly.
double ppo_term(double lp, double old, double a, double lo, double hi) {
  const double rho = std::exp(lp - old);
  return std::max(-a * rho, -a * std::min(std::max(rho, 1 - lo), 1 + hi));
}

TEST(PolicyLoss, TokenMeanMatchesDirectFormulaAndGradient) {
  PolicyLossInputs in = inputs();
  PolicyLossConfig cfg;
  auto out = policy_loss(in, cfg);
  auto lp = in.logprobs.detach(), old = in.old_logprobs, a = in.advantages, m = in.mask;
  double sum = 0;
  int clipped = 0;
  std::vector<double> grad(7, 0.0);
  for (int t = 0; t < 7; ++t) {
    if (m[t].item<double>() == 0) continue;
    const double x = lp[t].item<double>(), o = old[t].item<double>(), adv = a[t].item<double>();
    sum += ppo_term(x, o, adv, 0.2, 0.28);
    const double rho = std::exp(x - o);
    const bool clip_active = -adv * std::min(std::max(rho, 0.8), 1.28) > -adv * rho;
    clipped += clip_active;
    grad[t] = clip_active ? 0.0 : -adv * rho / 6.0;  // d/dlp of -A rho, over 6 response tokens
  }
  EXPECT_NEAR(out.loss.item<double>(), sum / 6.0, 1e-12);
  EXPECT_NEAR(out.clip_fraction, clipped / 6.0, 1e-12);
  EXPECT_GT(clipped, 0);
  out.loss.backward();
  KILN_EXPECT_CLOSE(in.logprobs.grad(), d(grad), 1e-12, 1e-12);
}

TEST(PolicyLoss, SeqMeanTokenMeanWeightsSequencesEqually) {
  PolicyLossInputs in = inputs();
  PolicyLossConfig cfg;
  cfg.aggregation = parse_aggregation("seq-mean-token-mean");
  auto out = policy_loss(in, cfg);
  double s0 = 0, s1 = 0;
  for (int t = 1; t < 3; ++t)
    s0 += ppo_term(in.logprobs[t].item<double>(), in.old_logprobs[t].item<double>(), 1.0, 0.2, 0.28);
  for (int t = 3; t < 7; ++t)
    s1 += ppo_term(in.logprobs[t].item<double>(), in.old_logprobs[t].item<double>(), -0.5, 0.2, 0.28);
  EXPECT_NEAR(out.loss.item<double>(), (s0 / 2 + s1 / 4) / 2, 1e-12);
  EXPECT_TRUE(test::throws_with([] { parse_aggregation("sum"); }, {"unknown aggregation 'sum'"}));
}

TEST(PolicyLoss, KlTisAndGspo) {
  PolicyLossInputs in = inputs();
  in.ref_logprobs = d({-1.1, -0.6, -1.9, -0.3, -0.2, -1.0, -1.0});
  in.rollout_logprobs = d({-1.0, -0.2, -1.6, -0.9, -0.3, -0.7, -0.1});
  PolicyLossConfig cfg;
  cfg.kl_coef = 0.1;
  cfg.tis = true;
  auto out = policy_loss(in, cfg);
  double sum = 0, kl = 0, wsum = 0;
  for (int t = 1; t < 7; ++t) {
    const double x = in.logprobs[t].item<double>(), o = in.old_logprobs[t].item<double>();
    const double ref = in.ref_logprobs[t].item<double>(), roll = in.rollout_logprobs[t].item<double>();
    const double w = std::min(std::exp(o - roll), 2.0);
    const double k3 = std::exp(ref - x) - (ref - x) - 1;
    sum += w * ppo_term(x, o, in.advantages[t].item<double>(), 0.2, 0.28) + 0.1 * k3;
    kl += k3;
    wsum += w;
  }
  EXPECT_NEAR(out.loss.item<double>(), sum / 6, 1e-12);
  EXPECT_NEAR(out.kl, kl / 6, 1e-12);
  EXPECT_NEAR(out.tis_weight_mean, wsum / 6, 1e-12);
  EXPECT_LT(out.tis_weight_mean, 2.0);

  // GSPO: one ratio per sequence from the mean log-ratio of its response tokens.
  PolicyLossInputs g = inputs();
  PolicyLossConfig gcfg;
  gcfg.gspo = true;
  gcfg.eps_low = gcfg.eps_high = 0.05;
  auto gout = policy_loss(g, gcfg);
  const double lr0 = ((-0.5 + 0.9) + (-2.0 + 1.6)) / 2, lr1 = ((-0.1 + 0.2) + 0 + (-1.2 + 0.7) + (-0.9 + 1.5)) / 4;
  auto term = [](double lr, double a) {
    const double s = std::exp(lr);
    return std::max(-a * s, -a * std::min(std::max(s, 0.95), 1.05));
  };
  EXPECT_NEAR(gout.loss.item<double>(), (2 * term(lr0, 1.0) + 4 * term(lr1, -0.5)) / 6, 1e-12);
  gout.loss.backward();
  // Gradient of sequence 1 (unclipped: s = exp(0.05)) spreads evenly over its 4 tokens.
  // d/dlp_t of 4 * (-A) * s / 6 with s = exp(mean of 4 log-ratios) is -A * s / 6 on each token.
  const double g1 = 0.5 * std::exp(lr1) / 6;
  for (int t = 3; t < 7; ++t) EXPECT_NEAR(g.logprobs.grad()[t].item<double>(), g1, 1e-12) << t;
}

// MIS: tokens whose exp(lp_old - lp_roll) lies outside [0.5, 2] carry no policy term (and no
// gradient) but still count in the token-mean's denominator; the share dropped is reported.
TEST(PolicyLoss, MaskedImportanceSamplingDropsTokensOutsideTheRange) {
  PolicyLossInputs in = inputs();
  in.rollout_logprobs = d({-1.0, -0.2, -1.6, -0.9, -0.3, -2.0, -1.5});  // ratios: ., 0.50, 1, 2.01, 1, 3.7, 1
  PolicyLossConfig cfg;
  cfg.mis = true;
  auto out = policy_loss(in, cfg);
  double sum = 0;
  for (int t : {2, 4, 6}) {  // token 1's ratio exp(-0.7) = 0.497 and tokens 3 and 5 fall outside
    sum += ppo_term(in.logprobs[t].item<double>(), in.old_logprobs[t].item<double>(), in.advantages[t].item<double>(),
                    0.2, 0.28);
  }
  EXPECT_NEAR(out.loss.item<double>(), sum / 6, 1e-12);
  EXPECT_NEAR(out.mis_masked_fraction, 3.0 / 6, 1e-12);
  out.loss.backward();
  for (int t : {1, 3, 5}) EXPECT_EQ(in.logprobs.grad()[t].item<double>(), 0.0) << t;
  EXPECT_NE(in.logprobs.grad()[2].item<double>(), 0.0);
  // A range that holds every ratio changes nothing.
  PolicyLossInputs all = inputs();
  all.rollout_logprobs = in.rollout_logprobs;
  cfg.mis_low = 0.01;
  cfg.mis_high = 10;
  PolicyLossConfig plain;
  EXPECT_NEAR(policy_loss(all, cfg).loss.item<double>(), policy_loss(inputs(), plain).loss.item<double>(), 1e-12);
  cfg.mis_low = 1.5;
  EXPECT_TRUE(test::throws_with([&] { policy_loss(all, cfg); }, {"mis_low", "mis_high"}));
  in.rollout_logprobs = at::Tensor();
  cfg.mis_low = 0.5;
  EXPECT_TRUE(test::throws_with([&] { policy_loss(in, cfg); }, {"MIS needs rollout_logprobs"}));
}

TEST(Shaping, OverlongPenaltyRampsOverTheBuffer) {
  EXPECT_EQ(overlong_penalty(12, 16, 4, 1.0), 0.0);   // up to max_tokens - buffer: nothing
  EXPECT_EQ(overlong_penalty(13, 16, 4, 1.0), -0.25);
  EXPECT_EQ(overlong_penalty(16, 16, 4, 1.0), -1.0);
  EXPECT_EQ(overlong_penalty(15, 16, 4, 0.5), -0.375);
  EXPECT_EQ(overlong_penalty(16, 16, 0, 1.0), 0.0);    // buffer 0: off
  EXPECT_EQ(overlong_penalty(16, 16, 16, 2.0), -2.0);  // the whole range is the buffer
  EXPECT_TRUE(test::throws_with([&] { overlong_penalty(3, 16, 17, 1.0); }, {"buffer=17", "max_tokens=16"}));
}

TEST(PolicyLoss, MicroBatchesWithGlobalNormalisersSumToTheWholeStep) {
  for (auto agg : {Aggregation::kTokenMean, Aggregation::kSeqMeanTokenMean}) {
    PolicyLossConfig cfg;
    cfg.aggregation = agg;
    PolicyLossInputs whole = inputs();
    auto full = policy_loss(whole, cfg);
    full.loss.backward();
    at::Tensor lp = inputs().logprobs.detach().clone().requires_grad_(true);
    double total = 0;
    for (auto [b, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 4}}) {
      PolicyLossInputs part;
      PolicyLossInputs all = inputs();
      part.logprobs = lp.narrow(0, b, n);
      part.old_logprobs = all.old_logprobs.narrow(0, b, n);
      part.advantages = all.advantages.narrow(0, b, n);
      part.mask = all.mask.narrow(0, b, n);
      part.seq_ids = at::zeros({n}, at::kLong);
      part.num_seqs = 1;
      part.total_tokens = 6;
      part.total_seqs = 2;
      auto o = policy_loss(part, cfg);
      o.loss.backward();
      total += o.loss.item<double>();
    }
    EXPECT_NEAR(total, full.loss.item<double>(), 1e-12);
    KILN_EXPECT_CLOSE(lp.grad(), whole.logprobs.grad(), 1e-12, 1e-12);
  }
}

TEST(PolicyLoss, BadInputsAreNamed) {
  PolicyLossInputs in = inputs();
  in.mask = d({1, 1});
  EXPECT_TRUE(test::throws_with([&] { policy_loss(in, {}); }, {"mask must be [7]"}));
  PolicyLossConfig cfg;
  cfg.kl_coef = 0.1;
  EXPECT_TRUE(test::throws_with([&] { policy_loss(inputs(), cfg); }, {"needs ref_logprobs"}));
}

TEST(Mismatch, MetricsByHand) {
  // d = lp_old - lp_roll on response tokens: seq 0 {0.1, -0.8}, seq 1 {0.0, 0.2, 0.0, 0.0}.
  at::Tensor old = d({-1.0, -0.5, -2.0, -0.1, -0.3, -1.2, -0.9});
  at::Tensor roll = d({-5.0, -0.6, -1.2, -0.1, -0.5, -1.2, -0.9});
  at::Tensor mask = d({0, 1, 1, 1, 1, 1, 1});
  auto m = mismatch_metrics(old, roll, mask, l({0, 0, 0, 1, 1, 1, 1}), 2);
  EXPECT_EQ(m.tokens, 6);
  EXPECT_NEAR(m.mean_abs_token, (0.1 + 0.8 + 0.2) / 6, 1e-12);
  EXPECT_NEAR(m.mean_abs_seq, ((0.1 + 0.8) / 2 + 0.2 / 4) / 2, 1e-12);
  EXPECT_NEAR(m.max_abs, 0.8, 1e-12);
  const double k3 = (std::exp(0.1) - 1.1) + (std::exp(-0.8) + 0.8 - 1) + (std::exp(0.2) - 1.2);
  EXPECT_NEAR(m.k3_kl, k3 / 6, 1e-12);
  EXPECT_NEAR(m.frac_outside, 1.0 / 6, 1e-12);  // exp(-0.8) = 0.449 < 0.5
}

TEST(Mismatch, RoutingDisagreementIgnoresOrderWithinTheSet) {
  at::Tensor own = at::tensor({0, 1, 2, 3, 4, 5, 6, 7}, at::kByte).view({2, 2, 2});
  at::Tensor same_sets = at::tensor({1, 0, 2, 3, 4, 5, 7, 6}, at::kByte).view({2, 2, 2});
  at::Tensor one_differs = at::tensor({0, 1, 2, 3, 4, 5, 6, 1}, at::kByte).view({2, 2, 2});
  EXPECT_EQ(routing_disagreement(own, same_sets, d({1, 1})), 0.0);
  EXPECT_EQ(routing_disagreement(own, one_differs, d({1, 1})), 0.25);
  EXPECT_EQ(routing_disagreement(own, one_differs, d({1, 0})), 0.0);
}

TEST(LrSchedule, WarmupThenConstantLinearOrCosineDecay) {
  LrSchedule s;
  s.warmup_steps = 10;
  s.total_steps = 110;
  EXPECT_DOUBLE_EQ(s.factor(5), 0.5);
  EXPECT_DOUBLE_EQ(s.factor(10), 1.0);
  EXPECT_DOUBLE_EQ(s.factor(60), 1.0);  // constant
  s.decay = LrDecay::kLinear;
  s.min_ratio = 0.1;
  EXPECT_DOUBLE_EQ(s.factor(60), 0.1 + 0.9 * 0.5);
  EXPECT_DOUBLE_EQ(s.factor(110), 0.1);
  EXPECT_DOUBLE_EQ(s.factor(500), 0.1);  // past the horizon it stays at the floor
  s.decay = LrDecay::kCosine;
  EXPECT_NEAR(s.factor(60), 0.1 + 0.9 * 0.5, 1e-12);
  EXPECT_NEAR(s.factor(35), 0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * 0.25)), 1e-12);
  EXPECT_TRUE(test::throws_with([] { parse_lr_decay("step"); }, {"unknown lr_decay 'step'", "constant, linear or cosine"}));
  EXPECT_EQ(parse_lr_decay(lr_decay_name(LrDecay::kCosine)), LrDecay::kCosine);
}

}  // namespace
}  // namespace kiln::trainer
