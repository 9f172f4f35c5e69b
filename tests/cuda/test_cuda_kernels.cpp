// CUDA paths against their references on odd sizes in fp32 and bf16: the RMSNorm kernel (shared
// and per-row weights), the fused RoPE kernel (bitwise), the MoE layout kernel and the stream read
// (exact).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tuple>
#include <vector>

#include "core/error.h"
#include "kernels/moe_layout.h"
#include "kernels/moe_route.h"
#include "kernels/rms_norm.h"
#include "kernels/rope.h"
#include "kernels/stream_read.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

TEST(CudaRmsNorm, MatchesReferenceOnOddSizes) {
  ASSERT_TRUE(at::hasCUDA()) << "the cuda label needs a GPU";
  at::manual_seed(0);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t rows : {1, 19, 111}) {
      // Odd widths take the scalar path; multiples of 16 bytes the vector path with 1..16 chunks
      // per thread, and 65536 falls back to scalar again.
      for (int64_t cols : {1, 19, 111, 4097, 8, 1024, 8192, 32768, 65536}) {
        at::Tensor x = (at::randn({rows, cols}) * 3).to(dtype);
        at::Tensor w = (at::rand({cols}) + 0.5).to(dtype);
        at::Tensor ref = kernels::rms_norm_reference(x.to(at::kFloat), w.to(at::kFloat), 1e-6);
        at::Tensor out = kernels::rms_norm_cuda(x.cuda(), w.cuda(), 1e-6);
        const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;  // bf16: two roundings of 2^-8
        EXPECT_TRUE(test::all_close(out.cpu(), ref, tol, tol))
            << "dtype " << dtype << " rows " << rows << " cols " << cols;
        // Same dtype on both sides: the kernel rounds exactly where the reference does, so only
        // the fp32 sum order differs. In bf16 that can move the normalised value by one ulp
        // (2^-7 relative at worst) before the final rounding (2^-8): rare, and bounded.
        at::Tensor same = kernels::rms_norm_reference(x, w, 1e-6);
        const double same_tol = dtype == at::kFloat ? 1e-5 : 0x1p-7 + 0x1p-8;
        EXPECT_TRUE(test::all_close(out.cpu(), same, same_tol, 1e-5));
        if (dtype == at::kBFloat16) {  // fp32 differs in the last bits wherever rsqrt does
          const double identical = out.cpu().eq(same).to(at::kDouble).mean().item<double>();
          EXPECT_GT(identical, 0.999) << "rows " << rows << " cols " << cols;
        }
      }
    }
  }
}

TEST(CudaRmsNorm, UnalignedPointersTakeTheScalarPath) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    at::Tensor flat = at::randn({19 * 1024 + 1}, at::TensorOptions().dtype(dtype).device(at::kCUDA));
    at::Tensor x = flat.narrow(0, 1, 19 * 1024).view({19, 1024});  // contiguous, data 2 or 4 bytes off
    at::Tensor w = at::rand({1024}, at::TensorOptions().dtype(dtype).device(at::kCUDA));
    const double tol = dtype == at::kFloat ? 1e-5 : 8e-3;
    KILN_EXPECT_CLOSE(kernels::rms_norm_cuda(x, w, 1e-6).cpu(), kernels::rms_norm_reference(x, w, 1e-6).cpu(), tol, 1e-5);
  }
}

TEST(CudaRmsNorm, DispatchUsesKernelOnlyWithoutGrad) {
  at::Tensor x = at::randn({5, 7}, at::kCUDA).requires_grad_(true);
  at::Tensor w = at::ones({7}, at::kCUDA);
  at::Tensor y = kernels::rms_norm(x, w, 1e-6);
  ASSERT_TRUE(y.requires_grad());  // reference path: autograd intact
  y.sum().backward();
  EXPECT_TRUE(x.grad().defined());
  at::NoGradGuard g;
  KILN_EXPECT_CLOSE(kernels::rms_norm(x, w, 1e-6).cpu(), kernels::rms_norm_reference(x, w, 1e-6).cpu(), 1e-5, 1e-5);
}

