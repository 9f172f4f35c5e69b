// rollout.numerics: bitwise on the GPU: the engine's recorded log-probs and routing are the
// trainer's forward's bit for bit in bf16 and fp32, through a mixed batch, chunked prefill,
// preemption and captured decode steps (the same check as the CPU test, on CUDA), and a bf16
// GRPO step's mismatch is 0.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tests/model/batch_invariant_checks.h"
#include "tests/trainer/grpo_fixtures.h"
#include "tests/trainer/small_model.h"
#include "trainer/grpo.h"

namespace kiln {
namespace {

TEST(CudaBatchInvariant, EngineLogprobsAndRoutingAreTheTrainersBitForBit) {
  const at::Device cuda(at::kCUDA, 0);
  test::check_engine_is_bitwise(at::kBFloat16, 1 << 20, cuda);
  test::check_engine_is_bitwise(at::kFloat, 1 << 20, cuda);
  // Preempted and recomputed: a cache of a few blocks (bf16 entries take half the bytes).
  test::check_engine_is_bitwise(at::kFloat, 8 << 10, cuda);
  test::check_engine_is_bitwise(at::kBFloat16, 4 << 10, cuda);
  // Captured decode steps (widths the graphs take): the same bits, preempted too.
  const model::ModelConfig graphed = test::bitwise_graph_config();
  ASSERT_TRUE(rollout::DecodeGraphs::available(model::Muse::init(graphed, 6, at::kBFloat16, cuda), nullptr,
                                                model::Numerics::kBitwise));
  test::check_engine_is_bitwise(at::kBFloat16, 1 << 20, cuda, false, graphed);
  test::check_engine_is_bitwise(at::kBFloat16, 16 << 10, cuda, false, graphed);
}

// The training forward on the GPU's batch-invariant kernels backpropagates through their plain
// forms (straight_through): the gradient is the standard forward's within fp32 rounding.
TEST(CudaBatchInvariant, GradientsMatchTheStandardForward) {
  test::check_bitwise_gradients(at::kFloat, at::Device(at::kCUDA, 0), 1e-4);
  // bf16: the grouped experts' dx kernel and the straight-through norms and router, each gradient
  // as close to fp64 as the standard forward's.
  test::check_bitwise_gradients_bf16(at::Device(at::kCUDA, 0));
}

// GRPO in bf16 on the GPU under bitwise numerics: every mismatch metric exactly 0, replay on and
// off, through micro-batches on the trainer's side and chunked prefill on the engine's.
TEST(CudaBatchInvariant, GrpoMismatchIsExactlyZero) {
  model::ModelConfig mc = test::byte_vocab_config();
  mc.init_std = 1.0;
  model::Muse policy = model::Muse::init(mc, 3, at::kBFloat16, at::Device(at::kCUDA, 0));
  const trainer::Dataset data = test::self_consistent_problems(policy, 200);
  trainer::GrpoConfig cfg = test::small_grpo(4, 4, 4);
  cfg.micro_batch_seqs = 5;
  cfg.mismatch_ab = true;
  cfg.engine.numerics = model::Numerics::kBitwise;
  cfg.engine.prefill_chunk = 3;
  trainer::GrpoTrainer trainer(policy, cfg, test::byte_tokenizer(), data);
  for (int s = 0; s < 2; ++s) {
    const trainer::StepMetrics m = trainer.step();
    ASSERT_GT(m.mismatch.tokens, 0);
    EXPECT_EQ(m.mismatch.max_abs, 0.0) << m.to_json();
    EXPECT_EQ(m.mismatch_no_replay.max_abs, 0.0) << m.to_json();
    EXPECT_EQ(m.routing_disagreement, 0.0);
    EXPECT_EQ(m.sync_check, 0.0);
  }
}

}  // namespace
}  // namespace kiln
