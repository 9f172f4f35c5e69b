// grpo.async.placement split: a trainer's end of the link to its rollout rank, and the rollout
// rank's server.
#include "trainer/split_rollout.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cstdio>
#include <string>

#include "core/clock.h"
#include "core/error.h"

namespace kiln::trainer {
// ---- the trainer's end ----

RankRollout::RankRollout(const GrpoConfig& cfg, const comm::Group& world, int peer, const Learner& learner,
                         const ProbeCheck& probe, DataStream& stream)
    : cfg_(cfg), link_(world, peer, /*trainer_side=*/true), learner_(learner), probe_(probe), stream_(stream) {}

// Never throws: the rollout rank is told to exit however the trainer ends.
RankRollout::~RankRollout() {
  if (broken()) return;
  try {
    if (started_) drain();
    link_.send(LinkKind::kExit);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "grpo: could not tell rollout rank %d to exit: %s\n", link_.peer(), e.what());
  }
}

bool RankRollout::can_make(int64_t i) const {
  return (sent_last_ <= 0 || i <= sent_last_) && sent_version_ >= weight_version_for(i, cfg_.async->max_staleness);
}

void RankRollout::drain() {
  while (can_make(received_ + 1)) receive_batch();
}

// The rollout rank's error, as this rank's.
void RankRollout::rollout_failed(const RolloutLink::Message& msg) {
  peer_gone_ = true;
  ByteReader r = msg.body("the error from the rollout rank");
  KILN_FAIL("grpo: rollout rank ", link_.peer(), " (async.placement split) stopped: ", r.get_string("the error"));
}

void RankRollout::receive_batch() {
  Exchange x(*this);  // done once the batch is read: a batch that cannot be read leaves the link unused
  const RolloutLink::Message msg = link_.recv();
  if (msg.kind == LinkKind::kError) rollout_failed(msg);
  KILN_CHECK(msg.kind == LinkKind::kBatch, "grpo: rollout rank ", link_.peer(), " sent ", link_kind_name(msg.kind),
             " where batch ", received_ + 1, " was due; report this");
  ByteReader r = msg.body(str_cat("batch ", received_ + 1, " from rank ", link_.peer()));
  ProducedBatch p = read_produced(r);
  r.expect_end();
  const int64_t i = ++received_;
  KILN_CHECK(p.batch.step == i && p.data_position == stream_.position(), "grpo: internal error: rollout rank ",
             link_.peer(), " sent the batch of step ", p.batch.step, " from data position ", p.data_position,
             " where step ", i, " from ", stream_.position(), " was due; report this");
  stream_.next(cfg_.prompts_per_step);  // this rank's stream follows the rollout rank's, for checkpoints
  ready_.push_back(std::move(p));
  x.done();
}

// A header (`head`, the last step, this rank's probe log-probs after `step`) and the weights.
int64_t RankRollout::send_weights(LinkKind kind, const std::vector<int64_t>& head, int64_t step) {
  ByteWriter w;
  for (int64_t v : head) w.put(v);
  w.put(last_step_);
  w.put_tensor(probe_.enabled() ? learner_.own_probe_logprobs(probe_.tokens(), step) : at::Tensor());
  Exchange x(*this);
  link_.send(kind, w);
  const int64_t bytes = link_.send_tensors(learner_.synced_tensors());
  x.done();
  sent_last_ = last_step_;
  return bytes;
}

// A session: the rollout rank starts from this rank's data position and weights, those of
// `trained` updates, with the first batch not already here (preloaded from a checkpoint).
void RankRollout::start_session(int64_t trained) {
  KILN_CHECK(!broken(), "grpo: an earlier error left rollout rank ", link_.peer(),
             peer_gone_ ? " stopped" : " mid-exchange", "; build a new trainer to go on");
  if (started_) return;
  sent_version_ = trained;
  received_ = trained + int64_t(ready_.size());
  send_weights(LinkKind::kStart, {trained, int64_t(stream_.position()), received_ + 1}, trained);
  started_ = true;
}

