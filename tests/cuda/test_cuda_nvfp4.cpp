// NVFP4 CUDA kernels against the CPU references: quantise and dequantise bit for bit (random blocks
// over a wide range of scales, zero blocks and matrices, ties), the W4A16 GEMMs (dense split-K,
// staged and wgmma, grouped split-K, staged and wgmma; bf16 and fp32 inputs, odd M and N, K with and without a tail) within
// stated tolerances, and errors.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "core/torch_version.h"
#include "kernels/nvfp4.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using kernels::Nvfp4Tensor;

// W [.., N, K] with block magnitudes spread over ~2^-12 .. 2^12 (E4M3 subnormal scales included) and
// every 7th block zero.
at::Tensor spread_weights(std::vector<int64_t> shape) {
  const int64_t K = shape.back();
  std::vector<int64_t> bshape = shape;
  bshape.back() = K / 16;
  bshape.push_back(1);
  std::vector<int64_t> vshape = bshape;
  vshape.back() = 16;
  at::Tensor mag = at::exp2(at::randn(bshape) * 4);
  int64_t num_blocks = 1;
  for (int64_t d : bshape) num_blocks *= d;
  at::Tensor keep = (at::arange(num_blocks) % 7 != 3).to(at::kFloat).view(bshape);
  return (at::randn(vshape) * mag * keep).view(shape);
}

void expect_same_quantization(const Nvfp4Tensor& got, const Nvfp4Tensor& want, const std::string& what) {
  EXPECT_TRUE(test::all_equal(got.packed.cpu(), want.packed)) << what << ": packed";
  EXPECT_TRUE(test::all_equal(got.block_scale.cpu(), want.block_scale)) << what << ": block_scale";
  EXPECT_TRUE(test::all_equal(got.tensor_scale.cpu(), want.tensor_scale)) << what << ": tensor_scale";
}

TEST(CudaNvfp4, QuantizeIsBitExact) {
  ASSERT_TRUE(at::hasCUDA()) << "the cuda label needs a GPU";
  at::manual_seed(7);
  // {2, 40, 272}: a stack whose matrices have whole tiles, a K tail and a partial row tile.
  const std::vector<std::vector<int64_t>> shapes = {{19, 48},    {111, 4112}, {1, 16},
                                                     {3, 19, 64}, {4097, 32},  {2, 40, 272}};
  for (const auto& shape : shapes)
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      at::Tensor w = spread_weights(shape);
      if (dtype == at::kHalf) w = w.clamp(-60000, 60000);
      w = w.to(dtype);
      const Nvfp4Tensor ref = kernels::nvfp4_quantize_reference(w);
      const std::string what = str_cat("shape ", at::IntArrayRef(shape), " dtype ", dtype);
      expect_same_quantization(kernels::nvfp4_quantize_cuda(w.cuda()), ref, what);
      // Written straight into the GEMMs' layout: the reference's blocks moved, their bits permuted.
      const Nvfp4Tensor kq = kernels::nvfp4_quantize_cuda(w.cuda(), /*kernel_layout=*/true);
      EXPECT_TRUE(kq.kernel_layout);
      expect_same_quantization(kq, kernels::nvfp4_to_kernel_layout(ref), what + " kernel layout");
    }
  // A stack with an all-zero expert (tensor scale 1, codes and scales 0) and an all-zero matrix.
  at::Tensor stack = spread_weights({3, 5, 32});
  stack[1].zero_();
  expect_same_quantization(kernels::nvfp4_quantize_cuda(stack.cuda()), kernels::nvfp4_quantize_reference(stack), "stack");
  Nvfp4Tensor zero = kernels::nvfp4_quantize_cuda(at::zeros({5, 32}, at::kCUDA));
  EXPECT_EQ(zero.tensor_scale.item<float>(), 1.0f);
  EXPECT_EQ(zero.packed.cpu().sum().item<int64_t>(), 0);
  expect_same_quantization(zero, kernels::nvfp4_quantize_reference(at::zeros({5, 32})), "zero matrix");
}

