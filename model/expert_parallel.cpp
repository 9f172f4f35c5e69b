// Expert sharding of a model and the differentiable row exchange the MoE layer dispatches with.
#include "model/expert_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "core/error.h"

namespace kiln::model {
namespace {

// Autograd node of the exchange. The group rides in saved_data as an address: the caller's group
// outlives the backward (it lives in the trainer or the test).
struct ExchangeRows : public torch::autograd::Function<ExchangeRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group,
                            std::vector<int64_t> send, std::vector<int64_t> recv, bool known) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    const auto* g = reinterpret_cast<const comm::Group*>(group);
    if (known) return g->all_to_all_known(x.contiguous(), send, recv);
    std::vector<int64_t> got;
    at::Tensor out = g->all_to_all_v(x.contiguous(), send, &got);
    KILN_CHECK(got == recv, "exchange_rows: rank ", g->rank(), " expected ", c10::IntArrayRef(recv),
               " rows from the ranks but they sent ", c10::IntArrayRef(got), "; every rank must pass matching counts");
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto* g = reinterpret_cast<const comm::Group*>(ctx->saved_data["group"].toInt());
    const std::vector<int64_t> send = ctx->saved_data["send"].toIntVector(),
                               recv = ctx->saved_data["recv"].toIntVector();
    // The reverse trip, whose counts the forward settled.
    at::Tensor back = g->all_to_all_known(grads[0].contiguous(), recv, send);
    return {back, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor exchange_rows(const comm::Group& group, const at::Tensor& x, const std::vector<int64_t>& send,
                         const std::vector<int64_t>& recv, bool known) {
  return ExchangeRows::apply(x, reinterpret_cast<int64_t>(&group), send, recv, known);
}

ExpertDispatcher::Routed AllToAllDispatcher::dispatch(const at::Tensor& z, const at::Tensor& flat, int64_t k,
                                                     int64_t local) const {
  if (fixed_shape_) return dispatch_fixed(z, flat, k, local);
  const int64_t S = group_.size();
  Routed r;
  at::Tensor owner = at::div(flat, local, "floor");
  r.order = std::get<1>(at::sort(owner, /*stable=*/true, 0, /*descending=*/false));  // slots by owner
  at::Tensor per_rank = at::zeros({S}, flat.options()).index_add_(0, owner, at::ones_like(owner)).cpu();
  r.send.assign(per_rank.data_ptr<int64_t>(), per_rank.data_ptr<int64_t>() + S);
  at::Tensor ids_out = (flat - owner * local).index_select(0, r.order);  // local expert ids at the owner
  r.ids = group_.all_to_all_v(ids_out, r.send, &r.recv);
  r.rows = exchange_rows(group_, z.index_select(0, at::div(r.order, k, "floor")), r.send, r.recv);
  return r;
}

// Slot i of rank r's buffer for rank j is row j * C + (its place among this rank's slots for j),
// all on the device: a stable sort by owner, and each slot's distance from its owner's first.
ExpertDispatcher::Routed AllToAllDispatcher::dispatch_fixed(const at::Tensor& z, const at::Tensor& flat, int64_t k,
                                                            int64_t local) const {
  const int64_t S = group_.size(), n = flat.size(0);
  // Without a set capacity, the most slots of any rank (a host all-reduce), which no rank's slots
  // for one rank exceed. With one, no host call at all (what a captured step needs).
  const int64_t C = capacity_ > 0 ? capacity_ : int64_t(group_.all_reduce(double(n), comm::ReduceOp::kMax));
  Routed r;
  r.send.assign(size_t(S), C);
  r.recv = r.send;
  const at::TensorOptions longs = flat.options().dtype(at::kLong);
  const at::Tensor token = at::div(at::arange(n, longs), k, "floor");  // each slot's row of z
  at::Tensor owner = at::div(flat, local, "floor");
  if (row_mask_.defined()) {  // the slots of masked-out tokens go to a spare owner S: never sent
    KILN_CHECK(row_mask_.size(0) * k == n, "expert exchange: a row mask of ", row_mask_.size(0), " tokens for ", n,
               " slots of top_k ", k);
    owner = at::where(row_mask_.index_select(0, token) != 0, owner, S);
  }
  r.order = std::get<1>(at::sort(owner, /*stable=*/true, 0, /*descending=*/false));
  const at::Tensor per_owner = at::zeros({S + 1}, longs).index_add_(0, owner, at::ones_like(owner));
  const at::Tensor first = per_owner.cumsum(0) - per_owner;  // each owner's first sorted slot
  const at::Tensor sorted_owner = owner.index_select(0, r.order);
  const at::Tensor place = at::arange(n, longs) - first.index_select(0, sorted_owner);
  // Each slot's row in the send buffer. A masked slot, or one beyond the capacity of its rank,
  // goes to a spare row past the buffer's end (not sent), and its output is read from row 0: a
  // masked token's output is never read, a dropped slot's is garbage (overflow()).
  const at::Tensor fits = (place < C).logical_and_(sorted_owner < S);
  const at::Tensor row = at::empty({n}, longs).scatter_(0, r.order, at::where(fits, sorted_owner * C + place, S * C));
  if (capacity_ > 0) {
    if (!overflow_.defined()) overflow_ = at::zeros({}, flat.options().dtype(at::kInt));
    // Once allocated it stays: captured steps write to its address.
    KILN_CHECK(overflow_.device() == flat.device(), "expert exchange: the overflow count lives on ",
               overflow_.device(), ", the slots on ", flat.device(), "; use one dispatcher per device");
    overflow_.add_((per_owner.narrow(0, 0, S) > C).any().to(at::kInt));
  }
  r.slot_rows = at::where(row == S * C, at::zeros_like(row), row);
  // The send buffer: slot rows from z, every other row from an appended zero row.
  const at::Tensor source = at::full({S * C + 1}, z.size(0), longs)
                                .scatter_(0, row, token)
                                .narrow(0, 0, S * C);
  const at::Tensor padded = at::cat({z, at::zeros({1, z.size(1)}, z.options())}).index_select(0, source);
  // Padding rows carry the spare id `local`: the receiving rank's experts skip them.
  const at::Tensor ids = at::full({S * C + 1}, local, longs).scatter_(0, row, flat.remainder(local)).narrow(0, 0, S * C);
  r.spare = true;
  r.live_rows = n;
  r.ids = group_.all_to_all_known(ids, r.send, r.recv);
  r.rows = exchange_rows(group_, padded, r.send, r.recv, /*known=*/true);
  return r;
}

at::Tensor AllToAllDispatcher::combine(const at::Tensor& y, const Routed& r) const {
  if (r.slot_rows.defined()) return exchange_rows(group_, y, r.recv, r.send, /*known=*/true).index_select(0, r.slot_rows);
  at::Tensor back = exchange_rows(group_, y, r.recv, r.send);  // owner order
  at::Tensor inverse = at::empty_like(r.order).scatter_(0, r.order, at::arange(r.order.size(0), r.order.options()));
  return back.index_select(0, inverse);
}

Muse shard_experts(const Muse& full, int rank, int size) {
  const int64_t E = full.config().num_experts;
  KILN_CHECK(size >= 1 && E % size == 0 && rank >= 0 && rank < size, "shard_experts: ", E,
             " experts do not split evenly over ", size, " ranks (rank ", rank, ")");
  const int64_t per = E / size, first = int64_t(rank) * per;
  Weights w = full.weights();  // shares every tensor
  at::NoGradGuard no_grad;
  for (LayerWeights& l : w.layers) {
    for (at::Tensor* t : {&l.expert_gate, &l.expert_up, &l.expert_down, &l.expert_norm})
      *t = t->narrow(0, first, per).clone();
    auto& q = l.nvfp4;  // NVFP4 stacks (the kernel layout is per matrix, so they slice by expert)
    for (kernels::Nvfp4Tensor* t : {&q.expert_gate, &q.expert_up, &q.expert_down}) {
      if (!t->packed.defined()) continue;
      for (at::Tensor* part : {&t->packed, &t->block_scale, &t->tensor_scale, &t->input_scale})
        if (part->defined()) *part = part->narrow(0, first, per).clone();
    }
    auto& a = l.lora;  // the experts' adapters split like the experts
    for (at::Tensor* t : {&a.gate_a, &a.gate_b, &a.up_a, &a.up_b, &a.down_a, &a.down_b})
      if (t->defined()) *t = t->narrow(0, first, per).clone();
  }
  return Muse(full.config(), std::move(w));
}

}  // namespace kiln::model
