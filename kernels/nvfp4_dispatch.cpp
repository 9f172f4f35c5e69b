// The NVFP4 W4A16 dispatch table: which kernel runs each call shape, and why (the numbers are kiln
// bench nvfp4 and bench rollout on an H100 and an H200; docs/PERFORMANCE.md has the tables), and the
// process's override of it.
#include "kernels/nvfp4_dispatch.h"

#include <atomic>

#include "core/error.h"

namespace kiln::kernels {
namespace {

// Rows (per matrix, or per expert on average) up to which the fused kernels beat dequantising the
// weights: they decode each weight tile once per 8-32 rows, dequantise + cuBLAS once per call.
constexpr int64_t kFusedMaxRows = 64;
// At 16 rows or fewer per matrix (decode) split-K's 16-token chunks win everywhere.
constexpr int64_t kDecodeRows = 16;
// The wgmma GEMM on one matrix of 8192 rows or more at 65-256 tokens (816B's q, o and unpooler):
// 1.15-2.2x dequantise + cuBLAS there. Narrower matrices (muse-small's), more tokens and the
// experts measured faster on split-K or the dequantised weights, so auto keeps them there.
constexpr int64_t kWgmmaMaxRows = 256, kWgmmaMinOut = 8192;
// The experts' grouped staged kernel at 17-192 rows per expert (bf16, an aligned stack): 1.07x
// split-K at 32 rows per expert and 1.26x at 64 on muse-small's experts; above 64 its tiled launch
// took 104 us against the dequantised stack's 150 at 128 rows per expert and lost at 256 (203
// against 176), so the bound lies between; the rollout at 1024 sequences in flight went from 0.88x
// to 0.92x BF16 with it to 192. (The dense staged kernel was fastest at one shape only, 128 rows
// of an 8192 x 4096 matrix, and is left out of the table.)
constexpr int64_t kStagedMaxRows = 192;
// The staged kernel per expert to 64 rows per expert, tiled above: on uneven routing tiles took
// 61 us against 97 at 64 rows per expert, but at 32 (a 256-sequence rollout step) the rollout lost
// with them (1.07x -> 1.02x BF16), their grid sized for every possible tile.
constexpr int64_t kStagedPerExpertMaxRows = kFusedMaxRows;

std::atomic<int> g_selected{int(Nvfp4Gemm::kAuto)};

Nvfp4Kernel dense_kernel(const Nvfp4Call& c, Nvfp4Gemm gemm) {
  if (c.rows <= kDecodeRows) return Nvfp4Kernel::kSplitK;
  if (c.wgmma_usable &&
      (gemm == Nvfp4Gemm::kWgmma || (c.rows > kFusedMaxRows && c.rows <= kWgmmaMaxRows && c.out >= kWgmmaMinOut)))
    return Nvfp4Kernel::kWgmma;
  return c.rows <= kFusedMaxRows ? Nvfp4Kernel::kSplitK : Nvfp4Kernel::kDequantized;
}

Nvfp4Kernel grouped_kernel(const Nvfp4Call& c, Nvfp4Gemm gemm) {
  const int64_t E = c.experts;
  const bool beyond_decode = c.rows > kDecodeRows * E;
  if (beyond_decode && gemm == Nvfp4Gemm::kWgmma && c.wgmma_usable) return Nvfp4Kernel::kWgmma;
  const bool staged_allowed = gemm == Nvfp4Gemm::kAuto || gemm == Nvfp4Gemm::kStagedTiles;
  if (staged_allowed && c.bf16 && c.staged_aligned && beyond_decode && c.rows <= kStagedMaxRows * E)
    return gemm == Nvfp4Gemm::kStagedTiles || c.rows > kStagedPerExpertMaxRows * E ? Nvfp4Kernel::kStagedTiles
                                                                                    : Nvfp4Kernel::kStaged;
  if (c.rows <= kFusedMaxRows * E) return Nvfp4Kernel::kSplitK;
  return c.bf16 && c.grouped_mm ? Nvfp4Kernel::kDequantizedGrouped : Nvfp4Kernel::kDequantizedLoop;
}

}  // namespace

const char* nvfp4_kernel_name(Nvfp4Kernel k) {
  switch (k) {
    case Nvfp4Kernel::kSplitK: return "splitK";
    case Nvfp4Kernel::kStaged: return "staged";
    case Nvfp4Kernel::kStagedTiles: return "staged tiles";
    case Nvfp4Kernel::kWgmma: return "wgmma";
    case Nvfp4Kernel::kDequantized: return "deq+mm";
    case Nvfp4Kernel::kDequantizedGrouped: return "deq+grouped_mm";
    case Nvfp4Kernel::kDequantizedLoop: return "deq+mm per expert";
    default: return "reference";
  }
}

Nvfp4Kernel nvfp4_kernel(const Nvfp4Call& call, Nvfp4Gemm gemm) {
  if (!call.served) return Nvfp4Kernel::kReference;
  return call.experts > 0 ? grouped_kernel(call, gemm) : dense_kernel(call, gemm);
}

Nvfp4Gemm nvfp4_gemm_selected() { return Nvfp4Gemm(g_selected.load(std::memory_order_relaxed)); }

Nvfp4Gemm select_nvfp4_gemm(Nvfp4Gemm gemm) {
  KILN_CHECK(gemm == Nvfp4Gemm::kAuto || gemm == Nvfp4Gemm::kSplitK || gemm == Nvfp4Gemm::kWgmma ||
                 gemm == Nvfp4Gemm::kStagedTiles,
             "nvfp4_gemm: ", int(gemm), " is not a choice (auto, splitk, wgmma or stagedtiles)");
  return Nvfp4Gemm(g_selected.exchange(int(gemm)));
}

bool nvfp4_wgmma_selected() { return nvfp4_gemm_selected() == Nvfp4Gemm::kWgmma; }

Nvfp4Gemm parse_nvfp4_gemm(const std::string& name) {
  if (name == "auto") return Nvfp4Gemm::kAuto;
  if (name == "splitk") return Nvfp4Gemm::kSplitK;
  if (name == "wgmma") return Nvfp4Gemm::kWgmma;
  if (name == "stagedtiles") return Nvfp4Gemm::kStagedTiles;
  KILN_FAIL("must be auto, splitk, wgmma or stagedtiles (got '", name, "')");
}

const char* nvfp4_gemm_name(Nvfp4Gemm gemm) {
  switch (gemm) {
    case Nvfp4Gemm::kSplitK: return "splitk";
    case Nvfp4Gemm::kWgmma: return "wgmma";
    case Nvfp4Gemm::kStagedTiles: return "stagedtiles";
    default: return "auto";
  }
}

}  // namespace kiln::kernels
