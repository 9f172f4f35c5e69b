// Where a GRPO step's batch comes from, chosen once by the placement: the engine on this rank,
// synchronously (colocated) or ahead of the trainer on a producer thread (grpo.async), or another
// rank (grpo.async.placement split). Each also takes the weights after an update and serves
// evaluation. split_rollout.h holds the third and the rollout rank's end.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "trainer/grpo_config.h"
#include "trainer/grpo_metrics.h"
#include "trainer/learner.h"
#include "trainer/producer.h"
#include "trainer/weight_sync.h"

namespace kiln::trainer {

class RolloutSource {
 public:
  virtual ~RolloutSource() = default;
  // The batch step `step` trains on, rolled out and rewarded on this rank alone.
  virtual ProducedBatch take(int64_t step, StepMetrics& m) = 0;
  // Update `step` is applied: its weights to the rollout, timed and checked (m.sync_*).
  virtual void sync_weights(int64_t step, StepMetrics& m) = 0;
  // The held-out evaluation with the weights of `step` updates (collective over the trainers).
  virtual EvalMetrics evaluate(const EvalConfig& ec, int64_t step) = 0;
  // The batches made ahead and not yet taken, with the data position after them, for a checkpoint
  // (grpo.async; a synchronous source has none): a resumed run draws its next prompts after them,
  // or, without them, from the oldest one's position.
  virtual BatchesAhead ahead() = 0;
  // A resumed run's next batches, from its checkpoint's ahead(): taken before any this source
  // makes, which start after them (the stream is already at their next_position).
  virtual void preload(std::vector<ProducedBatch> batches);
  // The last step the caller will run (0: unknown): no batch is made past it.
  virtual void set_last_step(int64_t step) = 0;
  // Drops every batch made ahead (before a checkpoint is loaded, or after a failed step).
  virtual void stop() = 0;
  // The learner's weights are now those of `step` updates; `push`: copy them into a local engine
  // first (a checkpoint was loaded into the learner).
  virtual void restart(int64_t step, bool push) = 0;
  // The producer on this rank, for dynamic sampling's extra rounds; null where batches are made
  // ahead or elsewhere.
  virtual Producer* local() = 0;
};

// The engine on this rank, used in step: the step's batch is rolled out when the step asks.
class ColocatedRollout : public RolloutSource {
 public:
  ColocatedRollout(const GrpoConfig& cfg, Producer& producer, const Learner& learner, const ProbeCheck& probe,
                   DataStream& stream, const std::vector<Example>& test);
  ProducedBatch take(int64_t step, StepMetrics& m) override;
  void sync_weights(int64_t step, StepMetrics& m) override;
  EvalMetrics evaluate(const EvalConfig& ec, int64_t step) override;
  BatchesAhead ahead() override { return {0, stream_.position(), {}}; }
  void set_last_step(int64_t step) override { last_step_ = step; }
  void stop() override {}
  void restart(int64_t step, bool push) override;
  Producer* local() override { return &producer_; }

 protected:
  const GrpoConfig& cfg_;
  Producer& producer_;
  const Learner& learner_;
  const ProbeCheck& probe_;
  DataStream& stream_;
  const std::vector<Example>& test_;
  int64_t last_step_ = 0;
};

// grpo.async: a producer thread rolls out batch i with the weights of update
// v(i) = max(0, i - 1 - k): it waits for that version, and the trainer applies update t only once
// batch t + k, the last that needs the version before it, is out. So staleness is exactly
// min(i - 1, k) whatever the timing, at most k batches wait, and nothing the producer does is
// collective.
class ThreadedRollout : public ColocatedRollout {
 public:
  using ColocatedRollout::ColocatedRollout;
  ~ThreadedRollout() override { stop(); }
  ProducedBatch take(int64_t step, StepMetrics& m) override;
  void sync_weights(int64_t step, StepMetrics& m) override;
  EvalMetrics evaluate(const EvalConfig& ec, int64_t step) override;
  BatchesAhead ahead() override;
  void preload(std::vector<ProducedBatch> batches) override;
  void set_last_step(int64_t step) override;
  void stop() override;
  Producer* local() override { return nullptr; }

 private:
  void produce_loop();
  void produce_batches();
  template <typename F>
  void with_producer_paused(int64_t made, const F& fn);

  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<ProducedBatch> ready_;
  int64_t produced_ = 0;  // batches made: 1 .. produced_
  uint64_t making_from_ = 0;  // the data position of the batch being made (or that failed)
  bool producing_ = false, stopping_ = false;
  std::exception_ptr error_;
};

// The update whose weights sample batch `i` under max_staleness `k`: max(0, i - 1 - k).
inline int64_t weight_version_for(int64_t i, int64_t k) { return std::max<int64_t>(0, i - 1 - k); }

}  // namespace kiln::trainer
