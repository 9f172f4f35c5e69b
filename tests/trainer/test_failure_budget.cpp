// Failing workers do not train in silence: the step's failure budget (max_failure_fraction) for
// rewards, sums and environments; a worker command that cannot start fails the trainer before its
// first step; a worker that fails every request stops the run at step 1, and with the budget
// lifted its failures are on the progress line and in metrics.jsonl.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>

#include "core/comm.h"
#include "core/error.h"
#include "tests/test_util.h"
#include "tests/trainer/grpo_fixtures.h"
#include "tests/trainer/small_model.h"
#include "trainer/batch_rewards.h"
#include "trainer/grpo.h"
#include "trainer/run.h"
#include "trainer/tasks.h"

namespace kiln::trainer {
namespace {

using test::throws_with;

std::string python() { return access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3"; }

// A batch of `prompts` x `n` samples of step 7, the last `failed` of them failed.
ProducedBatch batch_with_failures(int64_t prompts, int64_t n, int64_t failed) {
  ProducedBatch p;
  p.batch.total = prompts;
  p.batch.step = 7;
  const int64_t count = prompts * n;
  for (int64_t i = 0; i < count; ++i) {
    p.trajs.emplace_back();
    RewardRequest q;
    q.id = i;
    p.reqs.push_back(q);
    RewardResult r;
    r.reward = double(i % 2);
    if (i >= count - failed) {
      r = RewardResult();
      r.failed = true;
      r.error = str_cat("worker error: the judge is down (id=", i, ")");
    }
    p.results.push_back(r);
    p.lengths.push_back(1);
  }
  return p;
}

// finish_rewards on one rank: the failures it counts, or the error it throws.
std::string finish(const GrpoConfig& cfg, int64_t failed, int64_t* counted = nullptr) {
  StepMetrics m;
  std::vector<SampleRecord> samples;
  const std::string error = test::error_of([&] {
    finish_rewards(batch_with_failures(2, 4, failed), cfg, comm::Group::world(), m, samples);
  });
  if (counted) *counted = m.reward_failures;
  return error;
}

RewardSpec worker_reward(double max_failure_fraction) {
  RewardSpec r;
  r.type = RewardType::kWorker;
  r.worker.command = {"judge"};
  r.worker.max_failure_fraction = max_failure_fraction;
  return r;
}

TEST(FailureBudget, AStepWithMoreFailuresThanTheFractionStops) {
  GrpoConfig cfg = test::small_grpo(2, 4, 4);  // 8 samples a step
  cfg.reward = worker_reward(0.5);
  int64_t counted = 0;
  EXPECT_EQ(finish(cfg, 4, &counted), "");  // 4 of 8: at the limit, not past it
  EXPECT_EQ(counted, 4);
  const std::string e = finish(cfg, 5);
  for (const std::string part : {"grpo: 5 of the 8 samples of step 7 failed (reward errors)",
                                 "more than reward.max_failure_fraction=0.5 allows, whatever on_failure says",
                                 "the first failure (rank 0): worker error: the judge is down (id=3)",
                                 "raise reward.max_failure_fraction (1: never stop)"})
    EXPECT_NE(e.find(part), std::string::npos) << part << "\nin: " << e;
  cfg.reward.worker.max_failure_fraction = 1;
  EXPECT_EQ(finish(cfg, 8, &counted), "");
  EXPECT_EQ(counted, 8);
  cfg.reward.worker.max_failure_fraction = 0;
  EXPECT_EQ(finish(cfg, 0), "");
  EXPECT_NE(finish(cfg, 1), "");
}

TEST(FailureBudget, ASumTakesItsSmallestWorkerFractionAndTheEnvironmentItsOwn) {
  GrpoConfig cfg = test::small_grpo(2, 4, 4);
  RewardSpec exact;
  cfg.reward.type = RewardType::kSum;
  cfg.reward.parts = {worker_reward(0.9), exact, worker_reward(0.25)};
  cfg.reward.parts[0].name = "a";
  cfg.reward.parts[2].name = "b";
  EXPECT_EQ(cfg.reward.max_failure_fraction(), 0.25);
  EXPECT_EQ(finish(cfg, 2), "");
  EXPECT_NE(finish(cfg, 3).find("reward.max_failure_fraction=0.25"), std::string::npos);
  cfg.reward = RewardSpec();  // a built-in (or a Reward given in code): the default
  EXPECT_EQ(cfg.reward.max_failure_fraction(), 0.5);
  EXPECT_NE(finish(cfg, 5), "");
  cfg.environment.worker.command = {"env"};  // episodes: the environment's budget, whatever the reward's
  cfg.environment.worker.max_failure_fraction = 0.25;
  EXPECT_EQ(finish(cfg, 2), "");
  const std::string e = finish(cfg, 3);
  EXPECT_NE(e.find("grpo: 3 of the 8 episodes of step 7 failed (environment errors)"), std::string::npos) << e;
  EXPECT_NE(e.find("environment.max_failure_fraction=0.25"), std::string::npos) << e;
}

TEST(FailureBudget, ProtocolViolationsAreAStepMetric) {
  StepMetrics m;
  m.reward_stats.num_protocol_violations = 2;
  EXPECT_NE(m.to_json().find("\"protocol_violations\":2"), std::string::npos) << m.to_json();
}

// A worker (python) that answers every request with an error.
std::vector<std::string> failing_worker(const test::TempDir& dir, const std::string& why) {
  const std::string path = dir / "failing.py";
  std::ofstream(path) << "import json, sys\nfor line in sys.stdin:\n"
                         "    print(json.dumps({'id': json.loads(line)['id'], 'error': '"
                      << why << "'}), flush=True)\n";
  return {python(), path};
}

Dataset problems() { return split(arithmetic_problems(32, 1, 6), 0.25, 1); }

TEST(FailureBudget, AWorkerThatCannotStartFailsTheTrainerBeforeItsFirstStep) {
  model::Muse policy = model::Muse::init(test::byte_vocab_config(), 5, at::kFloat, at::kCPU);
  GrpoConfig cfg = test::small_grpo(2, 4, 2);
  cfg.reward = worker_reward(0.5);
  cfg.reward.worker.command = {"/nonexistent/judge.py"};
  cfg.reward.worker.on_failure = OnFailure::kZero;
  EXPECT_TRUE(throws_with([&] { GrpoTrainer t(policy, cfg, test::byte_tokenizer(), problems()); },
                          {"reward worker: cannot start the command", "/nonexistent/judge.py", "(errno 2)"}));
  cfg.reward = RewardSpec();
  cfg.environment.worker.command = {"sh", "-c", "echo env: cannot open tasks.json >&2; exit 2"};
  cfg.environment.worker.on_failure = OnFailure::kZero;
  EXPECT_TRUE(throws_with([&] { GrpoTrainer t(policy, cfg, test::byte_tokenizer(), problems()); },
                          {"environment: the worker exited with status 2 right after it started",
                           "env: cannot open tasks.json"}));
}

TEST(FailureBudget, AWorkerThatFailsEveryRequestStopsTheRunAtStepOne) {
  test::TempDir dir;
  model::Muse policy = model::Muse::init(test::byte_vocab_config(), 5, at::kFloat, at::kCPU);
  GrpoConfig cfg = test::small_grpo(2, 4, 2);
  cfg.reward = worker_reward(0.5);
  cfg.reward.worker.command = failing_worker(dir, "judge model not loaded");
  cfg.reward.worker.on_failure = OnFailure::kZero;
  cfg.reward.worker.start_check_s = 0.2;
  {
    GrpoTrainer trainer(policy, cfg, test::byte_tokenizer(), problems());
    EXPECT_TRUE(throws_with([&] { trainer.step(); }, {"grpo: 8 of the 8 samples of step 1 failed",
                                                      "reward.max_failure_fraction=0.5",
                                                      "worker error: judge model not loaded"}));
  }
  // With the budget lifted the run goes on, and says so: the progress line and metrics.jsonl.
  cfg.reward.worker.max_failure_fraction = 1;
  GrpoTrainer lenient(policy, cfg, test::byte_tokenizer(), problems());
  RunConfig rc;
  rc.steps = 1;
  rc.eval.prompts = 2;
  rc.tensorboard = false;
  rc.out = dir / "run";
  std::FILE* progress = std::tmpfile();
  ASSERT_NE(progress, nullptr);
  run_grpo(lenient, rc, progress);
  std::rewind(progress);
  std::string line;
  for (int c; (c = std::fgetc(progress)) != EOF;) line += char(c);
  std::fclose(progress);
  EXPECT_NE(line.find("fail 8/8"), std::string::npos) << line;
  std::ifstream metrics(dir / "run/metrics.jsonl");
  const std::string logged((std::istreambuf_iterator<char>(metrics)), std::istreambuf_iterator<char>());
  EXPECT_NE(logged.find("\"reward_failures\":8"), std::string::npos) << logged;
}

TEST(FailureBudget, AnEnvironmentThatFailsEveryTurnStopsTheRunAtStepOne) {
  test::TempDir dir;
  model::Muse policy = model::Muse::init(test::byte_vocab_config(), 5, at::kFloat, at::kCPU);
  GrpoConfig cfg = test::small_grpo(2, 4, 2);
  cfg.environment.worker.command = failing_worker(dir, "no such tool");
  cfg.environment.worker.on_failure = OnFailure::kZero;
  cfg.environment.worker.start_check_s = 0.2;
  GrpoTrainer trainer(policy, cfg, test::byte_tokenizer(), problems());
  EXPECT_TRUE(throws_with([&] { trainer.step(); }, {"grpo: 8 of the 8 episodes of step 1 failed (environment errors)",
                                                    "environment.max_failure_fraction=0.5",
                                                    "worker error: no such tool"}));
}

}  // namespace
}  // namespace kiln::trainer
