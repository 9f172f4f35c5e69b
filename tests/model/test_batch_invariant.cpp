// Batch-invariant numerics (model/batch_invariant.h, rollout.numerics: bitwise): a sequence's
// log-probs and routing are the same bits alone or packed with others, with a gradient or without,
// in fp32 and bf16; and the rollout engine's recorded log-probs and routing are the trainer's
// forward's exactly, through mixed batches, chunked prefill and preemption.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <vector>

#include "kernels/rms_norm.h"
#include "model/batch_invariant.h"
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
  o.numerics = bitwise ? model::Numerics::kBitwise : model::Numerics::kStandard;
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
TEST(BatchInvariant, GradientsMatchTheStandardForward) { test::check_bitwise_gradients(at::kDouble, at::kCPU, 1e-9); }
TEST(BatchInvariant, Bf16GradientsAreAsCloseToFp64AsTheStandardOnes) { test::check_bitwise_gradients_bf16(at::kCPU); }

// The grouped linear gives each row the bits rowwise_linear gives it with its group's weight, and
// the plain gradient; empty groups are skipped.
// The batch-invariant norm's gradient (its own node, by RMSNorm's backward formula) is autograd's
// through the reference norm, for a weight vector and for one weight row per row (the experts'
// norms), in fp64 to rounding and in bf16 to a bf16 step.
TEST(BatchInvariant, NormGradientIsTheReferenceNormsGradient) {
  for (const at::ScalarType dtype : {at::kDouble, at::kBFloat16})
    for (const bool per_row : {false, true}) {
      const at::Tensor x0 = at::randn({19, 24}, at::kDouble).to(dtype), g = at::randn({19, 24}, at::kDouble).to(dtype);
      const at::Tensor w0 = (at::randn(per_row ? std::vector<int64_t>{19, 24} : std::vector<int64_t>{24}, at::kDouble) + 1)
                                .to(dtype);
      auto grads = [&](bool invariant) {
        at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
        const at::Tensor y = invariant ? model::rowwise_rms_norm(x, w, 1e-6) : kernels::rms_norm_reference(x, w, 1e-6);
        (y * g).sum().backward();
        return std::make_pair(x.grad(), w.grad());
      };
      const auto [dx, dw] = grads(true);
      const auto [rx, rw] = grads(false);
      const double tol = dtype == at::kDouble ? 1e-12 : 2e-2;
      EXPECT_TRUE(test::all_close(dx.to(at::kDouble), rx.to(at::kDouble), tol, tol)) << dtype << " per_row " << per_row;
      EXPECT_TRUE(test::all_close(dw.to(at::kDouble), rw.to(at::kDouble), tol, tol)) << dtype << " per_row " << per_row;
    }
}

TEST(BatchInvariant, GroupedLinearIsRowwiseLinearPerGroup) {
  at::manual_seed(3);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    at::Tensor x = at::randn({19, 24}).to(dt), w = at::randn({4, 7, 24}).to(dt);
    const std::vector<int64_t> ends = {0, 5, 5, 18, 19};
    at::Tensor y = model::grouped_rowwise_linear(x, w, at::tensor(ends, at::kLong));
    for (int64_t e = 0; e < 4; ++e) {
      const int64_t n = ends[size_t(e) + 1] - ends[size_t(e)];
      if (n > 0)
        EXPECT_TRUE(test::all_equal(y.narrow(0, ends[size_t(e)], n),
                                    model::rowwise_linear(x.narrow(0, ends[size_t(e)], n), w[e])))
            << "group " << e << " " << dt;
    }
  }
  at::Tensor x = at::randn({19, 24}, at::kDouble).requires_grad_(true), w = at::randn({3, 7, 24}, at::kDouble).requires_grad_(true);
  const std::vector<int64_t> ends = {0, 11, 11, 19};
  model::grouped_rowwise_linear(x, w, at::tensor(ends, at::kLong)).pow(2).sum().backward();
  at::Tensor x2 = x.detach().clone().requires_grad_(true), w2 = w.detach().clone().requires_grad_(true);
  at::cat({at::linear(x2.narrow(0, 0, 11), w2[0]), at::linear(x2.narrow(0, 11, 8), w2[2])}).pow(2).sum().backward();
  EXPECT_TRUE(test::all_close(x.grad(), x2.grad(), 1e-12, 1e-12));
  EXPECT_TRUE(test::all_close(w.grad(), w2.grad(), 1e-12, 1e-12));
  // Frozen weights (LoRA's base): only dx is computed, the same.
  at::Tensor x3 = x.detach().clone().requires_grad_(true);
  model::grouped_rowwise_linear(x3, w.detach(), at::tensor(ends, at::kLong)).pow(2).sum().backward();
  EXPECT_TRUE(test::all_close(x3.grad(), x2.grad(), 1e-12, 1e-12));
  EXPECT_TRUE(test::throws_with([&] { model::grouped_rowwise_linear(x, w, at::tensor(std::vector<int64_t>{0, 19}, at::kLong)); },
                                {"grouped_rowwise_linear", "offsets"}));
}

