// Batch-invariant numerics (model/batch_invariant.h, rollout.numerics: bitwise): a sequence's
// log-probs and routing are the same bits alone or packed with others, with a gradient or without,
// in fp32 and bf16; and the rollout engine's recorded log-probs and routing are the trainer's
// forward's exactly, through mixed batches, chunked prefill and preemption.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <vector>

#include "model/muse.h"
#include "rollout/engine.h"
#include "tests/model/reference.h"
#include "tests/model/batch_invariant_checks.h"
#include "tests/rollout/engine_fixtures.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using test::bitwise_config;
using test::check_engine_is_bitwise;

// Log-probs and routing of `seq`'s rows when it is packed after `before` and before `after`.
std::pair<at::Tensor, at::Tensor> scored(const model::Muse& m, const std::vector<int64_t>& seq,
                                         const std::vector<std::vector<int64_t>>& before,
                                         const std::vector<std::vector<int64_t>>& after, bool bitwise) {
  std::vector<std::vector<int64_t>> all = before;
  all.push_back(seq);
  all.insert(all.end(), after.begin(), after.end());
  std::vector<int64_t> targets;
  int64_t first = 0;
  for (const auto& s : before) first += int64_t(s.size());
  for (const auto& s : all) {
    targets.insert(targets.end(), s.begin() + 1, s.end());
    targets.push_back(-100);
  }
  model::ForwardOptions o;
  o.batch_invariant = bitwise;
  o.targets = at::tensor(targets, at::kLong);
  const model::ForwardOutput out = m.forward(model::PackedBatch::from_sequences(all, at::kCPU), o);
  const int64_t n = int64_t(seq.size());
  return {out.logprobs.narrow(0, first, n).detach(), out.routing.narrow(0, first, n)};
}

void check_batch_invariance(at::ScalarType dtype) {
  const model::Muse m = model::Muse::init(bitwise_config(), 5, dtype, at::kCPU);
  const std::vector<int64_t> seq = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9};
  const auto alone = scored(m, seq, {}, {}, true);
  const std::vector<std::vector<std::vector<int64_t>>> company = {
      {{7}}, {{2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2, 3, 5, 3, 6}}, {{1, 2}, {3, 4, 5}}};
  for (size_t c = 0; c < company.size(); ++c) {
    const auto packed = scored(m, seq, company[c], company[(c + 1) % company.size()], true);
    EXPECT_TRUE(test::all_equal(packed.first, alone.first)) << "company " << c << " " << dtype;
    EXPECT_TRUE(test::all_equal(packed.second, alone.second)) << "company " << c << " " << dtype;
  }
  {  // the training forward: the same bits with a graph
    model::Muse trained = m.clone();
    trained.set_requires_grad(true);
    const auto with_grad = scored(trained, seq, company[1], {}, true);
    EXPECT_TRUE(test::all_equal(with_grad.first, alone.first)) << dtype;
  }
  // The standard numerics are within rounding of the bitwise ones.
  const auto standard = scored(m, seq, {}, {}, false);
  EXPECT_TRUE(test::all_close(standard.first.to(at::kDouble), alone.first.to(at::kDouble),
                              dtype == at::kFloat ? 1e-4 : 5e-2, dtype == at::kFloat ? 1e-5 : 1e-2));
}

TEST(BatchInvariant, LogprobsAndRoutingDoNotDependOnTheBatch) {
  check_batch_invariance(at::kFloat);
  check_batch_invariance(at::kBFloat16);
}

// The training forward backpropagates through the row-by-row ops: its gradient is the standard
// forward's within rounding.
TEST(BatchInvariant, GradientsMatchTheStandardForward) {
  model::Muse a = model::Muse::init(bitwise_config(), 5, at::kDouble, at::kCPU);
  model::Muse b = a.clone();
  a.set_requires_grad(true);
  b.set_requires_grad(true);
  const std::vector<std::vector<int64_t>> seqs = {{3, 1, 4, 1, 5, 9, 2, 6}, {5, 3, 5}};
  auto loss = [&](const model::Muse& m, bool bitwise) {
    model::ForwardOptions o;
    o.batch_invariant = bitwise;
    o.targets = at::tensor(std::vector<int64_t>{1, 4, 1, 5, 9, 2, 6, -100, 3, 5, -100}, at::kLong);
    o.replay_routing = m.forward(model::PackedBatch::from_sequences(seqs, at::kCPU), model::ForwardOptions{}).routing;
    return -m.forward(model::PackedBatch::from_sequences(seqs, at::kCPU), o).logprobs.sum();
  };
  loss(a, true).backward();
  loss(b, false).backward();
  auto pa = a.named_parameters(), pb = b.named_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_TRUE(pa[i].second.grad().defined()) << pa[i].first;
    EXPECT_TRUE(test::all_close(pa[i].second.grad(), pb[i].second.grad(), 1e-9, 1e-10)) << pa[i].first;
  }
}

TEST(BatchInvariant, EngineLogprobsAndRoutingAreTheTrainersBitForBit) {
  check_engine_is_bitwise(at::kFloat, 1 << 20, at::kCPU);
  check_engine_is_bitwise(at::kBFloat16, 1 << 20, at::kCPU);
  check_engine_is_bitwise(at::kFloat, 8 << 10, at::kCPU);  // preempted and recomputed
  check_engine_is_bitwise(at::kBFloat16, 4 << 10, at::kCPU);
}

TEST(BatchInvariant, EngineRefusesWhatCannotBeBitwise) {
  const model::Muse m = model::Muse::init(bitwise_config(), 6, at::kFloat, at::kCPU);
  rollout::EngineConfig ec = test::small_engine();
  ec.batch_invariant = true;
  rollout::Engine engine(m, ec);
  rollout::Request r = test::request({1, 2}, 1, 3, 1.0, 1);
  r.params.top_p = 0.9;
  EXPECT_TRUE(test::throws_with([&] { engine.add_request(r); }, {"numerics bitwise", "top_p"}));
  ec.quantization = rollout::Quantization::kNvfp4;
  EXPECT_TRUE(test::throws_with([&] { rollout::Engine bad(m, ec); }, {"numerics bitwise", "cannot be bitwise"}));
}

}  // namespace
}  // namespace kiln
