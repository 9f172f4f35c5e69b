// Environment workers with real processes: the request line, observations as text and as ids,
// rewards and done, answers the protocol rejects, a crash and a hang through the pool, and
// commands that cannot run stopped at the start.
#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "tests/test_util.h"
#include "trainer/environment.h"

namespace kiln::trainer {
namespace {

using test::throws_with;

EnvironmentSpec test_env() {
  EnvironmentSpec spec;
  spec.worker.command = {access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3",
                         test::source_path("tests/trainer/workers/test_env.py")};
  spec.worker.timeout_s = 3;
  spec.worker.shutdown_grace_s = 1;
  spec.worker.on_failure = OnFailure::kZero;
  spec.worker.start_check_s = 0;  // the start check has a test of its own
  return spec;
}

EnvRequest turn(int64_t id, const std::string& response, int64_t t = 0) {
  EnvRequest r;
  r.id = id;
  r.turn = t;
  r.prompt = "12+34=";
  r.response = response;
  r.response_ids = {int64_t(response.size()), 7};
  return r;
}

TEST(EnvironmentTest, RequestLineCarriesTheEpisode) {
  EnvRequest r = turn(5, "calc 2*3", 1);
  r.label = "46";
  r.metadata = R"({"k": [1]})";
  r.history.push_back({"first", "=6\n", {1, 2}, {3}});
  r.truncated = true;
  const nlohmann::json j = nlohmann::json::parse(environment_request_line(r));
  EXPECT_EQ(j["id"], 5);
  EXPECT_EQ(j["turn"], 1);
  EXPECT_EQ(j["prompt"], "12+34=");
  EXPECT_EQ(j["label"], "46");
  EXPECT_EQ(j["metadata"]["k"][0], 1);
  EXPECT_EQ(j["history"].size(), 1u);
  EXPECT_EQ(j["history"][0]["observation"], "=6\n");
  EXPECT_EQ(j["history"][0]["response_ids"], nlohmann::json::array({1, 2}));
  EXPECT_EQ(j["history"][0]["observation_ids"], nlohmann::json::array({3}));
  EXPECT_EQ(j["response"], "calc 2*3");
  EXPECT_EQ(j["response_ids"], nlohmann::json::array({8, 7}));
  EXPECT_EQ(j["truncated"], true);
  r.metadata = "[1]";
  EXPECT_TRUE(throws_with([&] { environment_request_line(r); }, {"metadata is not a JSON object", "id=5"}));
}

TEST(EnvironmentTest, ObservationsRewardsAndDone) {
  Environment env(test_env());
  const std::vector<EnvStep> s = env.step({turn(0, "text:=46\n"), turn(1, "ids:4,0,9"), turn(2, "end:1.5", 2)});
  ASSERT_EQ(s.size(), 3u);
  EXPECT_FALSE(s[0].done || s[0].failed || s[0].has_ids);
  EXPECT_EQ(s[0].observation, "=46\n");
  EXPECT_EQ(s[0].reward, 0.5);
  EXPECT_TRUE(s[1].has_ids && !s[1].done);
  EXPECT_EQ(s[1].observation_ids, (std::vector<int64_t>{4, 0, 9}));
  EXPECT_TRUE(s[2].done && !s[2].failed);
  EXPECT_EQ(s[2].reward, 1.5);
  ASSERT_EQ(s[2].components.size(), 1u);
  EXPECT_EQ(s[2].components[0], (std::pair<std::string, double>{"turns", 3.0}));
  // The worker sees what kiln sent: the echo comes back as the observation.
  const EnvStep echo = env.step({turn(9, "echo", 4)})[0];
  const nlohmann::json j = nlohmann::json::parse(echo.observation);
  EXPECT_EQ(j["turn"], 4);
  EXPECT_EQ(j["response_ids"], nlohmann::json::array({4, 7}));
}

TEST(EnvironmentTest, AnswersThatBreakTheProtocolFailTheirEpisode) {
  Environment env(test_env());
  const std::vector<EnvStep> s =
      env.step({turn(0, "nodone"), turn(1, "both"), turn(2, "badids"), turn(3, "error"), turn(4, "text:ok")});
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(s[size_t(i)].failed && s[size_t(i)].done && s[size_t(i)].reward == 0) << i;
  EXPECT_NE(s[0].error.find("\"done\" is missing"), std::string::npos) << s[0].error;
  EXPECT_NE(s[1].error.find("exactly one of \"observation\" and \"observation_ids\""), std::string::npos) << s[1].error;
  EXPECT_NE(s[2].error.find("\"observation_ids\"[1] is not a token id"), std::string::npos) << s[2].error;
  EXPECT_NE(s[3].error.find("cannot run this tool"), std::string::npos) << s[3].error;
  EXPECT_FALSE(s[4].failed);
  EXPECT_EQ(env.stats().num_failures, 4);
  // on_failure: stop names the environment, the command and the request.
  EnvironmentSpec stop = test_env();
  stop.worker.on_failure = OnFailure::kStop;
  Environment strict(stop);
  EXPECT_TRUE(throws_with([&] { strict.step({turn(7, "both")}); },
                          {"environment: request failed", "test_env.py", "id=7", "exactly one of"}));
}

EnvDemoRequest demo(int64_t id, const std::string& kind) { return {id, kind, "46", "arithmetic", "{}"}; }

TEST(EnvironmentTest, DemonstrationsAndTheAnswersTheProtocolRejects) {
  const nlohmann::json line = nlohmann::json::parse(environment_demo_line({4, "12+34=", "46", "d", R"({"k": 2})"}));
  EXPECT_EQ(line["id"], 4);
  EXPECT_EQ(line["demonstrate"], true);
  EXPECT_EQ(line["prompt"], "12+34=");
  EXPECT_EQ(line["label"], "46");
  EXPECT_EQ(line["metadata"]["k"], 2);
  Environment env(test_env());
  const std::vector<EnvDemo> d = env.demonstrate(
      {demo(0, "demo:text"), demo(1, "demo:ids"), demo(2, "demo:none"), demo(3, "demo:lastobs"), demo(4, "demo:noresponse")});
  ASSERT_EQ(d.size(), 5u);
  ASSERT_EQ(d[0].turns.size(), 2u);
  EXPECT_EQ(d[0].turns[0].response, "c 1+2");
  EXPECT_EQ(d[0].turns[0].observation, "=3\n");
  EXPECT_EQ(d[0].turns[1].response, "46");
  EXPECT_TRUE(d[0].turns[1].observation.empty() && d[0].turns[1].observation_ids.empty());
  ASSERT_EQ(d[1].turns.size(), 2u);
  EXPECT_EQ(d[1].turns[0].observation_ids, (std::vector<int64_t>{65, 66}));
  EXPECT_TRUE(d[2].turns.empty() && !d[2].failed);
  EXPECT_TRUE(d[3].failed && d[3].turns.empty());
  EXPECT_NE(d[3].error.find("the last turn (turns[0]) has an observation"), std::string::npos) << d[3].error;
  EXPECT_TRUE(d[4].failed);
  EXPECT_NE(d[4].error.find("turns[0] has no \"response\" string"), std::string::npos) << d[4].error;
}

TEST(EnvironmentTest, CrashAndHangEndOnlyTheirEpisodes) {
  EnvironmentSpec spec = test_env();
  spec.worker.num_workers = 2;
  spec.worker.timeout_s = 1;
  Environment env(spec);
  const std::vector<EnvStep> s = env.step({turn(0, "crash"), turn(1, "hang"), turn(2, "text:a"), turn(3, "end:1")});
  EXPECT_TRUE(s[0].failed && s[1].failed);
  EXPECT_NE(s[0].error.find("crashing on purpose"), std::string::npos) << s[0].error;
  EXPECT_NE(s[1].error.find("timeout_s=1"), std::string::npos) << s[1].error;
  EXPECT_TRUE(!s[2].failed && s[2].observation == "a");
  EXPECT_TRUE(!s[3].failed && s[3].done && s[3].reward == 1.0);
  EXPECT_GE(env.stats().num_restarts, 2);
}

// An environment whose command cannot run is an error at start(), before any episode, whatever
// on_failure says; so is one that exits at once (its status and stderr named).
TEST(EnvironmentTest, CommandThatCannotRunStopsAtTheStart) {
  EnvironmentSpec spec = test_env();
  spec.worker.command = {"/nonexistent/kiln-env"};
  Environment missing(spec);
  EXPECT_TRUE(throws_with([&] { missing.start(); },
                          {"environment: cannot start the command", "/nonexistent/kiln-env", "(errno 2)"}));
  EXPECT_TRUE(throws_with([&] { missing.step({turn(0, "text:a")}); }, {"environment: cannot start the command"}));
  spec.worker.command = {"sh", "-c", "echo env: no such task file >&2; exit 4"};
  spec.worker.start_check_s = 30;
  Environment exits(spec);
  EXPECT_TRUE(throws_with([&] { exits.start(); }, {"environment: the worker exited with status 4 right after it started",
                                                   "env: no such task file"}));
  spec = test_env();
  spec.worker.start_check_s = 0.2;
  Environment fine(spec);
  fine.start();
  EXPECT_EQ(fine.worker_pids().size(), 1u);
  EXPECT_FALSE(fine.step({turn(0, "text:a")})[0].failed);
}

TEST(EnvironmentTest, SpecIsChecked) {
  EnvironmentSpec spec = test_env();
  spec.max_turns = 0;
  EXPECT_TRUE(throws_with([&] { Environment e(spec); }, {"environment.max_turns", "below 1"}));
  spec = test_env();
  spec.worker.command.clear();
  EXPECT_TRUE(throws_with([&] { Environment e(spec); }, {"environment.command: missing"}));
  spec = test_env();
  spec.worker.max_failure_fraction = 1.5;
  EXPECT_TRUE(throws_with([&] { Environment e(spec); }, {"environment.max_failure_fraction: outside [0, 1]", "1.5"}));
  spec = test_env();
  spec.worker.start_check_s = -1;
  EXPECT_TRUE(throws_with([&] { Environment e(spec); }, {"environment.start_check_s: outside [0, 600]"}));
}

}  // namespace
}  // namespace kiln::trainer