TEST(CudaNvfp4, QuantizeTiesRoundToEven) {
  // amax 2688 makes s2 exactly 1; block 0 holds it (scale 448). Block 1 has bmax 6 (scale 1) and
  // every E2M1 midpoint, both signs, plus small negatives that round to -0 (code 8). Blocks 2..5
  // put bmax / 6 on E4M3 midpoints (normal and subnormal) so the scale itself ties.
  std::vector<float> v(6 * 16, 0.0f);
  v[0] = 2688.0f;
  const float mids[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  v[16] = 6.0f;
  for (int i = 0; i < 7; ++i) {
    v[17 + i] = mids[i];
    v[24 + i] = -mids[i];
  }
  v[31] = -0.1f;
  const float scale_ties[] = {1.0625f, 1.1875f, 1.5f * 0x1p-9f, 2.5f * 0x1p-9f};
  for (int b = 0; b < 4; ++b) {
    v[(2 + b) * 16] = 6.0f * scale_ties[b];
    for (int j = 1; j < 16; ++j) v[(2 + b) * 16 + j] = float(j % 5 - 2) * scale_ties[b];
  }
  at::Tensor w = at::tensor(v).view({2, 48});
  const Nvfp4Tensor ref = kernels::nvfp4_quantize_reference(w);
  expect_same_quantization(kernels::nvfp4_quantize_cuda(w.cuda()), ref, "ties");
  EXPECT_EQ(ref.tensor_scale.item<float>(), 1.0f);
  EXPECT_EQ(ref.block_scale[0][1].item<uint8_t>(), kernels::e4m3_encode(1.0f));
}

TEST(CudaNvfp4, DequantizeIsBitExact) {
  at::manual_seed(8);
  for (const auto& shape : std::vector<std::vector<int64_t>>{{19, 48}, {111, 4112}, {3, 7, 64}, {2, 40, 272}}) {
    const Nvfp4Tensor q = kernels::nvfp4_quantize_reference(spread_weights(shape));
    // Random codes and any finite scale byte too (ModelOpt writes 1.0 for zero blocks).
    Nvfp4Tensor r = q;
    r.packed = at::randint(256, q.packed.sizes(), at::kByte);
    r.block_scale = at::randint(0x7F, q.block_scale.sizes(), at::kByte);
    for (const Nvfp4Tensor& t : {q, r})
      for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
        at::Tensor got = kernels::nvfp4_dequantize_cuda(t.to(at::kCUDA), dtype);
        EXPECT_EQ(got.scalar_type(), dtype);
        EXPECT_TRUE(test::all_equal(got.cpu(), kernels::nvfp4_dequantize_reference(t, dtype)))
            << "shape " << at::IntArrayRef(shape) << " dtype " << dtype;
      }
    // The kernel layout comes back to the same values.
    const Nvfp4Tensor k = kernels::nvfp4_to_kernel_layout(q.to(at::kCUDA));
    EXPECT_TRUE(test::all_equal(kernels::nvfp4_dequantize_cuda(k, at::kFloat).cpu(),
                                kernels::nvfp4_dequantize_reference(q, at::kFloat)));
  }
}

// Tolerances, relative to the largest reference output |ref|max. Weights (e2m1 * sf) and bf16
// inputs are exact in bf16 and their products exact in fp32, so a bf16 input differs from the fp32
// reference only in the order of the fp32 sum, then by at most one bf16 rounding of the output
// (2^-8 relative; 2^-7 allows one ulp either way). fp32 inputs run as hi + lo bf16 terms (~16
// mantissa bits): x - hi - lo is at most 2^-18 |x|, so the sum is off by at most 2^-18 sum|x w|,
// under 64 |ref|max * 2^-18 = 2.4e-4 |ref|max at K = 4112 even with aligned signs; random signs
// leave it far below the 1e-4 used.
struct Tol {
  double rtol, atol_rel;
};
Tol tol_for(at::ScalarType dtype) { return dtype == at::kBFloat16 ? Tol{0x1p-7, 1e-3} : Tol{1e-4, 1e-4}; }

::testing::AssertionResult close_to_ref(const at::Tensor& got, const at::Tensor& ref, at::ScalarType dtype) {
  const Tol t = tol_for(dtype);
  const double scale = ref.numel() ? ref.abs().max().item<double>() : 1.0;
  return test::all_close(got.cpu(), ref, t.rtol, t.atol_rel * scale);
}

TEST(CudaNvfp4, LinearMatchesReference) {
  at::manual_seed(9);
  struct Case {
    int64_t N, K;
    std::vector<int64_t> Ms;
  };
  // K: 16 and 48 (tail only), 2080 (8 super-chunks + 2 tail blocks, 16-byte loads), 4112 (16
  // super-chunks + 1 tail block, 8-byte loads), 8208 and 8192 (32 super-chunks: up to 16 tokens a
  // cluster of two blocks splits K, the tail on the second); N odd, one row tile up to 129; M over 1..4 n-tiles and
  // several 32-token chunks.
  const std::vector<Case> cases = {{19, 16, {1, 19, 111}},         {111, 48, {1, 19, 64}},  {19, 4112, {1, 19, 111, 256}},
                                    {111, 2080, {1, 19, 64, 111}}, {4097, 48, {1, 19}},     {4097, 4112, {1, 19}},
                                    {4097, 2080, {111}},          {256, 4096, {1, 16, 33}}, {111, 8208, {1, 19, 111}},
                                    {96, 8192, {1, 16, 33}}};
  for (const Case& c : cases) {
    at::Tensor w = spread_weights({c.N, c.K}) * 1e-3;
    const Nvfp4Tensor q = kernels::nvfp4_quantize_reference(w);
    const Nvfp4Tensor kq = kernels::nvfp4_to_kernel_layout(q).to(at::kCUDA);
    for (int64_t M : c.Ms)
      for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
        at::Tensor x = at::randn({M, c.K}).to(dtype);
        at::Tensor ref = kernels::nvfp4_linear_reference(x, q);
        at::Tensor got = kernels::nvfp4_linear_cuda(x.cuda(), kq, at::Tensor());
        EXPECT_EQ(got.scalar_type(), dtype);
        EXPECT_TRUE(close_to_ref(got, ref.to(at::kFloat), dtype))
            << "M " << M << " N " << c.N << " K " << c.K << " dtype " << dtype;
        // The warp and cluster sums run in a fixed order: a second call is bit-identical.
        EXPECT_TRUE(test::all_equal(kernels::nvfp4_linear_cuda(x.cuda(), kq, at::Tensor()).cpu(), got.cpu()))
            << "M " << M << " N " << c.N << " K " << c.K << " dtype " << dtype << ": not deterministic";
      }
  }
}

