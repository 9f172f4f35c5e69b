// kiln train --dry-run's checks (trainer/dry_run.h) on muse-tiny recipes: a good recipe passes every
// check; a mistyped worker command, a missing data file, a checkpoint that lacks a tensor and a plan
// that cannot fit each fail their own check by name while the others still run.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "model/checkpoint.h"
#include "model/config.h"
#include "model/muse.h"
#include "tests/test_util.h"
#include "trainer/dry_run.h"
#include "trainer/recipe.h"

namespace kiln::trainer {
namespace {

const std::string kSource = KILN_SOURCE_DIR;

// The demo's recipe with `extra` appended (later keys of a section must not repeat earlier ones).
Recipe recipe(const test::TempDir& dir, const std::string& extra) {
  std::ifstream in(kSource + "/recipes/grpo-arith-tiny.yaml");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string from = "config: ../configs/muse-tiny.yaml";
  text.replace(text.find(from), from.size(), "config: " + kSource + "/configs/muse-tiny.yaml");
  const std::string path = dir.path() + "/recipe.yaml";
  std::ofstream(path) << text << extra;
  return Recipe::from_yaml_file(path);
}

const DryRunCheck* find(const std::vector<DryRunCheck>& checks, const std::string& name) {
  for (const DryRunCheck& c : checks)
    if (c.name == name) return &c;
  return nullptr;
}

std::string names(const std::vector<DryRunCheck>& checks) {
  std::string s;
  for (const DryRunCheck& c : checks)
    s += c.name + (c.skipped ? " skipped; " : c.ok ? " ok; " : " FAIL: " + c.detail + "; ");
  return s;
}

TEST(DryRun, AGoodRecipePassesEveryCheck) {
  test::TempDir dir;
  const std::vector<DryRunCheck> checks = dry_run(recipe(dir, ""), {});
  for (const DryRunCheck& c : checks) EXPECT_TRUE(c.ok) << c.name << ": " << c.detail;
  for (const char* name : {"model", "tokenizer", "data", "reward", "plan"}) EXPECT_NE(find(checks, name), nullptr) << name;
  EXPECT_NE(find(checks, "data")->detail.find("1800 train / 200 test examples"), std::string::npos)
      << find(checks, "data")->detail;
  EXPECT_NE(find(checks, "reward")->detail.find("scored 1"), std::string::npos) << find(checks, "reward")->detail;
  EXPECT_EQ(find(checks, "checkpoint"), nullptr);  // a random init has none
}

TEST(DryRun, AWorkerThatCannotStartFailsTheRewardCheckOnly) {
  test::TempDir dir;
  const Recipe r = recipe(dir, "");
  Recipe bad = r;
  bad.grpo.reward = RewardSpec();
  bad.grpo.reward.type = RewardType::kWorker;
  bad.grpo.reward.worker.command = {dir.path() + "/no_such_judge.py"};
  bad.grpo.reward.worker.on_failure = OnFailure::kZero;  // the start-up check fails whatever this says
  const std::vector<DryRunCheck> checks = dry_run(bad, {});
  const DryRunCheck* reward = find(checks, "reward");
  ASSERT_NE(reward, nullptr) << names(checks);
  EXPECT_FALSE(reward->ok);
  EXPECT_NE(reward->detail.find("no_such_judge.py"), std::string::npos) << reward->detail;
  for (const char* name : {"model", "tokenizer", "data", "plan"}) EXPECT_TRUE(find(checks, name)->ok) << names(checks);
}

TEST(DryRun, AMissingDataFileFailsTheDataCheck) {
  test::TempDir dir;
  Recipe r = recipe(dir, "");
  r.task = Task::kJsonl;
  r.data_path = dir.path() + "/missing.jsonl";
  const std::vector<DryRunCheck> checks = dry_run(r, {});
  ASSERT_NE(find(checks, "data"), nullptr) << names(checks);
  EXPECT_FALSE(find(checks, "data")->ok);
  EXPECT_NE(find(checks, "data")->detail.find("missing.jsonl"), std::string::npos) << find(checks, "data")->detail;
  EXPECT_TRUE(find(checks, "model")->ok);
  ASSERT_NE(find(checks, "reward"), nullptr) << names(checks);
  EXPECT_TRUE(find(checks, "reward")->skipped) << "the reward has no example to probe: " << names(checks);
}

TEST(DryRun, ACheckpointIsReadByItsHeadersAndAMissingTensorIsNamed) {
  test::TempDir dir;
  Recipe r = recipe(dir, "");
  r.init_from = dir.path() + "/ckpt";
  const model::ModelConfig cfg = model::ModelConfig::from_yaml_file(r.model_config);
  model::save_checkpoint(model::Muse::init(cfg, 1, at::kFloat, at::kCPU), r.init_from);
  std::vector<DryRunCheck> checks = dry_run(r, {});
  ASSERT_NE(find(checks, "checkpoint"), nullptr) << names(checks);
  EXPECT_TRUE(find(checks, "checkpoint")->ok) << find(checks, "checkpoint")->detail;
  // The same files under a config with one more layer: its tensors are missing.
  model::ModelConfig deeper = cfg;
  deeper.num_layers += 1;
  std::ofstream(r.init_from + "/config.json") << deeper.to_json();
  checks = dry_run(r, {});
  const DryRunCheck* ckpt = find(checks, "checkpoint");
  ASSERT_NE(ckpt, nullptr) << names(checks);
  EXPECT_FALSE(ckpt->ok);
  EXPECT_NE(ckpt->detail.find("model.layers." + std::to_string(cfg.num_layers)), std::string::npos) << ckpt->detail;
  EXPECT_TRUE(find(checks, "tokenizer")->ok) << names(checks);
}

TEST(DryRun, APlanThatCannotFitNamesWhatItNeeds) {
  test::TempDir dir;
  DryRunOptions o;
  o.nodes = 1;
  o.gpus_per_node = 2;
  o.gpu_bytes = 64.0 * (1 << 20);  // 64 MiB GPUs: muse-tiny's state and activations do not fit
  const std::vector<DryRunCheck> checks = dry_run(recipe(dir, ""), o);
  const DryRunCheck* plan = find(checks, "plan");
  ASSERT_NE(plan, nullptr) << names(checks);
  EXPECT_FALSE(plan->ok);
  EXPECT_NE(plan->detail.find("does not fit 64.00 MiB GPUs"), std::string::npos) << plan->detail;
  o.gpu_bytes = 140.0 * (1ll << 30);
  EXPECT_TRUE(find(dry_run(recipe(dir, ""), o), "plan")->ok);
}

}  // namespace
}  // namespace kiln::trainer
