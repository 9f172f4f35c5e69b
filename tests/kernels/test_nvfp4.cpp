// NVFP4 reference against hand-made vectors: every E2M1 and E4M3 code, every tie, saturation,
// zero blocks, the nibble order, and the shape errors of docs/MODEL.md §4.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/nvfp4.h"
#include "kernels/nvfp4_layout.h"
#include "tests/test_util.h"

namespace kiln::kernels {
namespace {

TEST(Nvfp4, E2m1EveryCodeAndEveryTie) {
  for (int c = 0; c < 16; ++c) EXPECT_EQ(e2m1_encode(e2m1_decode(uint8_t(c))), c) << "code " << c;
  // The midpoint between codes i and i+1 goes to the even one (0.25->0, 0.75->1.0, 1.25->1.0,
  // 1.75->2, 2.5->2, 3.5->4, 5->4); just above it is i+1, just below it is i.
  const std::vector<std::pair<float, int>> ties = {{0.25f, 0}, {0.75f, 1}, {1.25f, 2}, {1.75f, 3},
                                                   {2.5f, 4},  {3.5f, 5},  {5.0f, 6}};
  for (auto [x, lower] : ties) {
    const int even = lower % 2 == 0 ? lower : lower + 1;
    EXPECT_EQ(e2m1_encode(x), even) << x;
    EXPECT_EQ(e2m1_encode(-x), even | 8) << -x;
    EXPECT_EQ(e2m1_encode(std::nextafter(x, 100.0f)), lower + 1) << "just above " << x;
    EXPECT_EQ(e2m1_encode(std::nextafter(x, 0.0f)), lower) << "just below " << x;
  }
  EXPECT_EQ(e2m1_encode(6.0f), 7);
  EXPECT_EQ(e2m1_encode(7.0f), 7);    // saturates
  EXPECT_EQ(e2m1_encode(1e9f), 7);
  EXPECT_EQ(e2m1_encode(-100.0f), 15);
  EXPECT_EQ(e2m1_encode(-0.1f), 8);   // rounds to zero, keeps the sign
  EXPECT_EQ(e2m1_decode(8), 0.0f);
}

TEST(Nvfp4, E4m3EveryCodeTiesAndSaturation) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(e4m3_decode(uint8_t(c))));
      continue;
    }
    EXPECT_EQ(e4m3_encode(e4m3_decode(uint8_t(c))), c) << "code " << c;
  }
  EXPECT_EQ(e4m3_decode(0x7E), 448.0f);
  EXPECT_EQ(e4m3_decode(0x38), 1.0f);
  EXPECT_EQ(e4m3_decode(0x08), std::ldexp(1.0f, -6));  // the smallest normal
  EXPECT_EQ(e4m3_decode(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(e4m3_encode(1.0625f), 0x38);  // between 1 and 1.125: even mantissa
  EXPECT_EQ(e4m3_encode(1.1875f), 0x3A);  // between 1.125 and 1.25: even mantissa
  EXPECT_EQ(e4m3_encode(std::ldexp(1.0f, -10)), 0x00);      // subnormal tie to zero
  EXPECT_EQ(e4m3_encode(3 * std::ldexp(1.0f, -10)), 0x02);  // subnormal tie to the even neighbour
  EXPECT_EQ(e4m3_encode(7.5f * std::ldexp(1.0f, -9)), 0x08);  // subnormal-normal tie: the even normal
  EXPECT_EQ(e4m3_encode(464.0f), 0x7E);  // saturates rather than reaching the NaN code
  EXPECT_EQ(e4m3_encode(1e10f), 0x7E);
  EXPECT_EQ(e4m3_encode(-500.0f), 0xFE);
}

TEST(Nvfp4, HandMadeTensorQuantisesExactly) {
  // amax(W) = 6 * 448 makes the tensor scale exactly 1; block 0 has amax 6, so its scale is 1 and
  // the codes are the values themselves; block 1 holds the tensor amax (scale 448); block 2 is zero.
  const std::vector<float> b0 = {6, 0, 0.5f, 1, 1.5f, 2, 3, 4, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5, -6};
  const std::vector<int> c0 = {7, 0, 1, 2, 3, 4, 5, 6, 0, 2, 2, 4, 4, 6, 6, 15};
  at::Tensor w = at::zeros({2, 48});
  for (int j = 0; j < 16; ++j) w[0][j] = b0[size_t(j)];
  w[0][16] = 2688;  // 6 * 448
  w[0][17] = -448;  // -448 / 448 = -1: code 10
  w[1][33] = 1;     // row 1: block scale e4m3(1/6), the value lands on a code after rounding
  Nvfp4Tensor q = nvfp4_quantize_reference(w);
  EXPECT_EQ(q.tensor_scale.item<float>(), 1.0f);
  EXPECT_EQ(q.packed.sizes(), at::IntArrayRef({2, 24}));
  EXPECT_EQ(q.block_scale.sizes(), at::IntArrayRef({2, 3}));
  const uint8_t* pk = q.packed.data_ptr<uint8_t>();
  const uint8_t* ps = q.block_scale.data_ptr<uint8_t>();
  EXPECT_EQ(ps[0], 0x38);  // 1.0
  EXPECT_EQ(ps[1], 0x7E);  // 448
  EXPECT_EQ(ps[2], 0x00);  // all-zero block
  for (int j = 0; j < 16; j += 2)  // element 2i in the low nibble
    EXPECT_EQ(pk[j / 2], uint8_t(c0[size_t(j)] | (c0[size_t(j + 1)] << 4))) << "byte " << j / 2;
  EXPECT_EQ(pk[8], uint8_t(7 | (10 << 4)));  // 2688 / 448 = 6 and -448 / 448 = -1
  for (int j = 16; j < 24; ++j) EXPECT_EQ(pk[j], 0) << "zero block byte " << j;
  // Dequantisation gives code * sf * s2; the zero block reads 0 with sf 0 or ModelOpt's 1.0.
  at::Tensor d = nvfp4_dequantize_reference(q);
  for (int j = 0; j < 16; ++j) EXPECT_EQ(d[0][j].item<float>(), e2m1_decode(uint8_t(c0[size_t(j)]))) << j;
  EXPECT_EQ(d[0][16].item<float>(), 2688.0f);
  EXPECT_EQ(d[0][17].item<float>(), -448.0f);
  q.block_scale[0][2] = 0x38;
  EXPECT_TRUE(test::all_equal(nvfp4_dequantize_reference(q).narrow(1, 32, 16)[0], at::zeros({16})));
  // Row 1: sf = e4m3(1 / 6), then 1 / sf rounds to the nearest code.
  const float sf = e4m3_decode(ps[3 + 2]);
  EXPECT_EQ(sf, e4m3_decode(e4m3_encode(1.0f / 6.0f)));
  EXPECT_EQ(d[1][33].item<float>(), e2m1_decode(e2m1_encode(1.0f / sf)) * sf);
}

TEST(Nvfp4, OddShapesStayWithinTheFormatsError) {
  for (int64_t n : {1, 19, 111})
    for (int64_t k : {16, 4112}) {
      at::manual_seed(n * k);
      at::Tensor w = at::randn({n, k}) * 3;
      for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
        at::Tensor x = w.to(dt);
        at::Tensor d = nvfp4_dequantize_reference(nvfp4_quantize_reference(x));
        // Per block: E2M1's widest gap is 2 (4 to 6) at scale bmax/6 (times E4M3's rounding, 1/16).
        at::Tensor bmax = x.to(at::kFloat).abs().view({n, k / 16, 16}).amax(-1, true);
        at::Tensor err = (d - x.to(at::kFloat)).abs().view({n, k / 16, 16});
        EXPECT_TRUE((err <= bmax * (1.0 / 6.0) * (17.0 / 16.0) + 1e-6).all().item<bool>()) << n << "x" << k << " " << dt;
      }
    }
}