// Both dense kernels forced on the same bf16 inputs, odd sizes: M from 1 to 4097 over 1, 4 and 8
// n-tiles and several token chunks (the staged kernel's chunk is 32 tokens up to M = 32, else 64);
// N with partial row tiles and row blocks of 128 with idle warps; K with tail steps. On a 132-SM
// H200 the staged launch splits K over clusters of 4 blocks ((111, 8208), (4097, 2080) at M = 111)
// and of 2 ((4097, 1056) at M = 19); the others run one block per tile.
TEST(CudaNvfp4, StagedAndSplitKLinearsMatchReference) {
  at::manual_seed(12);
  struct Case {
    int64_t N, K;
    std::vector<int64_t> Ms;
  };
  const std::vector<Case> cases = {{19, 16, {1, 19, 111}},   {111, 48, {17, 33, 64, 65}}, {111, 8208, {19, 111}},
                                    {4097, 2080, {111}},     {4097, 1056, {19}},         {129, 4112, {1, 19, 257}},
                                    {256, 4096, {32, 64}},   {19, 272, {4097}}};
  for (const Case& c : cases) {
    const Nvfp4Tensor q = kernels::nvfp4_quantize_reference(spread_weights({c.N, c.K}) * 1e-3);
    const Nvfp4Tensor kq = kernels::nvfp4_to_kernel_layout(q).to(at::kCUDA);
    for (int64_t M : c.Ms) {
      at::Tensor x = at::randn({M, c.K}).to(at::kBFloat16);
      const at::Tensor ref = kernels::nvfp4_linear_reference(x, q).to(at::kFloat);
      for (kernels::Nvfp4Gemm gemm : {kernels::Nvfp4Gemm::kStaged, kernels::Nvfp4Gemm::kSplitK}) {
        const std::string what = str_cat("M ", M, " N ", c.N, " K ", c.K, gemm == kernels::Nvfp4Gemm::kStaged ? " staged" : " split-K");
        at::Tensor got = kernels::nvfp4_linear_cuda(x.cuda(), kq, at::Tensor(), gemm);
        EXPECT_TRUE(close_to_ref(got, ref, at::kBFloat16)) << what;
        EXPECT_TRUE(test::all_equal(kernels::nvfp4_linear_cuda(x.cuda(), kq, at::Tensor(), gemm).cpu(), got.cpu()))
            << what << ": not deterministic";
      }
    }
  }
  // The epilogue's extra scale, and the staged kernel refusing fp32 by name.
  const Nvfp4Tensor q = kernels::nvfp4_quantize_reference(spread_weights({111, 2080}));
  const Nvfp4Tensor kq = kernels::nvfp4_to_kernel_layout(q).to(at::kCUDA);
  at::Tensor x = at::randn({65, 2080}).to(at::kBFloat16);
  at::Tensor got = kernels::nvfp4_linear_cuda(x.cuda(), kq, at::full({}, 0.375f, at::kCUDA), kernels::Nvfp4Gemm::kStaged);
  EXPECT_TRUE(close_to_ref(got, kernels::nvfp4_linear_reference(x, q).to(at::kFloat) * 0.375f, at::kBFloat16));
  EXPECT_STREQ(kernels::nvfp4_linear_path(x.cuda(), kq), "deq+mm");
  EXPECT_STREQ(kernels::nvfp4_linear_path(x.cuda().narrow(0, 0, 64), kq), "splitK");
  EXPECT_STREQ(kernels::nvfp4_linear_path(x.cuda().to(at::kFloat), kq), "deq+mm");
  EXPECT_TRUE(test::throws_with(
      [&] { kernels::nvfp4_linear_cuda(x.cuda().to(at::kFloat), kq, at::Tensor(), kernels::Nvfp4Gemm::kStaged); },
      {"staged kernel takes bfloat16"}));
}

