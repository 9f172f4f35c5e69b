// The rollout engine's attention over its paged KV cache (cache_attention.h): the step's plans of
// cache rows and the attention of decode items (one padded batch) and prefill pieces (one by one).
#include "rollout/cache_attention.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <utility>

#include "model/batch_invariant.h"

namespace kiln::rollout {

CacheAttention::CacheAttention(KvCache& kv, const model::ModelConfig& cfg, model::Numerics numerics)
    : kv_(kv), W_(cfg.sliding_window), group_(cfg.num_q_heads / cfg.num_kv_heads), batch_invariant_(numerics == model::Numerics::kBitwise) {}

void CacheAttention::plan(const std::vector<Work>& step) {
  work_ = &step;
  plan_group(0);
  if (kv_.has_window_layers()) plan_group(1);
}

// Builds plan[g] for the scheduled work: every cache row read or written, in few host-to-device
// copies, and the padded layout of the decode items.
void CacheAttention::plan_group(int g) {
  const std::vector<Work>& work = *work_;
  const bool full = g == 0;
  GroupPlan& p = plan_[g];
  std::vector<int64_t> decode_read, write_rows, write_src, piece_rows, decode_out;
  std::vector<std::vector<int64_t>> q_rows, q_pos, k_rows, k_pos;
  std::vector<std::pair<int64_t, int64_t>> pieces(work.size(), {0, 0});
  const at::Device dev = kv_.keys(true).device();
  auto to_dev = [&](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong).to(dev); };
  model::KeyRanges& r = p.ranges;
  r = model::KeyRanges{};
  for (size_t i = 0; i < work.size(); ++i) {
    const Work& w = work[i];
    const Seq& s = *w.seq;
    const int64_t lo = full ? 0 : w.window_lo;
    if (batch_invariant_) {  // the item's positions [lo, start + n) in order, then each query's range
      const int64_t base = int64_t(r.table.size());
      kv_.rows(s.blocks, lo, w.start, full, r.table);
      for (int64_t j = 0; j < w.n; ++j) r.table.push_back(-1 - (w.offset + j));
      if (int64_t(r.begin.size()) < w.offset + w.n) {
        r.begin.resize(size_t(w.offset + w.n), 0);
        r.count.resize(size_t(w.offset + w.n), 0);
      }
      for (int64_t j = 0; j < w.n; ++j) {
        const int64_t pos = w.start + j, first = full ? 0 : std::max<int64_t>(0, pos - W_ + 1);
        r.begin[size_t(w.offset + j)] = base + first - lo;
        r.count[size_t(w.offset + j)] = pos - first + 1;
      }
    } else if (w.n == 1) {  // the standard numerics: decode items as one padded batch, pieces alone
      const int64_t first = int64_t(decode_read.size());
      kv_.rows(s.blocks, lo, w.start, full, decode_read);
      q_rows.push_back({w.offset});
      q_pos.push_back({w.start});
      k_rows.emplace_back();
      k_pos.emplace_back();
      for (int64_t p2 = lo; p2 < w.start; ++p2) {
        k_rows.back().push_back(first + p2 - lo);
        k_pos.back().push_back(p2);
      }
      k_pos.back().push_back(w.start);
      k_rows.back().push_back(-1 - w.offset);  // a new key: fixed up once decode_read is complete
      decode_out.push_back(w.offset);
    } else {
      const int64_t first = int64_t(piece_rows.size());
      kv_.rows(s.blocks, lo, w.start, full, piece_rows);
      pieces[i] = {first, int64_t(piece_rows.size()) - first};
    }
    const int64_t keep_from = full ? w.start : w.window_write_from;
    kv_.rows(s.blocks, keep_from, w.start + w.n, full, write_rows);
    for (int64_t p2 = keep_from; p2 < w.start + w.n; ++p2) write_src.push_back(w.offset + p2 - w.start);
  }
  const int64_t cached = int64_t(decode_read.size());
  for (auto& r : k_rows)
    for (int64_t& x : r)
      if (x < 0) x = cached + (-1 - x);  // new keys follow the cached ones in the key source
  if (batch_invariant_ && dev.is_cuda()) r.upload(dev);
  p.decode_read = to_dev(decode_read);
  p.decode_out = to_dev(decode_out);
  p.decode = q_rows.empty() ? model::PaddedLayout{} : model::PaddedLayout::build(q_rows, q_pos, k_rows, k_pos, dev);
  p.write_rows = to_dev(write_rows);
  p.write_src = to_dev(write_src);
  at::Tensor all_pieces = to_dev(piece_rows);
  p.piece_read.assign(work.size(), at::Tensor());
  for (size_t i = 0; i < work.size(); ++i)
    if (work[i].n > 1) p.piece_read[i] = all_pieces.narrow(0, pieces[i].first, pieces[i].second);
}