TEST(Nvfp4, BadShapesAreNamed) {
  EXPECT_TRUE(test::throws_with([] { nvfp4_quantize_reference(at::zeros({4, 24})); }, {"multiple of 16", "[4, 24]"}));
  Nvfp4Tensor q = nvfp4_quantize_reference(at::zeros({4, 32}));
  EXPECT_EQ(q.tensor_scale.item<float>(), 1.0f);  // an all-zero tensor
  Nvfp4Tensor bad = q;
  bad.block_scale = at::zeros({4, 3}, at::kByte);
  EXPECT_TRUE(test::throws_with([&] { nvfp4_dequantize_reference(bad); }, {"block scales", "[4, 2]", "[4, 3]"}));
  bad = q;
  bad.block_scale = at::Tensor();
  EXPECT_TRUE(test::throws_with([&] { nvfp4_dequantize_reference(bad); }, {"block scales"}));
  bad = q;
  bad.packed = at::zeros({4, 12}, at::kByte);  // K = 24
  EXPECT_TRUE(test::throws_with([&] { nvfp4_dequantize_reference(bad); }, {"K = 24", "multiple of 16"}));
}

TEST(Nvfp4, StacksQuantiseEachMatrixOnItsOwn) {
  at::manual_seed(3);
  at::Tensor w = at::randn({3, 5, 32});
  w[1].mul_(100);
  w[2].zero_();
  Nvfp4Tensor q = nvfp4_quantize_reference(w);
  EXPECT_EQ(q.packed.sizes(), at::IntArrayRef({3, 5, 16}));
  EXPECT_EQ(q.block_scale.sizes(), at::IntArrayRef({3, 5, 2}));
  EXPECT_EQ(q.tensor_scale.sizes(), at::IntArrayRef({3}));
  for (int64_t e = 0; e < 3; ++e) {
    Nvfp4Tensor one = nvfp4_quantize_reference(w[e]);
    EXPECT_TRUE(test::all_equal(q.packed[e], one.packed)) << e;
    EXPECT_TRUE(test::all_equal(q.block_scale[e], one.block_scale)) << e;
    EXPECT_EQ(q.tensor_scale[e].item<float>(), one.tensor_scale.item<float>()) << e;
    EXPECT_TRUE(test::all_equal(nvfp4_dequantize_reference(q)[e], nvfp4_dequantize_reference(one))) << e;
  }
  EXPECT_EQ(q.tensor_scale[2].item<float>(), 1.0f);
  Nvfp4Tensor bad = q;
  bad.tensor_scale = at::ones({}, at::kFloat);
  EXPECT_TRUE(test::throws_with([&] { nvfp4_dequantize_reference(bad); }, {"tensor scale", "[3]"}));
  bad.tensor_scale = at::Tensor();
  EXPECT_TRUE(test::throws_with([&] { nvfp4_dequantize_reference(bad); }, {"missing tensor scale"}));
}