TEST(CudaNvfp4, LinearExtraScaleAndStridedInput) {
  at::manual_seed(10);
  const Nvfp4Tensor q = kernels::nvfp4_quantize_reference(spread_weights({111, 2080}));
  const Nvfp4Tensor kq = kernels::nvfp4_to_kernel_layout(q).to(at::kCUDA);
  at::Tensor wide = at::randn({19, 2080 + 16});
  at::Tensor x = wide.narrow(1, 3, 2080);  // strided rows, data 12 bytes off
  at::Tensor scale = at::full({}, 0.375f);
  at::Tensor ref = kernels::nvfp4_linear_reference(x, q) * 0.375f;
  EXPECT_TRUE(close_to_ref(kernels::nvfp4_linear_cuda(x.cuda(), kq, scale.cuda()), ref, at::kFloat));
  // The dispatcher takes the kernel for CUDA inputs with kernel-layout weights.
  EXPECT_TRUE(close_to_ref(kernels::nvfp4_linear(x.cuda(), kq), kernels::nvfp4_linear_reference(x, q), at::kFloat));
}

TEST(CudaNvfp4, GroupedLinearMatchesReference) {
  at::manual_seed(11);
  // Experts with 0, 1, 19 rows and more; the second set exceeds 16 rows per expert on average
  // (the 4 n-tile body, with chunks of 32 and a 12-row remainder). 96 x 1056 takes the aligned
  // tiled path with a K tail; 111 x 4112 the unaligned one (odd scale offsets per expert).
  const std::vector<std::vector<int64_t>> count_sets = {{0, 1, 19, 0, 8, 40}, {0, 1, 19, 0, 8, 140}};
  for (auto [N, K] : std::vector<std::pair<int64_t, int64_t>>{{111, 4112}, {64, 48}, {19, 2080}, {96, 1056}})
    for (const auto& counts : count_sets) {
      const int64_t E = int64_t(counts.size());
      std::vector<int64_t> off{0};
      for (int64_t n : counts) off.push_back(off.back() + n);
      at::Tensor offsets = at::tensor(off, at::kLong);
      const Nvfp4Tensor q = kernels::nvfp4_quantize_reference(spread_weights({E, N, K}) * 1e-2);
      const Nvfp4Tensor kq = kernels::nvfp4_to_kernel_layout(q).to(at::kCUDA);
      for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
        at::Tensor x = at::randn({off.back(), K}).to(dtype);
        at::Tensor ref = kernels::nvfp4_grouped_linear_reference(x, q, offsets);
        at::Tensor got = kernels::nvfp4_grouped_linear_cuda(x.cuda(), kq, offsets.cuda(), at::Tensor());
        EXPECT_TRUE(close_to_ref(got, ref.to(at::kFloat), dtype))
            << "N " << N << " K " << K << " R " << off.back() << " dtype " << dtype;
      }
    }
}

