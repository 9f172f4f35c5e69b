// The GRPO run loop and its logs (metrics.jsonl, TensorBoard, samples.jsonl, progress line).
#include "trainer/run.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>

#include "core/comm.h"
#include "core/error.h"
#include "core/step_logs.h"
#include "core/stop_signal.h"
#include "core/tensorboard.h"
#include "core/yaml_util.h"

namespace kiln::trainer {
namespace {

std::FILE* open_log(const std::string& path, bool append) {
  std::FILE* f = std::fopen(path.c_str(), append ? "a" : "w");
  KILN_CHECK(f, "run: cannot open ", path, " for writing (", std::strerror(errno), "); check the run directory");
  return f;
}

}  // namespace

RunLog::RunLog(const std::string& dir, bool tensorboard, int64_t resumed_at) : dir_(dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  KILN_CHECK(!ec, "run: cannot create the run directory ", dir, " (", ec.message(), ")");
  if (resumed_at > 0) {  // before the event writer adds its file to the folder
    const LogCut m = keep_jsonl_through(dir + "/metrics.jsonl", resumed_at);
    const LogCut s = keep_jsonl_through(dir + "/samples.jsonl", resumed_at);
    const LogCut t = keep_events_through(dir + "/tensorboard", resumed_at);
    const uint64_t torn = m.torn_bytes + s.torn_bytes + t.torn_bytes;
    if (m.dropped + s.dropped + t.dropped > 0 || torn > 0)
      cut_report_ = fmt::format("run: the interrupted run had logged past step {}: cut {} metrics.jsonl line(s), "
                                "{} samples.jsonl line(s), {} TensorBoard record(s) and {} byte(s) of a write "
                                "cut short", resumed_at, m.dropped, s.dropped, t.dropped, torn);
  }
  metrics_ = open_log(dir + "/metrics.jsonl", /*append=*/resumed_at > 0);
  if (tensorboard) tb_ = std::make_unique<tensorboard::EventWriter>(dir + "/tensorboard");
}

RunLog::~RunLog() {
  if (metrics_) std::fclose(metrics_);
  if (samples_) std::fclose(samples_);
}

void RunLog::write_line(const std::string& file, std::FILE* f, const std::string& line) {
  const bool ok = std::fwrite(line.data(), 1, line.size(), f) == line.size() && std::fputc('\n', f) != EOF &&
                  std::fflush(f) == 0;
  KILN_CHECK(ok, "run: cannot write ", dir_, "/", file, " (", std::strerror(errno),
             "); check the disk space and permissions of the run directory");
}

// Every numeric field of a metrics object as a TensorBoard scalar; nested objects become
// "prefix/outer/inner".
void RunLog::scalars(const std::string& prefix, const std::string& json, int64_t step) {
  if (!tb_) return;
  std::function<void(const std::string&, const nlohmann::json&)> put = [&](const std::string& tag,
                                                                           const nlohmann::json& v) {
    if (v.is_object()) {
      for (auto& [k, inner] : v.items()) put(tag + "/" + k, inner);
    } else if (v.is_number()) {
      tb_->add_scalar(tag, v.get<double>(), step);
    }
  };
  const nlohmann::json parsed = nlohmann::json::parse(json);  // named: items() must not outlive it
  for (auto& [k, v] : parsed.items())
    if (k != "step") put(prefix + "/" + k, v);
  tb_->flush();
}

void RunLog::step(const StepMetrics& m) {
  const std::string line = m.to_json();
  write_line("metrics.jsonl", metrics_, line);
  scalars("train", line, m.step);
}

void RunLog::eval(const EvalMetrics& m) {
  const std::string line = m.to_json();
  write_line("metrics.jsonl", metrics_, line);
  scalars("eval", line, m.step);
}

void RunLog::samples(int64_t step, const std::vector<GrpoTrainer::SampleRecord>& samples) {
  if (!samples_) samples_ = open_log(dir_ + "/samples.jsonl", true);
  for (const auto& s : samples) {
    nlohmann::ordered_json j{{"step", step},       {"prompt", s.prompt}, {"response", s.response},
                             {"label", s.label},   {"data_source", s.data_source},
                             {"reward", s.reward}, {"components", s.components},
                             {"truncated", s.truncated}};
    write_line("samples.jsonl", samples_, j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  }
  if (tb_ && !samples.empty()) {
    const auto& s = samples.front();
    tb_->add_text("samples", "prompt:\n" + s.prompt + "\n\nresponse:\n" + s.response + "\n\nreward: " +
                                 std::to_string(s.reward), step);
    tb_->flush();
  }
}

namespace {
// For the collective-timeout test: KILN_STALL_AT=<step>:<rank> makes that rank stop answering
// after that step (it sleeps for an hour), as a hung or wedged rank would.
void stall_for_tests(int64_t step, int rank) {
  const char* v = std::getenv("KILN_STALL_AT");
  if (v && std::to_string(step) + ":" + std::to_string(rank) == v) std::this_thread::sleep_for(std::chrono::hours(1));
}
}  // namespace

RunResult run_grpo(GrpoTrainer& trainer, const RunConfig& c, std::FILE* progress) {
  const comm::Group& world = trainer.group();  // the ranks that train (not those that only roll out)
  const bool lead = world.rank() == 0;
  const int64_t first = trainer.steps_done() + 1;
  std::unique_ptr<RunLog> log;
  if (lead) log = std::make_unique<RunLog>(c.out, c.tensorboard, /*resumed_at=*/first - 1);
  if (lead && progress && !log->cut_report().empty()) std::fprintf(progress, "%s\n", log->cut_report().c_str());
  const std::string ckpt = c.out + "/checkpoint";
  auto evaluate = [&] {
    EvalMetrics e = trainer.evaluate(c.eval);
    if (lead) log->eval(e);
    return e;
  };
  EvalMetrics last;
  trainer.set_last_step(c.steps);  // grpo.async: no batch is sampled past the run's end, nor before the first eval
  if (first == 1) {
    last = evaluate();
    if (lead && progress)
      std::fprintf(progress, "step 0: held-out mean@%lld %.3f, pass@%lld %.3f\n", (long long)last.k,
                   last.all.mean_at_k, (long long)last.k, last.all.pass_at_k);
  }
  const auto start = std::chrono::steady_clock::now();
  int64_t tokens = 0;
  for (int64_t s = first; s <= c.steps; ++s) {
    StepMetrics m = trainer.step();
    tokens += m.tokens;
    if (lead) log->step(m);
    if (c.samples_every > 0 && s % c.samples_every == 0 && lead) {
      const auto& all = trainer.last_samples();
      const size_t n = std::min(all.size(), size_t(std::max<int64_t>(c.samples_per_dump, 0)));
      log->samples(s, std::vector<GrpoTrainer::SampleRecord>(all.begin(), all.begin() + std::ptrdiff_t(n)));
    }
    if ((c.eval_every > 0 && s % c.eval_every == 0) || s == c.steps) last = evaluate();
    stall_for_tests(s, world.rank());
    const bool saved = (c.checkpoint_every > 0 && s % c.checkpoint_every == 0) || s == c.steps;
    if (saved) trainer.save(ckpt);
    // A signal seen by any rank stops all of them after the same step.
    const int sig = int(world.all_reduce(double(stop_signal::received()), comm::ReduceOp::kMax));
    if (sig != 0 && s < c.steps) {
      if (!saved) trainer.save(ckpt);
      if (lead && progress) std::fprintf(progress, "\n");
      return RunResult{last, s, sig};
    }
    if (!lead || !progress) continue;
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // A synchronous full-parameter engine reads the trained weights themselves: nothing to send.
    const std::string sync = !m.weights_shared ? fmt::format("sync {:.1f} MB {:.1f} ms ({:.1f} GB/s)",
                                                            double(m.sync_bytes) / 1e6, m.sync_seconds * 1e3,
                                                            m.sync_gbps())
                                              : std::string("weights shared");
    // The step's samples the reward or environment could not score: a run that scores them 0 must show it.
    std::fprintf(progress, "\rstep %lld/%lld  reward %.3f  acc %.3f  fail %lld/%lld  eval %.3f  mismatch %.2e  %s  "
                 "%.0f tok/s  ETA %.0f s   ", (long long)s, (long long)c.steps, m.reward, m.accuracy,
                 (long long)m.reward_failures, (long long)m.reward_stats.num_requests, last.all.mean_at_k,
                 m.mismatch.mean_abs_token, sync.c_str(), double(tokens) / secs,
                 secs / double(s - first + 1) * double(c.steps - s));
    std::fflush(progress);
  }
  if (lead && progress && first <= c.steps) std::fprintf(progress, "\n");
  return RunResult{last, 0, 0};
}

void read_yaml(yaml::MapReader& m, RunConfig& c, uint64_t& seed) {
  m.get("steps", c.steps);
  m.get("checkpoint_every", c.checkpoint_every);
  m.get("samples_every", c.samples_every);
  m.get("samples_per_dump", c.samples_per_dump);
  m.get("tensorboard", c.tensorboard);
  m.get("seed", seed);
  m.get("out", c.out);
  m.finish();
  if (c.steps < 0) m.fail("steps", "must be >= 0");
  if (c.checkpoint_every < 0) m.fail("checkpoint_every", "must be >= 0 (0: only at the end)");
  if (c.samples_every < 0) m.fail("samples_every", "must be >= 0 (0: no sample dumps)");
}

void write_yaml(YAML::Emitter& e, const RunConfig& c, uint64_t seed) {
  e << YAML::Key << "steps" << YAML::Value << c.steps;
  e << YAML::Key << "checkpoint_every" << YAML::Value << c.checkpoint_every;
  e << YAML::Key << "samples_every" << YAML::Value << c.samples_every;
  e << YAML::Key << "samples_per_dump" << YAML::Value << c.samples_per_dump;
  e << YAML::Key << "tensorboard" << YAML::Value << c.tensorboard;
  e << YAML::Key << "seed" << YAML::Value << seed;
  e << YAML::Key << "out" << YAML::Value << c.out;
}

void read_eval_yaml(yaml::MapReader& m, RunConfig& c) {
  m.get("every", c.eval_every);
  read_yaml(m, c.eval);
  m.finish();
  if (c.eval_every < 0) m.fail("every", "must be >= 0 (0: only at the start and the end)");
  m.check("", [&] { c.eval.validate(); });
}

void write_eval_yaml(YAML::Emitter& e, const RunConfig& c) {
  e << YAML::Key << "every" << YAML::Value << c.eval_every;
  write_yaml(e, c.eval);
}

}  // namespace kiln::trainer