TEST(Nvfp4, KernelLayoutIsAPermutationThatTheGemmDecodes) {
  namespace layout = kernels::nvfp4_layout;
  std::vector<int> seen(32, 0);  // a permutation of the 32 bits
  for (int i = 0; i < 32; ++i) ++seen[size_t(layout::kernel_bit(i))];
  EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), 32);
  at::manual_seed(4);
  at::Tensor w = at::randn({7, 64});
  Nvfp4Tensor q = nvfp4_quantize_reference(w);
  Nvfp4Tensor k = nvfp4_to_kernel_layout(q);
  EXPECT_TRUE(k.kernel_layout);
  EXPECT_TRUE(test::all_equal(nvfp4_to_modelopt_layout(k).packed, q.packed));
  EXPECT_TRUE(test::all_equal(nvfp4_dequantize_reference(k), nvfp4_dequantize_reference(q)));
  // The GEMM's decode, in host arithmetic: pair_bits read as two bf16 values is e2m1 * 2^-126
  // (0.5 as the subnormal 2^-127) with the code's sign, for every element of every word.
  const uint8_t* a = q.packed.data_ptr<uint8_t>();
  const uint8_t* b = k.packed.data_ptr<uint8_t>();
  auto bf16 = [](uint32_t bits) {
    float f;
    const uint32_t u = bits << 16;
    std::memcpy(&f, &u, 4);
    return double(f);
  };
  int negatives = 0, halves = 0;
  for (int64_t word = 0; word < q.packed.numel() / 4; ++word) {
    uint32_t kw = 0;
    for (int i = 0; i < 4; ++i) kw |= uint32_t(b[word * 4 + i]) << (8 * i);
    EXPECT_EQ(layout::to_modelopt_word(layout::to_kernel_word(kw)), kw);
    for (int j = 0; j < 8; ++j) {
      const uint8_t byte = a[word * 4 + j / 2];
      const uint8_t code = j % 2 == 0 ? byte & 0xF : byte >> 4;
      const uint32_t pair = layout::pair_bits(kw, j / 2);
      const double got = bf16(j % 2 == 0 ? pair & 0xFFFF : pair >> 16) * std::ldexp(1.0, 126);
      ASSERT_EQ(got, double(e2m1_decode(code))) << "word " << word << " element " << j << " code " << int(code);
      if (std::signbit(got) != bool(code >> 3)) ADD_FAILURE() << "sign of word " << word << " element " << j;
      negatives += code >> 3;
      halves += (code & 7) == 1;  // 0.5: the subnormal case
    }
  }
  EXPECT_GT(negatives, 100);
  EXPECT_GT(halves, 10);
  // Every code in every slot of a word (all 2^32 words would be too many; every nibble value in
  // every position is enough for a bit permutation).
  for (int j = 0; j < 8; ++j)
    for (uint32_t code = 0; code < 16; ++code) {
      const uint32_t word = code << (4 * j);
      const uint32_t pair = layout::pair_bits(layout::to_kernel_word(word), j / 2);
      const double got = bf16(j % 2 == 0 ? pair & 0xFFFF : pair >> 16) * std::ldexp(1.0, 126);
      EXPECT_EQ(got, double(e2m1_decode(uint8_t(code)))) << "slot " << j << " code " << code;
      EXPECT_EQ(std::signbit(got), bool(code >> 3)) << "slot " << j << " code " << code;
      const uint32_t other = layout::pair_bits(layout::to_kernel_word(word), (j / 2 + 1) % 4);
      EXPECT_EQ(other, 0u) << "slot " << j << " leaks into another pair";
    }
  EXPECT_TRUE(test::throws_with([&] { nvfp4_to_kernel_layout(k); }, {"already in the kernel layout"}));
}

