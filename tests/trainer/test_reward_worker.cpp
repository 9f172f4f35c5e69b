// Reward workers end to end with real processes: the shipped example worker, crashes, hangs,
// garbage, out-of-order answers, workers that cannot start (the start check), protocol violations,
// stderr floods, a closed stdin (SIGPIPE), a pool of 3 under 100 requests, and no zombie or stray
// process left behind.
#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <thread>

#include "tests/test_util.h"
#include "trainer/reward_worker.h"

namespace kiln::trainer {
namespace {

using test::throws_with;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string python() { return access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3"; }

WorkerSpec test_worker(const std::vector<std::string>& flags = {}) {
  WorkerSpec spec;
  spec.command = {python(), test::source_path("tests/trainer/workers/test_worker.py")};
  spec.command.insert(spec.command.end(), flags.begin(), flags.end());
  spec.timeout_s = 5;
  spec.shutdown_grace_s = 1;
  spec.on_failure = OnFailure::kZero;
  spec.start_check_s = 0;  // the start check has its own tests; these reach the pool's later failures
  return spec;
}

// A file the test writes (a worker script), executable or not.
std::string write_file(const test::TempDir& dir, const std::string& name, const std::string& text, bool executable) {
  const std::string path = dir / name;
  std::ofstream(path) << text;
  chmod(path.c_str(), executable ? 0755 : 0644);
  return path;
}

RewardRequest request(int64_t id, const std::string& response, const std::string& label = "") {
  RewardRequest r;
  r.id = id;
  r.response = response;
  r.label = label;
  r.prompt = "p" + std::to_string(id);
  return r;
}

// Requests the test worker answers with reward = label = 1.5 * id.
std::vector<RewardRequest> plain_requests(int64_t first, int64_t n) {
  std::vector<RewardRequest> out;
  for (int64_t id = first; id < first + n; ++id) out.push_back(request(id, "ok", std::to_string(1.5 * double(id))));
  return out;
}

void expect_plain(const RewardRequest& req, const RewardResult& res) {
  EXPECT_FALSE(res.failed) << "id=" << req.id << ": " << res.error;
  EXPECT_EQ(res.reward, 1.5 * double(req.id)) << "id=" << req.id;
}

double component(const RewardResult& r, const std::string& name) {
  for (const auto& [n, v] : r.components)
    if (n == name) return v;
  ADD_FAILURE() << "no component " << name;
  return NAN;
}

struct Proc {
  int pid;
  char state;
  int ppid, pgrp;
};

// Every process on the machine, from /proc/<pid>/stat.
std::vector<Proc> processes() {
  std::vector<Proc> out;
  DIR* dir = opendir("/proc");
  if (!dir) return out;
  while (dirent* e = readdir(dir)) {
    const int pid = std::atoi(e->d_name);
    if (pid <= 0) continue;
    std::ifstream in(std::string("/proc/") + e->d_name + "/stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t paren = stat.rfind(')');
    if (paren == std::string::npos) continue;
    std::istringstream rest(stat.substr(paren + 2));
    Proc p{pid, '?', 0, 0};
    rest >> p.state >> p.ppid >> p.pgrp;
    out.push_back(p);
  }
  closedir(dir);
  return out;
}

std::vector<Proc> children() {
  std::vector<Proc> out;
  for (const Proc& p : processes())
    if (p.ppid == getpid()) out.push_back(p);
  return out;
}

// Our children are exactly the live workers, none a zombie.
void expect_only_workers(const WorkerReward& reward) {
  std::vector<int> pids = reward.worker_pids(), kids;
  for (const Proc& p : children()) {
    EXPECT_NE(p.state, 'Z') << "zombie child " << p.pid;
    kids.push_back(p.pid);
  }
  std::sort(pids.begin(), pids.end());
  std::sort(kids.begin(), kids.end());
  EXPECT_EQ(kids, pids);
}

// Nothing of ours is left, and no process of the given groups (a worker's own children) either.
void expect_all_gone(const std::vector<int>& groups = {}) {
  const Clock::time_point t0 = Clock::now();
  for (;;) {
    std::vector<Proc> left = children();
    for (const Proc& p : processes())
      if (std::find(groups.begin(), groups.end(), p.pgrp) != groups.end() && p.state != 'Z') left.push_back(p);
    if (left.empty()) return;
    if (seconds_since(t0) > 2) {  // a SIGKILLed grandchild takes a moment to disappear
      for (const Proc& p : left) ADD_FAILURE() << "process left: pid=" << p.pid << " state=" << p.state;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// ---- protocol ----

TEST(WorkerProtocolTest, RequestLineCarriesEveryField) {
  RewardRequest r = request(42, "caf\xc3\xa9 \xff!", "7");
  r.data_source = "gsm8k";
  r.metadata = "{\"difficulty\": 3, \"tags\": [\"a\"]}";
  r.truncated = true;
  const std::string line = worker_request_line(r);
  EXPECT_EQ(line.find('\n'), std::string::npos);
  for (char c : line) EXPECT_LT(static_cast<unsigned char>(c), 128) << line;  // ASCII on the wire
  const nlohmann::json j = nlohmann::json::parse(line);
  EXPECT_EQ(j["id"], 42);
  EXPECT_EQ(j["prompt"], "p42");
  EXPECT_EQ(j["response"], "caf\xc3\xa9 \xef\xbf\xbd!");  // invalid UTF-8 became U+FFFD
  EXPECT_EQ(j["label"], "7");
  EXPECT_EQ(j["data_source"], "gsm8k");
  EXPECT_EQ(j["metadata"]["difficulty"], 3);
  EXPECT_EQ(j["truncated"], true);
  r.metadata = "";
  EXPECT_TRUE(nlohmann::json::parse(worker_request_line(r))["metadata"].is_object());
  r.metadata = "[1, 2]";
  EXPECT_TRUE(throws_with([&] { worker_request_line(r); }, {"metadata is not a JSON object", "id=42"}));
}

// ---- the shipped example ----

TEST(WorkerRewardTest, ExampleWorkerScoresMath) {
  RewardSpec spec;
  spec.type = RewardType::kWorker;
  spec.worker.command = {python(), test::source_path("recipes/reward_worker_example.py")};
  spec.worker.num_workers = 2;
  auto reward = make_reward(spec);
  const std::vector<RewardRequest> reqs = {
      request(1, "so \\boxed{\\frac{1}{2}}", "0.5"), request(2, "the answer is 1,000.", "1000"),
      request(3, "\\boxed{7}", "8"),                   request(4, "\\boxed{\\sqrt{2}}", "\\sqrt{2}"),
      request(5, "no idea", "3"),                      request(6, "#### 12\n so 12", "12")};
  const std::vector<RewardResult> out = reward->score(reqs);
  ASSERT_EQ(out.size(), reqs.size());
  const std::vector<std::pair<double, double>> expected = {{1, 1}, {1, 0}, {0, 1}, {1, 1}, {0, 0}, {1, 0}};
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_FALSE(out[i].failed) << out[i].error;
    EXPECT_EQ(component(out[i], "correct"), expected[i].first) << reqs[i].response;
    EXPECT_EQ(component(out[i], "format"), expected[i].second) << reqs[i].response;
    EXPECT_DOUBLE_EQ(out[i].reward, expected[i].first + 0.1 * expected[i].second) << reqs[i].response;
  }
  const RewardStats s = reward->stats();
  EXPECT_EQ(s.num_requests, 6);
  EXPECT_EQ(s.num_answered, 6);
  EXPECT_EQ(s.num_failures + s.num_restarts + s.num_garbage_lines, 0);
  EXPECT_GT(s.mean_seconds(), 0.0);
  reward.reset();
  expect_all_gone();
}

// ---- ordering and the pool ----

TEST(WorkerRewardTest, OutOfOrderAnswersAreMatchedById) {
  WorkerSpec spec = test_worker({"--reverse"});
  spec.max_in_flight = 16;
  WorkerReward reward(spec);
  const std::vector<RewardRequest> reqs = plain_requests(100, 16);
  const std::vector<RewardResult> out = reward.score(reqs);
  for (size_t i = 0; i < reqs.size(); ++i) expect_plain(reqs[i], out[i]);
  EXPECT_EQ(component(out[3], "len"), 2.0);
  EXPECT_EQ(reward.stats().num_garbage_lines, 0);
}

TEST(WorkerRewardTest, PoolOfThreeAnswersEachOfManyRequestsOnce) {
  test::TempDir dir;
  const std::string log = dir / "ids.txt";
  WorkerSpec spec = test_worker({"--log", log});
  spec.num_workers = 3;
  WorkerReward reward(spec);
  EXPECT_TRUE(reward.worker_pids().empty());  // lazy: nothing runs before the first call
  const std::vector<RewardRequest> reqs = plain_requests(0, 100);
  const std::vector<RewardResult> out = reward.score(reqs);
  ASSERT_EQ(out.size(), reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) expect_plain(reqs[i], out[i]);
  std::map<int, int> seen;  // every request reached a worker exactly once
  std::ifstream in(log);
  for (int id; in >> id;) ++seen[id];
  EXPECT_EQ(seen.size(), 100u);
  for (const auto& [id, count] : seen) EXPECT_EQ(count, 1) << "id=" << id;
  const std::vector<int> pids = reward.worker_pids();
  EXPECT_EQ(pids.size(), 3u);
  expect_only_workers(reward);
  // The same processes serve the next call, with ids that repeat the first call's.
  const std::vector<RewardRequest> again = plain_requests(50, 10);
  const std::vector<RewardResult> out2 = reward.score(again);
  for (size_t i = 0; i < again.size(); ++i) expect_plain(again[i], out2[i]);
  EXPECT_EQ(reward.worker_pids(), pids);
  const RewardStats s = reward.stats();
  EXPECT_EQ(s.num_requests, 110);
  EXPECT_EQ(s.num_answered, 110);
  EXPECT_EQ(s.num_failures + s.num_restarts + s.num_retries + s.num_timeouts + s.num_garbage_lines, 0);
}

TEST(WorkerRewardTest, RepeatedIdsInOneCallAreRejected) {
  WorkerReward reward(test_worker());
  EXPECT_TRUE(throws_with([&] { reward.score({request(1, "a"), request(2, "b"), request(1, "c")}); },
                          {"request id used twice", "id=1", "positions 0 and 2"}));
  EXPECT_TRUE(reward.worker_pids().empty());
}

// ---- crashes ----

TEST(WorkerRewardTest, CrashIsRestartedAndTheRequestRetried) {
  test::TempDir dir;
  WorkerReward reward(test_worker());
  std::vector<RewardRequest> reqs = plain_requests(0, 6);
  reqs[2].response = "crash-once:" + (dir / "crashed");
  const std::vector<RewardResult> out = reward.score(reqs);
  for (size_t i = 0; i < reqs.size(); ++i) expect_plain(reqs[i], out[i]);
  const RewardStats s = reward.stats();
  EXPECT_EQ(s.num_restarts, 1);
  EXPECT_GE(s.num_retries, 1);
  EXPECT_EQ(s.num_failures, 0);
  expect_only_workers(reward);
}

TEST(WorkerRewardTest, RequestThatAlwaysCrashesFailsAfterOneRetry) {
  WorkerSpec spec = test_worker();
  spec.num_workers = 2;
  std::vector<RewardRequest> reqs = plain_requests(0, 12);
  reqs[5].response = "crash";
  {
    WorkerReward reward(spec);
    const std::vector<RewardResult> out = reward.score(reqs);
    for (size_t i = 0; i < reqs.size(); ++i)
      if (i != 5) expect_plain(reqs[i], out[i]);
    EXPECT_TRUE(out[5].failed);
    EXPECT_EQ(out[5].reward, 0.0);
    EXPECT_NE(out[5].error.find("exited with status 3"), std::string::npos) << out[5].error;
    EXPECT_NE(out[5].error.find("attempts=2"), std::string::npos) << out[5].error;
    EXPECT_NE(out[5].error.find("crashing on purpose (id=5)"), std::string::npos) << out[5].error;
    const RewardStats s = reward.stats();
    EXPECT_EQ(s.num_failures, 1);
    EXPECT_GE(s.num_restarts, 1);
    EXPECT_LE(s.num_restarts, 2);
    expect_only_workers(reward);
  }

  spec.on_failure = OnFailure::kStop;
  WorkerReward strict(spec);
  EXPECT_TRUE(throws_with([&] { strict.score(reqs); },
                          {"reward worker: request failed", "test_worker.py", "id=5", "exited with status 3",
                           "crashing on purpose (id=5)", "on_failure: zero"}));
  expect_only_workers(strict);  // workers with requests on them when it threw are gone
  const std::vector<RewardResult> after = strict.score(plain_requests(0, 4));  // and the pool still works
  for (size_t i = 0; i < after.size(); ++i) expect_plain(plain_requests(0, 4)[i], after[i]);
}

// ---- hangs ----

TEST(WorkerRewardTest, HungRequestTimesOutAndItsWorkerIsKilled) {
  WorkerSpec spec = test_worker();
  spec.timeout_s = 0.3;
  WorkerReward reward(spec);
  std::vector<RewardRequest> reqs = plain_requests(0, 8);
  reqs[1].response = "hang";
  const Clock::time_point t0 = Clock::now();
  const std::vector<RewardResult> out = reward.score(reqs);
  const double elapsed = seconds_since(t0);
  EXPECT_LT(elapsed, 3.0);
  EXPECT_GE(elapsed, 0.6);  // two attempts of 0.3 s each
  for (size_t i = 0; i < reqs.size(); ++i)
    if (i != 1) expect_plain(reqs[i], out[i]);
  EXPECT_TRUE(out[1].failed);
  EXPECT_NE(out[1].error.find("timeout_s=0.3"), std::string::npos) << out[1].error;
  const RewardStats s = reward.stats();
  EXPECT_EQ(s.num_timeouts, 2);
  EXPECT_EQ(s.num_failures, 1);
  EXPECT_GE(s.num_restarts, 1);
  expect_only_workers(reward);
}

TEST(WorkerRewardTest, KillReachesAWrappersChildren) {
  WorkerSpec spec;
  spec.command = {"sh", "-c", python() + " " + test::source_path("tests/trainer/workers/test_worker.py") + "; true"};
  spec.timeout_s = 0.3;
  spec.max_retries = 0;
  spec.on_failure = OnFailure::kZero;
  spec.shutdown_grace_s = 0.2;
  auto reward = std::make_unique<WorkerReward>(spec);
  expect_plain(request(0, "ok", "0"), reward->score({request(0, "ok", "0")})[0]);
  const std::vector<int> groups = reward->worker_pids();
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_TRUE(reward->score({request(1, "hang")})[0].failed);
  expect_all_gone(groups);  // the python under sh is gone too
  reward.reset();
  expect_all_gone();
}

TEST(WorkerRewardTest, DestructorKillsWorkersThatIgnoreEndOfInput) {
  WorkerSpec spec;
  spec.command = {python(), "-c",
                  "import json, sys, time\n"
                  "for line in sys.stdin:\n"
                  "    print(json.dumps({'id': json.loads(line)['id'], 'reward': 1}), flush=True)\n"
                  "time.sleep(60)\n"};
  spec.num_workers = 2;
  spec.shutdown_grace_s = 0.3;
  auto reward = std::make_unique<WorkerReward>(spec);
  EXPECT_EQ(reward->score(plain_requests(0, 4))[3].reward, 1.0);
  const Clock::time_point t0 = Clock::now();
  reward.reset();
  EXPECT_LT(seconds_since(t0), 1.5);
  expect_all_gone();
}

// ---- bad output ----

TEST(WorkerRewardTest, GarbageIsCountedAndBadAnswersFailTheirRequest) {
  WorkerReward reward(test_worker());
  std::vector<RewardRequest> reqs = plain_requests(0, 8);
  reqs[1].response = "garbage";  // three junk lines (limit 3), then its answer
  reqs[2].response = "nan";
  reqs[3].response = "str";
  reqs[4].response = "error";
  reqs[5].response = "dup";  // the repeat is one more junk line
  const std::vector<RewardResult> out = reward.score(reqs);
  for (size_t i : {0, 6, 7}) expect_plain(reqs[i], out[i]);
  EXPECT_FALSE(out[1].failed) << out[1].error;
  EXPECT_FALSE(out[5].failed) << out[5].error;
  EXPECT_EQ(out[5].reward, 7.5);
  EXPECT_TRUE(out[2].failed);
  EXPECT_NE(out[2].error.find("not valid JSON"), std::string::npos) << out[2].error;
  EXPECT_TRUE(out[3].failed);
  EXPECT_NE(out[3].error.find("not a finite number"), std::string::npos) << out[3].error;
  EXPECT_TRUE(out[4].failed);
  EXPECT_NE(out[4].error.find("worker error: cannot parse the response"), std::string::npos) << out[4].error;
  const RewardStats s = reward.stats();
  EXPECT_EQ(s.num_garbage_lines, 4);
  EXPECT_EQ(s.num_protocol_violations, 2);  // the unknown id 987654321 and the repeat
  EXPECT_EQ(s.num_failures, 3);
  EXPECT_EQ(s.num_restarts, 1);  // the fourth junk line passed max_garbage_lines
  expect_only_workers(reward);
}

// An unreadable answer fails the request its top-level "id" names, not one named inside it.
TEST(WorkerRewardTest, UnreadableAnswerFailsTheRequestItsTopLevelIdNames) {
  WorkerReward reward(test_worker());
  std::vector<RewardRequest> reqs = plain_requests(0, 3);
  reqs[1].response = "nestednan";  // names request 2 inside its components, itself at the top
  const std::vector<RewardResult> out = reward.score(reqs);
  expect_plain(reqs[0], out[0]);
  expect_plain(reqs[2], out[2]);
  EXPECT_TRUE(out[1].failed);
  EXPECT_NE(out[1].error.find("not valid JSON"), std::string::npos) << out[1].error;
  EXPECT_EQ(reward.stats().num_garbage_lines, 0);
}

TEST(WorkerRewardTest, WorkerPastTheGarbageLimitIsRestarted) {
  WorkerSpec spec = test_worker();
  spec.max_garbage_lines = 1;
  WorkerReward reward(spec);
  std::vector<RewardRequest> reqs = plain_requests(0, 5);
  reqs[4].response = "garbage";
  const std::vector<RewardResult> out = reward.score(reqs);
  for (size_t i = 0; i < 4; ++i) expect_plain(reqs[i], out[i]);
  EXPECT_TRUE(out[4].failed);
  EXPECT_NE(out[4].error.find("name no request in flight"), std::string::npos) << out[4].error;
  EXPECT_EQ(reward.stats().num_restarts, 1);  // for the retry alone, which fails it
  expect_only_workers(reward);
}

// ---- workers that cannot run: the start check ----

// Not found, not executable, a #! line naming no interpreter: posix_spawnp's errno, named with
// the command, whatever on_failure says; the same from score() on a pool that has not started.
TEST(WorkerStartTest, CommandThatCannotBeExecutedStopsWhateverOnFailureSays) {
  test::TempDir dir;
  const std::string plain = write_file(dir, "judge.py", "print('hi')\n", false);
  const std::string no_interpreter = write_file(dir, "judge2.py", "#!/nonexistent/python9\nprint('hi')\n", true);
  const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> cases = {
      {{"/nonexistent/kiln-reward-worker", "--flag"},
       {"/nonexistent/kiln-reward-worker --flag", "No such file or directory (errno 2)", "check the path"}},
      {{plain}, {plain, "Permission denied (errno 13)", "chmod +x"}},
      {{no_interpreter}, {no_interpreter, "(errno 2)", "#! line"}},
  };
  for (OnFailure policy : {OnFailure::kStop, OnFailure::kZero})
    for (const auto& [command, parts] : cases) {
      WorkerSpec spec;
      spec.command = command;
      spec.on_failure = policy;
      WorkerReward reward(spec);
      std::vector<std::string> expected = parts;
      expected.push_back("reward worker: cannot start the command");
      EXPECT_TRUE(throws_with([&] { reward.start(); }, expected));
      EXPECT_TRUE(throws_with([&] { reward.score(plain_requests(0, 5)); }, expected));
      EXPECT_EQ(reward.stats().num_failures, 0);
    }
  expect_all_gone();
}

// A worker that starts and exits at once (its script missing a module, say): the exit status and
// its stderr, as soon as it exits rather than after the whole check.
TEST(WorkerStartTest, WorkerThatExitsAtOnceStopsWithItsStatusAndStderr) {
  test::TempDir dir;
  const std::string script = write_file(dir, "fail.sh", "echo \"judge: no module named 'vllm'\" >&2\nexit 7\n", false);
  for (OnFailure policy : {OnFailure::kStop, OnFailure::kZero}) {
    WorkerSpec spec;
    spec.command = {"sh", script};
    spec.num_workers = 2;
    spec.on_failure = policy;
    spec.start_check_s = 30;
    WorkerReward reward(spec);
    const Clock::time_point t0 = Clock::now();
    EXPECT_TRUE(throws_with([&] { reward.start(); },
                            {"reward worker: the worker exited with status 7 right after it started, before any request",
                             "sh " + script, "start_check_s=30", "judge: no module named 'vllm'"}));
    EXPECT_LT(seconds_since(t0), 10.0);
    EXPECT_TRUE(throws_with([&] { reward.score(plain_requests(0, 3)); }, {"exited with status 7", "vllm"}));
    EXPECT_EQ(reward.stats().num_failures, 0);
  }
  // The test worker's own way to fail at start: its stderr line is in the error.
  WorkerSpec spec = test_worker({"--exit-at-start"});
  spec.start_check_s = 30;
  WorkerReward reward(spec);
  EXPECT_TRUE(throws_with([&] { reward.score(plain_requests(0, 3)); },
                          {"test_worker.py --exit-at-start", "exited with status 1", "cannot load the scoring model"}));
  EXPECT_TRUE(throws_with([&] { reward.start(); }, {"exited with status 1"}));  // checked again, not passed
  expect_only_workers(reward);
}

TEST(WorkerStartTest, WorkerThatClosesItsStdoutAtOnceStopsAndIsKilled) {
  WorkerSpec spec;
  spec.command = {"sh", "-c", "exec 1>&-; echo closing stdout >&2; exec sleep 30"};
  spec.start_check_s = 30;
  WorkerReward reward(spec);
  const Clock::time_point t0 = Clock::now();
  EXPECT_TRUE(throws_with([&] { reward.start(); }, {"the worker closed its stdout right after it started",
                                                    "exec sleep 30", "closing stdout"}));
  EXPECT_LT(seconds_since(t0), 10.0);
  expect_all_gone();  // the sleep went with it
}

TEST(WorkerStartTest, HealthyWorkersPassOnceAndServe) {
  WorkerSpec spec = test_worker();
  spec.num_workers = 2;
  spec.start_check_s = 0.3;
  WorkerReward reward(spec);
  EXPECT_TRUE(reward.worker_pids().empty());
  Clock::time_point t0 = Clock::now();
  reward.start();
  EXPECT_GE(seconds_since(t0), 0.3);  // every worker watched for the whole check
  const std::vector<int> pids = reward.worker_pids();
  EXPECT_EQ(pids.size(), 2u);
  expect_only_workers(reward);
  t0 = Clock::now();
  reward.start();  // passed: nothing to do
  EXPECT_LT(seconds_since(t0), 0.2);
  const std::vector<RewardRequest> reqs = plain_requests(0, 8);
  const std::vector<RewardResult> out = reward.score(reqs);
  for (size_t i = 0; i < reqs.size(); ++i) expect_plain(reqs[i], out[i]);
  EXPECT_EQ(reward.worker_pids(), pids);
  EXPECT_EQ(reward.stats().num_restarts, 0);
}

TEST(WorkerStartTest, SumStartsItsWorkerParts) {
  RewardSpec judge;
  judge.type = RewardType::kWorker;
  judge.name = "judge";
  judge.worker.command = {"/nonexistent/judge"};
  RewardSpec exact;
  exact.type = RewardType::kExactMatch;
  RewardSpec sum;
  sum.type = RewardType::kSum;
  sum.parts = {exact, judge};
  auto reward = make_reward(sum);
  EXPECT_TRUE(throws_with([&] { reward->start(); }, {"reward worker: cannot start the command", "/nonexistent/judge"}));
}

// A worker that passes the start check and then dies at every start is the restart limit's: each
// call's requests fail (score 0 under on_failure: zero) without looping forever.
TEST(WorkerRewardTest, WorkerThatExitsAtStartScoresZeroWithoutLoopingForever) {
  WorkerSpec spec = test_worker({"--exit-at-start"});  // start_check_s 0: no watch
  spec.num_workers = 2;
  spec.max_restarts = 3;
  WorkerReward reward(spec);
  const Clock::time_point t0 = Clock::now();
  const std::vector<RewardResult> out = reward.score(plain_requests(0, 20));
  EXPECT_LT(seconds_since(t0), 5.0);
  for (const RewardResult& r : out) {
    EXPECT_TRUE(r.failed);
    EXPECT_EQ(r.reward, 0.0);
  }
  EXPECT_NE(out.back().error.find("restart limit reached (max_restarts=3"), std::string::npos) << out.back().error;
  const RewardStats s = reward.stats();
  EXPECT_EQ(s.num_failures, 20);
  EXPECT_EQ(s.num_restarts, 3);
  expect_only_workers(reward);
  reward.score(plain_requests(0, 2));  // the next call tries again, within its own budget
  EXPECT_EQ(reward.stats().num_restarts, 6);
}

// ---- protocol violations ----

// Answers every request, and breaks the protocol as argv[1] says: "next" first answers the next id
// (a request not sent to it, or none of the call's), "dup" answers twice, "late" repeats its answer
// 0.3 s later, when kiln has moved on. Each line pair is one write, so kiln reads it at once.
constexpr const char* kLiar = R"(import json, os, sys, time
mode = sys.argv[1]
for line in sys.stdin:
    rid = json.loads(line)["id"]
    ans = json.dumps({"id": rid, "reward": 1.0}) + "\n"
    if mode == "next":
        ans = json.dumps({"id": rid + 1, "reward": 0.5}) + "\n" + ans
    if mode == "dup":
        ans = ans + ans
    os.write(1, ans.encode())
    if mode == "late":
        time.sleep(0.3)
        os.write(1, ans.encode())
)";

WorkerSpec liar(const test::TempDir& dir, const std::string& mode) {
  WorkerSpec spec = test_worker();
  spec.command = {python(), write_file(dir, "liar.py", kLiar, false), mode};
  spec.max_in_flight = 1;       // one request at a time: the next waits in kiln
  spec.max_garbage_lines = 100;  // violations are garbage too; keep the worker
  return spec;
}

void expect_all_scored(const std::vector<RewardResult>& out) {
  for (const RewardResult& r : out) {
    EXPECT_FALSE(r.failed) << r.error;
    EXPECT_EQ(r.reward, 1.0);
  }
}

TEST(WorkerProtocolTest, AnswersToIdsNotSentAreCountedAndWarnedAbout) {
  test::TempDir dir;
  WorkerReward reward(liar(dir, "next"));
  testing::internal::CaptureStderr();
  const std::vector<RewardResult> out = reward.score(plain_requests(0, 3));
  const std::string warned = testing::internal::GetCapturedStderr();
  expect_all_scored(out);
  EXPECT_EQ(reward.stats().num_protocol_violations, 3);
  EXPECT_EQ(reward.stats().num_garbage_lines, 3);
  for (const std::string& part :
       {"kiln: warning: reward worker: protocol violation: an answer to request id 1, not sent to this worker",
        "an answer to request id 2, not sent to this worker", "an answer to id 3, which no request of this call has",
        "liar.py next", "line={\"id\": 3, \"reward\": 0.5}"})
    EXPECT_NE(warned.find(part), std::string::npos) << part << "\nin:\n" << warned;
}

TEST(WorkerProtocolTest, SecondAnswersAreCountedAndTheWarningsBounded) {
  test::TempDir dir;
  WorkerReward reward(liar(dir, "dup"));
  testing::internal::CaptureStderr();
  const std::vector<RewardResult> out = reward.score(plain_requests(0, 7));
  const std::string warned = testing::internal::GetCapturedStderr();
  expect_all_scored(out);
  EXPECT_EQ(reward.stats().num_protocol_violations, 7);
  EXPECT_NE(warned.find("a second answer to request id 0 (command="), std::string::npos) << warned;
  EXPECT_NE(warned.find("a second answer to request id 2"), std::string::npos) << warned;
  EXPECT_EQ(warned.find("a second answer to request id 3"), std::string::npos) << warned;  // 3 a call
  EXPECT_NE(warned.find("reward worker: 4 more protocol violations in this call (command="), std::string::npos)
      << warned;
}

TEST(WorkerProtocolTest, ARepeatWrittenBetweenCallsIsNotTakenForAnAnswer) {
  test::TempDir dir;
  WorkerReward reward(liar(dir, "late"));
  expect_all_scored(reward.score(plain_requests(0, 1)));
  std::this_thread::sleep_for(std::chrono::milliseconds(700));  // the repeat is waiting in the pipe
  testing::internal::CaptureStderr();
  expect_all_scored(reward.score(plain_requests(0, 1)));  // the same id again
  const std::string warned = testing::internal::GetCapturedStderr();
  EXPECT_EQ(reward.stats().num_protocol_violations, 1);
  EXPECT_NE(warned.find("an answer to id 0 written while the worker had no request"), std::string::npos) << warned;
}

TEST(WorkerProtocolTest, ViolationsStopTheRunUnderOnFailureStop) {
  test::TempDir dir;
  for (const std::string mode : {"dup", "next"}) {
    WorkerSpec spec = liar(dir, mode);
    spec.on_failure = OnFailure::kStop;
    WorkerReward reward(spec);
    EXPECT_TRUE(throws_with([&] { reward.score(plain_requests(0, 3)); },
                            {"reward worker: protocol violation:", mode == "dup" ? "a second answer to request id 0"
                                                                                 : "an answer to request id 1",
                             "liar.py " + mode, "on_failure: zero"}));
    EXPECT_EQ(reward.stats().num_protocol_violations, 1);
  }
  WorkerSpec spec = liar(dir, "late");
  spec.on_failure = OnFailure::kStop;
  WorkerReward reward(spec);
  expect_all_scored(reward.score(plain_requests(0, 1)));
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  EXPECT_TRUE(throws_with([&] { reward.score(plain_requests(0, 1)); },
                          {"protocol violation: an answer to id 0 written while the worker had no request"}));
}
// ---- pipes ----

TEST(WorkerRewardTest, FloodOfStderrDoesNotDeadlock) {
  WorkerSpec spec = test_worker({"--stderr-flood", "64"});  // 64 KiB per request: a pipe's worth
  spec.max_in_flight = 2;
  WorkerReward reward(spec);
  const std::vector<RewardRequest> reqs = plain_requests(0, 30);
  const std::vector<RewardResult> out = reward.score(reqs);
  for (size_t i = 0; i < reqs.size(); ++i) expect_plain(reqs[i], out[i]);

  spec.on_failure = OnFailure::kStop;
  WorkerReward strict(spec);
  std::vector<RewardRequest> crash = plain_requests(0, 2);
  crash[1].response = "crash";
  const std::string message = test::error_of([&] { strict.score(crash); });
  EXPECT_NE(message.find("crashing on purpose"), std::string::npos) << message.substr(0, 300);
  EXPECT_LT(message.size(), 20000u);  // the stderr tail is bounded (16 KiB)
}

TEST(WorkerRewardTest, WorkerThatClosesStdinCannotKillUsWithSigpipe) {
  WorkerSpec spec = test_worker({"--close-stdin"});
  spec.max_restarts = 2;
  WorkerReward reward(spec);
  std::vector<RewardRequest> reqs = plain_requests(0, 3);
  for (RewardRequest& r : reqs) r.prompt = std::string(300000, 'p');  // more than a pipe holds: EPIPE
  const Clock::time_point t0 = Clock::now();
  const std::vector<RewardResult> out = reward.score(reqs);  // SIGPIPE's default would end this process
  EXPECT_LT(seconds_since(t0), 4.0);
  for (const RewardResult& r : out) EXPECT_TRUE(r.failed);
  EXPECT_NE(out[0].error.find("stopped reading its stdin"), std::string::npos) << out[0].error;
  sigset_t mask, pending;
  pthread_sigmask(SIG_BLOCK, nullptr, &mask);
  sigpending(&pending);
  EXPECT_FALSE(sigismember(&mask, SIGPIPE));  // the caller's mask is back
  EXPECT_FALSE(sigismember(&pending, SIGPIPE));
  expect_only_workers(reward);
}

// ---- sums ----

TEST(WorkerRewardTest, SumMarksAFailedWorkerPart) {
  RewardSpec judge;
  judge.type = RewardType::kWorker;
  judge.name = "judge";
  judge.worker = test_worker();
  RewardSpec exact;
  exact.type = RewardType::kExactMatch;
  exact.weight = 0.5;
  RewardSpec sum;
  sum.type = RewardType::kSum;
  sum.parts = {judge, exact};
  auto reward = make_reward(sum);
  std::vector<RewardRequest> reqs = {request(1, "3", "3"), request(2, "error", "3")};
  const std::vector<RewardResult> out = reward->score(reqs);
  EXPECT_FALSE(out[0].failed);
  EXPECT_EQ(out[0].reward, 3.0 + 0.5);
  EXPECT_EQ(component(out[0], "judge/len"), 1.0);
  EXPECT_TRUE(out[1].failed);
  EXPECT_EQ(out[1].reward, 0.0);
  EXPECT_NE(out[1].error.find("judge: worker error"), std::string::npos) << out[1].error;
  const RewardStats s = reward->stats();
  EXPECT_EQ(s.num_requests, 2);
  EXPECT_EQ(s.num_failures, 1);
  EXPECT_EQ(s.num_answered, 2);
}

}  // namespace
}  // namespace kiln::trainer
