// The kernels' CPU references: paged decode attention equals the model's plain attention over the
// same keys (full and window, shuffled blocks, rings), the sampler's greedy and tie rules, the
// MoE layout on a hand-worked case, and the training kernels' references (segment RMSNorm, MoE
// dispatch and combine with their gradients, SwiGLU).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "kernels/flash_varlen.h"
#include "kernels/invariant.h"
#include "kernels/moe_layout.h"
#include "kernels/moe_route.h"
#include "kernels/moe_rows.h"
#include "kernels/paged_attention.h"
#include "kernels/rms_norm.h"
#include "kernels/rope.h"
#include "kernels/sampling.h"
#include "kernels/stream_read.h"
#include "kernels/swiglu.h"
#include "model/muse.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

// Scatters each sequence's keys into shuffled blocks of a shared cache and checks the paged
// reference against model::sequence_attention on the contiguous keys.
void check_paged(int64_t window, int64_t block_size, at::ScalarType dtype) {
  const int64_t hq = 6, hkv = 2, hd = 8, group = hq / hkv;
  const std::vector<int64_t> positions = {0, 18, 110, 4096};  // 1, 19, 111 and 4097 keys
  const int64_t n = int64_t(positions.size());
  const int64_t ring = window > 0 ? (window + block_size - 1) / block_size + 1 : 0;
  int64_t cols = 0, blocks = 0;
  for (int64_t p : positions) {
    const int64_t need = ring > 0 ? ring : p / block_size + 1;
    cols = std::max(cols, need);
    blocks += need;
  }
  std::vector<int64_t> perm(blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
  at::Tensor kc = at::zeros({blocks * block_size, hkv, hd}, dtype), vc = at::zeros_like(kc);
  at::Tensor table = at::zeros({n, cols}, at::kLong);
  at::Tensor q = at::randn({n, hq, hd}, dtype);
  at::Tensor expect = at::empty_like(q);
  int64_t next = 0;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t p = positions[s];
    const int64_t used = ring > 0 ? ring : p / block_size + 1;
    for (int64_t c = 0; c < used; ++c) table[s][c] = perm[next++];
    at::Tensor k = at::randn({p + 1, hkv, hd}, dtype), v = at::randn({p + 1, hkv, hd}, dtype);
    for (int64_t j = 0; j <= p; ++j) {  // a ring keeps only the newest position of each slot
      const int64_t blk = j / block_size, col = ring > 0 ? blk % ring : blk;
      const int64_t row = table[s][col].item<int64_t>() * block_size + j % block_size;
      kc[row].copy_(k[j]);
      vc[row].copy_(v[j]);
    }
    const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
    at::Tensor ks = model::expand_kv_heads(k.narrow(0, lo, p + 1 - lo).transpose(0, 1), group);
    at::Tensor vs = model::expand_kv_heads(v.narrow(0, lo, p + 1 - lo).transpose(0, 1), group);
    expect[s].copy_(model::sequence_attention(q[s].unsqueeze(1), ks, vs, window == 0, window, p, lo).squeeze(1));
  }
  at::Tensor got = kernels::paged_decode_attention_reference(q, kc, vc, table, at::tensor(positions, at::kLong),
                                                             block_size, window, ring);
  const double tol = dtype == at::kDouble ? 1e-12 : 1e-5;
  EXPECT_TRUE(test::all_close(got, expect, tol, tol)) << "window " << window << " block " << block_size;
}

TEST(PagedAttentionReference, EqualsPlainAttentionFullAndWindow) {
  at::manual_seed(0);
  for (at::ScalarType dtype : {at::kFloat, at::kDouble})
    for (int64_t block : {1, 4, 16})
      for (int64_t window : {0, 5, 111}) check_paged(window, block, dtype);
}

TEST(PagedAttentionReference, BadShapesNameWhatWasExpected) {
  at::Tensor q = at::zeros({2, 4, 8}), kc = at::zeros({16, 2, 8}), table = at::zeros({2, 4}, at::kLong);
  at::Tensor pos = at::zeros({2}, at::kLong);
  EXPECT_TRUE(test::throws_with([&] { kernels::paged_decode_attention_reference(q, kc, kc, table, pos.narrow(0, 0, 1), 4, 0, 0); },
                                {"positions must be int64 [2]"}));
  EXPECT_TRUE(test::throws_with([&] { kernels::paged_decode_attention_reference(q, kc, kc, table, pos, 3, 0, 0); },
                                {"not whole blocks of 3"}));
  EXPECT_TRUE(test::throws_with(
      [&] { kernels::paged_decode_attention_reference(q, at::zeros({16, 3, 8}), at::zeros({16, 3, 8}), table, pos, 4, 0, 0); },
      {"Hq=4 is not a multiple of Hkv=3"}));
}