// Ranged attention: query i over exactly keys [begin, begin + count) of its key list, as
// query_attention computes it (within rounding); through a table, rows of the main and the fresh
// keys in the table's order, the same bits as those keys read in place; a range or table entry
// outside the keys is refused, named.
TEST(BatchInvariant, RangedAttentionReadsExactlyItsKeys) {
  at::manual_seed(4);
  at::Tensor q = at::randn({3, 4, 8}, at::kDouble), k = at::randn({10, 2, 8}, at::kDouble), v = at::randn({10, 2, 8}, at::kDouble);
  model::KeyRanges r;
  r.begin = {0, 4, 9};
  r.count = {1, 5, 1};
  at::Tensor o = model::ranged_attention(q, k, v, {}, {}, r);
  EXPECT_TRUE(test::all_close(o[1], model::query_attention(q[1], k.narrow(0, 4, 5), v.narrow(0, 4, 5)), 1e-12, 1e-12));
  // One key: the output is its value (per KV head, each query head of the group).
  EXPECT_TRUE(test::all_close(o[0].narrow(0, 0, 2), v[0][0].expand({2, 8}), 1e-12, 1e-12));
  // Main rows 7, 2 and fresh row 1, in that order.
  at::Tensor kf = at::randn({2, 2, 8}, at::kDouble), vf = at::randn({2, 2, 8}, at::kDouble);
  model::KeyRanges t;
  t.begin = {0};
  t.count = {3};
  t.table = {7, 2, -2};
  at::Tensor keys = at::stack({k[7], k[2], kf[1]}), values = at::stack({v[7], v[2], vf[1]});
  model::KeyRanges in_place;
  in_place.begin = {0};
  in_place.count = {3};
  EXPECT_TRUE(test::all_equal(model::ranged_attention(q.narrow(0, 0, 1), k, v, kf, vf, t),
                              model::ranged_attention(q.narrow(0, 0, 1), keys, values, {}, {}, in_place)));
  EXPECT_TRUE(test::all_close(model::ranged_attention(q.narrow(0, 0, 1), k, v, kf, vf, t)[0],
                              model::query_attention(q[0], keys, values), 1e-12, 1e-12));
  r.count[2] = 2;
  EXPECT_TRUE(test::throws_with([&] { model::ranged_attention(q, k, v, {}, {}, r); },
                                {"ranged_attention", "query 2", "of 10"}));
  t.table = {7, 2, -3};
  EXPECT_TRUE(test::throws_with([&] { model::ranged_attention(q.narrow(0, 0, 1), k, v, kf, vf, t); },
                                {"ranged_attention", "table entry -3"}));
  // Shapes the loop would read past: 3 KV heads for 4 query heads, a head dim that differs.
  EXPECT_TRUE(test::throws_with([&] { model::ranged_attention(q, at::randn({10, 3, 8}, at::kDouble), at::randn({10, 3, 8}, at::kDouble), {}, {}, r); },
                                {"ranged_attention", "Hkv dividing Hq"}));
  EXPECT_TRUE(test::throws_with([&] { model::ranged_attention(q, k.narrow(2, 0, 4), v.narrow(2, 0, 4), {}, {}, r); },
                                {"ranged_attention", "[m, Hkv, hd]"}));
}

TEST(BatchInvariant, EngineLogprobsAndRoutingAreTheTrainersBitForBit) {
  check_engine_is_bitwise(at::kFloat, 1 << 20, at::kCPU);
  check_engine_is_bitwise(at::kBFloat16, 1 << 20, at::kCPU);
  check_engine_is_bitwise(at::kFloat, 8 << 10, at::kCPU);  // preempted and recomputed
  check_engine_is_bitwise(at::kBFloat16, 4 << 10, at::kCPU);
  // The graph decode step's code (uncaptured on the CPU): its attention finds each row's keys
  // through the block tables on the device, and gives the same bits.
  check_engine_is_bitwise(at::kFloat, 1 << 20, at::kCPU, /*uncaptured=*/true);
  check_engine_is_bitwise(at::kBFloat16, 4 << 10, at::kCPU, /*uncaptured=*/true);
  check_engine_is_bitwise(at::kBFloat16, 16 << 10, at::kCPU, /*uncaptured=*/true, test::bitwise_graph_config());
}

TEST(BatchInvariant, EngineRefusesWhatCannotBeBitwise) {
  const model::Muse m = model::Muse::init(bitwise_config(), 6, at::kFloat, at::kCPU);
  rollout::EngineConfig ec = test::small_engine();
  ec.numerics = model::Numerics::kBitwise;
  rollout::Engine engine(m, ec);
  rollout::Request r = test::request({1, 2}, 1, 3, 1.0, 1);
  r.params.top_p = 0.9;
  EXPECT_TRUE(test::throws_with([&] { engine.add_request(r); }, {"numerics bitwise", "top_p"}));
  ec.quantization = rollout::Quantization::kNvfp4;
  EXPECT_TRUE(test::throws_with([&] { rollout::Engine bad(m, ec); }, {"numerics bitwise", "cannot be bitwise"}));
}

}  // namespace
}  // namespace kiln
