// The check after every weight sync: trainer and rollout score the same probe (the first training
// prompt and its answer) and must agree within a threshold; and the sync of a rollout engine on
// the trainer's own rank, timed and sized.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "model/muse.h"
#include "rollout/engine.h"
#include "trainer/dataset.h"
#include "trainer/grpo_config.h"
#include "trainer/grpo_metrics.h"

namespace kiln::text {
class Tokenizer;
}

namespace kiln::trainer {

class Learner;

// Each probe token's log-prob given the ones before it, in fp64 on the CPU. `experts`: the expert
// exchange of a sharded model (null for a whole one); `gather`: ZeRO-3's (null for none).
at::Tensor probe_logprobs(const model::Muse& m, const std::vector<int64_t>& probe,
                          const model::ExpertDispatcher* experts, const model::WeightGather* gather,
                          model::Numerics numerics);

class ProbeCheck {
 public:
  // The probe: the first training prompt and its answer, at most rollout.sync_check_tokens; none
  // when that is 0 or fewer than two tokens are left.
  ProbeCheck(const GrpoConfig& cfg, const Dataset& data, const text::Tokenizer& tok);
  const std::vector<int64_t>& tokens() const { return tokens_; }
  bool enabled() const { return !tokens_.empty(); }
  // The mean |difference| of the trainer's and the rollout's probe log-probs after `step`; above
  // the threshold (rollout.sync_check_threshold, or by quantisation) the run stops.
  double compare(const at::Tensor& mine, const at::Tensor& theirs, int64_t step) const;
  // The rollout engine's probe log-probs (its own model; `experts` for an expert-sharded one).
  at::Tensor engine_logprobs(const rollout::Engine& engine, const model::ExpertDispatcher* experts) const;

 private:
  std::vector<int64_t> tokens_;
  double threshold_ = 0;
  model::Numerics numerics_ = model::Numerics::kStandard;
};

// The trained weights into an engine on this rank after update `step`: timed (the device idle
// before and after) and sized, then the probe check (-1 when off); fills m.sync_*.
void sync_engine(const Learner& learner, rollout::Engine& engine, const ProbeCheck& probe, bool sharded_rollout,
                 int64_t step, StepMetrics& m);

}  // namespace kiln::trainer
