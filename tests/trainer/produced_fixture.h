// A rolled-out batch with every field set (trainer/produced.h), the same for a seed on every rank,
// and the field-by-field comparison the encoding tests use.
#pragma once
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include "trainer/produced.h"

namespace kiln::test {

inline trainer::ProducedBatch produced_fixture(int seed) {
  trainer::ProducedBatch p;
  for (int i = 0; i < 2; ++i) {
    trainer::Example e;
    e.prompt = "12+" + std::to_string(seed + i) + "=";
    e.messages = i == 0 ? "" : R"([{"role": "user", "content": "h\u00e9\n\"x\""}])";
    e.label = std::to_string(12 + seed + i);
    e.data_source = "arith";
    e.metadata = "{}";
    e.origin = "file:" + std::to_string(i + 1);
    e.prompt_text = std::string("with a NUL \0 inside", 19);
    e.prompt_ids = {1, 2, int64_t(seed), -3};
    e.answer_ids = i == 0 ? std::vector<int64_t>{} : std::vector<int64_t>{7, 8};
    e.answer_trained = i == 0 ? std::vector<uint8_t>{} : std::vector<uint8_t>{1, 0};
    p.batch.prompts.push_back(e);
  }
  p.batch.total = 64;
  p.batch.first = 2 * seed;
  p.batch.step = 5 + seed;
  for (int i = 0; i < 3; ++i) {
    trainer::Trajectory t;
    t.tokens = {1, 2, 3, 4 + i};
    t.prompt_len = 2;
    t.rollout_lp = {-0.5f, -1.25f - float(seed)};
    t.sampled = i == 1 ? std::vector<uint8_t>{1, 0} : std::vector<uint8_t>{};
    if (i != 2) t.routing = (at::arange(4 * 3 * 2, at::kLong) * (seed + 1 + i)).remainder(8).to(at::kByte).view({4, 3, 2});
    t.reward = 0.25 * i + seed;
    t.advantage = -0.125 * i;
    t.in_loss = i != 1;
    p.trajs.push_back(t);
    trainer::RewardRequest q;
    q.id = 100 + i;
    q.prompt = "12+3=";
    q.response = i == 0 ? "" : "15\n";
    q.label = "15";
    q.data_source = "arith";
    q.metadata = "{\"k\": 1}";
    q.truncated = i == 2;
    p.reqs.push_back(q);
    trainer::RewardResult x;
    x.reward = 1.0 / (i + 1);
    if (i > 0) x.components = {{"correct", 1.0}, {"format", 0.2 * i}};
    x.failed = i == 2;
    x.error = i == 2 ? "worker: timed out" : "";
    p.results.push_back(x);
    p.lengths.push_back(double(i + seed));
  }
  p.worker.num_requests = 3;
  p.worker.num_failures = 1;
  p.worker.num_timeouts = 2;
  p.worker.num_restarts = 4;
  p.worker.num_retries = 5;
  p.worker.num_garbage_lines = 6;
  p.worker.num_protocol_violations = 8;
  p.worker.num_answered = 7;
  p.worker.total_seconds = 0.75;
  p.rollout_seconds = 1.5;
  p.reward_seconds = 0.25;
  p.wait_seconds = 0.125;
  p.turns = 3;
  p.observed = 11;
  p.preemptions = 2;
  p.expert_overflow_steps = 3;
  p.kv_peak = 0.625;
  p.version = 9 + seed;
  p.data_position = (uint64_t(1) << 40) + uint64_t(seed);
  p.sync_check = 3e-7;
  return p;
}