// The grouped staged kernel forced (Nvfp4Gemm::kStaged on a stack) against the reference, bf16:
// experts with 0, 1, 19, 111 and 4097 rows (16 and 32-token chunks, partial chunks, many chunks),
// N below one row tile, of a whole and a partial row tile, of whole 256-row slabs and of a partial
// last slab, K below one step (the tail alone), of one, of several with a 32-value tail, and of
// eight. A second call is bit-identical, and so are the tiled launches (kStagedTiles, and
// kStagedTiles64's 64-token chunks: a token's sums do not depend on its chunk), also on grids too
// small for their tiles; the extra scale applies; fp32 x, stacks whose experts do not start on 16
// bytes and the tiled launches on one matrix are refused by name.
TEST(CudaNvfp4, GroupedStagedMatchesReference) {
  at::manual_seed(19);
  constexpr auto kStaged = kernels::Nvfp4Gemm::kStaged, kStagedTiles = kernels::Nvfp4Gemm::kStagedTiles,
                 kStagedTiles64 = kernels::Nvfp4Gemm::kStagedTiles64;
  std::vector<int64_t> forty(40, 0);  // more experts than the tiled launch's scan takes per pass
  for (auto [e, n] : {std::pair{1, 3}, {5, 17}, {31, 40}, {32, 1}, {35, 70}, {38, 33}}) forty[size_t(e)] = n;
  const std::vector<std::vector<int64_t>> count_sets = {{0, 1, 19, 0, 8, 40}, {0, 1, 19, 0, 8, 40, 111, 101},
                                                        {4097, 0, 111, 1, 0}, forty};
  for (auto [N, K] : std::vector<std::pair<int64_t, int64_t>>{
           {19, 512}, {64, 96}, {48, 256}, {96, 1056}, {512, 512}, {300, 2048}})
    for (const auto& counts : count_sets) {
      if (K >= 2048 && (counts[0] == 4097 || counts.size() == 40)) continue;  // the reference's cost
      const int64_t E = int64_t(counts.size());
      std::vector<int64_t> off{0};
      for (int64_t n : counts) off.push_back(off.back() + n);
      const std::string what = str_cat("N ", N, " K ", K, " E ", E, " R ", off.back());
      ASSERT_TRUE(kernels::grouped_stack_aligned(N, K)) << what;
      at::Tensor offsets = at::tensor(off, at::kLong);
      const Nvfp4Tensor q = kernels::nvfp4_quantize_reference(spread_weights({E, N, K}) * 1e-2);
      const Nvfp4Tensor kq = kernels::nvfp4_to_kernel_layout(q).to(at::kCUDA);
      at::Tensor x = at::randn({off.back(), K}).to(at::kBFloat16);
      at::Tensor ref = kernels::nvfp4_grouped_linear_reference(x, q, offsets);
      at::Tensor got = kernels::nvfp4_grouped_linear_cuda(x.cuda(), kq, offsets.cuda(), at::Tensor(), 0, kStaged);
      EXPECT_TRUE(close_to_ref(got, ref.to(at::kFloat), at::kBFloat16)) << what;
      at::Tensor again = kernels::nvfp4_grouped_linear_cuda(x.cuda(), kq, offsets.cuda(), at::Tensor(), 0, kStaged);
      EXPECT_TRUE(test::all_equal(again.cpu(), got.cpu())) << what << ": not deterministic";
      // The tiled launch computes every chunk as the per-expert one: bitwise the same, also on grids
      // sized for fewer rows than there are (live_rows 1: 16-row chunks; 16 E + 1: 32-row chunks),
      // which its loop must cover.
      for (int64_t live : {int64_t(0), int64_t(1), 16 * E + 1}) {
        const at::Tensor per_expert =
            live == 0 ? got : kernels::nvfp4_grouped_linear_cuda(x.cuda(), kq, offsets.cuda(), at::Tensor(), live, kStaged);
        for (auto g : {kStagedTiles, kStagedTiles64}) {
          at::Tensor tiles = kernels::nvfp4_grouped_linear_cuda(x.cuda(), kq, offsets.cuda(), at::Tensor(), live, g);
          EXPECT_TRUE(test::all_equal(tiles.cpu(), per_expert.cpu()))
              << what << " live_rows " << live << ": tiled launch" << (g == kStagedTiles64 ? " of 64 tokens" : "");
        }
      }
    }
  const Nvfp4Tensor q = kernels::nvfp4_quantize_reference(spread_weights({3, 64, 512}));
  const Nvfp4Tensor kq = kernels::nvfp4_to_kernel_layout(q).to(at::kCUDA);
  at::Tensor offsets = at::tensor(std::vector<int64_t>{0, 7, 7, 60}, at::kLong);
  at::Tensor x = at::randn({60, 512}).to(at::kBFloat16);
  at::Tensor got =
      kernels::nvfp4_grouped_linear_cuda(x.cuda(), kq, offsets.cuda(), at::full({}, 0.375f, at::kCUDA), 0, kStaged);
  EXPECT_TRUE(close_to_ref(got, kernels::nvfp4_grouped_linear_reference(x, q, offsets).to(at::kFloat) * 0.375f,
                           at::kBFloat16));
  for (auto g : {kStagedTiles, kStagedTiles64}) {
    at::Tensor tiled = kernels::nvfp4_grouped_linear_cuda(x.cuda(), kq, offsets.cuda(), at::full({}, 0.375f, at::kCUDA), 0, g);
    EXPECT_TRUE(test::all_equal(tiled.cpu(), got.cpu())) << "tiled launch with a scale";
  }
  for (auto g : {kStaged, kStagedTiles, kStagedTiles64})
    EXPECT_TRUE(test::throws_with(
        [&] { kernels::nvfp4_grouped_linear_cuda(x.cuda().to(at::kFloat), kq, offsets.cuda(), at::Tensor(), 0, g); },
        {"staged kernel takes bfloat16"}));
  const Nvfp4Tensor one = kernels::nvfp4_to_kernel_layout(kernels::nvfp4_quantize_reference(at::randn({64, 512})))
                              .to(at::kCUDA);
  for (auto g : {kStagedTiles, kStagedTiles64})
    EXPECT_TRUE(test::throws_with([&] { kernels::nvfp4_linear_cuda(x.cuda(), one, at::Tensor(), g); },
                                  {"kStagedTiles", "expert stacks only"}));
  const Nvfp4Tensor odd = kernels::nvfp4_to_kernel_layout(kernels::nvfp4_quantize_reference(at::randn({3, 19, 288})))
                              .to(at::kCUDA);
  at::Tensor x288 = at::randn({60, 288}, at::kCUDA).to(at::kBFloat16);
  EXPECT_TRUE(test::throws_with(
      [&] { kernels::nvfp4_grouped_linear_cuda(x288, odd, offsets.cuda(), at::Tensor(), 0, kStaged); },
      {"16 bytes", "N = 19", "K = 288"}));
}