TEST(SamplingReference, GreedyTakesTheFirstMaximumAndDrawsFollowTheCdf) {
  const float x[5] = {1.f, 3.f, 0.f, 3.f, -2.f};
  auto [id, lp] = kernels::sample_row_reference(x, 5, 0.0, 123);
  EXPECT_EQ(id, 1);
  double z = 0;
  for (float v : x) z += std::exp(double(v) - 3.0);
  EXPECT_NEAR(lp, -std::log(z), 1e-12);
  // A draw lands on the id whose CDF interval holds the stream's uniform.
  for (uint64_t seed = 0; seed < 200; ++seed) {
    const double u = kernels::stream_uniform(seed);
    auto [d, dlp] = kernels::sample_row_reference(x, 5, 1.0, seed);
    double below = 0;
    for (int64_t i = 0; i < d; ++i) below += std::exp(double(x[i]) - 3.0) / z;
    const double p = std::exp(double(x[d]) - 3.0) / z;
    EXPECT_LE(below, u + 1e-12);
    EXPECT_LT(u, below + p + 1e-12);
    EXPECT_NEAR(dlp, std::log(p), 1e-12);
  }
  // Rows: the same draws through the tensor entry point.
  at::Tensor logits = at::tensor(std::vector<float>(x, x + 5)).repeat({3, 1});
  auto [ids, lps] = kernels::sample_rows(logits, at::tensor(std::vector<double>{0.0, 1.0, 0.5}),
                                         at::tensor(std::vector<int64_t>{4, 5, 6}));
  EXPECT_EQ(ids[0].item<int64_t>(), 1);
  EXPECT_EQ(ids[1].item<int64_t>(), kernels::sample_row_reference(x, 5, 1.0, 5).first);
  EXPECT_EQ(ids[2].item<int64_t>(), kernels::sample_row_reference(x, 5, 0.5, 6).first);
  EXPECT_TRUE(test::throws_with([&] { kernels::sample_rows(logits, at::zeros({3}), at::zeros({3}, at::kLong)); },
                                {"temperature must be fp64 [3]"}));
}

TEST(MoeLayoutReference, HandWorkedCase) {
  // 3 tokens, top-2, 4 experts: slots (token-major) go to experts 2,0 | 2,3 | 0,2.
  at::Tensor flat = at::tensor(std::vector<int64_t>{2, 0, 2, 3, 0, 2});
  kernels::MoeLayout l = kernels::moe_layout_reference(flat, 4, 2, 4);
  // counts 2,0,3,1 -> padded 4,0,4,4: segments start at rows 0, 4, 4, 8; bound = 6 + 4 * 3 = 18.
  EXPECT_TRUE(test::all_equal(l.counts, at::tensor(std::vector<int64_t>{2, 0, 3, 1})));
  EXPECT_TRUE(test::all_equal(l.offsets, at::tensor(std::vector<int32_t>{4, 4, 8, 18})));
  EXPECT_TRUE(test::all_equal(l.ends, at::tensor(std::vector<int32_t>{4, 4, 8, 12})));  // the last real segment's end
  EXPECT_TRUE(test::all_equal(l.segments, at::tensor(std::vector<int64_t>{0, 4, 4, 8, 12})));
  EXPECT_EQ(l.bound, 18);
  // Sorted slots: 1,4 (expert 0), 0,2,5 (expert 2), 3 (expert 3).
  EXPECT_TRUE(test::all_equal(l.order, at::tensor(std::vector<int64_t>{1, 4, 0, 2, 5, 3})));
  EXPECT_TRUE(test::all_equal(l.dest, at::tensor(std::vector<int64_t>{0, 1, 4, 5, 6, 8})));
  EXPECT_TRUE(test::all_equal(l.src_token, at::tensor(std::vector<int64_t>{0, 2, 0, 1, 2, 1})));
  EXPECT_TRUE(test::all_equal(l.slot_row, at::tensor(std::vector<int64_t>{4, 0, 5, 8, 1, 6})));
  EXPECT_TRUE(test::throws_with([&] { kernels::moe_layout_reference(flat, 4, 4, 4); }, {"a multiple of top_k"}));
}

