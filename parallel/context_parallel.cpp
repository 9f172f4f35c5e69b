// Context parallelism: the zigzag split of a packed micro-batch, the differentiable gathers of keys
// and values (all of them for full attention, the halo for window layers) and the batch reduction.
#include "parallel/context_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "model/checkpoint.h"

namespace kiln::parallel {
namespace {

// Every rank's rows of x in rank order, rank j giving counts[j] (known beforehand on every rank, so
// no count exchange): padded to the most, all-gathered, unpadded.
at::Tensor gather_known(const comm::Group& g, const at::Tensor& x, const std::vector<int64_t>& counts) {
  KILN_CHECK(x.size(0) == counts[size_t(g.rank())], "context parallel: rank ", g.rank(), " gives ", x.size(0),
             " rows to a gather planned with ", counts[size_t(g.rank())]);
  const int64_t most = *std::max_element(counts.begin(), counts.end());
  std::vector<int64_t> shape = x.sizes().vec();
  if (most == 0) {
    shape[0] = 0;
    return at::empty(shape, x.options());
  }
  at::Tensor src = x.contiguous();
  if (x.size(0) < most) {
    shape[0] = most - x.size(0);
    src = at::cat({src, at::zeros(shape, x.options())}, 0);
  }
  at::Tensor all = g.all_gather(src);
  if (std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == most; })) return all;
  std::vector<at::Tensor> parts;
  for (size_t r = 0; r < counts.size(); ++r) parts.push_back(all.narrow(0, int64_t(r) * most, counts[r]));
  return at::cat(parts, 0);
}

// Runs fn() and, when `clock` is the address of a double, adds its seconds there with the device
// synchronised before and after.
template <typename F>
auto timed(int64_t clock, at::Device device, const F& fn) {
  if (!clock) return fn();
  model::synchronize(device);
  const auto t0 = std::chrono::steady_clock::now();
  auto out = fn();
  model::synchronize(device);
  *reinterpret_cast<double*>(clock) += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

// gather_known under a gradient. The backward is its transpose: every rank sends the gradient of
// each gathered block to the block's owner (all-to-all), which adds what the ranks sent in rank
// order. The group (and the clock, when timed) ride in saved_data as addresses: they outlive the
// backward (ContextParallel).
struct GatherRows : public torch::autograd::Function<GatherRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group,
                            std::vector<int64_t> counts, int64_t clock) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["counts"] = counts;
    ctx->saved_data["clock"] = clock;
    return timed(clock, x.device(), [&] { return gather_known(*reinterpret_cast<const comm::Group*>(group), x, counts); });
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto* g = reinterpret_cast<const comm::Group*>(ctx->saved_data["group"].toInt());
    const std::vector<int64_t> counts = ctx->saved_data["counts"].toIntVector();
    const int64_t mine = counts[size_t(g->rank())];
    at::Tensor back = timed(ctx->saved_data["clock"].toInt(), grads[0].device(), [&] {
      return g->all_to_all_known(grads[0].contiguous(), counts, std::vector<int64_t>(counts.size(), mine));
    });
    at::Tensor sum = back.narrow(0, 0, mine).clone();
    for (int64_t r = 1; r < int64_t(counts.size()); ++r) sum.add_(back.narrow(0, r * mine, mine));
    return {sum, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The group's sum of t, added in rank order on every rank (the same bits everywhere). Its backward
// is the identity: see model::BatchReduce.
struct SumOverGroup : public torch::autograd::Function<SumOverGroup> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& t, int64_t group) {
    const auto* g = reinterpret_cast<const comm::Group*>(group);
    at::Tensor all = g->all_gather(t.contiguous().reshape({1, -1}));  // [ranks, numel]
    at::Tensor sum = all[0].clone();
    for (int64_t r = 1; r < all.size(0); ++r) sum.add_(all[r]);
    return sum.view(t.sizes());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

at::Tensor long_tensor(const std::vector<int64_t>& v, at::Device device) {
  return at::tensor(v, at::kLong).to(device);
}

// Where each rank's pieces begin in its local rows: [rank][piece].
std::vector<std::vector<int64_t>> local_begins(const ContextSplit& split) {
  std::vector<std::vector<int64_t>> out(size_t(split.ranks()));
  for (int r = 0; r < split.ranks(); ++r) {
    int64_t at = 0;
    for (const ContextPiece& p : split.pieces(r)) out[size_t(r)].push_back(at), at += p.length;
  }
  return out;
}

}  // namespace

comm::Group context_group(const comm::Group& group, int64_t cp) {
  if (cp <= 1) return comm::Group();
  KILN_CHECK(group.size() % cp == 0, "context parallel: cp ", cp, " does not divide the ", group.size(), " ranks");
  return group.split(int(group.rank() / cp), group.rank());
}

