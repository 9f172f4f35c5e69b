// The byte encoding of a rolled-out batch (produced.h): every field of the batch, its prompts,
// trajectories, reward requests and results, and counters, in declaration order.
#include "trainer/produced.h"

#include <ATen/ATen.h>

namespace kiln::trainer {
namespace {

void write_example(ByteWriter& w, const Example& e) {
  for (const std::string* s : {&e.prompt, &e.messages, &e.label, &e.data_source, &e.metadata, &e.origin, &e.prompt_text})
    w.put(*s);
  w.put(e.prompt_ids);
  w.put(e.answer_ids);
  w.put(e.answer_trained);
}

Example read_example(ByteReader& r) {
  Example e;
  for (std::string* s : {&e.prompt, &e.messages, &e.label, &e.data_source, &e.metadata, &e.origin, &e.prompt_text})
    *s = r.get_string("a prompt's text");
  e.prompt_ids = r.get_vector<int64_t>("a prompt's ids");
  e.answer_ids = r.get_vector<int64_t>("a prompt's answer ids");
  e.answer_trained = r.get_vector<uint8_t>("a prompt's answer mask");
  return e;
}

}  // namespace

void write_trajectory(ByteWriter& w, const Trajectory& t) {
  w.put(t.tokens);
  w.put(t.prompt_len);
  w.put(t.rollout_lp);
  w.put(t.sampled);
  w.put_tensor(t.routing.defined() ? t.routing.cpu() : t.routing);
  w.put(t.reward);
  w.put(t.advantage);
  w.put(uint8_t(t.in_loss));
}

Trajectory read_trajectory(ByteReader& r) {
  Trajectory t;
  t.tokens = r.get_vector<int64_t>("a trajectory's tokens");
  t.prompt_len = r.get<int64_t>("a trajectory's prompt length");
  t.rollout_lp = r.get_vector<float>("a trajectory's rollout log-probs");
  t.sampled = r.get_vector<uint8_t>("a trajectory's sampled mask");
  t.routing = r.get_tensor("a trajectory's routing");
  t.reward = r.get<double>("a trajectory's reward");
  t.advantage = r.get<double>("a trajectory's advantage");
  t.in_loss = r.get<uint8_t>("a trajectory's loss flag") != 0;
  return t;
}

namespace {

void write_request(ByteWriter& w, const RewardRequest& q) {
  w.put(q.id);
  for (const std::string* s : {&q.prompt, &q.response, &q.label, &q.data_source, &q.metadata}) w.put(*s);
  w.put(uint8_t(q.truncated));
}

RewardRequest read_request(ByteReader& r) {
  RewardRequest q;
  q.id = r.get<int64_t>("a reward request's id");
  for (std::string* s : {&q.prompt, &q.response, &q.label, &q.data_source, &q.metadata})
    *s = r.get_string("a reward request's text");
  q.truncated = r.get<uint8_t>("a reward request's truncation") != 0;
  return q;
}

void write_result(ByteWriter& w, const RewardResult& x) {
  w.put(x.reward);
  w.put(int64_t(x.components.size()));
  for (const auto& [name, value] : x.components) {
    w.put(name);
    w.put(value);
  }
  w.put(uint8_t(x.failed));
  w.put(x.error);
}

RewardResult read_result(ByteReader& r) {
  RewardResult x;
  x.reward = r.get<double>("a reward");
  const int64_t n = r.count("a reward's components", 16);  // a name's length and a value each
  for (int64_t i = 0; i < n; ++i) {
    std::string name = r.get_string("a reward component's name");
    x.components.emplace_back(std::move(name), r.get<double>("a reward component's value"));
  }
  x.failed = r.get<uint8_t>("a reward's failure flag") != 0;
  x.error = r.get_string("a reward's error");
  return x;
}

void write_stats(ByteWriter& w, const RewardStats& s) {
  for (int64_t v : {s.num_requests, s.num_failures, s.num_timeouts, s.num_restarts, s.num_retries,
                    s.num_garbage_lines, s.num_protocol_violations, s.num_answered})
    w.put(v);
  w.put(s.total_seconds);
}

RewardStats read_stats(ByteReader& r) {
  RewardStats s;
  for (int64_t* v : {&s.num_requests, &s.num_failures, &s.num_timeouts, &s.num_restarts, &s.num_retries,
                     &s.num_garbage_lines, &s.num_protocol_violations, &s.num_answered})
    *v = r.get<int64_t>("the reward's counters");
  s.total_seconds = r.get<double>("the reward's seconds");
  return s;
}

// A vector of structs: its length, then each element.
template <typename T, typename F>
void write_all(ByteWriter& w, const std::vector<T>& v, const F& write_one) {
  w.put(int64_t(v.size()));
  for (const T& x : v) write_one(w, x);
}
// `least`: the fewest bytes one element takes, which bounds the count by what is left.
template <typename F>
auto read_all(ByteReader& r, const char* field, size_t least, const F& read_one) {
  const int64_t n = r.count(field, least);
  std::vector<decltype(read_one(r))> v;
  v.reserve(size_t(n));
  for (int64_t i = 0; i < n; ++i) v.push_back(read_one(r));
  return v;
}

}  // namespace

void write_produced(ByteWriter& w, const ProducedBatch& p) {
  write_all(w, p.batch.prompts, write_example);
  w.put(p.batch.total);
  w.put(p.batch.first);
  w.put(p.batch.step);
  write_all(w, p.trajs, write_trajectory);
  write_all(w, p.reqs, write_request);
  write_all(w, p.results, write_result);
  w.put(p.lengths);
  write_stats(w, p.worker);
  for (double v : {p.rollout_seconds, p.reward_seconds, p.wait_seconds, p.turns, p.observed}) w.put(v);
  w.put(p.preemptions);
  w.put(p.expert_overflow_steps);
  w.put(p.kv_peak);
  w.put(p.version);
  w.put(p.data_position);
  w.put(p.sync_check);
}

ProducedBatch read_produced(ByteReader& r) {
  ProducedBatch p;
  // The fewest bytes of each: 7 string and 3 vector lengths; 4 vector lengths, a tensor flag and 3
  // numbers; an id, 5 string lengths and a flag; a reward, a count, a flag and a string length.
  p.batch.prompts = read_all(r, "the prompts", 80, read_example);
  p.batch.total = r.get<int64_t>("the prompt count");
  p.batch.first = r.get<int64_t>("the first prompt's index");
  p.batch.step = r.get<int64_t>("the step");
  p.trajs = read_all(r, "the trajectories", 50, read_trajectory);
  p.reqs = read_all(r, "the reward requests", 49, read_request);
  p.results = read_all(r, "the reward results", 25, read_result);
  p.lengths = r.get_vector<double>("the response lengths");
  p.worker = read_stats(r);
  for (double* v : {&p.rollout_seconds, &p.reward_seconds, &p.wait_seconds, &p.turns, &p.observed})
    *v = r.get<double>("the timings");
  p.preemptions = r.get<int64_t>("the preemptions");
  p.expert_overflow_steps = r.get<int64_t>("the expert overflow steps");
  p.kv_peak = r.get<double>("the KV peak");
  p.version = r.get<int64_t>("the weight version");
  p.data_position = r.get<uint64_t>("the data position");
  p.sync_check = r.get<double>("the sync check");
  return p;
}

void write_ahead(ByteWriter& w, const BatchesAhead& a) {
  w.put(a.max_staleness);
  w.put(a.next_position);
  write_all(w, a.batches, write_produced);
}

BatchesAhead read_ahead(ByteReader& r) {
  BatchesAhead a;
  a.max_staleness = r.get<int64_t>("the max_staleness");
  a.next_position = r.get<uint64_t>("the data position after them");
  a.batches = read_all(r, "the batches", 100, read_produced);
  return a;
}

}  // namespace kiln::trainer