TEST(AddRmsNorm, IsTheResidualStepAndTheNextNorm) {
  at::Tensor a = at::randn({5, 8}, at::kDouble), x = at::randn({5, 8}, at::kDouble);
  at::Tensor wa = at::rand({8}, at::kDouble), wn = at::rand({8}, at::kDouble);
  auto [h, hn] = kernels::add_rms_norm(a, x, wa, wn, 1e-6);
  at::Tensor h_want = x + a * at::rsqrt(a.pow(2).mean(-1, true) + 1e-6) * wa;
  EXPECT_TRUE(at::allclose(h, h_want, 1e-12, 1e-12));
  EXPECT_TRUE(at::allclose(hn, h_want * at::rsqrt(h_want.pow(2).mean(-1, true) + 1e-6) * wn, 1e-12, 1e-12));
}

TEST(RopeCacheWrite, RotatesQAndWritesRotatedKeysAndValuesAtTheRows) {
  at::Tensor q = at::randn({3, 4, 8}), k = at::randn({3, 2, 8}), v = at::randn({3, 2, 8});
  at::Tensor ang = at::rand({3, 8});
  at::Tensor c = ang.cos(), s = ang.sin();
  at::Tensor kc = at::zeros({5, 2, 8}), vc = at::zeros({5, 2, 8});
  at::Tensor rows = at::tensor(std::vector<int64_t>{4, 0, 2});
  at::Tensor qr = kernels::rope_cache_write(q, k, v, c, s, kc, vc, rows);
  EXPECT_TRUE(test::all_equal(qr, kernels::apply_rope(q, c, s)));
  EXPECT_TRUE(test::all_equal(kc.index_select(0, rows), kernels::apply_rope(k, c, s)));
  EXPECT_TRUE(test::all_equal(vc.index_select(0, rows), v));
  EXPECT_TRUE(test::all_equal(kc.index_select(0, at::tensor(std::vector<int64_t>{1, 3})), at::zeros({2, 2, 8})));
  EXPECT_TRUE(test::throws_with([&] { kernels::rope_cache_write(q, k, v, c, s, kc, vc, rows.narrow(0, 0, 2)); },
                                {"rows int64 [T]"}));
}

TEST(MoeRouteReference, HandWorkedCases) {
  // Softmax over logits log(1, 2, 3, 4): scores 0.1 .. 0.4; top-2 is experts 3, 2 with weights 4/7, 3/7.
  at::Tensor logits = at::tensor(std::vector<float>{1, 2, 3, 4}).log().view({1, 4});
  kernels::MoeRoute r = kernels::moe_route_reference(logits, 2, false, at::Tensor(), at::Tensor());
  EXPECT_TRUE(test::all_equal(r.ids, at::tensor(std::vector<int64_t>{3, 2}).view({1, 2})));
  EXPECT_TRUE(at::allclose(r.weights, at::tensor(std::vector<float>{4.0f / 7, 3.0f / 7}).view({1, 2})));
  EXPECT_TRUE(at::allclose(r.scores.sum(), at::scalar_tensor(1.0f)));
  // Sigmoid: the bias moves the choice (expert 0 from last to first) but not the weights.
  at::Tensor bias = at::tensor(std::vector<float>{1, 0, 0, 0});
  r = kernels::moe_route_reference(logits, 2, true, bias, at::Tensor());
  EXPECT_TRUE(test::all_equal(r.ids, at::tensor(std::vector<int64_t>{0, 3}).view({1, 2})));
  const float s0 = 1 / (1 + 1.0f), s3 = 1 / (1 + 0.25f);  // sigmoid(log x) = x / (1 + x)
  EXPECT_TRUE(at::allclose(r.weights, at::tensor(std::vector<float>{s0 / (s0 + s3), s3 / (s0 + s3)}).view({1, 2})));
  // Replay takes the given experts whatever the scores.
  at::Tensor replay = at::tensor(std::vector<int64_t>{0, 1}).view({1, 2});
  r = kernels::moe_route_reference(logits, 2, false, at::Tensor(), replay);
  EXPECT_TRUE(test::all_equal(r.ids, replay));
  EXPECT_TRUE(at::allclose(r.weights, at::tensor(std::vector<float>{1.0f / 3, 2.0f / 3}).view({1, 2})));
  EXPECT_TRUE(test::throws_with([&] { kernels::moe_route_reference(logits, 5, false, at::Tensor(), at::Tensor()); },
                                {"top_k=5", "[1, 4]"}));
  EXPECT_TRUE(test::throws_with([&] { kernels::moe_route_reference(logits, 2, false, at::Tensor(), replay.view({2})); },
                                {"replay must be int64 [1, 2]"}));
}