TEST(Nvfp4, KernelLayoutPlacesEachWarpStepAsOneTile) {
  // What the GEMM's lanes read, written from the kernel's side: in a tile (32 whole rows x 256 K),
  // lane 4g + t's 16 bytes at 1024 r (+ 512) are blocks 2t, 2t+1 (8+2t, 9+2t) of row g + 8r, and
  // its scale word r holds the scales of blocks 2t, 2t+1, 8+2t, 9+2t. K tails of tiled rows follow
  // the tiles row-major; the last N % 32 rows are row-major at their old place.
  namespace layout = kernels::nvfp4_layout;
  at::manual_seed(6);
  struct Shape { int64_t E, N, K; };
  for (const Shape& sh : {Shape{1, 70, 560}, Shape{1, 32, 256}, Shape{1, 19, 48}, Shape{2, 33, 4112}, Shape{3, 64, 16}}) {
    SCOPED_TRACE("E " + std::to_string(sh.E) + " N " + std::to_string(sh.N) + " K " + std::to_string(sh.K));
    at::Tensor w = at::randn({sh.E, sh.N, sh.K});
    Nvfp4Tensor q = nvfp4_quantize_reference(sh.E == 1 ? w[0] : w);
    Nvfp4Tensor k = nvfp4_to_kernel_layout(q);
    Nvfp4Tensor back = nvfp4_to_modelopt_layout(k);
    EXPECT_TRUE(test::all_equal(back.packed, q.packed));
    EXPECT_TRUE(test::all_equal(back.block_scale, q.block_scale));
    EXPECT_TRUE(test::all_equal(nvfp4_dequantize_reference(k), nvfp4_dequantize_reference(q)));
    const int64_t N = sh.N, nb = sh.K / 16, n32 = N / 32 * 32, steps = nb / 16, nb32 = steps * 16;
    for (bool scale : {false, true}) {  // block_place is a bijection
      std::vector<int> seen(size_t(N * nb), 0);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t b = 0; b < nb; ++b) ++seen[size_t(layout::block_place(n, b, N, nb, scale))];
      EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), N * nb);
    }
    for (int64_t n = 0; n < N; ++n)  // block_at inverts the codes' places
      for (int64_t b = 0; b < nb; ++b) {
        const layout::RowBlock<int64_t> rb = layout::block_at(layout::block_place(n, b, N, nb, false), N, nb);
        ASSERT_TRUE(rb.n == n && rb.b == b) << "row " << n << " block " << b << " came back as " << rb.n << ", " << rb.b;
        for (bool scale : {false, true})  // the kernels' 32-bit arithmetic gives the same places
          ASSERT_EQ(int64_t(layout::block_place<uint32_t>(uint32_t(n), uint32_t(b), uint32_t(N), uint32_t(nb), scale)),
                    layout::block_place(n, b, N, nb, scale));
        const layout::RowBlock<uint32_t> r32 = layout::block_at<uint32_t>(
            uint32_t(layout::block_place(n, b, N, nb, false)), uint32_t(N), uint32_t(nb));
        ASSERT_TRUE(r32.n == n && r32.b == b) << "row " << n << " block " << b << " (32-bit)";
      }
    at::Tensor qp = q.packed.contiguous(), kp = k.packed.contiguous();
    at::Tensor qs = q.block_scale.contiguous().view(at::kByte), ks = k.block_scale.contiguous().view(at::kByte);
    for (int64_t e = 0; e < sh.E; ++e) {
      const uint8_t* a = qp.data_ptr<uint8_t>() + e * N * nb * 8;
      const uint8_t* c = kp.data_ptr<uint8_t>() + e * N * nb * 8;
      const uint8_t* as = qs.data_ptr<uint8_t>() + e * N * nb;
      const uint8_t* cs = ks.data_ptr<uint8_t>() + e * N * nb;
      auto word = [](const uint8_t* p) {
        uint32_t v = 0;
        for (int i = 0; i < 4; ++i) v |= uint32_t(p[i]) << (8 * i);
        return v;
      };
      // Block b of row n at kernel block index `at`: both words permuted, the scale byte moved.
      auto expect_block = [&](int64_t n, int64_t b, int64_t at, int64_t scale_at) {
        for (int i = 0; i < 2; ++i)
          ASSERT_EQ(word(c + 8 * at + 4 * i), layout::to_kernel_word(word(a + 8 * (n * nb + b) + 4 * i)))
              << "row " << n << " block " << b;
        ASSERT_EQ(cs[scale_at], as[n * nb + b]) << "scale of row " << n << " block " << b;
      };
      int64_t tiles_checked = 0;
      for (int64_t rt = 0; rt < n32 / 32; ++rt)
        for (int64_t sc = 0; sc < steps; ++sc, ++tiles_checked) {
          const int64_t tile = rt * steps + sc;
          for (int lane = 0; lane < 32; ++lane)
            for (int r = 0; r < 4; ++r) {
              const int g = lane / 4, t = lane % 4;
              const int64_t n = 32 * rt + g + 8 * r;
              const int blocks[4] = {2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t};
              for (int j = 0; j < 4; ++j)
                expect_block(n, 16 * sc + blocks[j], tile * 512 + (1024 * r + 512 * (j / 2) + 16 * lane + 8 * (j % 2)) / 8,
                             tile * 512 + 16 * lane + 4 * r + j);
            }
        }
      EXPECT_EQ(tiles_checked, (n32 / 32) * steps);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t b = n < n32 ? nb32 : 0; b < nb; ++b) {
          const int64_t at = n < n32 ? n32 * nb32 + n * (nb - nb32) + (b - nb32) : n * nb + b;
          expect_block(n, b, at, at);
        }
    }
  }
}