ContextSplit::ContextSplit(std::vector<int64_t> cu_seqlens, int ranks)
    : cu_seqlens_(std::move(cu_seqlens)), pieces_(size_t(std::max(ranks, 0))) {
  KILN_CHECK(ranks >= 1, "context parallel: the split needs at least one rank (got ", ranks, ")");
  KILN_CHECK(!cu_seqlens_.empty() && cu_seqlens_[0] == 0, "context parallel: cu_seqlens must start at 0");
  const int64_t N = ranks, C = 2 * N;
  int64_t turn = 0;  // the rank that gets the next left-over token
  for (int64_t s = 0; s < num_sequences(); ++s) {
    const int64_t n = cu_seqlens_[size_t(s + 1)] - cu_seqlens_[size_t(s)];
    KILN_CHECK(n >= 0, "context parallel: cu_seqlens must not decrease (at sequence ", s, ")");
    std::vector<int64_t> size(size_t(C), n / C);
    const int64_t rem = n % C;
    for (int64_t i = 0; i < rem; ++i) {  // ranks turn, turn + 1, ...: front chunks, then back chunks
      const int64_t r = (turn + i) % N;
      ++size[size_t(i < N ? r : C - 1 - r)];
    }
    turn = (turn + rem) % N;
    int64_t start = 0;
    for (int64_t c = 0; c < C; ++c) {
      const int64_t len = size[size_t(c)];
      std::vector<ContextPiece>& mine = pieces_[size_t(c < N ? c : C - 1 - c)];
      if (len > 0) {
        if (!mine.empty() && mine.back().sequence == s && mine.back().start + mine.back().length == start)
          mine.back().length += len;  // touches the rank's piece before it
        else
          mine.push_back({s, start, len, false});
        mine.back().last = start + len == n;
      }
      start += len;
    }
  }
  for (int r = 0; r < ranks; ++r)
    KILN_CHECK(num_tokens(r) > 0, "context parallel: rank ", r, " of ", ranks, " gets no tokens of a micro-batch of ",
               num_tokens(), " tokens in ", num_sequences(), " sequences; every cp rank needs one: give at least ",
               ranks, " tokens");
}

int64_t ContextSplit::num_tokens(int rank) const {
  int64_t n = 0;
  for (const ContextPiece& p : pieces(rank)) n += p.length;
  return n;
}

std::vector<int64_t> ContextSplit::rows(int rank) const {
  std::vector<int64_t> out;
  for (const ContextPiece& p : pieces(rank))
    for (int64_t i = 0; i < p.length; ++i) out.push_back(cu_seqlens_[size_t(p.sequence)] + p.start + i);
  return out;
}

int64_t ContextSplit::attention_work(int rank, int64_t window) const {
  int64_t work = 0;
  for (const ContextPiece& p : pieces(rank))
    for (int64_t pos = p.start; pos < p.start + p.length; ++pos)
      work += window > 0 ? std::min(pos + 1, window) : pos + 1;
  return work;
}

int64_t ContextSplit::attention_work(int rank, const model::ModelConfig& cfg) const {
  int64_t full = 0;
  for (int64_t l = 0; l < cfg.num_layers; ++l) full += cfg.is_full_attention(l);
  return full * attention_work(rank) + (cfg.num_layers - full) * attention_work(rank, cfg.sliding_window);
}

model::PackedBatch ContextSplit::local_batch(const at::Tensor& tokens, int rank) const {
  KILN_CHECK(tokens.dim() == 1 && tokens.size(0) == num_tokens(), "context parallel: tokens must be [",
             num_tokens(), "] for the split batch (got ", tokens.sizes(), ")");
  model::PackedBatch b;
  b.tokens = local_rows(tokens, rank);
  b.cu_seqlens = {0};
  for (const ContextPiece& p : pieces(rank)) {
    b.cu_seqlens.push_back(b.cu_seqlens.back() + p.length);
    b.start_positions.push_back(p.start);
  }
  return b;
}

at::Tensor ContextSplit::local_rows(const at::Tensor& whole, int rank) const {
  KILN_CHECK(whole.dim() >= 1 && whole.size(0) == num_tokens(), "context parallel: a per-token tensor of the batch "
             "has ", whole.dim() ? whole.size(0) : 0, " rows, expected ", num_tokens());
  return whole.index_select(0, long_tensor(rows(rank), whole.device()));
}

