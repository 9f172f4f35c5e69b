// The supervised warm start learns: on a handful of problems the answer loss falls and the answer
// tokens become the argmax.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

#include "trainer/sft.h"
#include "tests/test_util.h"
#include "tests/trainer/grpo_fixtures.h"
#include "tests/trainer/small_model.h"

namespace kiln::trainer {
namespace {

TEST(Sft, LossFallsAndAnswersAreMemorised) {
  model::ModelConfig c = test::byte_vocab_config();
  model::Muse m = model::Muse::init(c, 1, at::kFloat, at::kCPU);
  SftConfig cfg;
  cfg.batch_size = 8;
  cfg.optim.adamw.lr = 1e-2;
  SftTrainer sft(m, cfg, test::byte_tokenizer(), arithmetic_problems(8, 1, 3));
  const SftMetrics first = sft.step();
  SftMetrics last;
  for (int i = 0; i < 150; ++i) last = sft.step();
  EXPECT_LT(last.loss, 0.25 * first.loss) << "first " << first.loss << " last " << last.loss;
  EXPECT_GT(last.token_accuracy, 0.9);
  SftConfig bad;
  bad.batch_size = 0;
  EXPECT_TRUE(test::throws_with([&] { bad.validate(); }, {"batch_size must be positive"}));
}

// As in GRPO: a non-finite gradient norm skips the update, marked in the metrics as JSON (null
// loss, never "nan"), and stop_after_nonfinite of them in a row stop the run naming the step.
TEST(Sft, ANonFiniteGradientSkipsTheUpdateAndTooManyInARowStopTheRun) {
  model::ModelConfig c = test::byte_vocab_config();
  model::Muse m = model::Muse::init(c, 1, at::kFloat, at::kCPU);
  SftConfig cfg;
  cfg.batch_size = 4;
  cfg.stop_after_nonfinite = 2;
  SftTrainer sft(m, cfg, test::byte_tokenizer(), arithmetic_problems(8, 1, 3));
  at::Tensor w = m.weights().lm_head;
  const at::Tensor before = w.detach().clone();
  const auto hook = w.register_hook([](const at::Tensor& g) { return g * std::nan(""); });
  const SftMetrics first = sft.step();
  EXPECT_TRUE(first.skipped);
  EXPECT_TRUE(at::equal(w.detach(), before));
  EXPECT_NE(first.to_json().find("\"skipped\":true"), std::string::npos) << first.to_json();
  EXPECT_TRUE(test::throws_with([&] { sft.step(); }, {"sft: step 2", "gradient norm is not finite"}));
  w.remove_hook(hook);
  SftMetrics nan_loss;
  nan_loss.loss = std::nan("");
  EXPECT_NE(nan_loss.to_json().find("\"loss\":null"), std::string::npos) << nan_loss.to_json();
}

}  // namespace
}  // namespace kiln::trainer
