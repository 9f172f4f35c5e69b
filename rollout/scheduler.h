// The rollout engine's scheduler: continuous batching over the paged KV cache. Sequences wait in a
// queue, run in admission order, and get a chunk of their pending tokens each step within a token
// budget; when blocks run out the newest running sequences are preempted (their blocks released,
// their tokens recomputed when they run again).
#pragma once
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "rollout/engine.h"
#include "rollout/kv_cache.h"

namespace kiln::rollout {

// One sequence in the engine: a prompt being prefilled for its samples (a parent), or one sample.
struct Seq {
  int64_t request = 0;
  int64_t sample = -1;              // -1: the shared-prefill parent of a request (-2: forked)
  int64_t width = 1;                // running slots it takes: a prompt counts as the n samples it becomes
  std::vector<int64_t> tokens;      // prompt + generated
  int64_t prompt_len = 0;
  int64_t turn_start = 0;           // first token of this turn's generation (= prompt_len on the first)
  int64_t session = -1;             // multi-turn: the session it continues as (Request::keep_cache)
  int64_t computed = 0;             // tokens whose K/V are in the cache
  int64_t routed = 0;               // tokens whose routing is recorded (kept across preemption)
  BlockTable blocks;                // its KV blocks (shared with its prompt's until written)
  std::vector<float> logprobs;
  std::vector<int64_t> versions;    // the engine's weight version when each generated token was drawn
  std::vector<uint8_t> routing;     // [tokens, L, k], filled as tokens are first computed
  bool finalizing = false;          // finished sampling; computing the last token's routing
  FinishReason finish = FinishReason::kLength;
  int64_t preemptions = 0;
};

// A scheduled piece of work for one step: `n` tokens of `seq` starting at position `start`
// (= seq->computed when scheduled).
struct Work {
  Seq* seq = nullptr;
  int64_t start = 0;
  int64_t n = 0;
  int64_t offset = 0;                   // first row in the step's packed batch
  int64_t window_lo = 0;                // first cached position window layers read
  int64_t window_write_from = 0;        // first new position window layers keep
};

class Scheduler {
 public:
  // Limits from `config`: max_num_seqs (running slots), max_batch_tokens (tokens per step) and
  // prefill_chunk (tokens of one sequence per step); `window`: the model's sliding window.
  Scheduler(KvCache& kv, const EngineConfig& config, int64_t window);

  void enqueue(std::unique_ptr<Seq> s);  // waits at the back of the queue
  void start(std::unique_ptr<Seq> s);    // runs from the next step on (a sample forked from its prompt)

  // The next step's work: admits waiting sequences while their slots fit in max_num_seqs (one
  // always runs), then walks the running ones in admission order, giving each up to prefill_chunk
  // of its pending tokens within max_batch_tokens and making their blocks writable. When blocks run
  // out, the newest running sequence is preempted (to the front of the queue) until they fit; a
  // sequence that must preempt itself ends the step's list. Items get their rows in the packed
  // batch in order.
  const std::vector<Work>& schedule();
  const std::vector<Work>& work() const { return work_; }

  std::vector<std::unique_ptr<Seq>>& running() { return running_; }  // admission order
  bool idle() const { return waiting_.empty() && running_.empty(); }
  int64_t num_waiting() const { return int64_t(waiting_.size()); }
  int64_t preemptions() const { return preemptions_; }

 private:
  void preempt(std::unique_ptr<Seq> s);
  bool reserve(size_t i, int64_t n);

  KvCache& kv_;
  int64_t max_seqs_, max_tokens_, chunk_, window_;
  std::deque<std::unique_ptr<Seq>> waiting_;
  std::vector<std::unique_ptr<Seq>> running_;
  std::vector<Work> work_;
  int64_t preemptions_ = 0;
};

}  // namespace kiln::rollout