TEST(StreamReadReference, XorsLittleEndianWords) {
  at::Tensor bytes = at::tensor(std::vector<int64_t>{1, 0, 0, 0, 2, 0, 0, 0, 0, 1, 0, 0x80}, at::kLong).to(at::kByte);
  EXPECT_EQ(kernels::xor_words(bytes).item<int32_t>(), int32_t(0x80000103u));  // 1 ^ 2 ^ 0x80000100
  EXPECT_EQ(kernels::xor_words(at::empty({0}, at::kFloat)).item<int32_t>(), 0);
  EXPECT_EQ(kernels::xor_words(at::full({5}, 1.0f)).item<int32_t>(), int32_t(0x3F800000u));  // odd count
  EXPECT_TRUE(test::throws_with([&] { kernels::xor_words(at::zeros({3}, at::kByte)); }, {"whole 32-bit words", "3 bytes"}));
  at::Tensor acc = at::scalar_tensor(5, at::kInt);
  kernels::xor_words_into(bytes, acc);  // accumulates: 5 ^ x
  EXPECT_EQ(acc.item<int32_t>(), int32_t(0x80000106u));
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

// The training kernels' references (what the CPU runs, and what the CUDA kernels are held to).

TEST(SegmentRmsNormReference, EachRowUsesItsSegmentsWeight) {
  at::manual_seed(7);
  const int64_t rows = 19, cols = 5;
  at::Tensor x = at::randn({rows, cols}, at::kDouble), w = at::rand({4, cols}, at::kDouble) + 0.5;
  at::Tensor ends = at::tensor(std::vector<int32_t>{3, 3, 11, 19}, at::kInt);  // segment 1 is empty
  at::Tensor y = kernels::segment_rms_norm(x, w, ends, 1e-6);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = r < 3 ? 0 : r < 11 ? 2 : 3;
    KILN_EXPECT_CLOSE(y[r], kernels::rms_norm_reference(x[r], w[s], 1e-6), 1e-12, 1e-12);
  }
  EXPECT_TRUE(test::throws_with([&] { kernels::segment_rms_norm(x, w, ends.to(at::kLong), 1e-6); },
                                {"segment_rms_norm", "int32"}));
}

// The norm's gradient by its formula is autograd's through the reference norm in fp64, for a
// shared weight row and one row per row; each gradient is computed only where asked, and bad shapes
// are named.
TEST(RmsNormBackwardReference, IsAutogradsGradientOfTheReferenceNorm) {
  at::manual_seed(8);
  for (const bool per_row : {false, true}) {
    at::Tensor x = at::randn({19, 7}, at::kDouble).requires_grad_(true), dy = at::randn({19, 7}, at::kDouble);
    at::Tensor w = (at::rand(per_row ? std::vector<int64_t>{19, 7} : std::vector<int64_t>{7}, at::kDouble) + 0.5)
                       .requires_grad_(true);
    kernels::rms_norm_reference(x, w, 1e-6).backward(dy);
    const auto [dx, dw] = kernels::rms_norm_backward(x.detach(), w.detach(), dy, 1e-6, true, true);
    KILN_EXPECT_CLOSE(dx, x.grad(), 1e-12, 1e-12);
    KILN_EXPECT_CLOSE(dw, w.grad(), 1e-12, 1e-12);
    EXPECT_FALSE(kernels::rms_norm_backward(x.detach(), w.detach(), dy, 1e-6, false, true).first.defined());
    EXPECT_FALSE(kernels::rms_norm_backward(x.detach(), w.detach(), dy, 1e-6, true, false).second.defined());
  }
  EXPECT_TRUE(test::throws_with(
      [] { kernels::rms_norm_backward(at::zeros({3, 4}), at::zeros({5}), at::zeros({3, 4}), 1e-6, true, true); },
      {"rms_norm_backward", "weight [n] or [rows, n]", "[5]"}));
}

