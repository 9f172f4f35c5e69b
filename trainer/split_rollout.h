// grpo.async.placement split: the rollout runs on ranks of its own. RankRollout is a trainer's end
// (a RolloutSource); RolloutServer is the rollout rank's, which makes the batches and evaluates
// with the weights its trainer sends (trainer/rollout_link.h is the wire between them).
#pragma once
#include <cstdint>
#include <deque>
#include <vector>

#include "trainer/rollout_link.h"
#include "trainer/rollout_source.h"

namespace kiln::trainer {

// The rollout rank runs the producer's schedule with what it was sent: batch i once it has the
// weights of update v(i) and i is not past the last step it knows. The trainer knows what it sent,
// so it knows every batch the rollout rank will make, and it receives them all before it sends
// anything (drain): a rank never sends to one that is itself sending, which could block both.
class RankRollout : public RolloutSource {
 public:
  // `world`: both halves; `peer`: the rollout rank in it.
  RankRollout(const GrpoConfig& cfg, const comm::Group& world, int peer, const Learner& learner,
              const ProbeCheck& probe, DataStream& stream);
  ~RankRollout() override;  // the rollout rank returns from serving
  ProducedBatch take(int64_t step, StepMetrics& m) override;
  void sync_weights(int64_t step, StepMetrics& m) override;
  EvalMetrics evaluate(const EvalConfig& ec, int64_t step) override;
  BatchesAhead ahead() override;
  void preload(std::vector<ProducedBatch> batches) override;
  void set_last_step(int64_t step) override { last_step_ = step; }
  void stop() override;  // ends the session: a resume starts a new one from the checkpoint
  void restart(int64_t, bool) override {}  // the next session sends the weights
  Producer* local() override { return nullptr; }

 private:
  // Marks a send or receive under way; an exception that leaves one leaves the link unusable.
  struct Exchange {
    RankRollout& r;
    explicit Exchange(RankRollout& rollout) : r(rollout) { r.mid_exchange_ = true; }
    void done() { r.mid_exchange_ = false; }
  };
  bool broken() const { return peer_gone_ || mid_exchange_; }
  bool can_make(int64_t i) const;
  void drain();
  void receive_batch();
  [[noreturn]] void rollout_failed(const RolloutLink::Message& msg);
  int64_t send_weights(LinkKind kind, const std::vector<int64_t>& head, int64_t step);
  void start_session(int64_t trained);
  void send_last_step();

  const GrpoConfig& cfg_;
  RolloutLink link_;
  const Learner& learner_;
  const ProbeCheck& probe_;
  DataStream& stream_;  // follows the rollout rank's, for checkpoints
  int64_t last_step_ = 0;
  bool started_ = false;
  // The rollout rank returned after an error (rollout_failed), or an exchange was cut short by
  // one: no further message may go either way.
  bool peer_gone_ = false, mid_exchange_ = false;
  int64_t received_ = 0;      // batches received: 1 .. received_
  int64_t sent_version_ = 0;  // the weights the rollout rank has
  int64_t sent_last_ = 0;     // the last step it knows of (0: none)
  std::deque<ProducedBatch> ready_;
};

class RolloutServer {
 public:
  // `model`: what the engine's weights are named after (this rank's placeholders, or LoRA's base).
  RolloutServer(const GrpoConfig& cfg, const comm::Group& world, int peer, Producer& producer,
                const model::Muse& model, const ProbeCheck& probe, DataStream& stream,
                const std::vector<Example>& test);
  // Serves sessions until the trainer says exit; an error is sent to the trainer, then rethrown.
  void serve();

 private:
  void serve_sessions();
  bool serve_session(int64_t first);
  void receive_weights(ByteReader& r, int64_t version);

  const GrpoConfig& cfg_;
  RolloutLink link_;
  Producer& producer_;
  const model::Muse& model_;
  const ProbeCheck& probe_;
  DataStream& stream_;
  const std::vector<Example>& test_;
  int64_t steps_ = 0, last_step_ = 0;
  double last_sync_check_ = -1;  // the probe check of the weights it has
};

}  // namespace kiln::trainer
