// The trainer-rollout wire (rollout_link.h): message kinds over comm::Group's point-to-point
// bytes, tensors one by one, and the evaluation encodings.
#include "trainer/rollout_link.h"

#include <ATen/ATen.h>

#include <algorithm>
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
    case LinkKind::kLastStep: return "last step";
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
      recv_tag_(trainer_side ? kToTrainer : kToRollout), trainer_side_(trainer_side) {
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
  world_.send_bytes(out, peer_, send_tag_, /*watched=*/trainer_side_);  // a batch may wait out a step
}

RolloutLink::Message RolloutLink::recv() const {
  Message m;
  m.bytes = world_.recv_bytes(peer_, recv_tag_, /*watched=*/trainer_side_);
  KILN_CHECK(m.bytes.numel() >= 1, "rollout link: an empty message from rank ", peer_);
  const uint8_t k = m.bytes.data_ptr<uint8_t>()[0];
  KILN_CHECK(k >= uint8_t(LinkKind::kStart) && k <= uint8_t(LinkKind::kError), "rollout link: rank ", peer_,
             " sent a message of unknown kind ", int(k), " (expected 1 to ", int(LinkKind::kError), ")");
  m.kind = LinkKind(k);
  return m;
}

at::Tensor& RolloutLink::staging(int64_t bytes, bool pinned) const {
  if (!staging_.defined() || staging_.numel() < bytes || staging_.is_pinned() != pinned)
    staging_ = at::empty({std::max<int64_t>(bytes, staging_.defined() ? staging_.numel() : 0)},
                         at::TensorOptions().dtype(at::kByte).pinned_memory(pinned));
  return staging_;
}

// Each tensor is two messages: its name, dtype and shape (an empty tensor of it), then its values'
// bytes as they lie in a contiguous CPU copy (the staging buffer, or the tensor itself).

int64_t RolloutLink::send_tensors(const NamedTensors& tensors) const {
  int64_t bytes = 0;
  for (const auto& [name, t] : tensors) {
    ByteWriter head;
    head.put(name);
    head.put(int64_t(t.scalar_type()));
    head.put(t.sizes().vec());
    world_.send_bytes(head.tensor(), peer_, send_tag_);
    const int64_t n = int64_t(t.numel()) * int64_t(t.element_size());
    at::Tensor values;  // the CPU copy, or the tensor itself where it is one
    if (t.is_cpu() && t.is_contiguous()) {
      values = t.detach();
    } else {
      values = staging(n, t.is_cuda()).narrow(0, 0, n).view(t.scalar_type()).view(t.sizes());
      values.copy_(t.detach());  // from a GPU: done when it returns (not non_blocking)
    }
    world_.send_bytes(at::from_blob(values.data_ptr(), {n}, at::kByte), peer_, send_tag_);
    bytes += n;
  }
  return bytes;
}

at::Tensor RolloutLink::recv_tensor(const std::string& name, const at::Tensor& like) const {
  const at::Tensor head_bytes = world_.recv_bytes(peer_, recv_tag_);
  ByteReader head(head_bytes.data_ptr<uint8_t>(), size_t(head_bytes.numel()),
                  "the weights from rank " + std::to_string(peer_));
  const std::string got = head.get_string("a tensor's name");
  const int64_t dtype = head.get<int64_t>("a tensor's dtype");
  const std::vector<int64_t> shape = head.get_vector<int64_t>("a tensor's shape");
  head.expect_end();
  KILN_CHECK(got == name && dtype == int64_t(like.scalar_type()), "rollout link: rank ", peer_, " sent ", got, " ",
             at::IntArrayRef(shape), " (dtype ", dtype, ") where this rank's model has ", name, " ", like.scalar_type(),
             "; trainer and rollout ranks must build the same model from the same recipe");
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  // Room for the values the header announced, so that the receive never has to grow the buffer.
  const at::Tensor raw =
      world_.recv_bytes_into(staging(numel * int64_t(like.element_size()), like.is_cuda()), peer_, recv_tag_);
  KILN_CHECK(raw.numel() == numel * int64_t(like.element_size()), "rollout link: rank ", peer_, " sent ", raw.numel(),
             " bytes for ", name, " ", at::IntArrayRef(shape), ", which takes ", numel * int64_t(like.element_size()));
  return raw.view(like.scalar_type()).view(shape);
}

void write_eval_config(ByteWriter& w, const EvalConfig& c) {
  w.put(c.prompts);
  w.put(c.samples);
  w.put(c.temperature);
  w.put(c.max_tokens.value_or(0));  // 0: unset
}

EvalConfig read_eval_config(ByteReader& r) {
  EvalConfig c;
  c.prompts = r.get<int64_t>("eval.prompts");
  c.samples = r.get<int64_t>("eval.samples");
  c.temperature = r.get<double>("eval.temperature");
  if (const auto n = r.get<int64_t>("eval.max_tokens"); n != 0) c.max_tokens = n;
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
