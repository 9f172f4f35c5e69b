// Asynchronous GRPO (grpo.async): with staleness 0 the producer thread gives the synchronous run
// bit for bit; with k > 0 every batch is exactly min(step - 1, k) updates stale, runs repeat bit
// for bit whatever the threads' timing, and evaluation, checkpoints and resume work meanwhile (a
// resume keeps the batches made ahead and is the uninterrupted run bit for bit). And the rollout
// engine's counters the step reports.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <optional>

#include "tests/test_util.h"
#include "tests/trainer/grpo_fixtures.h"
#include "tests/trainer/small_model.h"
#include "trainer/grpo.h"
#include "trainer/tasks.h"

namespace kiln::trainer {
namespace {

// grpo.async with max_staleness k; without k the synchronous step.
GrpoConfig async_grpo(std::optional<int64_t> k) {
  GrpoConfig g = test::small_grpo(4, 4, 3);
  g.reward.type = RewardType::kRegexFormat;  // a digit anywhere: varies within groups
  g.reward.regex_format.pattern = "(?s).*[0-9].*";
  g.loss.tis = true;                          // off-policy batches: the rollout's log-probs correct
  if (k) g.async = AsyncConfig{*k};
  return g;
}

const Dataset& data() {
  static const Dataset d = split(arithmetic_problems(64, 1, 6), 0.25, 1);
  return d;
}

struct TrainedRun {
  std::vector<StepMetrics> steps;
  std::vector<at::Tensor> weights;
};

TrainedRun run(const GrpoConfig& cfg, int steps) {
  model::Muse policy = model::Muse::init(test::byte_vocab_config(), 4, at::kFloat, at::kCPU);
  GrpoTrainer trainer(policy, cfg, test::byte_tokenizer(), data());
  TrainedRun r;
  for (int s = 0; s < steps; ++s) r.steps.push_back(trainer.step());
  for (const auto& [name, t] : policy.named_parameters()) r.weights.push_back(t.detach().clone());
  return r;
}

void expect_same(const TrainedRun& a, const TrainedRun& b, const std::string& what) {
  ASSERT_EQ(a.steps.size(), b.steps.size());
  for (size_t i = 0; i < a.steps.size(); ++i) {
    EXPECT_EQ(a.steps[i].reward, b.steps[i].reward) << what << " step " << i + 1;
    EXPECT_EQ(a.steps[i].loss, b.steps[i].loss) << what << " step " << i + 1;
    EXPECT_EQ(a.steps[i].grad_norm, b.steps[i].grad_norm) << what << " step " << i + 1;
  }
  for (size_t i = 0; i < a.weights.size(); ++i) EXPECT_TRUE(at::equal(a.weights[i], b.weights[i])) << what;
}

TEST(GrpoAsync, StalenessZeroIsTheSynchronousRunBitwise) {
  const TrainedRun sync = run(async_grpo(std::nullopt), 3), threaded = run(async_grpo(0), 3);
  expect_same(sync, threaded, "k = 0");
  for (const StepMetrics& m : threaded.steps) {
    EXPECT_EQ(m.staleness, 0) << m.to_json();
    EXPECT_NE(m.to_json().find("\"async\":{\"staleness\":0"), std::string::npos);
  }
  EXPECT_EQ(sync.steps[0].staleness, -1);
  EXPECT_EQ(sync.steps[0].to_json().find("\"async\""), std::string::npos);
}

TEST(GrpoAsync, BatchesAreExactlyKStaleAndRunsRepeat) {
  for (int64_t k : {1, 2}) {
    const TrainedRun a = run(async_grpo(k), 5), b = run(async_grpo(k), 5);
    for (size_t i = 0; i < a.steps.size(); ++i) {
      EXPECT_EQ(a.steps[i].staleness, std::min<int64_t>(int64_t(i), k)) << a.steps[i].to_json();
      EXPECT_TRUE(std::isfinite(a.steps[i].loss) && std::isfinite(a.steps[i].grad_norm)) << a.steps[i].to_json();
    }
    expect_same(a, b, "k = " + std::to_string(k) + ", two runs");
  }
  // Stale batches train on other weights than the synchronous run's.
  const TrainedRun sync = run(async_grpo(std::nullopt), 3), stale = run(async_grpo(1), 3);
  EXPECT_EQ(sync.steps[0].loss, stale.steps[0].loss);  // step 1 is fresh either way
  EXPECT_NE(sync.steps[2].reward + sync.steps[2].loss, stale.steps[2].reward + stale.steps[2].loss);
}

// Steps 1 and 2 with an evaluation between them, a checkpoint after step 2 (the producer may be
// mid-batch: the save waits for it), then a trainer of other initial weights resumed from it for
// `more` steps.
std::vector<StepMetrics> interrupted_run(const GrpoConfig& cfg, const std::string& ckpt, int more,
                                         std::vector<at::Tensor>* weights = nullptr) {
  {
    model::Muse policy = model::Muse::init(test::byte_vocab_config(), 4, at::kFloat, at::kCPU);
    GrpoTrainer trainer(policy, cfg, test::byte_tokenizer(), data());
    trainer.step();
    const EvalMetrics e = trainer.evaluate(test::eval_prompts(4));  // pauses the producer, runs the engine
    EXPECT_EQ(e.all.prompts, 4);
    trainer.step();
    trainer.save(ckpt);
  }  // the destructor stops the producer mid-batch or between batches
  model::Muse resumed = model::Muse::init(test::byte_vocab_config(), 9, at::kFloat, at::kCPU);
  GrpoTrainer again(resumed, cfg, test::byte_tokenizer(), data());
  again.load(ckpt);
  EXPECT_EQ(again.steps_done(), 2);
  std::vector<StepMetrics> out;
  for (int s = 0; s < more; ++s) out.push_back(again.step());
  if (weights)
    for (const auto& [name, t] : resumed.named_parameters()) weights->push_back(t.detach().clone());
  return out;
}

// The checkpoint keeps the batches made ahead (sampled with weights older than its own): the
// resumed run trains them and is the uninterrupted run bit for bit, staleness included.
TEST(GrpoAsync, ResumeKeepsTheBatchesMadeAheadAndIsTheUninterruptedRunBitwise) {
  const test::TempDir tmp;
  for (int64_t k : {1, 2}) {
    const std::string what = "k = " + std::to_string(k);
    const GrpoConfig cfg = async_grpo(k);
    TrainedRun whole;
    {
      model::Muse policy = model::Muse::init(test::byte_vocab_config(), 4, at::kFloat, at::kCPU);
      GrpoTrainer trainer(policy, cfg, test::byte_tokenizer(), data());
      whole.steps.push_back(trainer.step());
      trainer.evaluate(test::eval_prompts(4));
      for (int s = 0; s < 3; ++s) whole.steps.push_back(trainer.step());
      for (const auto& [name, t] : policy.named_parameters()) whole.weights.push_back(t.detach().clone());
    }
    TrainedRun resumed;
    resumed.steps = interrupted_run(cfg, tmp.path() + "/ckpt" + std::to_string(k), 2, &resumed.weights);
    for (size_t s = 0; s < 2; ++s) {
      EXPECT_EQ(resumed.steps[s].step, int64_t(3 + s)) << what;
      EXPECT_EQ(resumed.steps[s].staleness, std::min<int64_t>(2 + int64_t(s), k)) << what << " " << resumed.steps[s].to_json();
      EXPECT_EQ(resumed.steps[s].staleness, whole.steps[2 + s].staleness) << what;
      EXPECT_TRUE(std::isfinite(resumed.steps[s].loss)) << what;
    }
    whole.steps.erase(whole.steps.begin(), whole.steps.begin() + 2);
    expect_same(resumed, whole, what + ", resumed against uninterrupted");
  }
}

TEST(GrpoAsync, CheckpointsOfOtherStalenessOrWithoutTheirBatchesAreHandled) {
  const test::TempDir tmp;
  const std::string dir = tmp.path() + "/ckpt";
  interrupted_run(async_grpo(1), dir, 0);
  {  // another max_staleness: the kept batches do not fit its schedule and are sampled again
    model::Muse policy = model::Muse::init(test::byte_vocab_config(), 9, at::kFloat, at::kCPU);
    GrpoTrainer again(policy, async_grpo(2), test::byte_tokenizer(), data());
    again.load(dir);
    {  // from the oldest batch's prompts: where the synchronous run is after two steps
      model::Muse other = model::Muse::init(test::byte_vocab_config(), 4, at::kFloat, at::kCPU);
      GrpoTrainer sync(other, async_grpo(std::nullopt), test::byte_tokenizer(), data());
      sync.step();
      sync.step();
      EXPECT_EQ(again.stream().position(), sync.stream().position());
      sync.load(dir);  // a synchronous run resumes from the same prompts
      EXPECT_EQ(sync.stream().position(), again.stream().position());
    }
    const StepMetrics m = again.step();
    EXPECT_EQ(m.step, 3);
    EXPECT_EQ(m.staleness, 0) << m.to_json();  // sampled with the loaded weights, all there are
  }
  // A damaged or missing file of batches is named.
  const std::string file = dir + "/ahead.bin";
  std::filesystem::resize_file(file, std::filesystem::file_size(file) / 2);
  model::Muse policy = model::Muse::init(test::byte_vocab_config(), 9, at::kFloat, at::kCPU);
  GrpoTrainer again(policy, async_grpo(1), test::byte_tokenizer(), data());
  EXPECT_TRUE(test::throws_with([&] { again.load(dir); }, {file}));
  std::filesystem::remove(file);
  EXPECT_TRUE(test::throws_with([&] { again.load(dir); }, {file, "missing"}));
}

TEST(GrpoAsync, MisuseIsRefused) {
  GrpoConfig bad = async_grpo(1);
  bad.dynamic_sampling = true;
  EXPECT_TRUE(test::throws_with([&] { bad.validate(); }, {"dynamic_sampling", "async"}));
  bad = async_grpo(-2);
  EXPECT_TRUE(test::throws_with([&] { bad.validate(); }, {"async.max_staleness must be >= 0"}));
}

// With the run's last step known, the producer samples nothing past it: the final sync waits for
// no extra batch, and the engine ran exactly one rollout per step.
TEST(GrpoAsync, NoBatchIsSampledPastTheLastStep) {
  model::Muse policy = model::Muse::init(test::byte_vocab_config(), 4, at::kFloat, at::kCPU);
  GrpoTrainer trainer(policy, async_grpo(2), test::byte_tokenizer(), data());
  trainer.set_last_step(3);
  for (int s = 0; s < 3; ++s) trainer.step();
  // 4 prompts per step: three batches drawn, not five.
  EXPECT_EQ(trainer.stream().position(), 12u);
}

// The step reports the rollout engine's preemptions and KV-cache peak: a cache short of what the
// step's sequences need at their full length preempts, and is nearly full at its peak.
TEST(GrpoEngineMetrics, PreemptionsAndKvPeakAreReported) {
  GrpoConfig cfg = async_grpo(std::nullopt);
  cfg.max_tokens = 8;
  cfg.engine.max_num_seqs = 16;
  const model::ModelConfig mc = test::byte_vocab_config();
  // Every window ring and a full-attention block per sequence, plus a third of the blocks that
  // whole sequences would need beyond that.
  const int64_t whole = rollout::kv_cache_bytes_for(mc, cfg.engine, 4, 8 + 8);
  const int64_t least = rollout::kv_cache_bytes_for(mc, cfg.engine, 4, 1);
  cfg.engine.kv_cache_bytes = least + (whole - least) / 3;
  model::Muse policy = model::Muse::init(mc, 4, at::kFloat, at::kCPU);
  GrpoTrainer trainer(policy, cfg, test::byte_tokenizer(), data());
  const StepMetrics m = trainer.step();
  EXPECT_GT(m.preemptions, 0) << m.to_json();
  EXPECT_GT(m.kv_peak, 0.5) << m.to_json();
  EXPECT_LE(m.kv_peak, 1.0) << m.to_json();
  EXPECT_NE(m.to_json().find("\"rollout_engine\":{\"preemptions\":"), std::string::npos);
}

}  // namespace
}  // namespace kiln::trainer
