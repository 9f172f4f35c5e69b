// The supervised warm start learns: on a handful of problems the answer loss falls and the answer
// tokens become the argmax.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <string>
#include <vector>

#include "trainer/environment.h"
#include "trainer/sft.h"
#include "tests/test_util.h"
#include "tests/trainer/grpo_fixtures.h"
#include "tests/trainer/small_model.h"

namespace kiln::trainer {
namespace {

EnvironmentSpec demo_env() {
  EnvironmentSpec spec;
  spec.worker.command = {access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3",
                         test::source_path("tests/trainer/workers/test_env.py")};
  spec.worker.timeout_s = 3;
  spec.worker.on_failure = OnFailure::kZero;
  spec.max_turns = 3;
  spec.max_observation_tokens = 16;
  spec.max_episode_tokens = 40;
  return spec;
}

Example demo_example(const std::string& kind) {
  Example ex;
  ex.prompt = ex.prompt_text = kind;
  ex.label = "46";
  ex.origin = "test#" + kind;
  return ex;
}

// The environment's demonstrations become the answers: each response then the stop id, trained;
// each observation as episodes take it (text tokenized once, or ids), not trained. Without one the
// label is the answer.
TEST(Sft, DemonstrationsTrainTheResponsesNotTheObservations) {
  auto tok = test::byte_tokenizer();
  const int64_t stop = tok->stop_ids().front();
  Environment env(demo_env());
  std::vector<Example> exs = {demo_example("demo:text"), demo_example("demo:ids"), demo_example("demo:none")};
  const DemoReport r = add_demonstrations(exs, env, *tok);
  EXPECT_EQ(r.demonstrated, 2);
  EXPECT_EQ(r.label, 1);
  std::vector<int64_t> want = tok->encode("c 1+2");
  want.push_back(stop);
  const std::vector<int64_t> obs = tok->encode("=3\n"), last = tok->encode("46");
  want.insert(want.end(), obs.begin(), obs.end());
  want.insert(want.end(), last.begin(), last.end());
  want.push_back(stop);
  EXPECT_EQ(exs[0].answer_ids, want);
  std::vector<uint8_t> trained(6, 1);
  trained.insert(trained.end(), obs.size(), 0);
  trained.insert(trained.end(), 3, 1);
  EXPECT_EQ(exs[0].answer_trained, trained);
  EXPECT_EQ(exs[1].answer_ids, (std::vector<int64_t>{'c', stop, 65, 66, '4', '6', stop}));
  EXPECT_EQ(exs[1].answer_trained, (std::vector<uint8_t>{1, 1, 0, 0, 1, 1, 1}));
  EXPECT_TRUE(exs[2].answer_ids.empty());
  // The targets: the prompt's last token predicts the first answer token; an observation's tokens
  // are never targets, the response after it is.
  exs[1].prompt_ids = {5, 6};
  const auto [seq, targets] = sft_sequence(exs[1], *tok);
  EXPECT_EQ(seq, (std::vector<int64_t>{5, 6, 'c', stop, 65, 66, '4', '6', stop}));
  EXPECT_EQ(targets, (std::vector<int64_t>{-100, 'c', stop, -100, -100, '4', '6', stop, -100}));
  exs[2].prompt_ids = {5};
  EXPECT_EQ(sft_sequence(exs[2], *tok).second, (std::vector<int64_t>{'4', '6', stop, -100}));
  // A demonstration beyond the episode limits names the example and the limit.
  std::vector<Example> long_obs = {demo_example("demo:long")};
  EXPECT_TRUE(test::throws_with([&] { add_demonstrations(long_obs, env, *tok); },
                                {"test#demo:long", "30 tokens", "max_observation_tokens (16)"}));
  std::vector<Example> many = {demo_example("demo:turns")};
  EXPECT_TRUE(test::throws_with([&] { add_demonstrations(many, env, *tok); }, {"5 turns", "max_turns (3)"}));
  // The trainer asks the environment itself, and needs one to ask.
  model::Muse m = model::Muse::init(test::byte_vocab_config(), 1, at::kFloat, at::kCPU);
  SftConfig cfg;
  cfg.batch_size = 2;
  cfg.demonstrations = Demonstrations::kEnvironment;
  SftTrainer sft(m, cfg, tok, {demo_example("demo:text"), demo_example("demo:none")}, comm::Group::world(), &env);
  EXPECT_EQ(sft.demonstrations().demonstrated, 1);
  EXPECT_EQ(sft.demonstrations().label, 1);
  EXPECT_TRUE(test::throws_with([&] { SftTrainer none(m, cfg, tok, {demo_example("demo:text")}); },
                                {"no environment was given"}));
}

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

// A loss can be non-finite while the gradient norm is not (a target log-prob that overflows to
// -inf has a finite gradient): here the head is NaN and every gradient hook zeroes the NaNs, so
// only the loss shows it. The update is skipped all the same, and stop_after_nonfinite of them in
// a row stop the run with an error naming the step, the loss and what to try.
TEST(Sft, ANonFiniteLossSkipsTheUpdateEvenWithAFiniteGradientNorm) {
  model::ModelConfig c = test::byte_vocab_config();
  model::Muse m = model::Muse::init(c, 1, at::kFloat, at::kCPU);
  SftConfig cfg;
  cfg.batch_size = 4;
  cfg.stop_after_nonfinite = 2;
  SftTrainer sft(m, cfg, test::byte_tokenizer(), arithmetic_problems(8, 1, 3));
  {
    at::NoGradGuard no_grad;
    m.weights().lm_head.fill_(std::nan(""));
  }
  std::vector<std::pair<at::Tensor, unsigned>> hooks;
  for (auto& [name, p] : m.named_parameters())
    hooks.emplace_back(p, p.register_hook([](const at::Tensor& g) { return g.nan_to_num(0.0, 0.0, 0.0); }));
  const at::Tensor before = m.weights().final_norm.detach().clone();
  const SftMetrics first = sft.step();
  EXPECT_TRUE(std::isnan(first.loss)) << first.to_json();
  EXPECT_TRUE(first.skipped) << "a NaN loss with a finite gradient norm was applied: " << first.to_json();
  EXPECT_TRUE(at::equal(m.weights().final_norm.detach(), before));
  EXPECT_TRUE(test::throws_with([&] { sft.step(); },
                                {"sft: step 2", "the loss is not finite", "stop_after_nonfinite: 2", "lower sft.lr"}));
  for (auto& [p, h] : hooks) p.remove_hook(h);
}

}  // namespace
}  // namespace kiln::trainer