inline void expect_same_produced(const trainer::ProducedBatch& a, const trainer::ProducedBatch& b) {
  ASSERT_EQ(a.batch.prompts.size(), b.batch.prompts.size());
  for (size_t i = 0; i < a.batch.prompts.size(); ++i) {
    const trainer::Example &x = a.batch.prompts[i], &y = b.batch.prompts[i];
    EXPECT_EQ(x.prompt, y.prompt);
    EXPECT_EQ(x.messages, y.messages);
    EXPECT_EQ(x.label, y.label);
    EXPECT_EQ(x.data_source, y.data_source);
    EXPECT_EQ(x.metadata, y.metadata);
    EXPECT_EQ(x.origin, y.origin);
    EXPECT_EQ(x.prompt_text, y.prompt_text);
    EXPECT_EQ(x.prompt_ids, y.prompt_ids);
    EXPECT_EQ(x.answer_ids, y.answer_ids);
    EXPECT_EQ(x.answer_trained, y.answer_trained);
  }
  EXPECT_EQ(a.batch.total, b.batch.total);
  EXPECT_EQ(a.batch.first, b.batch.first);
  EXPECT_EQ(a.batch.step, b.batch.step);
  ASSERT_EQ(a.trajs.size(), b.trajs.size());
  for (size_t i = 0; i < a.trajs.size(); ++i) {
    const trainer::Trajectory &x = a.trajs[i], &y = b.trajs[i];
    EXPECT_EQ(x.tokens, y.tokens);
    EXPECT_EQ(x.prompt_len, y.prompt_len);
    EXPECT_EQ(x.rollout_lp, y.rollout_lp);
    EXPECT_EQ(x.sampled, y.sampled);
    ASSERT_EQ(x.routing.defined(), y.routing.defined()) << "trajectory " << i;
    if (x.routing.defined()) {
      EXPECT_EQ(x.routing.scalar_type(), y.routing.scalar_type());
      EXPECT_TRUE(at::equal(x.routing, y.routing)) << "trajectory " << i;
    }
    EXPECT_EQ(x.reward, y.reward);
    EXPECT_EQ(x.advantage, y.advantage);
    EXPECT_EQ(x.in_loss, y.in_loss);
  }
  ASSERT_EQ(a.reqs.size(), b.reqs.size());
  for (size_t i = 0; i < a.reqs.size(); ++i) {
    EXPECT_EQ(a.reqs[i].id, b.reqs[i].id);
    EXPECT_EQ(a.reqs[i].prompt, b.reqs[i].prompt);
    EXPECT_EQ(a.reqs[i].response, b.reqs[i].response);
    EXPECT_EQ(a.reqs[i].label, b.reqs[i].label);
    EXPECT_EQ(a.reqs[i].data_source, b.reqs[i].data_source);
    EXPECT_EQ(a.reqs[i].metadata, b.reqs[i].metadata);
    EXPECT_EQ(a.reqs[i].truncated, b.reqs[i].truncated);
  }
  ASSERT_EQ(a.results.size(), b.results.size());
  for (size_t i = 0; i < a.results.size(); ++i) {
    EXPECT_EQ(a.results[i].reward, b.results[i].reward);
    EXPECT_EQ(a.results[i].components, b.results[i].components);
    EXPECT_EQ(a.results[i].failed, b.results[i].failed);
    EXPECT_EQ(a.results[i].error, b.results[i].error);
  }
  EXPECT_EQ(a.lengths, b.lengths);
  EXPECT_EQ(a.worker.num_requests, b.worker.num_requests);
  EXPECT_EQ(a.worker.num_failures, b.worker.num_failures);
  EXPECT_EQ(a.worker.num_timeouts, b.worker.num_timeouts);
  EXPECT_EQ(a.worker.num_restarts, b.worker.num_restarts);
  EXPECT_EQ(a.worker.num_retries, b.worker.num_retries);
  EXPECT_EQ(a.worker.num_garbage_lines, b.worker.num_garbage_lines);
  EXPECT_EQ(a.worker.num_protocol_violations, b.worker.num_protocol_violations);
  EXPECT_EQ(a.worker.num_answered, b.worker.num_answered);
  EXPECT_EQ(a.worker.total_seconds, b.worker.total_seconds);
  EXPECT_EQ(a.rollout_seconds, b.rollout_seconds);
  EXPECT_EQ(a.reward_seconds, b.reward_seconds);
  EXPECT_EQ(a.wait_seconds, b.wait_seconds);
  EXPECT_EQ(a.turns, b.turns);
  EXPECT_EQ(a.observed, b.observed);
  EXPECT_EQ(a.preemptions, b.preemptions);
  EXPECT_EQ(a.expert_overflow_steps, b.expert_overflow_steps);
  EXPECT_EQ(a.kv_peak, b.kv_peak);
  EXPECT_EQ(a.version, b.version);
  EXPECT_EQ(a.data_position, b.data_position);
  EXPECT_EQ(a.sync_check, b.sync_check);
}

}  // namespace kiln::test
