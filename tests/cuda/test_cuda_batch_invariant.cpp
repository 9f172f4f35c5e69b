// rollout.numerics: bitwise on the GPU: the engine's recorded log-probs and routing are the
// trainer's forward's bit for bit in bf16 and fp32, through a mixed batch, chunked prefill and
// preemption (the same check as the CPU test, on CUDA).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tests/model/batch_invariant_checks.h"

namespace kiln {
namespace {

TEST(CudaBatchInvariant, EngineLogprobsAndRoutingAreTheTrainersBitForBit) {
  const at::Device cuda(at::kCUDA, 0);
  test::check_engine_is_bitwise(at::kBFloat16, 1 << 20, cuda);
  test::check_engine_is_bitwise(at::kFloat, 1 << 20, cuda);
  // Preempted and recomputed: a cache of a few blocks (bf16 entries take half the bytes).
  test::check_engine_is_bitwise(at::kFloat, 8 << 10, cuda);
  test::check_engine_is_bitwise(at::kBFloat16, 4 << 10, cuda);
}

}  // namespace
}  // namespace kiln
