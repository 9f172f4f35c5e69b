// The rollout scheduler alone, over a real KV cache but no model: admission by slots (a prompt
// counts as its samples), chunks within the token budget and their rows, and preemption of the
// newest sequence (also of the one being scheduled) when blocks run out.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "rollout/scheduler.h"
#include "tests/rollout/engine_fixtures.h"

namespace kiln {
namespace {

using rollout::KvCache;
using rollout::Scheduler;
using rollout::Seq;
using rollout::Work;

constexpr int64_t kBlock = 4;

std::unique_ptr<Seq> seq(int64_t request, int64_t tokens, int64_t width = 1) {
  auto s = std::make_unique<Seq>();
  s->request = request;
  s->width = width;
  s->tokens.assign(size_t(tokens), 1);
  s->prompt_len = tokens;
  return s;
}

rollout::EngineConfig limits(int64_t max_seqs, int64_t max_tokens, int64_t chunk) {
  rollout::EngineConfig e;
  e.block_size = kBlock;
  e.max_num_seqs = max_seqs;
  e.max_batch_tokens = max_tokens;
  e.prefill_chunk = chunk;
  return e;
}

// What the engine does after a step: the scheduled tokens are now in the cache.
void compute(const std::vector<Work>& work) {
  for (const Work& w : work) w.seq->computed += w.n;
}

std::vector<int64_t> requests_of(const std::vector<Work>& work) {
  std::vector<int64_t> out;
  for (const Work& w : work) out.push_back(w.seq->request);
  return out;
}

int64_t full_block_bytes(const model::ModelConfig& c) {
  return rollout::KvLayout::of(c, kBlock, sizeof(float)).full_block_bytes;
}

TEST(Scheduler, AdmitsWhileSlotsFitAndAPromptCountsAsItsSamples) {
  const model::ModelConfig c = test::paged_config(1);
  KvCache kv(c, kBlock, 64 * full_block_bytes(c), 4, at::kFloat, at::kCPU);
  Scheduler sched(kv, limits(4, 64, 16), c.sliding_window);
  sched.enqueue(seq(0, 5, 3));  // a prompt for 3 samples
  sched.enqueue(seq(1, 3, 2));  // 3 + 2 > 4: waits, and so does everything behind it
  sched.enqueue(seq(2, 2, 1));
  EXPECT_EQ(requests_of(sched.schedule()), std::vector<int64_t>{0});
  EXPECT_EQ(sched.num_waiting(), 2);
  compute(sched.work());
  kv.release(sched.running()[0]->blocks);  // the prompt is done (the engine forks and retires it)
  sched.running().clear();
  EXPECT_EQ(requests_of(sched.schedule()), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(sched.num_waiting(), 0);
  // One sequence always runs, even one wider than max_num_seqs.
  Scheduler wide(kv, limits(2, 64, 16), c.sliding_window);
  wide.enqueue(seq(7, 3, 5));
  EXPECT_EQ(requests_of(wide.schedule()), std::vector<int64_t>{7});
}

TEST(Scheduler, ChunksWithinTheTokenBudget) {
  const model::ModelConfig c = test::paged_config();  // window layers too
  KvCache kv(c, kBlock, 64 * full_block_bytes(c), 4, at::kFloat, at::kCPU);
  Scheduler sched(kv, limits(4, 10, 4), c.sliding_window);
  for (int64_t r = 0; r < 3; ++r) sched.enqueue(seq(r, 9));
  std::vector<Work> w = sched.schedule();
  ASSERT_EQ(w.size(), 3u);
  EXPECT_EQ(w[0].n, 4);
  EXPECT_EQ(w[1].n, 4);
  EXPECT_EQ(w[2].n, 2);  // what is left of the 10-token budget
  EXPECT_EQ(w[1].offset, 4);
  EXPECT_EQ(w[2].offset, 8);
  compute(w);
  w = sched.schedule();
  ASSERT_EQ(w.size(), 3u);
  EXPECT_EQ(w[0].start, 4);
  EXPECT_EQ(w[0].n, 4);
  EXPECT_EQ(w[2].start, 2);
  EXPECT_EQ(w[2].n, 2);
  // Window layers read the last 5 positions before the piece, and keep its last 5.
  EXPECT_EQ(w[0].window_lo, 0);
  EXPECT_EQ(w[0].window_write_from, 4);
  compute(w);
  w = sched.schedule();
  EXPECT_EQ(w[0].start, 8);
  EXPECT_EQ(w[0].n, 1);
  EXPECT_EQ(w[0].window_lo, 4);
  EXPECT_EQ(w[1].n, 1);
  EXPECT_EQ(w[2].n, 4);
}

TEST(Scheduler, PreemptsTheNewestWhenBlocksRunOut) {
  const model::ModelConfig c = test::paged_config(1);  // full-attention layers only
  KvCache kv(c, kBlock, 4 * full_block_bytes(c), 4, at::kFloat, at::kCPU);
  Scheduler sched(kv, limits(4, 64, 16), c.sliding_window);
  sched.enqueue(seq(0, 8));
  sched.enqueue(seq(1, 8));
  compute(sched.schedule());  // both prefilled: the 4 blocks are taken
  EXPECT_EQ(kv.pool(true).num_free(), 0);
  Seq* a = sched.running()[0].get();
  a->tokens.push_back(2);  // a decodes a token: one more block, so b (the newest) goes
  std::vector<Work> w = sched.schedule();
  EXPECT_EQ(requests_of(w), std::vector<int64_t>{0});
  EXPECT_EQ(w[0].start, 8);
  EXPECT_EQ(sched.preemptions(), 1);
  EXPECT_EQ(sched.num_waiting(), 1);
  ASSERT_EQ(sched.running().size(), 1u);
  compute(w);
  // b is admitted again; a's next 8 tokens need 2 blocks where 1 is free: b goes again, then a
  // itself (the sequence being scheduled), and the step has nothing to run.
  a->tokens.resize(17, 3);
  w = sched.schedule();
  EXPECT_TRUE(w.empty());
  EXPECT_EQ(sched.preemptions(), 3);
  EXPECT_EQ(a->preemptions, 1);
  EXPECT_EQ(a->computed, 0);  // its tokens will be recomputed
  EXPECT_TRUE(a->blocks.full.empty());
  EXPECT_EQ(sched.num_waiting(), 2);
  // The last preempted waits first: a runs alone from position 0 (4 blocks), b cannot fit and waits.
  w = sched.schedule();
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].seq, a);
  EXPECT_EQ(w[0].start, 0);
  EXPECT_EQ(w[0].n, 16);
  EXPECT_EQ(sched.preemptions(), 4);
}

}  // namespace
}  // namespace kiln