ContextParallel::ContextParallel(const comm::Group& group, std::vector<int64_t> cu_seqlens,
                                 const model::ModelConfig& cfg, at::Device device, int64_t max_padded_score_bytes)
    : group_(group), rank_(group.rank()), split_(std::move(cu_seqlens), group.size()), window_(cfg.sliding_window) {
  full_plan_ = plan(true, device, cfg.num_q_heads, max_padded_score_bytes);
  window_plan_ = plan(false, device, cfg.num_q_heads, max_padded_score_bytes);
}

// Full layers: the key source is the gather of every rank's rows (rank j's local rows at offset
// sum(counts[<j])), and a piece reads its sequence's positions [0, end). Window layers: the key
// source is this rank's rows followed by the gathered halos, and a piece reads the halo rows of
// positions [start - W + 1, start) and its own rows.
ContextParallel::KindPlan ContextParallel::plan(bool full, at::Device device, int64_t heads,
                                                int64_t max_padded_score_bytes) const {
  const int R = split_.ranks();
  const int64_t halo = std::max<int64_t>(window_ - 1, 0);
  const auto begins = local_begins(split_);
  KindPlan p;
  // Source row of each (sequence, position) that the gather brings, -1 elsewhere.
  std::vector<std::vector<int64_t>> source(size_t(split_.num_sequences()));
  for (int64_t s = 0; s < split_.num_sequences(); ++s)
    source[size_t(s)].assign(size_t(split_.cu_seqlens()[size_t(s + 1)] - split_.cu_seqlens()[size_t(s)]), -1);
  int64_t offset = full ? 0 : split_.num_tokens(rank_);
  std::vector<int64_t> send;
  for (int r = 0; r < R; ++r) {
    int64_t count = 0;
    const auto& pieces = split_.pieces(r);
    for (size_t i = 0; i < pieces.size(); ++i) {
      const ContextPiece& c = pieces[i];
      const int64_t n = full ? c.length : c.last ? 0 : std::min(halo, c.length), first = c.length - n;
      for (int64_t j = 0; j < n; ++j) {
        source[size_t(c.sequence)][size_t(c.start + first + j)] = offset + count + j;
        if (!full && r == rank_) send.push_back(begins[size_t(r)][i] + first + j);
      }
      count += n;
    }
    p.send_counts.push_back(count);
    offset += count;
  }
  p.send_rows = long_tensor(send, device);
  std::vector<std::vector<int64_t>> q_rows, q_pos, k_rows, k_pos;
  const auto& mine = split_.pieces(rank_);
  for (size_t i = 0; i < mine.size(); ++i) {
    const ContextPiece& c = mine[i];
    const int64_t begin = begins[size_t(rank_)][i], end = c.start + c.length;
    const int64_t k_start = full ? 0 : std::max<int64_t>(0, c.start - halo);
    q_rows.emplace_back(), q_pos.emplace_back(), k_rows.emplace_back(), k_pos.emplace_back();
    for (int64_t j = 0; j < c.length; ++j) q_rows.back().push_back(begin + j), q_pos.back().push_back(c.start + j);
    for (int64_t pos = k_start; pos < end; ++pos) {
      const int64_t row = !full && pos >= c.start ? begin + pos - c.start : source[size_t(c.sequence)][size_t(pos)];
      KILN_CHECK(row >= 0, "context parallel: no rank sends the key of sequence ", c.sequence, " at position ", pos,
                 " that rank ", rank_, "'s piece at ", c.start, " reads");
      k_rows.back().push_back(row);
      k_pos.back().push_back(pos);
    }
    p.q_begin.push_back(begin);
    p.q_length.push_back(c.length);
    p.q_start.push_back(c.start);
    p.k_start.push_back(k_start);
    p.k_rows.push_back(long_tensor(k_rows.back(), device));
  }
  p.padded = model::PaddedLayout::build(q_rows, q_pos, k_rows, k_pos, device);
  p.use_padded = p.padded.score_bytes(heads) <= max_padded_score_bytes;
  if (device.is_cuda()) {
    std::vector<int64_t> all_k;
    std::vector<int32_t> cu_q = {0}, cu_k = {0};
    for (size_t i = 0; i < k_rows.size(); ++i) {
      KILN_CHECK(p.q_begin[i] == cu_q.back(), "context parallel: rank ", rank_, "'s piece ", i, " starts at local row ",
                 p.q_begin[i], ", not after the pieces before it; report this");
      all_k.insert(all_k.end(), k_rows[i].begin(), k_rows[i].end());
      cu_q.push_back(cu_q.back() + int32_t(p.q_length[i]));
      cu_k.push_back(cu_k.back() + int32_t(k_rows[i].size()));
      p.max_q = std::max(p.max_q, p.q_length[i]);
      p.max_k = std::max(p.max_k, int64_t(k_rows[i].size()));
    }
    p.flash_k_rows = long_tensor(all_k, device);
    p.cu_q = at::tensor(cu_q, at::kInt).to(device);
    p.cu_k = at::tensor(cu_k, at::kInt).to(device);
  }
  return p;
}