TEST(CudaRmsNorm, NonContiguousInputAndErrors) {
  at::Tensor x = at::randn({19, 38}, at::kCUDA).narrow(1, 3, 19);  // strided rows
  at::Tensor w = at::rand({19}, at::kCUDA);
  KILN_EXPECT_CLOSE(kernels::rms_norm_cuda(x, w, 1e-6).cpu(), kernels::rms_norm_reference(x, w, 1e-6).cpu(), 1e-5, 1e-5);
  EXPECT_THROW(kernels::rms_norm_cuda(x, at::rand({18}, at::kCUDA), 1e-6), Error);
  EXPECT_THROW(kernels::rms_norm_cuda(x, w.to(at::kBFloat16), 1e-6), Error);
  EXPECT_THROW(kernels::rms_norm_cuda(x.cpu(), w.cpu(), 1e-6), Error);
}

TEST(CudaRmsNorm, PerRowWeightsMatchReference) {
  at::manual_seed(2);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t rows : {1, 19, 111}) {
      for (int64_t cols : {19, 1024, 4097}) {
        at::Tensor x = (at::randn({rows, cols}) * 3).to(dtype).cuda();
        at::Tensor w = (at::rand({rows, cols}) + 0.5).to(dtype).cuda();
        at::Tensor out = kernels::rms_norm(x, w, 1e-6);  // dispatches to the kernel (no grad)
        at::Tensor ref = kernels::rms_norm_reference(x, w, 1e-6);
        const double tol = dtype == at::kFloat ? 1e-5 : 0x1p-7 + 0x1p-8;
        EXPECT_TRUE(test::all_close(out.cpu(), ref.cpu(), tol, 1e-5)) << dtype << " " << rows << "x" << cols;
      }
    }
  }
  at::Tensor x = at::randn({4, 8}, at::kCUDA);
  EXPECT_TRUE(test::throws_with([&] { kernels::rms_norm_cuda(x, at::rand({3, 8}, at::kCUDA), 1e-6); },
                                {"weight must be [8] or, for 2-D x"}));
}

TEST(CudaRope, BitwiseEqualsReference) {
  at::manual_seed(3);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t T : {1, 19, 111, 4097}) {
      for (int64_t hd : {16, 128}) {
        at::Tensor x = at::randn({T, 3, hd}).to(dtype).cuda();
        at::Tensor ang = at::rand({T, hd}) * 6.3;
        at::Tensor c = ang.cos().to(dtype).cuda(), s = ang.sin().to(dtype).cuda();
        at::Tensor out = kernels::apply_rope_cuda(x, c, s);
        EXPECT_TRUE(test::all_equal(out.cpu(), kernels::apply_rope_reference(x, c, s).cpu()))
            << dtype << " T " << T << " hd " << hd;
      }
    }
  }
}

// The fused residual step and next norm of the rollout: bitwise the composition it replaces (two
// rms_norm launches and an add), on odd row counts and widths, including widths the vector path
// refuses (then it composes).
TEST(CudaAddRmsNorm, EqualsTheCompositionBitwise) {
  at::manual_seed(7);
  for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    for (int64_t rows : {1, 19, 111, 4097}) {
      for (int64_t cols : {64, 1000, 2048, 4100, 19}) {
        auto cuda = [&](at::Tensor t) { return t.to(dtype).cuda(); };
        at::Tensor a = cuda(at::randn({rows, cols}) * 3), x = cuda(at::randn({rows, cols}));
        at::Tensor wa = cuda(at::rand({cols}) + 0.5), wn = cuda(at::rand({cols}) + 0.5);
        auto [h, hn] = kernels::add_rms_norm(a, x, wa, wn, 1e-6);
        at::Tensor h_ref = x + kernels::rms_norm(a, wa, 1e-6);
        at::Tensor hn_ref = kernels::rms_norm(h_ref, wn, 1e-6);
        const std::string what = std::string(c10::toString(dtype)) + " rows " + std::to_string(rows) + " cols " +
                                 std::to_string(cols);
        EXPECT_TRUE(test::all_equal(h.cpu(), h_ref.cpu())) << what;
        EXPECT_TRUE(test::all_equal(hn.cpu(), hn_ref.cpu())) << what;
        // And the ATen reference on the CPU, within a rounding.
        auto [hc, hnc] = kernels::add_rms_norm_reference(a.cpu().to(at::kDouble), x.cpu().to(at::kDouble),
                                                         wa.cpu().to(at::kDouble), wn.cpu().to(at::kDouble), 1e-6);
        const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
        EXPECT_TRUE(at::allclose(hn.cpu().to(at::kDouble), hnc, tol, tol)) << what;
      }
    }
  }
}