// The wgmma GEMM's data flow (kernels/nvfp4_wgmma.cu) replayed on the host over a real
// kernel-layout matrix: each warp's loads (its half of a 32-row tile, 16 bytes at 1024 r + 16 lane
// and 512 further, the scale words of its two rows), the blocks it decodes per stage, the A
// fragment registers as the kernel fills them, placed by wgmma's register layout for A (PTX ISA:
// per warp mma.m16n8k16's), and B read as 16 contiguous values of the permuted activations
// (wgmma_source) per k16 step. The sum over every step and slot must be the reference product.
TEST(Nvfp4, WgmmaDataFlowComputesTheProduct) {
  namespace layout = kernels::nvfp4_layout;
  std::vector<int> seen(256, 0);
  for (int q = 0; q < 256; ++q) ++seen[size_t(layout::wgmma_source(q))];
  EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), 256) << "wgmma_source is not a permutation";
  at::manual_seed(14);
  const int64_t N = 128, K = 512, M = 5, num_super = K / 256;
  const Nvfp4Tensor q = nvfp4_quantize_reference(at::randn({N, K}));
  const Nvfp4Tensor kq = nvfp4_to_kernel_layout(q);
  const at::Tensor x = at::randn({M, K}, at::kDouble);
  const uint8_t* codes = kq.packed.data_ptr<uint8_t>();
  const uint8_t* scales = kq.block_scale.view(at::kByte).data_ptr<uint8_t>();
  auto word = [](const uint8_t* p) {
    uint32_t w = 0;
    for (int i = 0; i < 4; ++i) w |= uint32_t(p[i]) << (8 * i);
    return w;
  };
  // Value i (0..15) of a block given as its two kernel-layout words and its scale byte.
  auto value = [](uint32_t w0, uint32_t w1, uint8_t sf, int i) {
    const uint32_t w = layout::to_modelopt_word(i < 8 ? w0 : w1);
    return double(e2m1_decode(uint8_t((w >> (4 * (i % 8))) & 0xF))) * double(e4m3_decode(sf));
  };
  at::Tensor xp = at::empty_like(x);  // the permute kernel
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xp[m][k] = x[m][k / 256 * 256 + layout::wgmma_source(int(k % 256))];
  const double* xpd = xp.data_ptr<double>();
  at::Tensor y = at::zeros({M, N}, at::kDouble);
  double* yd = y.data_ptr<double>();
  for (int64_t row0 = 0; row0 < N; row0 += 64)  // a block's 64 rows
    for (int warp = 0; warp < 4; ++warp)
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4, r0 = 2 * (warp % 2);
        const int64_t first_tile = (row0 / 32 + warp / 2) * num_super;
        for (int64_t sc = 0; sc < num_super; ++sc) {
          const uint8_t* c_at = codes + (first_tile + sc) * layout::kTileUnits * 8;
          const uint8_t* s_at = scales + (first_tile + sc) * layout::kTileUnits + 16 * lane + 4 * r0;
          for (int c = 0; c < 4; ++c) {
            double d[2][16];  // rows r0 and r0 + 1 (g and g + 8 of the warp's 16), block c
            for (int h = 0; h < 2; ++h) {
              const uint8_t* p = c_at + 1024 * (r0 + h) + 16 * lane + (c < 2 ? 0 : 512) + ((c & 1) ? 8 : 0);
              for (int i = 0; i < 16; ++i) d[h][i] = value(word(p), word(p + 4), s_at[4 * h + c], i);
            }
            for (int st = 0; st < 4; ++st) {  // k16 step 4c + st of this 256-wide step
              // The kernel's A fragment, a[r] = {d[0][2 st], d[1][2 st], d[0][2 st + 1], d[1][2 st + 1]}
              // with d[h][i] holding values 2i, 2i+1 of row h's block, read as wgmma does: element v =
              // 2r + half is at row 16 warp + g + 8 ((v / 2) % 2), k-slot 2t + v % 2 + 8 (v / 4).
              const int regs[4][2] = {{0, 2 * st}, {1, 2 * st}, {0, 2 * st + 1}, {1, 2 * st + 1}};  // (h, i)
              for (int r = 0; r < 4; ++r)
                for (int half = 0; half < 2; ++half) {
                  const int v = 2 * r + half, slot = 2 * t + v % 2 + 8 * (v / 4);
                  const double a = d[regs[r][0]][2 * regs[r][1] + half];
                  const int64_t row = row0 + 16 * warp + g + 8 * ((v / 2) % 2);
                  const int64_t k = sc * 256 + 64 * c + 16 * st + slot;  // B: contiguous in the permuted row
                  for (int64_t m = 0; m < M; ++m) yd[m * N + row] += a * xpd[m * K + k];
                }
            }
          }
        }
      }
  y *= double(kq.tensor_scale.item<float>());
  const at::Tensor ref = nvfp4_linear_reference(x, q);
  EXPECT_TRUE(test::all_close(y, ref, 1e-9, 1e-9)) << "max |diff| " << (y - ref).abs().max().item<double>();
}

