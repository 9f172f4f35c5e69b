// Every parameter's gradient against central finite differences in fp64 on the micro config, and
// the layer recompute (ForwardOptions::recompute) against the stored-activation backward.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "model/lora.h"
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

// Loss, routing and every gradient with each layer recomputed in the backward, against the same
// step with stored activations: own routing and replayed routing, the load-balance term in the
// loss, fp32 and fp64, full parameters and LoRA adapters (whose base needs no gradient).
TEST(Gradients, RecomputeEqualsStoredActivations) {
  for (at::ScalarType dtype : {at::kFloat, at::kDouble})
    for (bool replay : {false, true})
      for (bool lora : {false, true}) {
        model::ModelConfig cfg = test::micro_config();
        model::Muse m = model::Muse::init(cfg, 5, dtype, at::kCPU);
        if (lora) {
          model::LoraConfig lc;
          lc.rank = 2;
          lc.alpha = 4;
          model::add_lora(m, lc, 9);
          at::NoGradGuard g;
          for (auto& [n, t] : model::lora_parameters(m))
            if (n.find("lora_B") != std::string::npos) t.copy_(at::randn_like(t) * 0.3);
        }
        const auto trained = lora ? model::lora_parameters(m) : m.named_parameters();
        m.set_requires_grad(!lora);
        for (auto& [n, t] : trained) t.requires_grad_(true);
        model::PackedBatch batch =
            model::PackedBatch::from_sequences({{1, 5, 3, 9, 2, 10}, {4, 4, 0, 7}, {8}}, at::kCPU);
        at::manual_seed(4);
        model::ForwardOptions opt;
        opt.targets = at::randint(cfg.vocab_size, {batch.num_tokens()}, at::kLong);
        if (replay) opt.replay_routing = at::randint(cfg.num_experts, {batch.num_tokens(), cfg.num_layers, cfg.top_k},
                                                     at::kByte);
        if (replay) {  // distinct experts per token: replay with repeats is not a routing
          at::Tensor perm = at::stack({at::randperm(cfg.num_experts).narrow(0, 0, cfg.top_k)}).to(at::kByte);
          opt.replay_routing.copy_(perm.expand_as(opt.replay_routing));
        }
        std::vector<at::Tensor> grads[2];
        at::Tensor loss[2], routing[2];
        for (int r = 0; r < 2; ++r) {
          opt.recompute = r == 1;
          for (auto& [n, t] : trained) t.mutable_grad() = at::Tensor();
          auto out = m.forward(batch, opt);
          at::Tensor l = out.logprobs.pow(2).sum() + 0.5 * out.load_balance_loss;
          l.backward();
          loss[r] = l.detach();
          routing[r] = out.routing;
          for (auto& [n, t] : trained) grads[r].push_back(t.grad().defined() ? t.grad().clone() : at::Tensor());
        }
        const std::string what = std::string(at::toString(dtype)) + (replay ? ", replayed" : ", own routing") +
                                 (lora ? ", LoRA" : ", full");
        EXPECT_TRUE(test::all_equal(routing[1], routing[0])) << what;
        EXPECT_TRUE(test::all_close(loss[1], loss[0], 1e-12, 0)) << what;
        for (size_t i = 0; i < trained.size(); ++i) {
          ASSERT_TRUE(grads[0][i].defined() && grads[1][i].defined()) << trained[i].first << ", " << what;
          // The recompute repeats the same ops on the same values: equal up to the order in which
          // autograd accumulates a parameter's gradient contributions.
          EXPECT_TRUE(test::all_close(grads[1][i], grads[0][i], dtype == at::kFloat ? 1e-5 : 1e-12, 1e-7))
              << trained[i].first << ", " << what;
        }
      }
}

// No gradient, no graph: under NoGradGuard the option changes nothing and keeps nothing.
TEST(Gradients, RecomputeWithoutGradientIsThePlainForward) {
  model::Muse m = model::Muse::init(test::micro_config(), 5, at::kFloat, at::kCPU);
  m.set_requires_grad(true);
  model::PackedBatch batch = model::PackedBatch::from_sequences({{1, 5, 3, 9}, {2}}, at::kCPU);
  model::ForwardOptions opt;
  opt.targets = at::tensor(std::vector<int64_t>{5, 3, 9, 0, 1});
  at::NoGradGuard g;
  at::Tensor plain = m.forward(batch, opt).logprobs;
  opt.recompute = true;
  at::Tensor again = m.forward(batch, opt).logprobs;
  EXPECT_TRUE(test::all_equal(again, plain));
  EXPECT_FALSE(again.requires_grad());
}

}  // namespace
}  // namespace kiln