// The decode step's RoPE fused with the cache write: q, the cache rows written and every row left
// alone bitwise the composition (apply_rope twice, index_copy_ twice), on odd sizes and GQA shapes.
TEST(CudaRopeCacheWrite, EqualsTheCompositionBitwise) {
  at::manual_seed(8);
  for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    for (int64_t T : {1, 19, 111, 4097}) {
      for (auto [hq, hkv, hd] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{1, 1, 16}, {16, 2, 128}, {6, 3, 64}}) {
        auto cuda = [&](at::Tensor t) { return t.to(dtype).cuda(); };
        at::Tensor q = cuda(at::randn({T, hq, hd})), k = cuda(at::randn({T, hkv, hd})), v = cuda(at::randn({T, hkv, hd}));
        at::Tensor ang = at::rand({T, hd}) * 6.3;
        at::Tensor c = cuda(ang.cos()), s = cuda(ang.sin());
        const int64_t R = T + 37;
        at::Tensor rows = at::randperm(R, at::kLong).narrow(0, 0, T).cuda();  // distinct rows of a larger cache
        at::Tensor kc = cuda(at::randn({R, hkv, hd})), vc = cuda(at::randn({R, hkv, hd}));
        at::Tensor kr = kc.clone(), vr = vc.clone();
        at::Tensor got = kernels::rope_cache_write(q, k, v, c, s, kc, vc, rows);
        at::Tensor want = kernels::rope_cache_write_reference(q, k, v, c, s, kr, vr, rows);
        const std::string what = std::string(c10::toString(dtype)) + " T " + std::to_string(T) + " hq " +
                                 std::to_string(hq) + " hkv " + std::to_string(hkv) + " hd " + std::to_string(hd);
        EXPECT_TRUE(test::all_equal(got.cpu(), want.cpu())) << what;
        EXPECT_TRUE(test::all_equal(kc.cpu(), kr.cpu())) << what;
        EXPECT_TRUE(test::all_equal(vc.cpu(), vr.cpu())) << what;
      }
    }
  }
}

TEST(CudaMoeLayout, EqualsReferenceExactly) {
  at::manual_seed(4);
  // Slot counts on both sides of the one-kernel layouts' sizes (512, 4096 slots) and expert counts
  // on both sides of their tables (256: ranking within warps; 1024: cub's sort; above, a sort first).
  for (int64_t tokens : {1, 19, 64, 111, 512, 4097}) {
    for (auto [E, k] : std::vector<std::pair<int64_t, int64_t>>{{8, 2}, {64, 8}, {256, 8}, {1, 1}, {512, 4}, {2048, 2}}) {
      // Skewed routing: a few experts take most slots, many stay empty.
      at::Tensor flat = (at::rand({tokens * k}).pow(3) * double(E)).to(at::kLong).clamp_max(E - 1).cuda();
      kernels::MoeLayout a = kernels::moe_layout_cuda(flat, E, k, 16);
      kernels::MoeLayout b = kernels::moe_layout_reference(flat, E, k, 16);
      EXPECT_EQ(a.bound, b.bound);
      for (auto [x, y] : {std::pair{a.counts, b.counts}, {a.offsets, b.offsets}, {a.ends, b.ends},
                          {a.segments, b.segments}, {a.order, b.order}, {a.dest, b.dest}, {a.src_token, b.src_token},
                          {a.slot_row, b.slot_row}})
        EXPECT_TRUE(test::all_equal(x.cpu(), y.cpu())) << "tokens " << tokens << " E " << E << " k " << k;
    }
  }
}