at::Tensor ContextParallel::attend(int64_t layer, bool full, const model::PackedBatch& batch, const at::Tensor& q,
                                   const at::Tensor& k, const at::Tensor& v) {
  const int64_t T = split_.num_tokens(rank_), heads = k.size(1);
  KILN_CHECK(q.size(0) == T && batch.num_tokens() == T, "context parallel: layer ", layer, " attends ", q.size(0),
             " queries of a batch of ", batch.num_tokens(), " tokens, but this rank's split holds ", T,
             "; run the forward on ContextParallel::local_batch");
  const KindPlan& p = full ? full_plan_ : window_plan_;
  at::Tensor kv = at::cat({k, v}, 1);  // [T, 2 Hkv, hd]: one gather for both
  int64_t total = 0;
  for (int64_t c : p.send_counts) total += c;
  const int64_t group = reinterpret_cast<int64_t>(&group_);
  const int64_t clock = timed_ ? reinterpret_cast<int64_t>(&exchanged_.seconds) : 0;
  at::Tensor src = kv;
  if (full) {
    src = GatherRows::apply(kv, group, p.send_counts, clock);
    exchanged_.full_rows += src.size(0);
    ++exchanged_.full_layers;
  } else {
    if (total > 0) {  // every rank sees the same counts, so all skip or all gather
      at::Tensor halo = GatherRows::apply(kv.index_select(0, p.send_rows), group, p.send_counts, clock);
      exchanged_.window_rows += halo.size(0);
      src = at::cat({kv, halo}, 0);
    }
    ++exchanged_.window_layers;
  }
  const bool flash =
      fused_ && p.cu_q.defined() && model::piece_flash_available(q.device(), q.scalar_type(), q.size(2));
  exchanged_.flash_layers += flash;
  return attend_kind(p, full, flash, q, src.narrow(1, 0, heads), src.narrow(1, heads, heads));
}

at::Tensor ContextParallel::attend_kind(const KindPlan& p, bool full, bool flash, const at::Tensor& q,
                                        const at::Tensor& k_src, const at::Tensor& v_src) const {
  if (flash)
    return model::piece_flash_attention(q, k_src.index_select(0, p.flash_k_rows), v_src.index_select(0, p.flash_k_rows),
                                        p.cu_q, p.cu_k, p.max_q, p.max_k, full ? 0 : window_);
  if (p.use_padded) return model::padded_attention(p.padded, q, k_src, v_src, full, window_);
  const int64_t group = q.size(1) / k_src.size(1);
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < p.q_begin.size(); ++i) {
    at::Tensor qs = q.narrow(0, p.q_begin[i], p.q_length[i]).transpose(0, 1);  // [Hq, n, hd]
    at::Tensor ks = model::expand_kv_heads(k_src.index_select(0, p.k_rows[i]).transpose(0, 1), group);
    at::Tensor vs = model::expand_kv_heads(v_src.index_select(0, p.k_rows[i]).transpose(0, 1), group);
    outs.push_back(model::sequence_attention(qs, ks, vs, full, window_, p.q_start[i], p.k_start[i]).transpose(0, 1));
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs, 0);
}

at::Tensor ContextParallel::sum(const at::Tensor& t) const {
  return SumOverGroup::apply(t, reinterpret_cast<int64_t>(&group_));
}

at::Tensor ContextParallel::gather(const at::Tensor& local) const {
  std::vector<int64_t> counts, where;  // where[row of the whole batch] = its row in the gather
  std::vector<int64_t> order;
  for (int r = 0; r < split_.ranks(); ++r) {
    counts.push_back(split_.num_tokens(r));
    const std::vector<int64_t> rows = split_.rows(r);
    order.insert(order.end(), rows.begin(), rows.end());
  }
  where.assign(order.size(), 0);
  for (size_t i = 0; i < order.size(); ++i) where[size_t(order[i])] = int64_t(i);
  const at::Tensor all = local.requires_grad()
                             ? GatherRows::apply(local, reinterpret_cast<int64_t>(&group_), counts, int64_t(0))
                             : gather_known(group_, local, counts);
  return all.index_select(0, long_tensor(where, all.device()));
}

model::ForwardOptions ContextParallel::options(model::ForwardOptions o) {
  fused_ = o.fused_kernels() && !o.bitwise();
  o.attention = this;
  o.batch_reduce = this;
  return o;
}

}  // namespace kiln::parallel