// The process's NVFP4 GEMM choice (recipe kernels.nvfp4_gemm, flag --nvfp4-gemm): auto until set,
// set and restored by select_nvfp4_gemm, the four names and nothing else. CPU inputs never take a
// CUDA kernel whatever the choice.
TEST(Nvfp4, GemmChoiceIsSetByNameAndCpuInputsKeepTheReference) {
  EXPECT_EQ(nvfp4_gemm_selected(), Nvfp4Gemm::kAuto);
  for (const char* name : {"auto", "splitk", "wgmma", "stagedtiles"})
    EXPECT_STREQ(nvfp4_gemm_name(parse_nvfp4_gemm(name)), name);
  EXPECT_TRUE(test::throws_with([] { parse_nvfp4_gemm("wmma"); },
                                {"'wmma'", "auto", "splitk", "wgmma", "stagedtiles"}));
  EXPECT_THROW(select_nvfp4_gemm(Nvfp4Gemm::kWgmma64), std::exception);  // a block shape, not a choice
  EXPECT_EQ(select_nvfp4_gemm(Nvfp4Gemm::kWgmma), Nvfp4Gemm::kAuto);
  EXPECT_TRUE(nvfp4_wgmma_selected());
  const Nvfp4Tensor q = nvfp4_to_kernel_layout(nvfp4_quantize_reference(at::randn({64, 256})));
  EXPECT_FALSE(nvfp4_wgmma_usable(at::zeros({32, 256}).to(at::kBFloat16), q));
  EXPECT_STREQ(nvfp4_linear_path(at::zeros({32, 256}).to(at::kBFloat16), q), "reference");
  const Nvfp4Tensor stack = nvfp4_to_kernel_layout(nvfp4_quantize_reference(at::randn({4, 64, 256})));
  EXPECT_STREQ(nvfp4_grouped_linear_path(at::zeros({128, 256}).to(at::kBFloat16), stack, 128), "reference");
  EXPECT_EQ(select_nvfp4_gemm(Nvfp4Gemm::kAuto), Nvfp4Gemm::kWgmma);
}