namespace {
// An item's keys (or values) in position order: the cache rows `read`, then its new ones.
at::Tensor with_cached(const at::Tensor& cache, const at::Tensor& read, const at::Tensor& fresh) {
  return read.numel() > 0 ? at::cat({cache.index_select(0, read), fresh}, 0) : fresh;
}
}  // namespace

at::Tensor CacheAttention::attend(int64_t layer, bool full, const model::PackedBatch& batch, const at::Tensor& q,
                                  const at::Tensor& k, const at::Tensor& v) {
  const int64_t g = kv_.group_of(layer);
  const GroupPlan& p = plan_[full ? 0 : 1];
  at::Tensor kl = kv_.keys(full)[g], vl = kv_.values(full)[g];  // [blocks * B, Hkv, hd]
  // Batch-invariant: each new query over exactly the positions it sees, in position order, cached
  // ones first, read in place through the plan's table (model::ranged_attention, as the trainer's
  // forward); else decode items batched and prefill pieces one by one.
  at::Tensor o = batch_invariant_ ? model::ranged_attention(q, kl, vl, k, v, p.ranges)
                                  : attend_batched(p, full, q, k, v, kl, vl);
  // Keep the new keys (every position for full layers, the last W for window layers) only after
  // every read of this layer.
  kl.index_copy_(0, p.write_rows, k.index_select(0, p.write_src));
  vl.index_copy_(0, p.write_rows, v.index_select(0, p.write_src));
  return o;
}

// The decode items as one padded batch, the prefill pieces one by one.
at::Tensor CacheAttention::attend_batched(const GroupPlan& p, bool full, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const at::Tensor& kl, const at::Tensor& vl) const {
  const std::vector<Work>& work = *work_;
  at::Tensor o = at::empty_like(q);
  if (p.decode.num_problems > 0) {
    at::Tensor ks = at::cat({kl.index_select(0, p.decode_read), k}, 0);
    at::Tensor vs = at::cat({vl.index_select(0, p.decode_read), v}, 0);
    o.index_copy_(0, p.decode_out, model::padded_attention(p.decode, q, ks, vs, full, W_));
  }
  for (size_t i = 0; i < work.size(); ++i) {
    const Work& w = work[i];
    if (w.n == 1) continue;
    at::Tensor keys = with_cached(kl, p.piece_read[i], k.narrow(0, w.offset, w.n));
    at::Tensor values = with_cached(vl, p.piece_read[i], v.narrow(0, w.offset, w.n));
    at::Tensor qs = q.narrow(0, w.offset, w.n).transpose(0, 1);
    at::Tensor ks = model::expand_kv_heads(keys.transpose(0, 1), group_);
    at::Tensor vs = model::expand_kv_heads(values.transpose(0, 1), group_);
    const int64_t lo = full ? 0 : w.window_lo;
    o.narrow(0, w.offset, w.n).copy_(model::sequence_attention(qs, ks, vs, full, W_, w.start, lo).transpose(0, 1));
  }
  return o;
}

}  // namespace kiln::rollout
