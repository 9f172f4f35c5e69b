// GRPO's learner: the policy under its parallel layout (LoRA adapters, expert shards, ZeRO-3), the
// optimizer over the tensors this rank owns and the frozen KL reference. It scores lp_old, takes
// the policy-loss mini-steps, hands its weights to a rollout engine, and saves and restores what it
// trains.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/comm.h"
#include "model/muse.h"
#include "parallel/parallel.h"
#include "parallel/sharded_model.h"
#include "parallel/zero3.h"
#include "rollout/engine.h"
#include "trainer/grpo_config.h"
#include "trainer/grpo_metrics.h"
#include "trainer/produced.h"
#include "trainer/scoring.h"
#include "trainer/update_guard.h"

namespace kiln::trainer {

// lp_old (and lp_ref) for the loss, and what the mismatch metrics need.
struct OldLogprobs {
  Scored old, ref;
  // lp_old is the rollout's log-probs (StepMetrics::lp_old_from_rollout); the first mini-step
  // measures the mismatch on `whole` (this rank's trajectories, packed on the CPU; sequence ids
  // from seq_offset).
  bool from_rollout = false;
  Packed whole;
  int64_t seq_offset = 0, num_seqs = 0;
};

// What a checkpoint says of where training stood: its state.json, and this rank's batches made
// ahead (grpo.async) where it kept them.
struct TrainedState {
  int64_t step = 0;
  uint64_t data_position = 0;  // before the oldest batch made ahead
  std::optional<BatchesAhead> ahead;
};

class Learner {
 public:
  // Records the device memory allocated after each part it builds (construction_memory).
  using MemoryNote = std::function<void(const char* what)>;
  // Adds LoRA's adapters (cfg.lora set) and builds the layout's shards; `cfg.parallel` is
  // resolved. The optimizer comes with prepare_training(), after the rollout engine is built.
  // `tokenizer_files`: the folder whose tokenizer files go with every saved model (may be empty).
  Learner(model::Muse& policy, const GrpoConfig& cfg, const comm::Group& group, std::string tokenizer_files,
          const MemoryNote& note);
  ~Learner();
  // The KL reference, the trained tensors, the optimizer and the gradient reducer.
  void prepare_training(const MemoryNote& note);

  bool lora() const { return cfg_.lora.has_value(); }
  model::Muse& trained() { return layout_->trained(); }
  const model::Muse& trained() const { return layout_->trained(); }
  const model::ExpertDispatcher* dispatcher() const { return layout_->experts(); }
  parallel::ShardedModel& layout() { return *layout_; }

  // ---- the step ----
  // Under parallel.cp the trajectories of every rank of this rank's cp group, in rank order, and
  // the batch they form (first and total; its prompts stay this rank's): what the group trains
  // together, each micro-batch's tokens split over its ranks (collective over the group). Without
  // cp it leaves both as they are.
  void share_context(std::vector<Trajectory>& trajs, PromptBatch& b) const;
  // lp_old (the rollout's log-probs where they are the trainer's bit for bit, else a forward under
  // replay), lp_ref, and the mismatch metrics over every rank's tokens (collective).
  OldLogprobs score_old(const std::vector<Trajectory>& trajs, const PromptBatch& b, StepMetrics& m);
  // The optimizer's mini-steps of `step`, each over a disjoint slice of the batch, micro-batched.
  void train(const std::vector<Trajectory>& trajs, const OldLogprobs& o, const PromptBatch& b, int64_t step,
             StepMetrics& m);

  // ---- the rollout's weights ----
  // Where an engine gets what this rank holds only in part; none without sharding.
  rollout::WeightSource engine_source() const;
  // Whether an engine built on trained() reads the trained tensors themselves (no copy, no sync).
  bool engine_reads_trained() const;
  // The trained weights into `engine`: the adapters alone under LoRA, nothing where it reads the
  // trained tensors. Returns the bytes copied.
  int64_t push_to(rollout::Engine& engine) const;
  // What a weight sync to another rank sends: the adapters (LoRA) or every trained tensor.
  std::vector<std::pair<std::string, at::Tensor>> synced_tensors() const;
  // The trained model's log-probs of `probe` after `step`; non-finite ones stop the run (divergence).
  at::Tensor own_probe_logprobs(const std::vector<int64_t>& probe, int64_t step) const;
  // A whole policy brought up to date from the trained shards (collective).
  void update_policy() { layout_->update_policy(); }

  // ---- checkpoints (learner_checkpoint.cpp; collective) ----
  // `ahead`: this rank's batches made ahead, kept with the checkpoint (grpo.async), or null.
  void save(const std::string& dir, int64_t step, uint64_t data_position, const BatchesAhead* ahead = nullptr) const;
  TrainedState load(const std::string& dir);
  void save_model(const std::string& dir, int64_t step) const;

 private:
  model::ForwardOptions forward_options() const;
  const parallel::Zero3* zero_of(const model::Muse& m) const;
  Scored score(const model::Muse& model, const std::vector<Trajectory>& trajs, bool replay,
               bool base_only = false) const;
  bool lp_old_from_rollout(const StepMetrics& m) const;
  void measure_mismatch(const OldLogprobs& o, const at::Tensor& lp, int64_t first_token, StepMetrics& m) const;
  struct MiniStep;
  void mini_step(MiniStep& ms, const std::vector<Trajectory>& trajs, const OldLogprobs& o, int64_t step,
                 StepMetrics& m);
  double reduce_and_clip(bool armed);
  double base_fingerprint() const;
  model::Muse whole_adapters() const;
  void check_finite(const std::string& dir, int64_t step) const;
  void write_model(const std::string& out) const;
  void restore_adapters(const std::string& dir);

  model::Muse& policy_;
  const GrpoConfig& cfg_;
  const comm::Group& group_;                     // every trainer rank: gradients, optimizer state
  comm::Group cp_group_;                         // parallel.cp consecutive ranks that split each micro-batch
  comm::Group data_group_;                       // one rank of each cp group: sums over the data (metrics)
  std::string tokenizer_files_;
  std::unique_ptr<parallel::ShardedModel> layout_;
  std::unique_ptr<model::Muse> reference_;       // frozen copy of the starting policy, when kl_coef != 0
  std::unique_ptr<parallel::Zero3> ref_zero3_;   // ... and its ZeRO-3 sharding
  std::vector<at::Tensor> params_;               // all trained tensors: clipping, the all-reduce, the broadcast
  std::vector<bool> is_expert_;                  // ep > 1: params_[i] is an expert shard
  std::unique_ptr<parallel::ZeroOne> zero_;      // the optimizer, over the tensors this rank owns
  std::unique_ptr<parallel::OverlappedGradReducer> reducer_;  // data parallel without expert shards
  UpdateGuard guard_;                            // skips updates with a non-finite gradient norm
};

}  // namespace kiln::trainer
