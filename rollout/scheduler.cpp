// The rollout engine's scheduler (scheduler.h): admission, chunked prefill within a token budget,
// and preemption by recompute, newest first.
#include "rollout/scheduler.h"

#include <algorithm>

namespace kiln::rollout {

Scheduler::Scheduler(KvCache& kv, const EngineConfig& config, int64_t window)
    : kv_(kv), max_seqs_(config.max_num_seqs), max_tokens_(config.max_batch_tokens), chunk_(config.prefill_chunk),
      window_(window) {}

void Scheduler::enqueue(std::unique_ptr<Seq> s) { waiting_.push_back(std::move(s)); }

void Scheduler::start(std::unique_ptr<Seq> s) { running_.push_back(std::move(s)); }

void Scheduler::preempt(std::unique_ptr<Seq> s) {
  kv_.release(s->blocks);
  s->computed = 0;
  s->preemptions++;
  preemptions_++;
  waiting_.push_front(std::move(s));
}

// Reserves blocks for n tokens of running_[i], preempting the newest other sequences as needed.
// Returns false when running_[i] itself had to go back to the queue.
bool Scheduler::reserve(size_t i, int64_t n) {
  while (true) {
    Seq& s = *running_[i];
    if (kv_.fits(s.blocks, s.computed, n)) {
      kv_.make_writable(s.blocks, s.computed, n);
      return true;
    }
    std::unique_ptr<Seq> victim = std::move(running_.back());
    running_.pop_back();
    const bool self = i == running_.size();
    preempt(std::move(victim));
    if (self) return false;
  }
}

const std::vector<Work>& Scheduler::schedule() {
  work_.clear();
  int64_t used = 0;
  for (const auto& s : running_) used += s->width;
  while (!waiting_.empty() && (running_.empty() || used + waiting_.front()->width <= max_seqs_)) {
    used += waiting_.front()->width;
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
  int64_t budget = max_tokens_;
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    Seq& s = *running_[i];
    const int64_t pending = int64_t(s.tokens.size()) - s.computed;
    const int64_t n = std::min({pending, chunk_, budget});
    if (n <= 0) continue;
    if (!reserve(i, n)) break;
    budget -= n;
    Work w;
    w.seq = &s;
    w.start = s.computed;
    w.n = n;
    work_.push_back(w);
  }
  // Sequences preempted after being scheduled drop out (their blocks are gone).
  work_.erase(std::remove_if(work_.begin(), work_.end(),
                             [&](const Work& w) {
                               return std::none_of(running_.begin(), running_.end(),
                                                   [&](const auto& r) { return r.get() == w.seq; });
                             }),
              work_.end());
  int64_t offset = 0;
  for (Work& w : work_) {
    w.offset = offset;
    offset += w.n;
    w.window_lo = std::max<int64_t>(0, w.start - window_ + 1);
    w.window_write_from = kv_.first_window_write(w.start, w.n);
  }
  return work_;
}

}  // namespace kiln::rollout