// The experts' dispatch by rows per expert on average: split-K to 16, the grouped staged kernel at
// 17-192 (bf16 and an aligned stack; split-K to 64 under --nvfp4-gemm=splitk, ctest
// kiln_cuda_nvfp4_splitk), then the dequantised stack on torch's grouped GEMM (fp32: split-K to
// 64, then a GEMM per expert). The staged kernel is launched per expert to 64 rows per expert and
// tiled above (tiled throughout under --nvfp4-gemm=stagedtiles, ctest
// kiln_cuda_nvfp4_stagedtiles); where the dispatch takes it, nvfp4_grouped_linear's output is
// bitwise that launch's.
TEST(CudaNvfp4, GroupedDispatchFollowsTheRowsPerExpert) {
  if (kernels::nvfp4_wgmma_selected()) GTEST_SKIP() << "--nvfp4-gemm=wgmma takes every grouped call above 16 rows";
  at::manual_seed(23);
  const bool splitk = kernels::nvfp4_gemm_selected() == kernels::Nvfp4Gemm::kSplitK;
  const bool tiles_only = kernels::nvfp4_gemm_selected() == kernels::Nvfp4Gemm::kStagedTiles;
  const char* middle = splitk ? "splitK" : tiles_only ? "staged tiles" : "staged";
  const bool grouped_mm = KILN_TORCH_AT_LEAST(2, 8);
  const Nvfp4Tensor kq = kernels::nvfp4_to_kernel_layout(kernels::nvfp4_quantize_reference(spread_weights({4, 256, 512})))
                             .to(at::kCUDA);
  const char* deq = grouped_mm ? "deq+grouped_mm" : "deq+mm per expert";
  const std::pair<int64_t, const char*> by_rows[] = {{1, "splitK"},          {64, "splitK"},  {65, middle},
                                                     {256, middle},          {257, splitk ? deq : "staged tiles"},
                                                     {768, splitk ? deq : "staged tiles"}, {769, deq}};
  for (auto [R, path] : by_rows) {
    const at::Tensor x = at::randn({R, 512}, at::kCUDA).to(at::kBFloat16);
    EXPECT_STREQ(kernels::nvfp4_grouped_linear_path(x, kq, R), path) << R << " rows";
    EXPECT_STREQ(kernels::nvfp4_grouped_linear_path(x.to(at::kFloat), kq, R), R > 256 ? "deq+mm per expert" : "splitK")
        << R << " fp32 rows";
    if (std::string(path).rfind("staged", 0) != 0) continue;
    std::vector<int64_t> off{0, R / 4, R / 2, R / 2, R};  // an expert without rows
    const at::Tensor offsets = at::tensor(off, at::kLong).cuda();
    at::Tensor got = kernels::nvfp4_grouped_linear(x, kq, offsets);
    const auto launch = std::string(path) == "staged" ? kernels::Nvfp4Gemm::kStaged : kernels::Nvfp4Gemm::kStagedTiles;
    at::Tensor staged = kernels::nvfp4_grouped_linear_cuda(x, kq, offsets, at::Tensor(), 0, launch);
    EXPECT_TRUE(test::all_equal(got.cpu(), staged.cpu())) << R << " rows: the dispatch did not run the staged kernel";
  }
  // A stack the staged kernel does not take keeps split-K (19 rows x 288: experts off 16 bytes).
  const Nvfp4Tensor odd = kernels::nvfp4_to_kernel_layout(kernels::nvfp4_quantize_reference(at::randn({3, 19, 288})))
                              .to(at::kCUDA);
  EXPECT_STREQ(kernels::nvfp4_grouped_linear_path(at::zeros({100, 288}, at::kCUDA).to(at::kBFloat16), odd, 100), "splitK");
  EXPECT_STREQ(kernels::nvfp4_grouped_linear_path(at::zeros({100, 512}).to(at::kBFloat16), kq.to(at::kCPU), 100),
               "reference");
}

