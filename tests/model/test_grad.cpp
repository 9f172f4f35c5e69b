// Every parameter's gradient against central finite differences in fp64 on the micro config.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "model/muse.h"
#include "tests/model/reference.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

void check_gradients(const model::ModelConfig& cfg) {
  model::Muse m = model::Muse::init(cfg, 21, at::kDouble, at::kCPU);
  model::PackedBatch batch = model::PackedBatch::from_sequences({{1, 5, 3, 9, 2}, {4, 4, 0, 7, 10, 6, 8}}, at::kCPU);
  const int64_t T = batch.num_tokens();
  at::manual_seed(3);
  model::ForwardOptions opt;
  opt.targets = at::randint(cfg.vocab_size, {T}, at::kLong);
  at::Tensor weights = at::randn({T}, at::kDouble);
  auto loss_of = [&](const model::ForwardOptions& o) {
    auto out = m.forward(batch, o);
    return (out.logprobs * weights).sum() + 0.1 * out.load_balance_loss;
  };
  // Finite differences run with the expert sets fixed (replayed), where the loss is smooth.
  model::ForwardOptions fixed = opt;
  {
    at::NoGradGuard g;
    fixed.replay_routing = m.forward(batch, opt).routing;
  }
  m.set_requires_grad(true);
  loss_of(opt).backward();
  at::NoGradGuard no_grad;
  const double h = 1e-6;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(17);
  for (auto& [name, p] : m.named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << name;
    at::Tensor flat = p.view({-1}), grad = p.grad().view({-1});
    const int64_t n = flat.numel(), checks = std::min<int64_t>(n, 24);
    at::Tensor picks = n <= 24 ? at::arange(n) : at::randperm(n, gen).narrow(0, 0, checks);
    at::Tensor fd = at::empty({checks}, at::kDouble), an = at::empty({checks}, at::kDouble);
    for (int64_t c = 0; c < checks; ++c) {
      const int64_t i = picks[c].item<int64_t>();
      const double orig = flat[i].item<double>();
      flat[i] = orig + h;
      const double up = loss_of(fixed).item<double>();
      flat[i] = orig - h;
      const double down = loss_of(fixed).item<double>();
      flat[i] = orig;
      fd[c] = (up - down) / (2 * h);
      an[c] = grad[i].item<double>();
    }
    EXPECT_TRUE(test::all_close(an, fd, 1e-5, 1e-7)) << "parameter " << name;
  }
}

TEST(Gradients, EveryParameterMatchesFiniteDifferencesSoftmaxRouter) { check_gradients(test::micro_config()); }

TEST(Gradients, EveryParameterMatchesFiniteDifferencesSigmoidRouter) {
  model::ModelConfig cfg = test::micro_config();
  cfg.router_score = model::RouterScore::kSigmoid;
  check_gradients(cfg);
}

}  // namespace
}  // namespace kiln
