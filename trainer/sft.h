// The supervised warm start: next-token cross-entropy on the label (and end-of-answer) tokens of
// dataset examples, so a small model starts GRPO with partial skill.
#pragma once
#include <cstdint>
#include <memory>

#include "core/comm.h"
#include "model/muse.h"
#include "optimizers/optimizer.h"
#include "trainer/schedule.h"
#include "trainer/dataset.h"

namespace kiln::text {
class Tokenizer;
}

namespace kiln::trainer {

struct SftConfig {
  int64_t steps = 200;
  int64_t batch_size = 64;     // problems per step
  optimizers::OptimizerConfig optim = default_optim();
  LrSchedule schedule;
  double grad_clip = 1.0;
  int64_t stop_after_nonfinite = 3;  // non-finite gradient norms in a row that stop the run; each is skipped
  uint64_t seed = 0;
  PromptFormat prompt;         // the same rendering GRPO uses (the recipe's prompt: section)
  void validate() const;
  static optimizers::OptimizerConfig default_optim() {
    optimizers::OptimizerConfig o;
    o.adamw.lr = o.muon.lr = 3e-3;
    return o;
  }
};

struct SftMetrics {
  int64_t step = 0;
  double loss = 0;             // mean negative log-likelihood per answer token
  double token_accuracy = 0;   // answer tokens whose argmax was right
  bool skipped = false;        // the gradient norm was not finite: the update was not applied
  std::string to_json() const;
};

class SftTrainer {
 public:
  // The target of an example is its label followed by the tokenizer's first stop id (its eos).
  // Data parallel over `group`: each rank takes its share of every batch, gradients are summed,
  // and each parameter's owner steps it (ZeRO-1) and broadcasts it.
  SftTrainer(model::Muse& model, SftConfig config, std::shared_ptr<const text::Tokenizer> tokenizer,
             std::vector<Example> train, const comm::Group& group = comm::Group::world());
  ~SftTrainer();
  SftMetrics step();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::trainer
