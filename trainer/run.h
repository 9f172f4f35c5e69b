// The outer GRPO loop that `kiln train` runs: the step loop with evaluation and checkpoint cadence,
// and what a run leaves in its directory: metrics.jsonl, TensorBoard event files, sample dumps and
// the live progress line. Rank 0 writes; every rank steps.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "core/yaml_fwd.h"
#include "trainer/grpo.h"

namespace kiln::tensorboard {
class EventWriter;
}

namespace kiln::trainer {

// Where one run's numbers go: <dir>/metrics.jsonl (one JSON object per step or evaluation),
// TensorBoard events under <dir>/tensorboard/ (every numeric field, as "train/<key>" or
// "eval/<key>"), and sample dumps in <dir>/samples.jsonl. Every write is checked: a full disk or
// an unwritable file is an error naming the file.
class RunLog {
 public:
  // `resumed_at`: 0 for a fresh run (metrics.jsonl starts empty); else the step of the checkpoint
  // a resumed run continues from. What the interrupted run logged after that step (its lines in
  // metrics.jsonl and samples.jsonl, evaluations included, and its TensorBoard records) is cut
  // (core/step_logs.h), so each step the run redoes appears once; the rest is appended to.
  RunLog(const std::string& dir, bool tensorboard, int64_t resumed_at);
  ~RunLog();
  // What the cut of a resumed run removed, one line ("" when nothing was).
  const std::string& cut_report() const { return cut_report_; }
  void step(const StepMetrics& m);
  void eval(const EvalMetrics& m);
  // One line per sample: step, prompt, response, label, data_source, reward, components.
  void samples(int64_t step, const std::vector<GrpoTrainer::SampleRecord>& samples);

 private:
  void write_line(const std::string& file, std::FILE* f, const std::string& line);
  void scalars(const std::string& prefix, const std::string& json, int64_t step);

  std::string dir_, cut_report_;
  std::FILE* metrics_ = nullptr;
  std::FILE* samples_ = nullptr;
  std::unique_ptr<tensorboard::EventWriter> tb_;
};

struct RunConfig {
  int64_t steps = 20;
  int64_t eval_every = 10;        // 0 = only at the start and the end
  int64_t checkpoint_every = 20;  // and at the end; 0 = only at the end
  int64_t samples_every = 0;      // sample dumps every N steps; 0 = none
  int64_t samples_per_dump = 16;  // samples written per dump (rank 0's first ones)
  bool tensorboard = true;
  EvalConfig eval;
  std::string out;                // the run directory
};

// A recipe's run: section (trainer/run.cpp, docs/CONFIG.md), finished and checked, a bad value
// named at its key's file and line. It also holds the run's seed, which the trainers keep
// (GrpoConfig::seed, SftConfig::seed).
void read_yaml(yaml::MapReader& m, RunConfig& c, uint64_t& seed);
void write_yaml(YAML::Emitter& e, const RunConfig& c, uint64_t seed);
// A recipe's eval: section: every (eval_every) and the evaluation's settings (c.eval), finished
// and checked.
void read_eval_yaml(yaml::MapReader& m, RunConfig& c);
void write_eval_yaml(YAML::Emitter& e, const RunConfig& c);

struct RunResult {
  EvalMetrics last;          // the last evaluation
  int64_t stopped_at = 0;    // the step after which a stop signal ended the run; 0: it ran to the end
  int stop_signal = 0;       // that signal (core/stop_signal.h)
};

// Runs the steps left (from trainer.steps_done() + 1 to config.steps): evaluates before the first
// step of a fresh run, every eval_every steps and at the end; checkpoints into <out>/checkpoint
// every checkpoint_every steps and at the end; prints the progress line to `progress` (rank 0,
// nullptr for none). After each step every rank learns whether any received a stop signal
// (stop_signal::received(), one all-reduce); if so they checkpoint that step and return early.
RunResult run_grpo(GrpoTrainer& trainer, const RunConfig& config, std::FILE* progress);

}  // namespace kiln::trainer