// The wgmma GEMM forced, dense and grouped, with the launcher's block and with 64 and 128 weight
// rows per block (kWgmma, kWgmma64, kWgmma128), against the reference on bf16 inputs: token counts over every tile width (32, 64, 128 by rows per matrix) with partial tiles
// (1, 19, 111, 4097 rows), N of one and several 64-row tiles, K of one and several 256-wide steps
// (the weights' shared-memory ring wraps at three), experts with no rows, and spare rows past the last
// expert. A second call is bit-identical; the epilogue's extra scale applies. Skipped where the
// kernel cannot run (not a compute capability 9.0 device, or no sm_90a code in the build).
TEST(CudaNvfp4, WgmmaLinearsMatchReference) {
  at::manual_seed(13);
  {
    const Nvfp4Tensor probe = kernels::nvfp4_to_kernel_layout(kernels::nvfp4_quantize_reference(at::randn({64, 256})))
                                  .to(at::kCUDA);
    if (!kernels::nvfp4_wgmma_usable(at::zeros({1, 256}, at::kCUDA).to(at::kBFloat16), probe))
      GTEST_SKIP() << "the wgmma GEMM needs sm_90a code and a compute capability 9.0 device";
  }
  constexpr auto kWgmma = kernels::Nvfp4Gemm::kWgmma;
  // The launcher's choice, and 64 and 128 weight rows per block forced (128: N a multiple of 128).
  const std::vector<kernels::Nvfp4Gemm> variants = {kWgmma, kernels::Nvfp4Gemm::kWgmma64, kernels::Nvfp4Gemm::kWgmma128};
  auto takes = [](kernels::Nvfp4Gemm g, int64_t N) {
    return kernels::wgmma_warpgroups_fit(N, kernels::wgmma_warpgroups(g));
  };
  struct Case {
    int64_t N, K;
    std::vector<int64_t> Ms;
  };
  const std::vector<Case> cases = {{64, 256, {1, 19, 33, 111}}, {128, 1024, {1, 17, 64, 65, 129}},
                                    {192, 2048, {19, 4097}},    {1024, 512, {111}}};
  for (const Case& c : cases) {
    const Nvfp4Tensor q = kernels::nvfp4_quantize_reference(spread_weights({c.N, c.K}) * 1e-3);
    const Nvfp4Tensor kq = kernels::nvfp4_to_kernel_layout(q).to(at::kCUDA);
    for (int64_t M : c.Ms)
      for (kernels::Nvfp4Gemm g : variants) {
        if (!takes(g, c.N)) continue;
        const std::string what = str_cat("dense M ", M, " N ", c.N, " K ", c.K, " gemm ", int(g));
        at::Tensor x = at::randn({M, c.K}).to(at::kBFloat16);
        at::Tensor got = kernels::nvfp4_linear_cuda(x.cuda(), kq, at::Tensor(), g);
        EXPECT_EQ(got.scalar_type(), at::kBFloat16) << what;
        EXPECT_TRUE(close_to_ref(got, kernels::nvfp4_linear_reference(x, q).to(at::kFloat), at::kBFloat16)) << what;
        EXPECT_TRUE(test::all_equal(kernels::nvfp4_linear_cuda(x.cuda(), kq, at::Tensor(), g).cpu(), got.cpu()))
            << what << ": not deterministic";
      }
  }
  // Grouped: rows per expert on average 11, 35 and 700 (tiles of 32, 64, 128), four spare rows.
  const std::vector<std::vector<int64_t>> count_sets = {{0, 1, 19, 0, 8, 40}, {0, 1, 19, 0, 8, 40, 111, 101},
                                                        {4097, 0, 111, 1, 0}};
  for (auto [N, K] : std::vector<std::pair<int64_t, int64_t>>{{64, 256}, {128, 1024}, {256, 512}})
    for (const auto& counts : count_sets)
      for (kernels::Nvfp4Gemm g : variants) {
        if (!takes(g, N)) continue;
        const int64_t E = int64_t(counts.size());
        std::vector<int64_t> off{0};
        for (int64_t n : counts) off.push_back(off.back() + n);
        const std::string what = str_cat("grouped N ", N, " K ", K, " E ", E, " R ", off.back(), " gemm ", int(g));
        at::Tensor offsets = at::tensor(off, at::kLong);
        const Nvfp4Tensor q = kernels::nvfp4_quantize_reference(spread_weights({E, N, K}) * 1e-2);
        const Nvfp4Tensor kq = kernels::nvfp4_to_kernel_layout(q).to(at::kCUDA);
        at::Tensor x = at::randn({off.back() + 4, K}).to(at::kBFloat16);
        at::Tensor ref = kernels::nvfp4_grouped_linear_reference(x.narrow(0, 0, off.back()), q, offsets);
        at::Tensor got = kernels::nvfp4_grouped_linear_cuda(x.cuda(), kq, offsets.cuda(), at::Tensor(), 0, g);
        EXPECT_TRUE(close_to_ref(got.narrow(0, 0, off.back()), ref.to(at::kFloat), at::kBFloat16)) << what;
        at::Tensor again = kernels::nvfp4_grouped_linear_cuda(x.cuda(), kq, offsets.cuda(), at::Tensor(), 0, g);
        EXPECT_TRUE(test::all_equal(again.narrow(0, 0, off.back()).cpu(), got.narrow(0, 0, off.back()).cpu()))
            << what << ": not deterministic";
      }
  // The extra scale, and shapes the kernel does not take refused by name.
  const Nvfp4Tensor q = kernels::nvfp4_quantize_reference(spread_weights({128, 512}));
  const Nvfp4Tensor kq = kernels::nvfp4_to_kernel_layout(q).to(at::kCUDA);
  at::Tensor x = at::randn({65, 512}).to(at::kBFloat16);
  at::Tensor got = kernels::nvfp4_linear_cuda(x.cuda(), kq, at::full({}, 0.375f, at::kCUDA), kWgmma);
  EXPECT_TRUE(close_to_ref(got, kernels::nvfp4_linear_reference(x, q).to(at::kFloat) * 0.375f, at::kBFloat16));
  const Nvfp4Tensor odd = kernels::nvfp4_to_kernel_layout(kernels::nvfp4_quantize_reference(at::randn({96, 512})))
                              .to(at::kCUDA);
  EXPECT_TRUE(test::throws_with([&] { kernels::nvfp4_linear_cuda(x.cuda(), odd, at::Tensor(), kWgmma); },
                                {"N a multiple of 64", "N = 96"}));
  // The dispatch: on its own, wgmma for one matrix of 8192 rows or more at 65-256 tokens, where it
  // measured faster than both others; with --nvfp4-gemm=wgmma, wherever it runs above 16 tokens.
  const bool everywhere = kernels::nvfp4_wgmma_selected();
  const Nvfp4Tensor wide = kernels::nvfp4_quantize_cuda(at::randn({8192, 256}, at::kCUDA) * 0.02, /*kernel_layout=*/true);
  const std::pair<int64_t, const char*> by_rows[] = {{16, "splitK"}, {19, "splitK"}, {65, "wgmma"}, {256, "wgmma"},
                                                     {257, "deq+mm"}};
  for (auto [M, path] : by_rows) {
    const at::Tensor xm = at::zeros({M, 256}, at::kCUDA).to(at::kBFloat16);
    EXPECT_STREQ(kernels::nvfp4_linear_path(xm, wide), everywhere && M > 16 ? "wgmma" : path) << M << " rows";
  }
  EXPECT_STREQ(kernels::nvfp4_linear_path(x.cuda().narrow(0, 0, 65), kq), everywhere ? "wgmma" : "deq+mm");
  const Nvfp4Tensor n192 = kernels::nvfp4_to_kernel_layout(kernels::nvfp4_quantize_reference(at::randn({192, 512})))
                               .to(at::kCUDA);
  EXPECT_TRUE(test::throws_with(
      [&] { kernels::nvfp4_linear_cuda(x.cuda(), n192, at::Tensor(), kernels::Nvfp4Gemm::kWgmma128); },
      {"N a multiple of 128", "N = 192"}));
  EXPECT_TRUE(test::throws_with([&] { kernels::nvfp4_linear_cuda(x.cuda().to(at::kFloat), kq, at::Tensor(), kWgmma); },
                                {"wgmma GEMM needs bfloat16"}));
}

