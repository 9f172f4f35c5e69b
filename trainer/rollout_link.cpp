// The trainer-rollout wire (rollout_link.h): message kinds over comm::Group's point-to-point
// bytes, tensors one by one, and the evaluation encodings.
#include "trainer/rollout_link.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cstring>

#include "core/error.h"
#include "trainer/grpo.h"

namespace kiln::trainer {
namespace {
// Tags of the two directions (any two of comm's 0-32767 that nothing else uses).
constexpr int kToRollout = 7101, kToTrainer = 7102;
}  // namespace

const char* link_kind_name(LinkKind k) {
  switch (k) {
    case LinkKind::kStart: return "start";
    case LinkKind::kWeights: return "weights";
    case LinkKind::kEval: return "eval";
    case LinkKind::kStop: return "stop";
    case LinkKind::kExit: return "exit";
    case LinkKind::kBatch: return "batch";
    case LinkKind::kEvalResult: return "eval result";
    case LinkKind::kError: return "error";
  }
  return "unknown";
}

RolloutLink::RolloutLink(comm::Group world, int peer, bool trainer_side)
    : world_(std::move(world)), peer_(peer), send_tag_(trainer_side ? kToRollout : kToTrainer),
      recv_tag_(trainer_side ? kToTrainer : kToRollout) {
  KILN_CHECK(peer >= 0 && peer < world_.size() && peer != world_.rank(), "rollout link: peer ", peer,
             " is not another rank of a group of ", world_.size());
}

ByteReader RolloutLink::Message::body(const std::string& what) const {
  return ByteReader(bytes.data_ptr<uint8_t>() + 1, size_t(bytes.numel()) - 1, what);
}

void RolloutLink::send(LinkKind kind, const ByteWriter& body) const {
  at::Tensor out = at::empty({int64_t(body.bytes().size()) + 1}, at::kByte);
  out.data_ptr<uint8_t>()[0] = uint8_t(kind);
  if (!body.bytes().empty()) std::memcpy(out.data_ptr<uint8_t>() + 1, body.bytes().data(), body.bytes().size());
  world_.send_bytes(out, peer_, send_tag_);
}

RolloutLink::Message RolloutLink::recv() const {
  Message m;
  m.bytes = world_.recv_bytes(peer_, recv_tag_);
  KILN_CHECK(m.bytes.numel() >= 1, "rollout link: an empty message from rank ", peer_);
  const uint8_t k = m.bytes.data_ptr<uint8_t>()[0];
  KILN_CHECK(k >= uint8_t(LinkKind::kStart) && k <= uint8_t(LinkKind::kError), "rollout link: rank ", peer_,
             " sent a message of unknown kind ", int(k), " (expected 1 to ", int(LinkKind::kError), ")");
  m.kind = LinkKind(k);
  return m;
}

int64_t RolloutLink::send_tensors(const NamedTensors& tensors) const {
  int64_t bytes = 0;
  for (const auto& [name, t] : tensors) {
    ByteWriter w;
    w.put(name);
    w.put_tensor(t.detach().cpu().contiguous());
    bytes += int64_t(t.numel() * t.element_size());
    world_.send_bytes(w.tensor(), peer_, send_tag_);
  }
  return bytes;
}

void RolloutLink::recv_tensors(const NamedTensors& into) const {
  at::NoGradGuard no_grad;
  for (const auto& [name, t] : into) {
    const at::Tensor bytes = world_.recv_bytes(peer_, recv_tag_);
    ByteReader r(bytes.data_ptr<uint8_t>(), size_t(bytes.numel()), "the weights from rank " + std::to_string(peer_));
    const std::string got = r.get_string("a tensor's name");
    const at::Tensor v = r.get_tensor("a tensor's values");
    r.expect_end();
    KILN_CHECK(got == name && v.sizes() == t.sizes(), "rollout link: rank ", peer_, " sent ", got, " ", v.sizes(),
               " where this rank's model has ", name, " ", t.sizes(),
               "; trainer and rollout ranks must build the same model from the same recipe");
    at::Tensor dst = t;
    dst.copy_(v);
  }
}

void write_eval_config(ByteWriter& w, const EvalConfig& c) {
  w.put(c.limit);
  w.put(c.samples);
  w.put(c.temperature);
  w.put(c.max_tokens);
}

EvalConfig read_eval_config(ByteReader& r) {
  EvalConfig c;
  c.limit = r.get<int64_t>("eval.limit");
  c.samples = r.get<int64_t>("eval.samples");
  c.temperature = r.get<double>("eval.temperature");
  c.max_tokens = r.get<int64_t>("eval.max_tokens");
  return c;
}

namespace {
void write_score(ByteWriter& w, const EvalScore& s) {
  w.put(s.prompts);
  w.put(s.mean_at_k);
  w.put(s.pass_at_k);
  w.put(s.reward);
}

EvalScore read_score(ByteReader& r) {
  EvalScore s;
  s.prompts = r.get<int64_t>("an eval score's prompts");
  s.mean_at_k = r.get<double>("an eval score's mean@k");
  s.pass_at_k = r.get<double>("an eval score's pass@k");
  s.reward = r.get<double>("an eval score's reward");
  return s;
}
}  // namespace

void write_eval_metrics(ByteWriter& w, const EvalMetrics& m) {
  w.put(m.step);
  w.put(m.k);
  write_score(w, m.all);
  w.put(int64_t(m.by_source.size()));
  for (const auto& [source, s] : m.by_source) {
    w.put(source);
    write_score(w, s);
  }
}

EvalMetrics read_eval_metrics(ByteReader& r) {
  EvalMetrics m;
  m.step = r.get<int64_t>("the eval step");
  m.k = r.get<int64_t>("the eval k");
  m.all = read_score(r);
  const int64_t n = r.count("the eval sources", 1);
  for (int64_t i = 0; i < n; ++i) {
    std::string source = r.get_string("an eval data_source");
    m.by_source[source] = read_score(r);
  }
  return m;
}

}  // namespace kiln::trainer
