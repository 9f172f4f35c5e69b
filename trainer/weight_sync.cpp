// The probe check of a weight sync, and the sync of an engine on the trainer's rank.
#include "trainer/weight_sync.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <cmath>

#include "core/clock.h"
#include "core/error.h"
#include "text/tokenizer.h"
#include "trainer/learner.h"

namespace kiln::trainer {

at::Tensor probe_logprobs(const model::Muse& m, const std::vector<int64_t>& probe,
                          const model::ExpertDispatcher* experts, const model::WeightGather* gather,
                          model::Numerics numerics) {
  at::NoGradGuard g;
  model::PackedBatch b = model::PackedBatch::from_sequences({probe}, m.device());
  model::ForwardOptions o;
  o.load_balance = false;
  o.experts = experts;
  o.gather = gather;
  o.numerics = numerics;
  o.targets = at::cat({b.tokens.narrow(0, 1, b.num_tokens() - 1), at::full({1}, -100L, b.tokens.options())});
  return m.forward(b, o).logprobs.narrow(0, 0, b.num_tokens() - 1).to(at::kDouble).cpu();
}

ProbeCheck::ProbeCheck(const GrpoConfig& cfg, const Dataset& data, const text::Tokenizer& tok)
    : threshold_(cfg.sync_check_threshold.value_or(cfg.engine.quantization == rollout::Quantization::kNone ? 1e-3
                                                                                                          : 1.0)),
      numerics_(cfg.engine.numerics) {
  if (cfg.sync_check_tokens == 0 || data.train.empty()) return;
  std::vector<int64_t> probe = data.train[0].prompt_ids;
  if (!data.train[0].label.empty()) {
    const std::vector<int64_t> label = tok.encode(data.train[0].label);
    probe.insert(probe.end(), label.begin(), label.end());
  }
  if (int64_t(probe.size()) > cfg.sync_check_tokens) probe.resize(size_t(cfg.sync_check_tokens));
  if (probe.size() >= 2) tokens_ = std::move(probe);
}

double ProbeCheck::compare(const at::Tensor& mine, const at::Tensor& theirs, int64_t step) const {
  const double diff = (mine - theirs).abs().mean().item<double>();
  KILN_CHECK(std::isfinite(diff) && diff <= threshold_, "grpo: weight sync check failed after step ", step,
             ": trainer and rollout log-probs differ by ", diff, " (mean over ", mine.numel(),
             " probe tokens; threshold ", threshold_, "); the rollout's weights are not the trainer's");
  return diff;
}

at::Tensor ProbeCheck::engine_logprobs(const rollout::Engine& engine, const model::ExpertDispatcher* experts) const {
  return probe_logprobs(engine.model(), tokens_, experts, nullptr, numerics_);
}

void sync_engine(const Learner& learner, rollout::Engine& engine, const ProbeCheck& probe, bool sharded_rollout,
                 int64_t step, StepMetrics& m) {
  const bool cuda = learner.trained().device().is_cuda();
#if KILN_WITH_CUDA
  if (cuda) c10::cuda::device_synchronize();  // the optimizer's kernels are not the sync's
#endif
  const auto t = Clock::now();
  // Tensor by tensor: ZeRO-3's from their owners, a replica's experts (or their adapters) from
  // every rank; a sharded engine takes its own experts.
  m.sync_bytes = learner.push_to(engine);
  m.weights_shared = learner.engine_reads_trained();
#if KILN_WITH_CUDA
  if (cuda) c10::cuda::device_synchronize();
#endif
  (void)cuda;
  m.sync_seconds = seconds_since(t);
  m.sync_check = -1;
  // Under expert parallelism both forwards exchange tokens, so every rank of the group runs them together.
  if (!probe.enabled()) return;
  const at::Tensor mine = learner.own_probe_logprobs(probe.tokens(), step);
  m.sync_check = probe.compare(mine, probe.engine_logprobs(engine, sharded_rollout ? learner.dispatcher() : nullptr), step);
}

}  // namespace kiln::trainer