TEST(CudaNvfp4, ErrorsNameTheProblem) {
  at::Tensor w = at::randn({8, 64});
  const Nvfp4Tensor q = kernels::nvfp4_to_kernel_layout(kernels::nvfp4_quantize_reference(w)).to(at::kCUDA);
  at::Tensor x = at::randn({3, 64}, at::kCUDA);
  EXPECT_TRUE(test::throws_with([&] { kernels::nvfp4_quantize_cuda(at::randn({4, 24}, at::kCUDA)); }, {"multiple of 16"}));
  Nvfp4Tensor bad = q;
  bad.block_scale = bad.block_scale.narrow(1, 0, 3);
  EXPECT_TRUE(test::throws_with([&] { kernels::nvfp4_linear_cuda(x, bad, at::Tensor()); }, {"block scales"}));
  bad = q;
  bad.tensor_scale = at::Tensor();
  EXPECT_TRUE(test::throws_with([&] { kernels::nvfp4_linear_cuda(x, bad, at::Tensor()); }, {"missing tensor scale"}));
  bad = q;
  bad.packed = bad.packed.narrow(1, 0, 4);  // K = 8: not a multiple of 16
  EXPECT_TRUE(test::throws_with([&] { kernels::nvfp4_linear_cuda(x.narrow(1, 0, 8), bad, at::Tensor()); }, {"K = 8"}));
  EXPECT_TRUE(test::throws_with([&] { kernels::nvfp4_linear_cuda(at::randn({3, 48}, at::kCUDA), q, at::Tensor()); },
                                {"x must be [M, 64]"}));
  EXPECT_TRUE(test::throws_with(
      [&] { kernels::nvfp4_linear_cuda(x, kernels::nvfp4_to_modelopt_layout(q), at::Tensor()); }, {"kernel layout"}));
  EXPECT_TRUE(test::throws_with([&] { kernels::nvfp4_linear_cuda(x.cpu(), q, at::Tensor()); }, {"CUDA device"}));
  Nvfp4Tensor stack = kernels::nvfp4_to_kernel_layout(kernels::nvfp4_quantize_reference(at::randn({2, 8, 64}))).to(at::kCUDA);
  EXPECT_TRUE(test::throws_with(
      [&] { kernels::nvfp4_grouped_linear_cuda(x, stack, at::tensor({0, 3}, at::kLong).cuda(), at::Tensor()); },
      {"offsets must be int64 [3]"}));
}

}  // namespace
}  // namespace kiln