ProducedBatch RankRollout::take(int64_t step, StepMetrics& m) {
  start_session(step - 1);  // the step under way has not updated the weights yet
  if (ready_.empty() && last_step_ != sent_last_) send_last_step();  // set_last_step moved it
  if (ready_.empty()) {
    KILN_CHECK(can_make(received_ + 1), "grpo: internal error: step ", step,
               " waits for a batch the rollout rank cannot make (weights ", sent_version_, ", last step ", sent_last_,
               "); report this");
    receive_batch();
  }
  ProducedBatch p = std::move(ready_.front());
  ready_.pop_front();
  m.sync_check = p.sync_check;  // the check of the weights that sampled it
  return p;
}

// The weight sync: after the batches made with the weights before (through step + k).
void RankRollout::sync_weights(int64_t step, StepMetrics& m) {
  if (!started_) return;  // the next session starts from these weights
  drain();
  const auto t = Clock::now();
  m.sync_bytes = send_weights(LinkKind::kWeights, {step}, step);
  m.sync_seconds = seconds_since(t);
  sent_version_ = step;
}

// The last step, where the rollout rank knew another (a caller that extends or ends a run).
void RankRollout::send_last_step() {
  drain();
  ByteWriter w;
  w.put(last_step_);
  Exchange x(*this);
  link_.send(LinkKind::kLastStep, w);
  x.done();
  sent_last_ = last_step_;
}

EvalMetrics RankRollout::evaluate(const EvalConfig& ec, int64_t step) {
  ec.validate();
  start_session(step);
  drain();
  ByteWriter w;
  w.put(step);
  w.put(last_step_);
  write_eval_config(w, ec);
  Exchange x(*this);
  link_.send(LinkKind::kEval, w);
  sent_last_ = last_step_;
  const RolloutLink::Message msg = link_.recv();
  if (msg.kind == LinkKind::kError) rollout_failed(msg);
  KILN_CHECK(msg.kind == LinkKind::kEvalResult, "grpo: rollout rank ", link_.peer(), " sent ",
             link_kind_name(msg.kind), " where the evaluation was due; report this");
  ByteReader r = msg.body("the evaluation from rank " + std::to_string(link_.peer()));
  EvalMetrics em = read_eval_metrics(r);
  r.expect_end();
  x.done();
  return em;
}

// Every batch the rollout rank can make with the weights sent is received first: the stream here
// follows the rollout rank's only as batches arrive.
BatchesAhead RankRollout::ahead() {
  if (started_ && !broken()) drain();
  return {cfg_.async->max_staleness, stream_.position(), std::vector<ProducedBatch>(ready_.begin(), ready_.end())};
}

void RankRollout::preload(std::vector<ProducedBatch> batches) {
  KILN_CHECK(!started_ && ready_.empty(), "grpo: internal error: batches preloaded mid-session; report this");
  ready_.assign(std::make_move_iterator(batches.begin()), std::make_move_iterator(batches.end()));
}

void RankRollout::stop() {
  if (broken()) return;
  if (started_) {
    drain();
    Exchange x(*this);
    link_.send(LinkKind::kStop);
    x.done();
    started_ = false;
  }
  ready_.clear();  // received, or preloaded from a checkpoint
}

// ---- the rollout rank's end ----

RolloutServer::RolloutServer(const GrpoConfig& cfg, const comm::Group& world, int peer, Producer& producer,
                             const model::Muse& model, const ProbeCheck& probe, DataStream& stream,
                             const std::vector<Example>& test)
    : cfg_(cfg), link_(world, peer, /*trainer_side=*/false), producer_(producer), model_(model), probe_(probe),
      stream_(stream), test_(test) {}