TEST(MoeRowsReference, DispatchAndCombineByHandAndTheirGradients) {
  // 3 tokens, k = 2, rows padded to 8: slot t*2+j goes to row slot_row[t*2+j].
  at::Tensor slot_row = at::tensor(std::vector<int64_t>{5, 0, 1, 6, 2, 7}, at::kLong);
  at::Tensor z = at::arange(6, at::kDouble).view({3, 2}).requires_grad_(true);
  at::Tensor zp = kernels::moe_dispatch(z, slot_row, 2, 8);
  at::Tensor expect = at::zeros({8, 2}, at::kDouble);
  for (int64_t s = 0; s < 6; ++s) expect[slot_row[s].item<int64_t>()] = z[s / 2].detach();
  EXPECT_TRUE(test::all_equal(zp.detach(), expect));
  at::Tensor g = at::randn({8, 2}, at::kDouble);
  zp.backward(g);
  for (int64_t t = 0; t < 3; ++t)
    KILN_EXPECT_CLOSE(z.grad()[t], g[slot_row[2 * t].item<int64_t>()] + g[slot_row[2 * t + 1].item<int64_t>()], 1e-12, 1e-12);

  at::Tensor y = at::randn({8, 2}, at::kDouble).requires_grad_(true);
  at::Tensor w = at::rand({3, 2}, at::kDouble).requires_grad_(true);
  at::Tensor m = kernels::moe_combine(y, w, slot_row);
  at::Tensor dm = at::randn({3, 2}, at::kDouble);
  m.backward(dm);
  for (int64_t t = 0; t < 3; ++t) {
    const int64_t a = slot_row[2 * t].item<int64_t>(), b = slot_row[2 * t + 1].item<int64_t>();
    KILN_EXPECT_CLOSE(m[t], w[t][0] * y[a] + w[t][1] * y[b], 1e-12, 1e-12);
    KILN_EXPECT_CLOSE(w.grad()[t][0], (dm[t] * y[a]).sum(), 1e-12, 1e-12);
    KILN_EXPECT_CLOSE(y.grad()[a], dm[t] * w[t][0], 1e-12, 1e-12);
  }
  EXPECT_EQ(y.grad()[3].abs().sum().item<double>(), 0.0);  // a padding row gets no gradient
  EXPECT_TRUE(test::throws_with([&] { kernels::moe_combine(y, w, slot_row.narrow(0, 0, 5)); },
                                {"moe_combine", "tokens * k = 6"}));
}

TEST(SwigluReference, IsSiluTimesUpAndFlashIsOffOnTheCpu) {
  at::Tensor g = at::randn({19, 3}, at::kDouble), u = at::randn({19, 3}, at::kDouble);
  KILN_EXPECT_CLOSE(kernels::swiglu(g, u), g * at::sigmoid(g) * u, 1e-12, 1e-12);
  EXPECT_FALSE(kernels::flash_varlen_available(at::Device(at::kCPU), at::kBFloat16, 64));
  EXPECT_TRUE(test::throws_with([&] { kernels::swiglu(g, u.narrow(0, 0, 18)); }, {"swiglu", "must match"}));
}

// A build without CUDA has the mma invariant GEMM alone: asking for wgmma is an error that says so,
// and changes nothing; the setter returns the previous setting (auto at first); other names are
// refused naming the three.
TEST(InvariantGemmChoice, CpuBuildsHaveMmaAlone) {
  if (KILN_WITH_CUDA) GTEST_SKIP() << "a CUDA build: tests/cuda/test_cuda_invariant.cpp covers the choice";
  EXPECT_EQ(kernels::invariant_gemm(), "mma");
  EXPECT_EQ(kernels::set_invariant_gemm("mma"), "auto");
  EXPECT_TRUE(test::throws_with([] { kernels::set_invariant_gemm("wgmma"); }, {"wgmma", "needs a CUDA build"}));
  EXPECT_TRUE(test::throws_with([] { kernels::set_invariant_gemm("wmma"); }, {"'wmma'", "auto, mma or wgmma"}));
  EXPECT_EQ(kernels::invariant_gemm(), "mma");
  EXPECT_EQ(kernels::set_invariant_gemm("auto"), "mma");
}

}  // namespace
}  // namespace kiln