// The wgmma GEMM's block by the rows per group that carry work: 32, 64 or 128-token tiles; two
// warpgroups with 128-token tiles where N is a multiple of 128, unless one count is forced.
TEST(Nvfp4, WgmmaBlockFollowsTheRowsPerGroup) {
  struct Case {
    int64_t rows, groups, N;
    int forced, tokens, warpgroups;
  };
  const Case cases[] = {{17, 1, 8192, 0, 32, 1},    {32, 1, 8192, 0, 32, 1},     {33, 1, 8192, 0, 64, 1},
                        {64, 1, 8192, 0, 64, 1},    {65, 1, 8192, 0, 128, 2},    {4097, 1, 8192, 0, 128, 2},
                        {4097, 1, 192, 0, 128, 1},  {2048, 64, 1024, 0, 32, 1},  {2049, 64, 1024, 0, 64, 1},
                        {65536, 64, 1024, 0, 128, 2}, {65536, 64, 1024, 1, 128, 1}, {19, 1, 128, 2, 32, 2}};
  for (const Case& c : cases) {
    const WgmmaBlock b = wgmma_block(c.rows, c.groups, c.N, c.forced);
    EXPECT_EQ(b.tokens, c.tokens) << c.rows << " rows, " << c.groups << " groups, N " << c.N;
    EXPECT_EQ(b.warpgroups, c.warpgroups) << c.rows << " rows, " << c.groups << " groups, N " << c.N;
  }
  EXPECT_EQ(wgmma_warpgroups(Nvfp4Gemm::kWgmma), 0);
  EXPECT_EQ(wgmma_warpgroups(Nvfp4Gemm::kWgmma64), 1);
  EXPECT_EQ(wgmma_warpgroups(Nvfp4Gemm::kWgmma128), 2);
  EXPECT_TRUE(is_wgmma(Nvfp4Gemm::kWgmma128));
  EXPECT_FALSE(is_wgmma(Nvfp4Gemm::kSplitK));
  // The grouped staged kernel's stacks: every expert's codes (N K / 2 bytes) and scales (N K / 16)
  // on 16 bytes.
  EXPECT_TRUE(grouped_stack_aligned(1024, 1024));
  EXPECT_TRUE(grouped_stack_aligned(96, 1056));
  EXPECT_TRUE(grouped_stack_aligned(48, 256));
  EXPECT_TRUE(grouped_stack_aligned(19, 512));    // 608 scale bytes per expert
  EXPECT_FALSE(grouped_stack_aligned(19, 288));   // 342
  EXPECT_FALSE(grouped_stack_aligned(64, 4112));  // K not a multiple of 32
  EXPECT_TRUE(grouped_stack_aligned(1, 256));     // one row: 128 code bytes, 16 scale bytes
  EXPECT_TRUE(wgmma_warpgroups_fit(192, 1));
  EXPECT_FALSE(wgmma_warpgroups_fit(192, 2));
  EXPECT_TRUE(wgmma_warpgroups_fit(256, 2));
}

TEST(Nvfp4, ActivationQuantisationEqualsTheScalarEncoders) {
  // Every code and tie in row 0; dynamic scales are per row (amax / (6 * 448)).
  at::manual_seed(5);
  for (int64_t m : {1, 19}) {
    at::Tensor x = at::randn({m, 48}) * 7;
    x[0].narrow(0, 0, 16).copy_(at::tensor({6.f, 0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, .25f, .75f, 1.25f, 1.75f,
                                            2.5f, 3.5f, 5.f, -6.f}));
    if (m > 1) x[1].mul_(1000);  // a loud row does not change the others' scales
    at::Tensor s;
    at::Tensor fq = nvfp4_fake_quantize_activations(x, at::Tensor(), &s);
    ASSERT_EQ(s.sizes(), at::IntArrayRef({m, 1}));
    for (int64_t r = 0; r < m; ++r) {
      const float amax = x[r].abs().max().item<float>();
      const float sr = float(double(amax) / (6.0 * 448.0));
      EXPECT_EQ(s[r][0].item<float>(), sr) << r;
      for (int64_t b = 0; b < 3; ++b) {
        const float bmax = x[r].narrow(0, 16 * b, 16).abs().max().item<float>();
        const uint8_t sf = e4m3_encode(bmax / (sr * 6.0f));
        for (int64_t j = 0; j < 16; ++j) {
          const float v = x[r][16 * b + j].item<float>();
          const float want = e2m1_decode(e2m1_encode(v / (e4m3_decode(sf) * sr))) * e4m3_decode(sf);
          ASSERT_EQ(fq[r][16 * b + j].item<float>(), want) << "row " << r << " element " << 16 * b + j;
        }
      }
    }
    // A static scale is used as given, for every row.
    nvfp4_fake_quantize_activations(x, at::scalar_tensor(0.01f), &s);
    EXPECT_EQ(s.item<float>(), 0.01f);
  }
  at::Tensor s;
  EXPECT_TRUE(test::all_equal(nvfp4_fake_quantize_activations(at::zeros({2, 16}), at::Tensor(), &s), at::zeros({2, 16})));
  EXPECT_TRUE(test::all_equal(s, at::ones({2, 1})));
}

