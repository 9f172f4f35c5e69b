// Multi-turn episodes on a small model with real environment processes: the ids the trainer sees
// are the ids the engine sampled or was given, turn by turn; observations are out of the mask; the
// rollout's log-probs and routing equal a full forward of the episode; limits, environment
// failures, and GRPO steps and evaluation over episodes.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <numeric>

#include "tests/test_util.h"
#include "tests/trainer/grpo_fixtures.h"
#include "tests/trainer/small_model.h"
#include "trainer/episodes.h"
#include "trainer/grpo.h"
#include "trainer/scoring.h"
#include "trainer/tasks.h"

namespace kiln::trainer {
namespace {

EnvironmentSpec scripted_env(int turns, const std::vector<std::string>& flags = {}) {
  EnvironmentSpec spec;
  spec.worker.command = {access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3",
                         test::source_path("tests/trainer/workers/test_env.py"), "--script", std::to_string(turns)};
  spec.worker.command.insert(spec.worker.command.end(), flags.begin(), flags.end());
  spec.worker.timeout_s = 5;
  spec.worker.shutdown_grace_s = 1;
  spec.worker.on_failure = OnFailure::kZero;
  spec.worker.max_retries = 0;
  return spec;
}

struct EpisodeRig {
  model::Muse policy = model::Muse::init(test::byte_vocab_config(), 6, at::kFloat, at::kCPU);
  std::shared_ptr<const text::Tokenizer> tok = test::byte_tokenizer();
  std::vector<Example> examples = arithmetic_problems(3, 1, 9);
  rollout::Engine engine{policy, [] {
                           rollout::EngineConfig ec;
                           ec.kv_cache_bytes = 8 << 20;
                           ec.block_size = 4;
                           return ec;
                         }()};

  std::vector<std::vector<Episode>> run(Environment& env, int64_t max_tokens = 3) {
    std::vector<const Example*> ex;
    std::vector<rollout::Request> reqs;
    for (size_t i = 0; i < examples.size(); ++i) {
      examples[i].prompt_text = examples[i].prompt;
      examples[i].prompt_ids = tok->encode(examples[i].prompt);
      ex.push_back(&examples[i]);
      rollout::Request r;
      r.prompt = examples[i].prompt_ids;
      r.params.n = 2;
      r.params.max_tokens = max_tokens;
      r.params.temperature = 0.9;
      r.params.seed = 11 + i;
      reqs.push_back(r);
    }
    return run_episodes(engine, env, *tok, ex, reqs);
  }

