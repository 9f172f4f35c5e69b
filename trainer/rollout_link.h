// The wire between a trainer rank and the rank that rolls out for it (grpo.async.placement: split):
// typed messages in order each way, named tensors one message each, and the encodings of an
// evaluation request and its result.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/bytes.h"
#include "core/comm.h"

namespace kiln::trainer {

struct EvalConfig;
struct EvalMetrics;

// Trainer -> rollout: kStart (a session: position, step, weights), kWeights (a new version),
// kEval (score the held-out prompts), kLastStep (the run's last step moved), kStop (end the
// session), kExit (return from serving).
// Rollout -> trainer: kBatch (a ProducedBatch), kEvalResult, kError (what stopped the rollout).
enum class LinkKind : uint8_t { kStart = 1, kWeights, kEval, kLastStep, kStop, kExit, kBatch, kEvalResult, kError };
const char* link_kind_name(LinkKind k);

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

class RolloutLink {
 public:
  // `peer` is a rank of `world`; this end sends under one tag and receives under the other.
  RolloutLink(comm::Group world, int peer, bool trainer_side);
  int peer() const { return peer_; }

  struct Message {
    LinkKind kind{};
    at::Tensor bytes;  // the whole message, the kind byte first
    ByteReader body(const std::string& what) const;  // the bytes after the kind
  };
  // The trainer's sends and receives are watched by the collective timeout (a batch that never
  // comes is a hung rollout rank); the rollout rank's are not: it waits through whole training
  // steps and checkpoints, for its next order or for its batch to be taken, and the trainer's own
  // collectives are watched.
  void send(LinkKind kind, const ByteWriter& body = ByteWriter()) const;
  Message recv() const;
  // Tensor by tensor (a header naming it, then its values' bytes from a CPU copy), so that no
  // more than one tensor is ever held on the CPU; returns the bytes of the values. A GPU tensor is
  // staged through one pinned buffer, reused (no allocation, no page faults per tensor).
  int64_t send_tensors(const NamedTensors& tensors) const;
  // The next tensor, which must be `name`, of `like`'s dtype (any shape: the caller checks it), on
  // the CPU; send_tensors' counterpart, one call per tensor. It lies in a buffer the next call
  // reuses (pinned when `like` is on a GPU): copy it before then.
  at::Tensor recv_tensor(const std::string& name, const at::Tensor& like) const;

 private:
  comm::Group world_;
  int peer_ = 0, send_tag_ = 0, recv_tag_ = 0;
  bool trainer_side_ = false;
  mutable at::Tensor staging_;  // the tensors' bytes on their way (uint8, grown as needed)
  // staging_ with room for `bytes`, pinned where the other side of the copy is a GPU.
  at::Tensor& staging(int64_t bytes, bool pinned) const;
};

void write_eval_config(ByteWriter& w, const EvalConfig& c);
EvalConfig read_eval_config(ByteReader& r);
void write_eval_metrics(ByteWriter& w, const EvalMetrics& m);
EvalMetrics read_eval_metrics(ByteReader& r);

}  // namespace kiln::trainer
