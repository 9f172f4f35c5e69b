// The colocated rollout and grpo.async's producer thread.
#include "trainer/rollout_source.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <optional>

#include "core/clock.h"
#include "core/error.h"

namespace kiln::trainer {

ColocatedRollout::ColocatedRollout(const GrpoConfig& cfg, Producer& producer, const Learner& learner,
                                   const ProbeCheck& probe, DataStream& stream, const std::vector<Example>& test)
    : cfg_(cfg), producer_(producer), learner_(learner), probe_(probe), stream_(stream), test_(test) {}

ProducedBatch ColocatedRollout::take(int64_t step, StepMetrics&) {
  return producer_.produce(producer_.draw_prompts(step), 0);
}

void ColocatedRollout::sync_weights(int64_t step, StepMetrics& m) {
  sync_engine(learner_, producer_.engine(), probe_, cfg_.parallel.sharded_rollout(), step, m);
}

EvalMetrics ColocatedRollout::evaluate(const EvalConfig& ec, int64_t step) {
  return producer_.evaluate(ec, test_, step);
}

void RolloutSource::preload(std::vector<ProducedBatch> batches) {
  KILN_CHECK(batches.empty(), "grpo: internal error: a synchronous rollout was given ", batches.size(),
             " batches made ahead; report this");
}

void ColocatedRollout::restart(int64_t step, bool push) {
  if (push) learner_.push_to(producer_.engine());
  producer_.rebase(step);
}

// ---- grpo.async: the producer thread ----

ProducedBatch ThreadedRollout::take(int64_t step, StepMetrics&) {
  if (!thread_.joinable()) {
    produced_ = step - 1 + int64_t(ready_.size());  // the steps already trained and the batches preloaded
    thread_ = std::thread([this] { produce_loop(); });
  }
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return !ready_.empty() || error_; });
  if (ready_.empty()) std::rethrow_exception(error_);  // what stopped the producer, at the step that needs it
  ProducedBatch p = std::move(ready_.front());
  ready_.pop_front();
  return p;
}

// The weight sync of update t waits for batch t + k, the last sampled with the weights before it,
// and none past the last step.
void ThreadedRollout::sync_weights(int64_t step, StepMetrics& m) {
  const int64_t made = step + cfg_.async->max_staleness;
  with_producer_paused(last_step_ > 0 ? std::min(made, last_step_) : made,
                       [&] { ColocatedRollout::sync_weights(step, m); });
}

EvalMetrics ThreadedRollout::evaluate(const EvalConfig& ec, int64_t step) {
  EvalMetrics em;
  with_producer_paused(0, [&] { em = ColocatedRollout::evaluate(ec, step); });
  return em;
}

BatchesAhead ThreadedRollout::ahead() {
  BatchesAhead a;
  a.max_staleness = cfg_.async->max_staleness;
  with_producer_paused(0, [&] {
    a.batches.assign(ready_.begin(), ready_.end());
    // Between batches the stream is past the last one made; a producer that failed drew the
    // prompts of a batch it did not make.
    a.next_position = error_ ? making_from_ : stream_.position();
  });
  return a;
}

void ThreadedRollout::preload(std::vector<ProducedBatch> batches) {
  KILN_CHECK(!thread_.joinable() && ready_.empty(), "grpo: internal error: batches preloaded into a running producer; report this");
  ready_.assign(std::make_move_iterator(batches.begin()), std::make_move_iterator(batches.end()));
}

void ThreadedRollout::set_last_step(int64_t step) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    last_step_ = step;
  }
  cv_.notify_all();
}

void ThreadedRollout::stop() {
  if (thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
    thread_ = std::thread();
  }
  ready_.clear();  // made ahead, or preloaded from a checkpoint
  producing_ = stopping_ = false;
  error_ = nullptr;
}

// Runs fn while the producer is between batches and, when `made` > 0, once it has made that many.
// A producer that failed is idle for good: fn runs anyway, and take() reports the error at the
// step that needs its batch, as the synchronous step would.
template <typename F>
void ThreadedRollout::with_producer_paused(int64_t made, const F& fn) {
  if (!thread_.joinable()) return fn();
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return error_ || (!producing_ && produced_ >= made); });
  struct Wake {  // the producer re-checks its condition however fn ends
    std::condition_variable& cv;
    ~Wake() { cv.notify_all(); }
  } wake{cv_};
#if KILN_WITH_CUDA
  if (learner_.trained().device().is_cuda()) c10::cuda::device_synchronize();  // the producer's stream is done
#endif
  fn();
}

void ThreadedRollout::produce_loop() {
  try {
    produce_batches();
  } catch (...) {  // nothing may leave a thread: the trainer rethrows it
    std::lock_guard<std::mutex> lk(mu_);
    producing_ = false;
    error_ = std::current_exception();
  }
  cv_.notify_all();
}

void ThreadedRollout::produce_batches() {
  at::NoGradGuard no_grad;  // grad mode is per thread
#if KILN_WITH_CUDA
  // Its own stream, so that the rollout's kernels overlap the trainer's; a high-priority one: the
  // rollout's small decode kernels go ahead of the trainer's queued GEMM blocks, since the step
  // waits for the slower side and on one GPU that has been the rollout (docs/PERFORMANCE.md).
  std::optional<c10::cuda::CUDAStreamGuard> stream_guard;
  const at::Device device = learner_.trained().device();
  if (device.is_cuda()) stream_guard.emplace(c10::cuda::getStreamFromPool(true, device.index()));
#endif
  for (;;) {
    int64_t i = 0;
    const auto waiting = Clock::now();
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] {
        i = produced_ + 1;
        return stopping_ || ((last_step_ <= 0 || i <= last_step_) &&
                             producer_.weight_version() >= weight_version_for(i, cfg_.async->max_staleness));
      });
      if (stopping_) return;
      producing_ = true;
      making_from_ = stream_.position();
    }
    const double waited = seconds_since(waiting);
    ProducedBatch p = producer_.produce_next(i);
    p.wait_seconds = waited;
    {
      std::lock_guard<std::mutex> lk(mu_);
      producing_ = false;
      ready_.push_back(std::move(p));
      ++produced_;
    }
    cv_.notify_all();
  }
}

}  // namespace kiln::trainer
