// GRPO steps end to end on a small model: finite metrics, near-zero train-vs-rollout mismatch
// with routing replay in fp32 on CPU, weights that move and reach the rollout engine.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <filesystem>

#include "model/lora.h"
#include "trainer/grpo.h"
#include "trainer/scoring.h"
#include "tests/test_util.h"
#include "tests/trainer/small_model.h"
#include "tests/trainer/grpo_fixtures.h"

namespace kiln::trainer {
namespace {

GrpoConfig small_grpo() {
  GrpoConfig g = test::small_grpo(4, 4, 4);
  g.micro_batch_seqs = 5;  // several micro-batches, one partial
  return g;
}

TEST(Grpo, StepsRunWithNearZeroMismatchUnderReplayAndSyncWeights) {
  model::ModelConfig mc = test::byte_vocab_config();
  mc.init_std = 1.0;  // sharp enough that the greedy reply is sampled often, but not always
  model::Muse policy = model::Muse::init(mc, 3, at::kFloat, at::kCPU);
  Dataset data = test::self_consistent_problems(policy, 200);
  ASSERT_GE(data.train.size(), 8u);
  at::Tensor before = policy.weights().layers[0].pooler.detach().clone();
  GrpoConfig cfg = small_grpo();
  cfg.max_tokens = 1;
  cfg.mismatch_ab = true;
  GrpoTrainer trainer(policy, cfg, test::byte_tokenizer(), data);
  double grad_seen = 0;
  for (int s = 1; s <= 3; ++s) {
    StepMetrics m = trainer.step();
    EXPECT_EQ(m.step, s);
    EXPECT_TRUE(std::isfinite(m.loss) && std::isfinite(m.grad_norm)) << m.to_json();
    grad_seen += m.grad_norm;
    EXPECT_GE(m.reward, 0.0);
    EXPECT_LE(m.reward, 1.0);
    EXPECT_GE(m.pass_at_n, m.accuracy);  // a prompt with any right sample counts whole
    EXPECT_LE(m.pass_at_n, 1.0);
    EXPECT_EQ(m.response_length, 1.0);
    EXPECT_EQ(m.mismatch.tokens, 16);
    // Same weights, fp32, the rollout's expert sets: only summation order differs.
    EXPECT_LT(m.mismatch.mean_abs_token, 1e-4) << m.to_json();
    EXPECT_LT(m.mismatch.max_abs, 1e-3) << m.to_json();
    EXPECT_TRUE(m.has_no_replay);
    EXPECT_GE(m.routing_disagreement, 0.0);
    EXPECT_LE(m.routing_disagreement, 1.0);
    EXPECT_NE(m.to_json().find("\"mismatch_no_replay\""), std::string::npos);
    // Synchronous full-parameter: the engine reads the trained tensors themselves (nothing is
    // copied), and the mismatch above shows it reads them as updated.
    EXPECT_EQ(m.sync_bytes, 0);
    EXPECT_TRUE(m.weights_shared);
    EXPECT_GE(m.sync_check, 0.0);
    EXPECT_LT(m.sync_check, 1e-5);
  }
  EXPECT_GT(grad_seen, 0.0);
  EXPECT_FALSE(at::equal(before, policy.weights().layers[0].pooler.detach()));
  EXPECT_EQ(trainer.stream().position(), 12u);
  const double acc = trainer.evaluate(test::eval_prompts(8)).all.mean_at_k;
  EXPECT_GE(acc, 0.0);
  EXPECT_LE(acc, 1.0);
}

// Everything in a step's metrics but wall-clock times.
std::string without_times(const StepMetrics& m) {
  StepMetrics c = m;
  c.rollout_seconds = c.reward_seconds = c.lp_old_seconds = c.train_seconds = c.sync_seconds = c.step_seconds = 0;
  c.tokens_per_second = 0;
  return c.to_json();
}

// Runs 4 steps straight, and 2 + save + load + 2 into other weights: every step's metrics and the
// final weights must agree bitwise. The optimizer state lives where `state` says.
void check_resume(double kl_coef, optimizers::Placement state = optimizers::Placement::kDevice, int64_t lora_rank = 0,
                  bool dynamic_sampling = false) {
  test::TempDir nvme;
  model::ModelConfig mc = test::byte_vocab_config();
  mc.init_std = 1.0;
  model::Muse a = model::Muse::init(mc, 3, at::kFloat, at::kCPU);
  Dataset data = test::self_consistent_problems(a, 200);
  GrpoConfig cfg = small_grpo();
  cfg.max_tokens = 1;
  cfg.loss.kl_coef = kl_coef;
  cfg.optim.state = state;
  cfg.optim.nvme_dir = nvme.path();
  if (lora_rank > 0) cfg.lora = model::LoraConfig{lora_rank, 2.0 * double(lora_rank)};
  cfg.dynamic_sampling = dynamic_sampling;
  std::vector<std::string> straight;
  {
    GrpoTrainer t(a, cfg, test::byte_tokenizer(), data);
    for (int s = 0; s < 4; ++s) straight.push_back(without_times(t.step()));
  }
  test::TempDir dir;
  model::Muse b = model::Muse::init(mc, 3, at::kFloat, at::kCPU);
  {
    GrpoTrainer t(b, cfg, test::byte_tokenizer(), data);
    t.step();
    t.step();
    t.save(dir / "ckpt");
    t.save(dir / "ckpt");  // replacing an existing checkpoint works too
  }
  // Other weights, which load must replace (LoRA: the same base, only adapters are checkpointed).
  model::Muse c = model::Muse::init(mc, lora_rank > 0 ? 3 : 99, at::kFloat, at::kCPU);
  GrpoTrainer resumed(c, cfg, test::byte_tokenizer(), data);
  resumed.load(dir / "ckpt");
  EXPECT_EQ(resumed.steps_done(), 2);
  EXPECT_EQ(without_times(resumed.step()), straight[2]);
  EXPECT_EQ(without_times(resumed.step()), straight[3]);
  for (size_t i = 0; i < a.named_parameters().size(); ++i)
    EXPECT_TRUE(test::all_equal(c.named_parameters()[i].second, a.named_parameters()[i].second))
        << a.named_parameters()[i].first;
  if (dynamic_sampling) {  // extra rounds drew prompts: the data position they left is restored
    int64_t rounds = 0;
    for (const std::string& line : straight)
      rounds += line.find("\"rounds\":") != std::string::npos && line.find("\"rounds\":1,") == std::string::npos;
    EXPECT_GT(rounds, 0) << "no step sampled a second round: the resume saw no extra draws";
    return;
  }
  if (lora_rank > 0) {  // adapters for another base are refused
    model::Muse other = model::Muse::init(mc, 99, at::kFloat, at::kCPU);
    GrpoTrainer wrong(other, cfg, test::byte_tokenizer(), data);
    EXPECT_TRUE(test::throws_with([&] { wrong.load(dir / "ckpt"); }, {"adapters for another base"}));
    EXPECT_FALSE(std::filesystem::exists(dir / "ckpt/model"));
  }
  const auto la = model::lora_parameters(a), lc = model::lora_parameters(c);
  ASSERT_EQ(la.size(), lc.size());
  EXPECT_EQ(la.empty(), lora_rank == 0);
  for (size_t i = 0; i < la.size(); ++i) EXPECT_TRUE(test::all_equal(lc[i].second, la[i].second)) << la[i].first;
  EXPECT_TRUE(test::throws_with([&] { resumed.load(dir / "nothing"); }, {"no complete checkpoint at", "nothing to resume from"}));
  // A truncated optimizer state is named, and the checkpoint is left as it was.
  std::filesystem::copy(dir / "ckpt", dir / "cut", std::filesystem::copy_options::recursive);
  const std::string opt_file = dir / "cut/optimizer.safetensors";
  std::filesystem::resize_file(opt_file, std::filesystem::file_size(opt_file) - 100);
  EXPECT_TRUE(test::throws_with([&] { resumed.load(dir / "cut"); }, {"cut/optimizer.safetensors"}));
  if (kl_coef != 0 && lora_rank == 0) {  // the reference policy is part of the checkpoint (LoRA: the base itself)
    GrpoConfig no_kl = cfg;
    no_kl.loss.kl_coef = 0;
    model::Muse d = model::Muse::init(mc, 3, at::kFloat, at::kCPU);
    GrpoTrainer plain(d, no_kl, test::byte_tokenizer(), data);
    plain.step();
    plain.save(dir / "plain");
    EXPECT_TRUE(test::throws_with([&] { resumed.load(dir / "plain"); }, {"has no reference/ policy", "kl_coef"}));
  }
}

// rollout.numerics: bitwise: the trainer rescores every sampled token to the rollout's bits
// (chunked prefill and a mixed batch on the engine's side, micro-batches on the trainer's), so
// every mismatch metric is exactly 0 with routing replay on and off, the routing agrees by
// construction, and the sync check reads 0.
TEST(Grpo, BitwiseNumericsGiveExactlyZeroMismatch) {
  model::ModelConfig mc = test::byte_vocab_config();
  mc.init_std = 1.0;
  model::Muse policy = model::Muse::init(mc, 3, at::kFloat, at::kCPU);
  Dataset data = test::self_consistent_problems(policy, 200);
  GrpoConfig cfg = small_grpo();
  cfg.mismatch_ab = true;
  cfg.engine.numerics = model::Numerics::kBitwise;
  cfg.engine.prefill_chunk = 3;
  GrpoTrainer trainer(policy, cfg, test::byte_tokenizer(), data);
  for (int s = 1; s <= 2; ++s) {
    const StepMetrics m = trainer.step();
    // lp_old is the rollout's; the first mini-step's forward measured the mismatch on every token.
    EXPECT_TRUE(m.lp_old_from_rollout);
    ASSERT_GT(m.mismatch.tokens, 0);
    EXPECT_EQ(m.mismatch.max_abs, 0.0) << m.to_json();
    EXPECT_EQ(m.mismatch.mean_abs_token, 0.0);
    EXPECT_EQ(m.mismatch.k3_kl, 0.0);
    EXPECT_TRUE(m.has_no_replay);
    EXPECT_EQ(m.mismatch_no_replay.max_abs, 0.0);
    EXPECT_EQ(m.routing_disagreement, 0.0);
    EXPECT_EQ(m.sync_check, 0.0);
    EXPECT_EQ(m.clip_fraction, 0.0);  // one mini-step: its ratio is exactly 1
  }
  GrpoConfig bad = cfg;
  bad.top_p = 0.9;
  EXPECT_TRUE(test::throws_with([&] { bad.validate(); }, {"numerics bitwise", "top_p"}));
}

// lp_old from the rollout against the same run with lp_old scored (score_lp_old), bit for bit:
// losses, gradient norms and weights, with two mini-steps (the second trains on weights the first
// changed, against the rollout's lp_old) and the TIS correction on. Scored as before: replay off
// with the A/B on (it needs lp_old's own routing), and a batch stale by one update (other weights).
TEST(Grpo, BitwiseLpOldFromTheRolloutEqualsTheScoredOne) {
  model::ModelConfig mc = test::byte_vocab_config();
  mc.init_std = 1.0;
  const model::Muse init = model::Muse::init(mc, 3, at::kFloat, at::kCPU);
  Dataset data = test::self_consistent_problems(init, 200);
  GrpoConfig cfg = small_grpo();
  cfg.engine.numerics = model::Numerics::kBitwise;
  cfg.mini_steps = 2;
  cfg.loss.tis = true;
  cfg.reward.type = RewardType::kRegexFormat;  // a digit anywhere: rewards vary within groups
  cfg.reward.regex_format.pattern = "(?s).*[0-9].*";
  struct Run {
    std::vector<StepMetrics> steps;
    std::vector<at::Tensor> weights;
  };
  auto run = [&](const GrpoConfig& c) {
    model::Muse policy = init.clone();
    Run r;
    GrpoTrainer t(policy, c, test::byte_tokenizer(), data);
    for (int s = 1; s <= 3; ++s) r.steps.push_back(t.step());
    for (const auto& [name, w] : policy.named_parameters()) r.weights.push_back(w.detach().clone());
    return r;
  };
  const Run taken = run(cfg);
  GrpoConfig scored_cfg = cfg;
  scored_cfg.score_lp_old = true;
  const Run scored = run(scored_cfg);
  for (size_t s = 0; s < taken.steps.size(); ++s) {
    const StepMetrics &a = taken.steps[s], &b = scored.steps[s];
    EXPECT_TRUE(a.lp_old_from_rollout);
    EXPECT_FALSE(b.lp_old_from_rollout);
    EXPECT_GT(a.mismatch.tokens, 0);  // the first mini-step's half of the batch
    EXPECT_LT(a.mismatch.tokens, b.mismatch.tokens);
    EXPECT_EQ(a.mismatch.max_abs, 0.0);
    EXPECT_EQ(b.mismatch.max_abs, 0.0);
    EXPECT_EQ(a.loss, b.loss) << "step " << s + 1;
    EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << s + 1;
    EXPECT_EQ(a.clip_fraction, b.clip_fraction) << "step " << s + 1;
    EXPECT_GT(a.grad_norm, 0);
  }
  for (size_t i = 0; i < taken.weights.size(); ++i) EXPECT_TRUE(at::equal(taken.weights[i], scored.weights[i])) << i;
  GrpoConfig ab = cfg;
  ab.routing_replay = false;
  ab.mismatch_ab = true;
  for (const StepMetrics& m : run(ab).steps) {
    EXPECT_FALSE(m.lp_old_from_rollout);
    EXPECT_EQ(m.mismatch.max_abs, 0.0);
  }
  GrpoConfig stale = cfg;
  stale.async = AsyncConfig{1};
  const Run async_run = run(stale);
  EXPECT_TRUE(async_run.steps[0].lp_old_from_rollout);  // the first batch is on-policy
  EXPECT_EQ(async_run.steps[1].staleness, 1);
  EXPECT_FALSE(async_run.steps[1].lp_old_from_rollout);
  // An fp64 policy: the rollout keeps its log-probs in fp32, so lp_old is scored, and the mismatch
  // is that storage's rounding alone.
  model::Muse fp64 = model::Muse::init(mc, 3, at::kDouble, at::kCPU);
  GrpoTrainer t64(fp64, cfg, test::byte_tokenizer(), data);
  const StepMetrics m64 = t64.step();
  EXPECT_FALSE(m64.lp_old_from_rollout);
  EXPECT_LT(m64.mismatch.max_abs, 1e-6);
}

TEST(Grpo, ResumeFromACheckpointReproducesTheUninterruptedRunBitwise) { check_resume(0.0); }
TEST(Grpo, ResumeWithTheKlTermRestoresTheReferencePolicy) { check_resume(0.05); }
TEST(Grpo, ResumeWithOptimizerStateOnNvmeIsBitwiseToo) { check_resume(0.0, optimizers::Placement::kNvme); }
TEST(Grpo, ResumeWithDynamicSamplingIsBitwiseToo) {
  check_resume(0.0, optimizers::Placement::kDevice, 0, /*dynamic_sampling=*/true);
}
// LoRA: only the adapters train (the base stays bitwise), the KL reference is the base with the
// adapters off, and the checkpoint carries a PEFT adapter.
TEST(Grpo, LoraTrainsOnlyAdaptersAndResumesBitwise) { check_resume(0.05, optimizers::Placement::kDevice, 4); }

// A rollout whose weights are not the trainer's stops the run at the sync check, naming the step,
// the difference and the threshold. Here the rollout serves NVFP4 codes (its scores differ by
// ~1e-2) while the threshold is left at a bf16 rollout's level.
TEST(Grpo, SyncCheckStopsTheRunWhenTheRolloutDisagrees) {
  model::ModelConfig mc = test::byte_vocab_config();
  model::Muse policy = model::Muse::init(mc, 3, at::kFloat, at::kCPU);
  Dataset data = test::self_consistent_problems(policy, 200);
  GrpoConfig cfg = small_grpo();
  cfg.max_tokens = 1;
  cfg.engine.quantization = rollout::Quantization::kNvfp4;
  cfg.sync_check_threshold = 1e-3;
  GrpoTrainer trainer(policy, cfg, test::byte_tokenizer(), data);
  EXPECT_TRUE(test::throws_with([&] { trainer.step(); },
                                {"weight sync check failed after step", "threshold 0.001", "not the trainer's"}));
  // The default threshold for an NVFP4 rollout (1.0) lets the same run go on.
  cfg.sync_check_threshold.reset();
  GrpoTrainer lenient(policy, cfg, test::byte_tokenizer(), data);
  StepMetrics m = lenient.step();
  EXPECT_GT(m.sync_check, 1e-3) << m.to_json();
  EXPECT_LT(m.sync_check, 1.0);
}

// A non-finite gradient norm skips the update (every weight stays bitwise as it was) and is
// counted; the run goes on when the gradients are finite again, and stops with an error naming
// the step and the quantity after stop_after_nonfinite such updates in a row. A gradient hook
// poisons the gradients without touching the forward, so rollout and weight sync stay healthy.
TEST(Grpo, ANonFiniteGradientSkipsTheUpdateAndTooManyInARowStopTheRun) {
  model::ModelConfig mc = test::byte_vocab_config();
  mc.init_std = 1.0;  // diverse samples, so that groups have advantages and updates move weights
  model::Muse policy = model::Muse::init(mc, 3, at::kFloat, at::kCPU);
  Dataset data = test::self_consistent_problems(policy, 200);
  GrpoConfig cfg = small_grpo();
  cfg.max_tokens = 1;
  cfg.stop_after_nonfinite = 2;
  GrpoTrainer trainer(policy, cfg, test::byte_tokenizer(), data);
  auto snapshot = [&] {
    std::vector<at::Tensor> out;
    for (auto& [name, t] : policy.named_parameters()) out.push_back(t.detach().clone());
    return out;
  };
  auto unchanged = [&](const std::vector<at::Tensor>& before) {
    auto now = policy.named_parameters();
    for (size_t i = 0; i < now.size(); ++i)
      if (!at::equal(now[i].second.detach(), before[i])) return false;
    return true;
  };
  at::Tensor w = policy.weights().layers[0].pooler;
  auto poison = [&] { return w.register_hook([](const at::Tensor& g) { return g * std::nan(""); }); };
  auto hook = poison();
  auto before = snapshot();
  StepMetrics m = trainer.step();
  EXPECT_EQ(m.skipped_updates, 1) << m.to_json();
  EXPECT_TRUE(std::isnan(m.grad_norm));
  EXPECT_NE(m.to_json().find("\"skipped_updates\":1"), std::string::npos) << m.to_json();
  EXPECT_TRUE(unchanged(before)) << "a skipped update changed the weights";
  w.remove_hook(hook);
  m = trainer.step();  // finite again: applied, and the count in a row starts over
  EXPECT_EQ(m.skipped_updates, 0);
  EXPECT_TRUE(std::isfinite(m.grad_norm));
  ASSERT_GT(m.grad_norm, 0) << m.to_json();
  EXPECT_FALSE(unchanged(before));
  hook = poison();
  EXPECT_EQ(trainer.step().skipped_updates, 1);
  EXPECT_TRUE(test::throws_with([&] { trainer.step(); }, {"grpo: step 4", "gradient norm is not finite",
                                                          "2 update(s) in a row", "stop_after_nonfinite: 2"}));
  w.remove_hook(hook);
  cfg.stop_after_nonfinite = 0;
  EXPECT_TRUE(test::throws_with([&] { cfg.validate(); }, {"stop_after_nonfinite must be at least 1"}));
  cfg.stop_after_nonfinite = 2;
  for (double bad : {-1.0, std::nan("")}) {
    cfg.grad_clip = bad;
    EXPECT_TRUE(test::throws_with([&] { cfg.validate(); }, {"grad_clip must be finite and >= 0"}));
  }
  cfg.grad_clip = 1;
  cfg.temperature = INFINITY;
  EXPECT_TRUE(test::throws_with([&] { cfg.validate(); }, {"temperature must be positive and finite"}));
}

TEST(Grpo, LoraSyncsAdaptersOnlyAndChecksTheSync) {
  model::ModelConfig mc = test::byte_vocab_config();
  mc.init_std = 1.0;
  model::Muse policy = model::Muse::init(mc, 3, at::kFloat, at::kCPU);
  const model::Muse base = policy.clone();
  Dataset data = test::self_consistent_problems(policy, 200);
  GrpoConfig cfg = small_grpo();
  cfg.max_tokens = 1;
  cfg.lora = model::LoraConfig{4, 8};
  cfg.loss.kl_coef = 0.05;
  GrpoTrainer trainer(policy, cfg, test::byte_tokenizer(), data);
  int64_t adapter_bytes = 0;
  for (auto& [n, t] : model::lora_parameters(policy)) adapter_bytes += t.numel() * 4;
  for (int s = 0; s < 3; ++s) {
    StepMetrics m = trainer.step();
    EXPECT_EQ(m.sync_bytes, adapter_bytes);  // adapters only
    EXPECT_GE(m.sync_seconds, 0.0);
    if (m.sync_seconds > 0) EXPECT_NEAR(m.sync_gbps() * 1e9 * m.sync_seconds, double(adapter_bytes), 1.0);
    EXPECT_NE(m.to_json().find("\"sync_gbps\""), std::string::npos);
    EXPECT_GE(m.sync_check, 0.0);
    EXPECT_LT(m.sync_check, 1e-5);  // same base, fp32: the rollout scores as the trainer does
    EXPECT_LT(m.mismatch.mean_abs_token, 1e-4) << m.to_json();
    if (s > 0) EXPECT_GT(m.kl, 0.0);  // the adapters moved away from the base
  }
  for (size_t i = 0; i < base.named_parameters().size(); ++i)  // the base is frozen
    EXPECT_TRUE(test::all_equal(policy.named_parameters()[i].second, base.named_parameters()[i].second));
  double moved = 0;
  for (auto& [n, t] : model::lora_parameters(policy))
    if (n.find("lora_B") != std::string::npos) moved += t.abs().sum().item<double>();
  EXPECT_GT(moved, 0.0);
  GrpoConfig bad = cfg;
  bad.lora->targets = {"embed_tokens"};
  EXPECT_TRUE(test::throws_with([&] { GrpoTrainer t(policy, bad, test::byte_tokenizer(), data); }, {"unknown target"}));
}

TEST(Grpo, KlToTheFrozenReferenceStartsAtZeroAndGrows) {
  model::ModelConfig mc = test::byte_vocab_config();
  mc.init_std = 1.0;
  model::Muse policy = model::Muse::init(mc, 3, at::kFloat, at::kCPU);
  Dataset data = test::self_consistent_problems(policy, 200);
  GrpoConfig cfg = small_grpo();
  cfg.max_tokens = 1;
  cfg.loss.kl_coef = 0.1;
  GrpoTrainer trainer(policy, cfg, test::byte_tokenizer(), data);
  // Step 1's single mini-step trains the starting weights: the policy is the reference.
  const StepMetrics first = trainer.step();
  EXPECT_GE(first.kl, 0.0);
  EXPECT_LT(first.kl, 1e-7) << first.to_json();
  double later = 0;
  for (int s = 0; s < 3; ++s) later = trainer.step().kl;
  EXPECT_GT(later, 1e-6);  // lr 1e-2 moves the policy away from the frozen reference
  EXPECT_TRUE(std::isfinite(later));
}

TEST(Grpo, ReplayOffStillRunsAndConfigErrorsAreClear) {
  model::Muse policy = model::Muse::init(test::byte_vocab_config(), 4, at::kFloat, at::kCPU);
  GrpoConfig cfg = small_grpo();
  cfg.routing_replay = false;
  GrpoTrainer trainer(policy, cfg, test::byte_tokenizer(), split(arithmetic_problems(32, 1, 6), 0.25, 1));
  StepMetrics m = trainer.step();
  EXPECT_TRUE(std::isfinite(m.loss));
  GrpoConfig bad = small_grpo();
  bad.samples_per_prompt = 1;
  EXPECT_TRUE(test::throws_with([&] { bad.validate(); }, {"samples_per_prompt must be at least 2"}));
}

// Shaping end to end: with max_tokens 4 and a buffer of 2, answers of 3 and 4 tokens are penalised
// (the metric is the mean penalty, and the reported reward stays unshaped); with mask_truncated a
// step whose samples all run to max_tokens has no token in the loss, so nothing trains, where the
// same step without the mask does; MIS with a range that holds every ratio drops nothing.
TEST(Grpo, OverlongPenaltyTruncationMaskAndMisRun) {
  model::Muse policy = model::Muse::init(test::byte_vocab_config(), 4, at::kFloat, at::kCPU);
  const Dataset data = split(arithmetic_problems(32, 1, 6), 0.25, 1);
  GrpoConfig cfg = small_grpo();
  cfg.overlong_buffer = 2;
  cfg.overlong_penalty = 0.5;
  cfg.loss.mis = true;
  cfg.loss.mis_low = 0.01;
  cfg.loss.mis_high = 100;
  GrpoTrainer shaped(policy, cfg, test::byte_tokenizer(), data);
  const StepMetrics m = shaped.step();
  EXPECT_LT(m.overlong_penalty, 0.0) << m.to_json();  // an untrained model rarely stops before 3 tokens
  EXPECT_GE(m.overlong_penalty, -0.5);
  EXPECT_EQ(m.mis_masked_fraction, 0.0);
  EXPECT_NE(m.to_json().find("overlong_penalty"), std::string::npos);

  // Every sample runs to max_tokens (an untrained model does not stop within 4 tokens); the reward
  // (any digit in the response) varies within groups, so without the mask the step trains.
  GrpoConfig masked = small_grpo();
  masked.reward.type = RewardType::kRegexFormat;
  masked.reward.regex_format.pattern = "(?s).*[0-9].*";
  for (bool mask : {false, true}) {
    model::Muse m2 = model::Muse::init(test::byte_vocab_config(), 4, at::kFloat, at::kCPU);
    std::vector<at::Tensor> copies;
    for (const auto& [name, t] : m2.named_parameters()) copies.push_back(t.detach().clone());
    masked.mask_truncated = mask;
    GrpoTrainer trainer(m2, masked, test::byte_tokenizer(), data);
    const StepMetrics t = trainer.step();
    ASSERT_EQ(t.truncated_fraction, 1.0) << t.to_json();
    ASSERT_LT(t.zero_variance_groups, 1.0) << t.to_json();
    bool moved = false;
    const auto after = m2.named_parameters();
    for (size_t i = 0; i < after.size(); ++i) moved |= !at::equal(after[i].second, copies[i]);
    EXPECT_EQ(moved, !mask) << "mask_truncated " << mask << ": " << t.to_json();
    if (mask) EXPECT_EQ(t.loss, 0.0) << t.to_json();
    else EXPECT_NE(t.loss, 0.0) << t.to_json();
  }
  GrpoConfig bad = small_grpo();
  bad.overlong_buffer = 5;
  EXPECT_TRUE(test::throws_with([&] { bad.validate(); }, {"overlong_buffer must be in [0, max_tokens=4]"}));
  bad = small_grpo();
  bad.loss.mis = true;
  bad.loss.mis_high = 0.9;
  EXPECT_TRUE(test::throws_with([&] { bad.validate(); }, {"mis_high=0.9"}));
}

// Dynamic sampling: flat groups are dropped and more rounds sampled. With a reward that is 0 for
// every response (exact match, untrained model) every group is flat: all rounds are spent, every
// group but one dropped, and the rank trains on that flat group (no advantage, so no update). With
// a reward that varies (a digit anywhere) the informative groups are kept, at most
// prompts_per_step of them, and the books balance: what was trained plus dropped is at most what
// was sampled, and a short batch means the rounds ran out.
TEST(Grpo, DynamicSamplingDropsFlatGroupsAndSamplesMoreRounds) {
  const Dataset data = split(arithmetic_problems(64, 1, 6), 0.25, 1);
  GrpoConfig cfg = small_grpo();
  cfg.dynamic_sampling = true;
  cfg.max_sampling_rounds = 2;
  {
    model::Muse m = model::Muse::init(test::byte_vocab_config(), 4, at::kFloat, at::kCPU);
    GrpoTrainer trainer(m, cfg, test::byte_tokenizer(), data);
    const StepMetrics s = trainer.step();
    ASSERT_EQ(s.zero_variance_groups, 1.0) << s.to_json();
    EXPECT_EQ(s.sampling_rounds, 3) << s.to_json();
    EXPECT_EQ(s.groups_dropped, 11);  // the twelfth is the flat group it trains on
    EXPECT_EQ(s.groups_trained, 1);
    EXPECT_EQ(s.loss, 0.0);
    EXPECT_NE(s.to_json().find("\"dynamic_sampling\""), std::string::npos);
  }
  cfg.reward.type = RewardType::kRegexFormat;
  cfg.reward.regex_format.pattern = "(?s).*[0-9].*";
  model::Muse m = model::Muse::init(test::byte_vocab_config(), 4, at::kFloat, at::kCPU);
  GrpoTrainer trainer(m, cfg, test::byte_tokenizer(), data);
  int64_t trained = 0;
  for (int step = 0; step < 3; ++step) {
    const StepMetrics s = trainer.step();
    EXPECT_GE(s.groups_trained, 1) << s.to_json();
    EXPECT_LE(s.groups_trained, cfg.prompts_per_step) << s.to_json();
    EXPECT_LE(s.groups_trained + s.groups_dropped, cfg.prompts_per_step * s.sampling_rounds) << s.to_json();
    if (s.groups_trained < cfg.prompts_per_step) EXPECT_EQ(s.sampling_rounds, 1 + cfg.max_sampling_rounds) << s.to_json();
    if (s.sampling_rounds > 1) EXPECT_GT(s.groups_dropped, 0) << s.to_json();
    EXPECT_TRUE(std::isfinite(s.loss));
    trained += s.groups_trained;
  }
  EXPECT_GT(trained, 3);  // the digit reward varies within groups often enough to fill more than one a step
  GrpoConfig bad = small_grpo();
  bad.max_sampling_rounds = -1;
  EXPECT_TRUE(test::throws_with([&] { bad.validate(); }, {"max_sampling_rounds must be >= 0"}));
}

// Trajectories out of the loss keep their mask (lp_old and the mismatch see them) but not their
// loss mask.
TEST(Scoring, PackedLossMaskLeavesOutTrajectoriesNotInTheLoss) {
  std::vector<Trajectory> trajs(2);
  for (auto& t : trajs) {
    t.tokens = {5, 6, 7, 8};
    t.prompt_len = 2;
    t.rollout_lp = {-0.1f, -0.2f};
    t.routing = at::zeros({4, 1, 1}, at::kByte);
  }
  trajs[1].in_loss = false;
  const Packed p = pack(trajs, 0, 2, at::kCPU, at::kDouble);
  KILN_EXPECT_CLOSE(p.mask, at::tensor({0., 1., 1., 0., 0., 1., 1., 0.}, at::kDouble), 0, 0);
  KILN_EXPECT_CLOSE(p.loss_mask, at::tensor({0., 1., 1., 0., 0., 0., 0., 0.}, at::kDouble), 0, 0);
}

// The chunked entropies equal those of the full logits of the same forward, at two temperatures
// and across micro-batches (the rows of every sequence, prompt included).
TEST(Scoring, TokenEntropiesEqualTheFullLogits) {
  model::Muse m = model::Muse::init(test::byte_vocab_config(), 2, at::kDouble, at::kCPU);
  std::vector<Trajectory> trajs;
  for (const std::vector<int64_t>& seq : {std::vector<int64_t>{1, 5, 9, 2, 7}, {3, 4}, {8, 8, 8, 6, 1, 0, 2}}) {
    Trajectory t;
    t.tokens = seq;
    t.prompt_len = 1;
    t.rollout_lp.assign(seq.size() - 1, 0.f);
    model::ForwardOptions o;
    t.routing = m.forward(model::PackedBatch::from_sequences({seq}, at::kCPU), o).routing;
    trajs.push_back(t);
  }
  for (double temp : {1.0, 0.7}) {
    const at::Tensor got = token_entropies(m, trajs, /*micro_batch_seqs=*/2, temp, {});
    std::vector<at::Tensor> want;
    for (const Trajectory& t : trajs) {
      model::ForwardOptions o;
      o.return_logits = true;
      const at::Tensor logp = at::log_softmax(m.forward(model::PackedBatch::from_sequences({t.tokens}, at::kCPU), o).logits / temp, -1);
      want.push_back(-(logp.exp() * logp).sum(-1));
    }
    EXPECT_TRUE(test::all_close(got, at::cat(want, 0), 1e-10, 1e-12)) << "temperature " << temp;
    EXPECT_GT(got.min().item<double>(), 0);
  }
}

}  // namespace
}  // namespace kiln::trainer