void RolloutServer::serve() {
  try {
    serve_sessions();
  } catch (const std::exception& e) {
    try {  // the trainer reports it too, instead of waiting for a batch that will not come
      ByteWriter w;
      w.put(std::string(e.what()));
      link_.send(LinkKind::kError, w);
    } catch (...) {
    }
    throw;
  }
}

void RolloutServer::serve_sessions() {
  at::NoGradGuard no_grad;
  for (;;) {
    const RolloutLink::Message msg = link_.recv();
    if (msg.kind == LinkKind::kExit) return;
    KILN_CHECK(msg.kind == LinkKind::kStart, "grpo: trainer rank ", link_.peer(), " sent ", link_kind_name(msg.kind),
               " before starting a session; report this");
    ByteReader r = msg.body("the start from rank " + std::to_string(link_.peer()));
    steps_ = r.get<int64_t>("the step");
    stream_.seek(uint64_t(r.get<int64_t>("the data position")));
    const int64_t first = r.get<int64_t>("the first batch");
    receive_weights(r, steps_);
    if (!serve_session(first)) return;
  }
}

// Makes every batch it can from `first` on, and between them answers the trainer; false once told
// to exit.
bool RolloutServer::serve_session(int64_t first) {
  int64_t next = first;
  double waited = 0;
  for (;;) {
    if ((last_step_ <= 0 || next <= last_step_) &&
        producer_.weight_version() >= weight_version_for(next, cfg_.async->max_staleness)) {
      ProducedBatch p = producer_.produce_next(next++);
      p.wait_seconds = waited;
      p.sync_check = last_sync_check_;
      waited = 0;
      ByteWriter w;
      write_produced(w, p);
      link_.send(LinkKind::kBatch, w);
      continue;
    }
    const auto t = Clock::now();
    const RolloutLink::Message msg = link_.recv();
    waited += seconds_since(t);
    ByteReader r = msg.body(str_cat("the ", link_kind_name(msg.kind), " message from rank ", link_.peer()));
    switch (msg.kind) {
      case LinkKind::kWeights:
        receive_weights(r, r.get<int64_t>("the weight version"));
        break;
      case LinkKind::kEval: {
        steps_ = r.get<int64_t>("the step");
        last_step_ = r.get<int64_t>("the last step");
        const EvalConfig ec = read_eval_config(r);
        r.expect_end();
        ByteWriter w;
        write_eval_metrics(w, producer_.evaluate(ec, test_, steps_));
        link_.send(LinkKind::kEvalResult, w);
        break;
      }
      case LinkKind::kLastStep:
        last_step_ = r.get<int64_t>("the last step");
        r.expect_end();
        break;
      case LinkKind::kStop:
        return true;
      case LinkKind::kExit:
        return false;
      default:
        KILN_FAIL("grpo: trainer rank ", link_.peer(), " sent ", link_kind_name(msg.kind), " mid-session; report this");
    }
  }
}

// The rest of a start or weights header (the last step, the trainer's probe log-probs), then the
// weights straight into the engine, one tensor at a time (this rank's own model holds none of
// them); the probe checks the engine against the trainer.
void RolloutServer::receive_weights(ByteReader& r, int64_t version) {
  steps_ = version;  // what the probe check's message names
  last_step_ = r.get<int64_t>("the last step");
  const at::Tensor theirs = r.get_tensor("the trainer's probe log-probs");
  r.expect_end();
  const rollout::WeightSource next = [&](const std::string& name, const at::Tensor& own) {
    return link_.recv_tensor(name, own);
  };
  rollout::Engine& engine = producer_.engine();
  if (cfg_.lora) engine.update_adapters(model_, next);
  else engine.update_weights(model_, next);
  producer_.rebase(version);
  last_sync_check_ = -1;
  if (theirs.defined()) last_sync_check_ = probe_.compare(theirs, probe_.engine_logprobs(engine, nullptr), steps_);
}

}  // namespace kiln::trainer
