// The supervised warm start: next-token cross-entropy on the label (and end-of-answer) tokens of
// dataset examples, so a small model starts GRPO with partial skill.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/comm.h"
#include "core/yaml_fwd.h"
#include "parallel/parallel.h"
#include "model/muse.h"
#include "optimizers/optimizer.h"
#include "trainer/schedule.h"
#include "trainer/dataset.h"
#include "trainer/environment.h"

namespace kiln::text {
class Tokenizer;
}

namespace kiln::trainer {

// sft.demonstrations: where the warm start's answers come from.
enum class Demonstrations {
  kLabel,        // each example's label, then the tokenizer's stop id
  kEnvironment,  // the recipe's environment demonstrates an episode per example (add_demonstrations)
};
Demonstrations parse_demonstrations(const std::string& name);  // label | environment
const char* demonstrations_name(Demonstrations d);

struct SftConfig {
  int64_t steps = 200;
  int64_t batch_size = 64;     // problems per step
  optimizers::OptimizerConfig optim = default_optim();
  LrSchedule schedule;
  double grad_clip = 1.0;
  int64_t stop_after_nonfinite = 3;  // non-finite losses or gradient norms in a row that stop the run; each is skipped
  uint64_t seed = 0;
  PromptFormat prompt;         // the same rendering GRPO uses (the recipe's prompt: section)
  Demonstrations demonstrations = Demonstrations::kLabel;
  void validate() const;
  static optimizers::OptimizerConfig default_optim() {
    optimizers::OptimizerConfig o;
    o.adamw.lr = o.muon.lr = 3e-3;
    return o;
  }
};

// A recipe's sft: section (trainer/sft.cpp, docs/CONFIG.md): steps, batch_size, the optimizer's
// and the schedule's keys, grad_clip, stop_after_nonfinite and demonstrations, finished, then
// validate(). `environment`: whether the recipe has an environment: section (demonstrations:
// environment needs one). A bad value is named at its key's file and line.
void read_yaml(yaml::MapReader& m, SftConfig& c, bool environment);
void write_yaml(YAML::Emitter& e, const SftConfig& c);

struct SftMetrics {
  int64_t step = 0;
  double loss = 0;             // mean negative log-likelihood per answer token
  double token_accuracy = 0;   // answer tokens whose argmax was right
  bool skipped = false;        // the loss or the gradient norm was not finite: the update was not applied
  std::string to_json() const;
};

struct DemoReport {
  int64_t demonstrated = 0;  // examples given an episode to imitate
  int64_t label = 0;         // examples the environment had none for: their label is the answer
  int64_t failed = 0;        // requests that failed (on_failure: zero): their label is the answer
};
// Asks `env` for a demonstration of every example and stores it as the example's answer_ids and
// answer_trained: each turn's response then the tokenizer's first stop id (trained), each
// observation as episodes take it (not trained). A demonstration that does not fit
// max_episode_tokens, max_turns or max_observation_tokens is an error naming the example.
DemoReport add_demonstrations(std::vector<Example>& examples, Environment& env, const text::Tokenizer& tok);
// One example's training sequence (prompt then answer) and its targets: position j holds the id
// at j + 1 where that is a trained answer token, else -100.
std::pair<std::vector<int64_t>, std::vector<int64_t>> sft_sequence(const Example& ex, const text::Tokenizer& tok);

class SftTrainer {
 public:
  // The target of an example is its answer_ids where add_demonstrations set them (their trained
  // tokens), else its label followed by the tokenizer's first stop id (its eos).
  // Data parallel over `group`: each rank takes its share of every batch, gradients are summed,
  // and each parameter's owner steps it (ZeRO-1) and broadcasts it. Under `parallel` (the
  // recipe's parallel: section) the experts are sharded over ep ranks and the dense part may be
  // under ZeRO-3, as in GRPO (parallel/sharded_model.h); `model` may then be this rank's share
  // (parallel::policy_share), trained in place, or a whole model that only sync_policy() and
  // save_model() bring up to date.
  // With sft.demonstrations: environment, `env` demonstrates every example (add_demonstrations).
  SftTrainer(model::Muse& model, SftConfig config, std::shared_ptr<const text::Tokenizer> tokenizer,
             std::vector<Example> train, const comm::Group& group = comm::Group::world(), Environment* env = nullptr,
             parallel::ParallelConfig parallel = {});
  ~SftTrainer();
  SftMetrics step();
  const DemoReport& demonstrations() const;
  // A whole `model` from the trained shards (collective); nothing to do for a share.
  void sync_policy();
  // The trained weights with the tokenizer's files into `dir` (collective): each rank writes the
  // tensors it holds, into dir.tmp, then renamed, so a kill leaves no half-written `dir`.
  void save_model(const std::string& dir) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::trainer