  Trajectory trajectory(size_t i, const Episode& e) const {
    Trajectory t;
    t.tokens = examples[i].prompt_ids;
    t.prompt_len = int64_t(t.tokens.size());
    t.tokens.insert(t.tokens.end(), e.response.begin(), e.response.end());
    t.rollout_lp = e.logprobs;
    t.sampled = e.sampled;
    t.routing = e.routing;
    return t;
  }
};

TEST(Episodes, TheTrainerSeesTheIdsSampledAndGivenTurnByTurn) {
  EpisodeRig s;
  Environment env(scripted_env(3));
  const auto eps = s.run(env);
  ASSERT_EQ(eps.size(), 3u);
  EXPECT_EQ(s.engine.num_sessions(), 0);  // every session ended
  for (size_t i = 0; i < eps.size(); ++i) {
    ASSERT_EQ(eps[i].size(), 2u);
    for (const Episode& e : eps[i]) {
      ASSERT_EQ(e.turns.size(), 3u);
      EXPECT_TRUE(e.last.done && !e.last.failed && !e.truncated);
      // The response is each turn's sampled ids, then the observation's, exactly.
      std::vector<int64_t> want;
      std::vector<uint8_t> mask;
      for (size_t t = 0; t < e.turns.size(); ++t) {
        const EnvTurn& turn = e.turns[t];
        want.insert(want.end(), turn.response_ids.begin(), turn.response_ids.end());
        mask.insert(mask.end(), turn.response_ids.size(), 1);
        const std::vector<int64_t> obs =
            t + 1 == e.turns.size() ? std::vector<int64_t>{}
            : t % 2 == 0           ? s.tok->encode("o" + std::to_string(t) + "|")  // text, tokenized once
                                   : std::vector<int64_t>{65 + int64_t(t), 66 + int64_t(t)};  // ids as given
        EXPECT_EQ(turn.observation_ids, obs) << "turn " << t;
        want.insert(want.end(), obs.begin(), obs.end());
        mask.insert(mask.end(), obs.size(), 0);
      }
      EXPECT_EQ(e.response, want);
      EXPECT_EQ(e.sampled, mask);
      EXPECT_EQ(e.routing.size(0), int64_t(s.examples[i].prompt_ids.size() + e.response.size()));
      EXPECT_EQ(e.last.reward, double(std::accumulate(e.turns.back().response_ids.begin(),
                                                      e.turns.back().response_ids.end(), int64_t(0)) % 2));
      // A full forward of the episode: the rollout's routing, and its log-probs on drawn tokens.
      const std::vector<Trajectory> traj = {s.trajectory(i, e)};
      const Scored own = score_trajectories(s.policy, traj, false, 8, 0.9, model::ForwardOptions());
      EXPECT_TRUE(test::all_equal(own.routing, e.routing));
      const Packed p = pack(traj, 0, 1, at::kCPU, at::kDouble);
      const int64_t P = int64_t(s.examples[i].prompt_ids.size());
      for (size_t j = 0; j < e.response.size(); ++j) {
        const int64_t pos = P + int64_t(j) - 1;  // the position that predicts response token j
        EXPECT_EQ(p.mask[pos].item<double>(), double(e.sampled[j])) << j;
        if (e.sampled[j]) EXPECT_NEAR(own.logprobs[pos].item<double>(), e.logprobs[j], 1e-5) << j;
      }
    }
  }
}

TEST(Episodes, LimitsEndEpisodesTruncated) {
  EpisodeRig s;
  EnvironmentSpec spec = scripted_env(5);
  spec.max_turns = 2;
  Environment env(spec);
  for (const auto& request : s.run(env))
    for (const Episode& e : request) {
      EXPECT_EQ(e.turns.size(), 2u);
      EXPECT_TRUE(e.truncated && !e.last.done);
      EXPECT_EQ(s.engine.num_sessions(), 0);
    }
  spec = scripted_env(5);
  spec.max_episode_tokens = 6;  // 3 sampled + "o0|" leave no room for a second turn
  Environment tight(spec);
  for (const auto& request : s.run(tight))
    for (const Episode& e : request) {
      EXPECT_LE(int64_t(e.response.size()), 6);
      EXPECT_TRUE(e.truncated);
    }
}

TEST(Episodes, EnvironmentFailuresEndOnlyTheirEpisodes) {
  EpisodeRig s;
  EnvironmentSpec crashing = scripted_env(3, {"--crash-turn", "1"});
  crashing.worker.max_retries = 1;  // a crash charges every request on the worker: the innocent go again alone
  Environment env(crashing);
  int failed = 0, finished = 0;
  for (const auto& request : s.run(env))
    for (const Episode& e : request) {
      const bool odd = !e.turns.empty() && e.turns[0].response_ids[0] % 2 == 1;
      if (odd) {
        EXPECT_TRUE(e.last.failed && e.last.reward == 0 && e.turns.size() == 2u) << e.last.error;
        EXPECT_NE(e.last.error.find("crashing on turn 1"), std::string::npos) << e.last.error;
      } else {
        EXPECT_TRUE(!e.last.failed && e.turns.size() == 3u);
      }
      failed += odd, finished += !odd;
    }
  EXPECT_GT(failed, 0);  // both kinds among these seeds' first tokens
  EXPECT_GT(finished, 0);
  EXPECT_EQ(s.engine.num_sessions(), 0);
  Environment bad(scripted_env(3, {"--bad-ids"}));
  for (const auto& request : s.run(bad))
    for (const Episode& e : request) {
      EXPECT_TRUE(e.bad_observation && e.last.failed);
      EXPECT_NE(e.last.error.find("observation_ids holds 100000, outside the vocabulary (128 ids)"), std::string::npos)
          << e.last.error;
    }
  Environment nul(scripted_env(3, {"--nul-text"}));
  for (const auto& request : s.run(nul))
    for (const Episode& e : request) {
      EXPECT_TRUE(e.bad_observation && e.last.failed && e.turns.size() == 1u);
      EXPECT_NE(e.last.error.find("the tokenizer rejects the observation"), std::string::npos) << e.last.error;
    }
  EnvironmentSpec strict = scripted_env(3, {"--bad-ids"});
  strict.worker.on_failure = OnFailure::kStop;
  Environment stop(strict);
  EXPECT_TRUE(test::throws_with([&] { s.run(stop); }, {"outside the vocabulary", "on_failure: zero"}));
  EXPECT_EQ(s.engine.num_sessions(), 0);  // the error left no session or queued turn behind
  EXPECT_FALSE(s.engine.has_unfinished());
}

TEST(Grpo, MultiTurnEpisodesTrainAndEvaluate) {
  model::Muse policy = model::Muse::init(test::byte_vocab_config(), 4, at::kFloat, at::kCPU);
  GrpoConfig cfg = test::small_grpo(2, 4, 3);
  cfg.environment = scripted_env(3);
  GrpoTrainer trainer(policy, cfg, test::byte_tokenizer(), split(arithmetic_problems(32, 1, 6), 0.25, 1));
  for (int step = 0; step < 2; ++step) {
    const StepMetrics m = trainer.step();
    EXPECT_EQ(m.episode_turns, 3.0) << m.to_json();
    EXPECT_GT(m.observation_tokens, 0.0);
    EXPECT_TRUE(std::isfinite(m.loss) && std::isfinite(m.grad_norm)) << m.to_json();
    EXPECT_NE(m.to_json().find("\"episodes\""), std::string::npos);
    // The mismatch covers the drawn tokens only: 8 episodes of 3 turns of at most 3 tokens.
    EXPECT_EQ(double(m.mismatch.tokens), m.response_length * 8) << m.to_json();
    EXPECT_LT(m.mismatch.mean_abs_token, 1e-4) << m.to_json();
  }
  const EvalMetrics e = trainer.evaluate(test::eval_prompts(4));
  EXPECT_EQ(e.all.prompts, 4);
  EXPECT_GE(e.all.reward, 0.0);
  GrpoConfig bad = cfg;
  bad.overlong_buffer = 1;
  EXPECT_TRUE(test::throws_with([&] { bad.validate(); }, {"not defined for multi-turn episodes"}));
}

}  // namespace
}  // namespace kiln::trainer
