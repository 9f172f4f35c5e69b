// The supervised warm start learns: on a handful of problems the answer loss falls and the answer
// tokens become the argmax.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace kiln::trainer
