// grpo.async.placement split at the world size mpirun gives: the first half of the ranks train and
// the second half roll out for them. The run equals the colocated async run of the trainers alone
// bit for bit (k = 0, itself the synchronous run, and k = 1), with evaluations, a checkpoint and a
// resume (the batches made ahead kept with the checkpoint); a rollout rank's error reaches its trainer, a trainer-side failure ends the session and
// the run goes on; misuse is refused with a message.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <memory>

#include "core/error.h"
#include "core/files.h"
#include "tests/test_util.h"
#include "tests/trainer/grpo_fixtures.h"
#include "tests/trainer/small_model.h"
#include "rollout/engine.h"
#include "trainer/grpo.h"
#include "trainer/tasks.h"

namespace kiln::trainer {
namespace {

using comm::Group;

GrpoConfig split_grpo(int64_t k) {
  GrpoConfig g = test::small_grpo(4, 4, 3);
  g.reward.type = RewardType::kRegexFormat;  // a digit anywhere: varies within groups
  g.reward.regex_format.pattern = "(?s).*[0-9].*";
  g.loss.tis = true;
  g.async = AsyncConfig{k};
  return g;
}

const Dataset& data() {
  static const Dataset d = split(arithmetic_problems(64, 1, 6), 0.25, 1);
  return d;
}

model::Muse policy(uint64_t seed) { return model::Muse::init(test::byte_vocab_config(), seed, at::kFloat, at::kCPU); }

// One directory for every rank (they share the machine).
std::string shared_dir(const std::string& what) {
  at::Tensor id = at::tensor(std::vector<int64_t>{int64_t(::getpid())});
  Group::world().broadcast(id, 0);
  return "/tmp/kiln-split-" + std::to_string(id.item<int64_t>()) + "-" + what;
}

// What a run reports and ends with: each step's metrics, the evaluations at steps 0 and 2, then a
// resumed trainer's step 3 and weights.
struct SplitRun {
  std::vector<StepMetrics> steps;
  std::vector<EvalMetrics> evals;
  StepMetrics resumed;
  std::vector<at::Tensor> weights, resumed_weights;
};

std::vector<at::Tensor> weights_of(const model::Muse& m) {
  std::vector<at::Tensor> out;
  for (const auto& [name, t] : m.named_parameters()) out.push_back(t.detach().clone());
  return out;
}

// Three steps (the last step set to 2 at first, then to 3) with evaluations at 0 and 2 and a
// checkpoint after step 2, then a second trainer (other initial weights, but LoRA's base) resumed
// from it for step 3. Under the split placement a rollout rank serves each of the two trainers in
// turn and returns an empty run.
SplitRun run(const GrpoConfig& cfg, const Group& g, const std::string& dir) {
  SplitRun r;
  {
    model::Muse p = policy(4);
    GrpoTrainer t(p, cfg, test::byte_tokenizer(), data(), g);
    if (t.serves_rollouts()) {
      t.serve_rollouts();
    } else {
      t.set_last_step(2);  // then moved to 3 before step 3: the rollout rank is told (kLastStep)
      r.evals.push_back(t.evaluate(test::eval_prompts(8)));
      for (int s = 1; s <= 3; ++s) {
        if (s == 3) t.set_last_step(3);
        r.steps.push_back(t.step());
        if (s != 2) continue;
        r.evals.push_back(t.evaluate(test::eval_prompts(8)));
        t.save(dir);
      }
      r.weights = weights_of(p);
    }
  }
  model::Muse p = policy(cfg.lora ? 4 : 5);  // LoRA resumes on its base alone (checked)
  GrpoTrainer t(p, cfg, test::byte_tokenizer(), data(), g);
  if (t.serves_rollouts()) {
    t.serve_rollouts();
    return r;
  }
  t.load(dir);
  t.set_last_step(3);
  r.resumed = t.step();
  r.resumed_weights = weights_of(p);
  return r;
}

void expect_same_step(const StepMetrics& a, const StepMetrics& b, const std::string& what) {
  EXPECT_EQ(a.reward, b.reward) << what;
  EXPECT_EQ(a.accuracy, b.accuracy) << what;
  EXPECT_EQ(a.loss, b.loss) << what;
  EXPECT_EQ(a.grad_norm, b.grad_norm) << what;
  EXPECT_EQ(a.tokens, b.tokens) << what;
  EXPECT_EQ(a.staleness, b.staleness) << what;
  EXPECT_EQ(a.mismatch.mean_abs_token, b.mismatch.mean_abs_token) << what;
}

void expect_same_weights(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << what << " tensor " << i;
}

TEST(AsyncSplit, EqualsTheColocatedRunBitwise) {
  const Group& w = Group::world();
  if (w.size() % 2 != 0) GTEST_SKIP() << "the split placement needs an even number of ranks";
  const int T = w.size() / 2;
  const bool trains = w.rank() < T;
  const Group half = w.split(trains ? 0 : 1, w.rank());  // the trainers alone run the reference
  for (int64_t k : {0, 1}) {
    const std::string what = "k = " + std::to_string(k);
    GrpoConfig cfg = split_grpo(k);
    SplitRun colocated;
    const std::string ref_dir = shared_dir("colocated" + std::to_string(k));
    if (trains) colocated = run(cfg, half, ref_dir);
    cfg.async->placement = AsyncConfig::Placement::kSplit;
    const std::string split_dir = shared_dir("split" + std::to_string(k));
    const SplitRun apart = run(cfg, w, split_dir);
    w.barrier();
    if (w.rank() == 0) {
      remove_tree(ref_dir);
      remove_tree(split_dir);
    }
    if (!trains) {
      EXPECT_TRUE(apart.steps.empty());
      continue;
    }
    ASSERT_EQ(apart.steps.size(), 3u) << what;
    for (size_t s = 0; s < 3; ++s) {
      const std::string at = what + ", step " + std::to_string(s + 1);
      expect_same_step(apart.steps[s], colocated.steps[s], at);
      // Batch 3 is sampled only once the last step moves to 3 after step 2, from the newest weights.
      EXPECT_EQ(apart.steps[s].staleness, s == 2 ? 0 : std::min<int64_t>(int64_t(s), k)) << at;
      EXPECT_GE(apart.steps[s].rollout_wait_seconds, 0) << at;
      // The rollout rank checked its weights against the trainer's probe log-probs.
      EXPECT_GE(apart.steps[s].sync_check, 0) << at;
      EXPECT_LT(apart.steps[s].sync_check, 1e-5) << at;
      EXPECT_GT(apart.steps[s].sync_bytes, 0) << at;
    }
    EXPECT_GT(colocated.steps[0].grad_norm, 0) << "all advantages zero: the comparison would be empty";
    ASSERT_EQ(apart.evals.size(), 2u);
    for (size_t e = 0; e < 2; ++e) {
      EXPECT_EQ(apart.evals[e].step, colocated.evals[e].step) << what;
      EXPECT_EQ(apart.evals[e].all.prompts, 8) << what;
      EXPECT_EQ(apart.evals[e].all.mean_at_k, colocated.evals[e].all.mean_at_k) << what << ", eval " << e;
      EXPECT_EQ(apart.evals[e].all.reward, colocated.evals[e].all.reward) << what << ", eval " << e;
    }
    expect_same_weights(apart.weights, colocated.weights, what);
    expect_same_step(apart.resumed, colocated.resumed, what + ", resumed step 3");
    expect_same_weights(apart.resumed_weights, colocated.resumed_weights, what + ", resumed");
    // Without a resume k = 0 is the synchronous run; a resume keeps that (step 3 equal).
    if (k == 0) expect_same_step(apart.resumed, apart.steps[2], "k = 0, resumed against uninterrupted");
  }
}

// LoRA (adapters sent, the rollout rank's engine sharing its own frozen base) and an NVFP4 rollout
// (each weight re-quantised as it arrives): the same run as colocated, bit for bit.
TEST(AsyncSplit, LoraAndNvfp4RolloutsEqualTheColocatedRun) {
  const Group& w = Group::world();
  if (w.size() % 2 != 0) GTEST_SKIP() << "the split placement needs an even number of ranks";
  const bool trains = w.rank() < w.size() / 2;
  const Group half = w.split(trains ? 0 : 1, w.rank());
  for (const std::string variant : {"lora", "nvfp4"}) {
    GrpoConfig cfg = split_grpo(1);
    if (variant == "lora") {
      cfg.lora = model::LoraConfig{4, 8};
    } else {
      cfg.engine.quantization = rollout::Quantization::kNvfp4;
    }
    SplitRun colocated;
    const std::string ref_dir = shared_dir("colocated-" + variant), split_dir = shared_dir("split-" + variant);
    if (trains) colocated = run(cfg, half, ref_dir);
    cfg.async->placement = AsyncConfig::Placement::kSplit;
    const SplitRun apart = run(cfg, w, split_dir);
    w.barrier();
    if (w.rank() == 0) {
      remove_tree(ref_dir);
      remove_tree(split_dir);
    }
    if (!trains) continue;
    ASSERT_EQ(apart.steps.size(), 3u) << variant;
    for (size_t s = 0; s < 3; ++s) {
      expect_same_step(apart.steps[s], colocated.steps[s], variant + ", step " + std::to_string(s + 1));
      EXPECT_GE(apart.steps[s].sync_check, 0) << variant;
      EXPECT_LT(apart.steps[s].sync_check, variant == "lora" ? 1e-5 : 1.0) << variant;
      // NVFP4 serves other weights than the trainer's: the probe check sees the difference.
      if (variant == "nvfp4") EXPECT_GT(apart.steps[s].sync_check, 0) << "the probe check did not run";
    }
    EXPECT_EQ(apart.evals[1].all.mean_at_k, colocated.evals[1].all.mean_at_k) << variant;
    expect_same_weights(apart.weights, colocated.weights, variant);
    expect_same_step(apart.resumed, colocated.resumed, variant + ", resumed step 3");
    expect_same_weights(apart.resumed_weights, colocated.resumed_weights, variant + ", resumed");
  }
}

// Four steps with the last step unknown, so that batches are made ahead of every checkpoint; with
// `dir`, a checkpoint after step 2 and a trainer of other initial weights resumed from it for steps
// 3 and 4. Returns steps 3 and 4 (in `steps`) and the final weights.
SplitRun run_through_a_resume(const GrpoConfig& cfg, const Group& g, const std::string& dir) {
  SplitRun r;
  model::Muse first = policy(4);
  auto trainer = std::make_unique<GrpoTrainer>(first, cfg, test::byte_tokenizer(), data(), g);
  if (trainer->serves_rollouts()) {
    trainer->serve_rollouts();
    if (dir.empty()) return r;
    model::Muse second = policy(5);
    GrpoTrainer again(second, cfg, test::byte_tokenizer(), data(), g);
    again.serve_rollouts();
    return r;
  }
  trainer->step();
  trainer->step();
  model::Muse second = policy(5);
  model::Muse* trained = &first;
  if (!dir.empty()) {
    trainer->save(dir);
    trainer.reset();  // its rollout rank returns from serving, and serves the next trainer
    trainer = std::make_unique<GrpoTrainer>(second, cfg, test::byte_tokenizer(), data(), g);
    trainer->load(dir);
    trained = &second;
  }
  for (int s = 3; s <= 4; ++s) r.steps.push_back(trainer->step());
  r.weights = weights_of(*trained);
  return r;
}

// The batches the rollout rank made ahead of a checkpoint go with it: the resumed run is the
// uninterrupted colocated one bit for bit.
TEST(AsyncSplit, AResumeKeepsTheBatchesMadeAhead) {
  const Group& w = Group::world();
  if (w.size() % 2 != 0) GTEST_SKIP() << "the split placement needs an even number of ranks";
  const bool trains = w.rank() < w.size() / 2;
  const Group half = w.split(trains ? 0 : 1, w.rank());
  GrpoConfig cfg = split_grpo(1);
  SplitRun whole;
  if (trains) whole = run_through_a_resume(cfg, half, "");
  cfg.async->placement = AsyncConfig::Placement::kSplit;
  const std::string dir = shared_dir("resume-ahead");
  const SplitRun apart = run_through_a_resume(cfg, w, dir);
  w.barrier();
  if (w.rank() == 0) remove_tree(dir);
  if (!trains) return;
  ASSERT_EQ(apart.steps.size(), 2u);
  for (size_t s = 0; s < 2; ++s) {
    const std::string at = "step " + std::to_string(s + 3);
    expect_same_step(apart.steps[s], whole.steps[s], at);
    EXPECT_EQ(apart.steps[s].staleness, 1) << at << ": the batch made ahead was sampled again";
  }
  expect_same_weights(apart.weights, whole.weights, "after step 4");
}

// A reward that fails on the rollout rank: its trainer's step says which rank and why, and the
// rollout rank's serve_rollouts throws the same error.
struct FailingReward : Reward {
  std::vector<RewardResult> score(const std::vector<RewardRequest>&) override {
    KILN_FAIL("the reward service is down");
  }
};

TEST(AsyncSplit, ARolloutRanksErrorReachesItsTrainer) {
  const Group& w = Group::world();
  if (w.size() % 2 != 0) GTEST_SKIP() << "the split placement needs an even number of ranks";
  GrpoConfig cfg = split_grpo(1);
  cfg.async->placement = AsyncConfig::Placement::kSplit;
  model::Muse p = policy(4);
  GrpoTrainer t(p, cfg, test::byte_tokenizer(), data(), w, std::make_shared<FailingReward>());
  if (t.serves_rollouts()) {
    EXPECT_TRUE(test::throws_with([&] { t.serve_rollouts(); }, {"the reward service is down"}));
    return;
  }
  const int peer = w.rank() + w.size() / 2;
  EXPECT_TRUE(test::throws_with([&] { t.step(); }, {"rollout rank " + std::to_string(peer), "the reward service is down"}));
  EXPECT_TRUE(test::throws_with([&] { t.step(); }, {"an earlier error left rollout rank"}));
}

// A failure on the trainer's side (a diverged update: a NaN weight under stop_after_nonfinite 1)
// ends the session cleanly: once the cause is gone the same trainer goes on, a new session starts
// from its weights, and the rollout rank serves to the end.
TEST(AsyncSplit, ATrainerSideFailureEndsTheSessionAndTheRunGoesOn) {
  const Group& w = Group::world();
  if (w.size() % 2 != 0) GTEST_SKIP() << "the split placement needs an even number of ranks";
  GrpoConfig cfg = split_grpo(1);
  cfg.async->placement = AsyncConfig::Placement::kSplit;
  cfg.stop_after_nonfinite = 1;
  model::Muse p = policy(4);
  GrpoTrainer t(p, cfg, test::byte_tokenizer(), data(), w);
  if (t.serves_rollouts()) {
    t.serve_rollouts();  // returns once its trainer is gone
    return;
  }
  t.set_last_step(4);
  EXPECT_TRUE(std::isfinite(t.step().loss));
  at::Tensor norm = p.weights().final_norm;
  const at::Tensor kept = norm.detach().clone();
  {
    at::NoGradGuard g;
    norm.fill_(std::nan(""));
  }
  EXPECT_TRUE(test::throws_with([&] { t.step(); }, {"not finite"}));
  {
    at::NoGradGuard g;
    norm.copy_(kept);
  }
  for (int64_t s = 3; s <= 4; ++s) {
    const StepMetrics m = t.step();
    EXPECT_EQ(m.step, s);
    EXPECT_TRUE(std::isfinite(m.loss)) << "step " << s;
    EXPECT_LE(m.staleness, 1) << "step " << s;
    EXPECT_GE(m.sync_check, 0) << "step " << s;
    EXPECT_LT(m.sync_check, 1e-5) << "step " << s;
  }
  EXPECT_EQ(t.evaluate(test::eval_prompts(8)).all.prompts, 8);
}

TEST(AsyncSplit, MisuseIsRefusedWithAMessage) {
  const Group& w = Group::world();
  if (w.size() % 2 != 0) return;
  GrpoConfig cfg = split_grpo(0);
  cfg.async->placement = AsyncConfig::Placement::kSplit;
  cfg.parallel.dense = parallel::DenseSharding::kZero3;
  model::Muse p = policy(4);
  EXPECT_TRUE(test::throws_with([&] { GrpoTrainer t(p, cfg, test::byte_tokenizer(), data(), w); },
                     {"async.placement split", "parallel.ep 1 and dense replicated"}));
  const Group alone = w.split(w.rank(), 0);  // one rank cannot be split in two halves
  cfg.parallel.dense = parallel::DenseSharding::kReplicated;
  EXPECT_TRUE(test::throws_with([&] { GrpoTrainer t(p, cfg, test::byte_tokenizer(), data(), alone); },
                     {"needs an even number of ranks", "got 1"}));
}

}  // namespace
}  // namespace kiln::trainer