TEST(CudaMoeRoute, EqualsReference) {
  at::manual_seed(6);
  for (int64_t T : {1, 19, 111, 4097}) {
    for (auto [E, k] : std::vector<std::pair<int64_t, int64_t>>{{8, 2}, {64, 8}, {256, 8}, {1000, 1}, {40, 40}}) {
      for (bool sigmoid : {false, true}) {
        const std::string what = "T " + std::to_string(T) + " E " + std::to_string(E) + " k " + std::to_string(k) +
                                 (sigmoid ? " sigmoid" : " softmax");
        at::Tensor logits = (at::randn({T, E}) * 2).cuda();
        at::Tensor bias = sigmoid ? (at::randn({E}) * 0.1).cuda() : at::Tensor();
        kernels::MoeRoute a = kernels::moe_route_cuda(logits, k, sigmoid, bias, at::Tensor());
        kernels::MoeRoute b = kernels::moe_route_reference(logits, k, sigmoid, bias, at::Tensor());
        EXPECT_TRUE(test::all_equal(a.ids.cpu(), b.ids.cpu())) << what;
        EXPECT_TRUE(at::allclose(a.weights.cpu(), b.weights.cpu(), 1e-5, 1e-7)) << what;
        // Replay: the given experts, in the given order, weighted by their renormalised scores.
        at::Tensor replay = std::get<1>(at::rand({T, E}).topk(k, -1)).cuda();
        a = kernels::moe_route_cuda(logits, k, sigmoid, bias, replay);
        b = kernels::moe_route_reference(logits, k, sigmoid, bias, replay);
        EXPECT_TRUE(test::all_equal(a.ids.cpu(), replay.cpu())) << what;
        EXPECT_TRUE(at::allclose(a.weights.cpu(), b.weights.cpu(), 1e-5, 1e-7)) << what << " replay";
      }
    }
  }
  // The dispatcher keeps the reference where a gradient is wanted.
  at::Tensor logits = at::randn({3, 8}).cuda().requires_grad_(true);
  kernels::MoeRoute r = kernels::moe_route(logits, 2, false, at::Tensor(), at::Tensor());
  EXPECT_TRUE(r.scores.defined() && r.weights.requires_grad());
}

TEST(CudaStreamRead, EqualsReferenceExactlyAtAnyAlignment) {
  at::manual_seed(5);
  for (int64_t count : {int64_t(1), int64_t(19), int64_t(111), int64_t(4097), (int64_t(1) << 20) + 3})
    for (int64_t skip : {0, 1, 3}) {  // word offsets 0, 4 and 12 bytes from a 16-byte boundary
      at::Tensor words = at::randint(-(int64_t(1) << 31), int64_t(1) << 31, {count + skip}, at::kLong).to(at::kInt);
      at::Tensor part = words.cuda().narrow(0, skip, count);
      const int32_t want = kernels::xor_words_reference(words.narrow(0, skip, count)).item<int32_t>();
      EXPECT_EQ(kernels::xor_words(part).item<int32_t>(), want) << "count " << count << " skip " << skip;
      at::Tensor acc = at::scalar_tensor(want, at::TensorOptions().dtype(at::kInt).device(at::kCUDA));
      kernels::xor_words_into(part, acc);  // x ^ x
      EXPECT_EQ(acc.item<int32_t>(), 0) << "count " << count << " skip " << skip;
    }
  at::Tensor bytes = at::zeros({4100}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA));
  EXPECT_TRUE(test::throws_with([&] { kernels::xor_words(bytes.narrow(0, 1, 4096)); }, {"4-byte boundary", "offset 1"}));
}

}  // namespace
}  // namespace kiln
