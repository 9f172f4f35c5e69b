// The NVFP4 dispatch table (kernels/nvfp4_dispatch.h) walked on the CPU: each shape's kernel under
// every choice, at the rows where the table changes its answer.
#include <gtest/gtest.h>

#include <string>

#include "kernels/nvfp4_dispatch.h"

namespace kiln::kernels {
namespace {

Nvfp4Call dense(int64_t rows, int64_t out, bool wgmma_usable = true, bool bf16 = true) {
  Nvfp4Call c;
  c.served = true, c.bf16 = bf16, c.rows = rows, c.out = out, c.wgmma_usable = wgmma_usable;
  c.grouped_mm = true;
  return c;
}

Nvfp4Call stack(int64_t rows, int64_t experts, bool bf16 = true, bool aligned = true, bool grouped_mm = true) {
  Nvfp4Call c = dense(rows, 512, /*wgmma_usable=*/true, bf16);
  c.experts = experts, c.staged_aligned = aligned, c.grouped_mm = grouped_mm;
  return c;
}

std::string kernel(const Nvfp4Call& c, Nvfp4Gemm g) { return nvfp4_kernel_name(nvfp4_kernel(c, g)); }

TEST(Nvfp4Dispatch, DenseShapesTakeTheMeasuredKernel) {
  const Nvfp4Gemm kAuto = Nvfp4Gemm::kAuto;
  // One wide matrix (816B's q, o, unpooler): split-K to 64 rows, wgmma at 65-256, then dequantised.
  for (auto [rows, want] : {std::pair<int64_t, const char*>{1, "splitK"}, {16, "splitK"}, {19, "splitK"},
                            {64, "splitK"}, {65, "wgmma"}, {256, "wgmma"}, {257, "deq+mm"}, {4097, "deq+mm"}})
    EXPECT_EQ(kernel(dense(rows, 8192), kAuto), want) << rows << " rows";
  // A narrower matrix (muse-small's) or no wgmma (not Hopper, fp32): never wgmma under auto.
  EXPECT_EQ(kernel(dense(111, 4096), kAuto), "deq+mm");
  EXPECT_EQ(kernel(dense(111, 8192, /*wgmma_usable=*/false), kAuto), "deq+mm");
  EXPECT_EQ(kernel(dense(19, 8192, false, /*bf16=*/false), kAuto), "splitK");
  // Forced wgmma: wherever usable above 16 rows; decode keeps split-K, an unusable shape its path.
  EXPECT_EQ(kernel(dense(16, 4096), Nvfp4Gemm::kWgmma), "splitK");
  EXPECT_EQ(kernel(dense(17, 4096), Nvfp4Gemm::kWgmma), "wgmma");
  EXPECT_EQ(kernel(dense(4097, 4096), Nvfp4Gemm::kWgmma), "wgmma");
  EXPECT_EQ(kernel(dense(4097, 4096, false), Nvfp4Gemm::kWgmma), "deq+mm");
  // split-K and staged tiles concern the experts: one matrix keeps auto's answers.
  for (Nvfp4Gemm g : {Nvfp4Gemm::kSplitK, Nvfp4Gemm::kStagedTiles})
    for (int64_t rows : {1, 19, 111, 4097}) EXPECT_EQ(kernel(dense(rows, 8192), g), kernel(dense(rows, 8192), kAuto));
  // Not served (CPU, another dtype, the ModelOpt layout): the reference, whatever the choice.
  Nvfp4Call cpu = dense(111, 8192);
  cpu.served = false;
  for (Nvfp4Gemm g : {Nvfp4Gemm::kAuto, Nvfp4Gemm::kWgmma, Nvfp4Gemm::kSplitK}) EXPECT_EQ(kernel(cpu, g), "reference");
}

TEST(Nvfp4Dispatch, ExpertsTakeTheirKernelByRowsPerExpert) {
  const int64_t E = 4;
  struct Row {
    int64_t rows;
    const char *automatic, *splitk, *tiles;
  };
  // 4 experts: split-K to 16 rows per expert, the staged kernel per expert at 17-64, tiled at
  // 65-192, then the dequantised stack; split-K forgoes the staged kernel, staged tiles tiles it.
  const Row rows[] = {{1, "splitK", "splitK", "splitK"},
                      {64, "splitK", "splitK", "splitK"},
                      {65, "staged", "splitK", "staged tiles"},
                      {256, "staged", "splitK", "staged tiles"},
                      {257, "staged tiles", "deq+grouped_mm", "staged tiles"},
                      {768, "staged tiles", "deq+grouped_mm", "staged tiles"},
                      {769, "deq+grouped_mm", "deq+grouped_mm", "deq+grouped_mm"},
                      {4097, "deq+grouped_mm", "deq+grouped_mm", "deq+grouped_mm"}};
  for (const Row& r : rows) {
    EXPECT_EQ(kernel(stack(r.rows, E), Nvfp4Gemm::kAuto), r.automatic) << r.rows << " rows";
    EXPECT_EQ(kernel(stack(r.rows, E), Nvfp4Gemm::kSplitK), r.splitk) << r.rows << " rows";
    EXPECT_EQ(kernel(stack(r.rows, E), Nvfp4Gemm::kStagedTiles), r.tiles) << r.rows << " rows";
    // Forced wgmma: every call above 16 rows per expert.
    EXPECT_EQ(kernel(stack(r.rows, E), Nvfp4Gemm::kWgmma), r.rows > 16 * E ? "wgmma" : "splitK") << r.rows;
  }
  // fp32 and stacks the staged kernel does not take: split-K to 64 rows per expert, then the
  // dequantised weights (a GEMM per expert for fp32, or without torch's grouped GEMM).
  for (int64_t R : {19, 256, 257, 4097}) {
    EXPECT_EQ(kernel(stack(R, E, /*bf16=*/false), Nvfp4Gemm::kAuto), R > 256 ? "deq+mm per expert" : "splitK") << R;
    EXPECT_EQ(kernel(stack(R, E, true, /*aligned=*/false), Nvfp4Gemm::kAuto), R > 256 ? "deq+grouped_mm" : "splitK")
        << R;
    EXPECT_EQ(kernel(stack(R, E, true, true, /*grouped_mm=*/false), Nvfp4Gemm::kSplitK),
              R > 256 ? "deq+mm per expert" : "splitK")
        << R;
  }
}

TEST(Nvfp4Dispatch, ChoicesAreNamedAndPutInPlace) {
  for (const char* name : {"auto", "splitk", "wgmma", "stagedtiles"})
    EXPECT_STREQ(nvfp4_gemm_name(parse_nvfp4_gemm(name)), name);
  EXPECT_THROW(parse_nvfp4_gemm("staged"), std::exception);
  const Nvfp4Gemm before = select_nvfp4_gemm(Nvfp4Gemm::kStagedTiles);
  EXPECT_EQ(nvfp4_gemm_selected(), Nvfp4Gemm::kStagedTiles);
  EXPECT_FALSE(nvfp4_wgmma_selected());
  select_nvfp4_gemm(before);
}

}  // namespace
}  // namespace kiln::kernels