TEST(Nvfp4, LinearReferencesAgreeWithDequantisedMatmul) {
  at::manual_seed(6);
  for (int64_t m : {1, 19, 111})
    for (auto dt : {at::kFloat, at::kBFloat16}) {
      at::Tensor w = at::randn({19, 48}), x = at::randn({m, 48}).to(dt);
      Nvfp4Tensor q = nvfp4_quantize_reference(w);
      at::Tensor y = nvfp4_linear_reference(x, q);
      EXPECT_EQ(y.scalar_type(), dt);
      at::Tensor expect = at::matmul(x.to(at::kDouble), nvfp4_dequantize_reference(q, at::kDouble).t());
      const double tol = dt == at::kFloat ? 1e-5 : 1e-2;
      EXPECT_LE((y.to(at::kDouble) - expect).abs().max().item<double>(), tol * expect.abs().max().item<double>());
      // Kernel layout in, same answer.
      EXPECT_TRUE(test::all_equal(nvfp4_linear_reference(x, nvfp4_to_kernel_layout(q)), y));
      // W4A4: the activations quantised first, the product scaled by their tensor scale.
      Nvfp4LinearOptions o;
      o.w4a4 = true;
      at::Tensor s;
      at::Tensor xq = nvfp4_fake_quantize_activations(x, at::Tensor(), &s);
      at::Tensor y4 = nvfp4_linear_reference(x, q, o);
      at::Tensor e4 = at::matmul(xq.to(at::kDouble), nvfp4_dequantize_reference(q, at::kDouble).t()) * s.to(at::kDouble);
      EXPECT_LE((y4.to(at::kDouble) - e4).abs().max().item<double>(), tol * e4.abs().max().item<double>());
      EXPECT_GT((y4.to(at::kDouble) - expect).abs().max().item<double>(), 0.0);  // it does quantise
    }
  EXPECT_TRUE(test::throws_with([] { nvfp4_linear_reference(at::ones({2, 32}), nvfp4_quantize_reference(at::ones({3, 48}))); },
                                {"input must be [M, 48]", "[2, 32]"}));
}

TEST(Nvfp4, GroupedReferenceIsOneLinearPerExpert) {
  at::manual_seed(7);
  at::Tensor w = at::randn({4, 19, 32});
  Nvfp4Tensor q = nvfp4_quantize_reference(w);
  const std::vector<int64_t> rows = {3, 0, 1, 19};  // an empty expert too
  at::Tensor offsets = at::tensor({0L, 3L, 3L, 4L, 23L});
  at::Tensor x = at::randn({23, 32});
  at::Tensor y = nvfp4_grouped_linear_reference(x, q, offsets);
  int64_t start = 0;
  for (int64_t e = 0; e < 4; ++e) {
    if (rows[size_t(e)] == 0) continue;
    Nvfp4Tensor one{q.packed[e], q.block_scale[e], q.tensor_scale[e], false, at::Tensor()};
    EXPECT_TRUE(test::all_equal(y.narrow(0, start, rows[size_t(e)]),
                                nvfp4_linear_reference(x.narrow(0, start, rows[size_t(e)]), one)))
        << e;
    start += rows[size_t(e)];
  }
  // Rows past the last expert's belong to none: zero (an expert exchange's padding rows).
  const at::Tensor short_y = nvfp4_grouped_linear_reference(x, q, at::tensor({0L, 3L, 3L, 4L, 20L}));
  EXPECT_TRUE(test::all_equal(short_y.narrow(0, 0, 20), y.narrow(0, 0, 20)));
  EXPECT_TRUE(test::all_equal(short_y.narrow(0, 20, 3), at::zeros({3, short_y.size(1)}, short_y.options())));
  EXPECT_TRUE(test::throws_with([&] { nvfp4_grouped_linear_reference(x, q, at::tensor({0L, 3L, 3L, 4L, 25L})); },
                                {"offsets must run from 0 to at most the rows (23)"}));
}

TEST(Nvfp4, AlignedRowsRunThroughTheirSegmentsExpert) {
  // The MoE layer's padded layout (segments of 16-row multiples, zero rows between): each real row
  // gets its expert's product, as in the unpadded grouped call.
  at::manual_seed(8);
  Nvfp4Tensor q = nvfp4_quantize_reference(at::randn({3, 19, 32}));
  at::Tensor offsets = at::tensor({0L, 5L, 5L, 22L});
  at::Tensor x = at::randn({22, 32});
  const std::vector<int64_t> dest = {0, 1, 2, 3, 4, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32};
  at::Tensor rows = at::tensor(dest, at::kLong);
  at::Tensor xp = at::zeros({48, 32}).index_copy_(0, rows, x);
  at::Tensor got = nvfp4_grouped_linear_aligned(xp, q, at::tensor({16, 16, 48}, at::kInt)).index_select(0, rows);
  EXPECT_TRUE(test::all_close(got, nvfp4_grouped_linear_reference(x, q, offsets), 1e-6, 1e-6));
  EXPECT_TRUE(test::throws_with([&] { nvfp4_grouped_linear_aligned(xp, q, at::tensor({16, 48}, at::kInt)); },
                                {"ends must be [E]", "[2]"}));
}

}  // namespace
}  // namespace kiln::kernels
