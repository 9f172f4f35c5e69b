// CUDA-graph decode steps: static input buffers per (padded rows, table width), one warm-up run and
// one capture per bucket, then per step a single host-to-device copy, a replay and one copy back.
// Without capture (any device) the same buffers and forward run eagerly each step.
#include "rollout/decode_graph.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "core/error.h"
#include "core/torch_version.h"
#include "kernels/invariant.h"
#include "kernels/paged_attention.h"
#include "kernels/rope.h"
#include "kernels/sampling.h"
#include "model/batch_invariant.h"
#include "model/expert_parallel.h"
#if KILN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#if KILN_WITH_CUDA && KILN_TORCH_AT_LEAST(2, 8)
#define KILN_GRAPH_CAPTURE 1
#else
#define KILN_GRAPH_CAPTURE 0
#endif

namespace kiln::rollout {

int64_t decode_bucket_rows(int64_t n) {
  if (n <= 8) {
    int64_t b = 1;
    while (b < n) b *= 2;
    return b;
  }
  return (n + 15) / 16 * 16;
}

namespace {
int64_t bucket_cols(int64_t n) {
  int64_t b = 4;
  while (b < n) b *= 2;
  return b;
}
}  // namespace

struct DecodeGraphs::Impl {
  // One step's buffers (and, captured, its graph). The input buffer packs, per row: token,
  // position, full-pool write row, window-pool write row, temperature (fp64 bits), stream seed,
  // whether the row is real (1) or padding (0), then the two block tables.
  struct Bucket : model::AttentionBackend {
    Impl* owner = nullptr;
    int64_t rows = 0, cols = 0;
    at::Tensor host_in, dev_in;
    at::Tensor tokens, positions, write_full, write_win, temperature, seeds, valid, table_full, table_ring;
    at::Tensor ids, logprobs, routing, logits;  // the step's outputs (captured: static addresses)
    // Batch-invariant numerics: each row's keys, per layer kind ([1] full attention, [0] window),
    // in position order as cache rows: model::KeyRanges' packed form on the device, built in the
    // step (no host read), and its host form on the CPU.
    at::Tensor key_rows[2];
    model::KeyRanges host_keys[2];
    at::Tensor host_ids, host_lps, host_routing;
#if KILN_GRAPH_CAPTURE
    std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif

    at::Tensor attend(int64_t layer, bool full, const model::PackedBatch&, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v) override {
      auto [kl, vl] = cache(layer, full);
      const at::Tensor& rows_written = full ? write_full : write_win;
      kl.index_copy_(0, rows_written, k);  // the new key first: the kernel reads it from the cache
      vl.index_copy_(0, rows_written, v);
      return paged(full, q, kl, vl);
    }

    // RoPE of q and k and the cache write of k and v in one kernel, then the paged attention.
    at::Tensor attend_unrotated(int64_t layer, bool full, const model::PackedBatch& batch, const at::Tensor& q,
                                const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                const at::Tensor& sin) override {
      if (!owner->opt.fuse_rope_cache) return model::AttentionBackend::attend_unrotated(layer, full, batch, q, k, v, cos, sin);
      auto [kl, vl] = cache(layer, full);
      at::Tensor qr = kernels::rope_cache_write(q, k, v, cos, sin, kl, vl, full ? write_full : write_win);
      return paged(full, qr, kl, vl);
    }

    std::pair<at::Tensor, at::Tensor> cache(int64_t layer, bool full) const {
      const KvPools& p = owner->pools;
      const int64_t g = p.group_index[layer];
      return {(full ? p.k_full : p.k_win)[g], (full ? p.v_full : p.v_win)[g]};
    }

    at::Tensor paged(bool full, const at::Tensor& q, const at::Tensor& kl, const at::Tensor& vl) const {
      const KvPools& p = owner->pools;
      if (owner->opt.bitwise()) {  // the trainer's ranged attention, over the rows in the cache
        if (q.is_cuda())  // every entry is a cache row: the kernel's second key source is never read
          return kernels::ranged_attention_cuda(q, kl, vl, kl, vl, key_rows[full], key_rows[full].size(0) - 2 * rows);
        return model::ranged_attention(q, kl, vl, {}, {}, host_keys[full]);
      }
      return kernels::paged_decode_attention(q, kl, vl, full ? table_full : table_ring, positions, p.block_size,
                                             full ? 0 : p.window, full ? 0 : p.ring);
    }

    // Each row's keys for layers of one kind: positions [lo, position] (lo 0 for full attention,
    // else the window's first), each at its cache row through the block table or the ring. The
    // entries past a row's count are never read; they repeat its last key.
    void build_key_rows(bool full) {
      const KvPools& p = owner->pools;
      const int64_t B = p.block_size, span = full ? cols * B : p.window;
      const at::Tensor j = at::arange(span, positions.options());
      const at::Tensor lo = full ? at::zeros_like(positions) : (positions - (p.window - 1)).clamp_min(0);
      const at::Tensor count = positions - lo + 1;
      const at::Tensor pos = at::minimum(lo.unsqueeze(1) + j.unsqueeze(0), positions.unsqueeze(1));  // [rows, span]
      const at::Tensor block = full ? at::div(pos, B, "floor") : at::div(pos, B, "floor").remainder(p.ring);
      const at::Tensor at_row = (full ? table_full : table_ring).gather(1, block) * B + pos.remainder(B);
      key_rows[full] = at::cat({at::arange(rows, positions.options()) * span, count, at_row.reshape({-1})}).to(at::kInt);
      if (positions.is_cuda()) return;
      const at::Tensor host = key_rows[full].to(at::kLong).contiguous();
      const int64_t* h = host.data_ptr<int64_t>();
      model::KeyRanges& r = host_keys[full];
      r.begin.assign(h, h + rows);
      r.count.assign(h + rows, h + 2 * rows);
      r.table.assign(h + 2 * rows, h + 2 * rows + rows * span);
    }

    // The step itself: what is captured.
    void forward() {
      const model::Muse& m = owner->model;
      if (owner->opt.bitwise()) {
        build_key_rows(true);
        if (owner->pools.ring > 0) build_key_rows(false);
      }
      model::PackedBatch batch;
      batch.tokens = tokens;
      batch.cu_seqlens.resize(size_t(rows + 1));
      for (int64_t i = 0; i <= rows; ++i) batch.cu_seqlens[size_t(i)] = i;
      model::ForwardOptions opt;
      opt.attention = this;
      opt.skip_head = true;
      opt.check_inputs = false;
      opt.load_balance = false;
      opt.rollout = true;
      opt.positions = positions;
      opt.numerics = owner->opt.numerics;
      if (owner->experts) {  // every rank of the group runs this many rows now, padded alike
        owner->experts->set_capacity(owner->capacity(rows));
        owner->experts->set_row_mask(valid);  // padding rows send nothing
        owner->experts->clear_overflow();
        opt.experts = owner->experts.get();
      }
      model::ForwardOutput out = m.forward(batch, opt);
      routing = out.routing;
      logits = m.logits(out.hidden, owner->opt.numerics);
      if (owner->opt.capture) std::tie(ids, logprobs) = kernels::sample_rows(logits, temperature, seeds);
    }
  };

  model::Muse model;
  KvPools pools;
  int64_t max_rows;
  DecodeGraphOptions opt;
  bool pinned;
  std::unique_ptr<model::AllToAllDispatcher> experts;  // an expert shard's fixed-shape exchange
  at::Tensor host_overflow;                            // its overflow count after a step
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<Bucket>> buckets;
#if KILN_GRAPH_CAPTURE
  decltype(at::cuda::graph_pool_handle()) pool{};  // one memory pool shared by every captured graph
#endif

  Impl(const model::Muse& m, KvPools p, int64_t max_rows, DecodeGraphOptions o)
      : model(m), pools(std::move(p)), max_rows(decode_bucket_rows(max_rows)), opt(o), pinned(m.device().is_cuda()) {
    if (opt.expert_group) {
      experts = std::make_unique<model::AllToAllDispatcher>(*opt.expert_group, /*fixed_shape=*/true);
      host_overflow = host_buffer(1, at::kInt);
    }
#if KILN_GRAPH_CAPTURE
    if (opt.capture) pool = at::cuda::graph_pool_handle();
#else
    KILN_CHECK(!opt.capture, "rollout: CUDA-graph decode needs a CUDA build on torch >= 2.8");
#endif
  }

  // The exchange's overflow count into host_overflow (0 where it exchanged nothing: a group of one).
  void read_overflow(bool non_blocking) {
    if (!experts) return;
    if (experts->overflow().defined()) host_overflow.copy_(experts->overflow().reshape({1}), non_blocking);
    else host_overflow.zero_();
  }

  // Rows each rank sends each rank in a step of `rows` (DecodeGraphOptions::expert_capacity).
  int64_t capacity(int64_t rows) const {
    const int64_t slots = rows * model.config().top_k;
    if (opt.expert_capacity == 0) return slots;
    const double mean = opt.expert_capacity * double(slots) / double(opt.expert_group->size());
    return std::max<int64_t>(1, int64_t(std::min(double(slots), std::ceil(mean + 4 * std::sqrt(mean)))));
  }

  at::Tensor host_buffer(int64_t n, at::ScalarType t) const {
    return at::empty({n}, at::TensorOptions().dtype(t).pinned_memory(pinned));
  }

  Bucket& bucket(int64_t rows, int64_t cols) {
    auto& slot = buckets[{rows, cols}];
    if (slot) return *slot;
    slot = std::make_unique<Bucket>();
    Bucket& b = *slot;
    b.owner = this;
    b.rows = rows;
    b.cols = cols;
    const int64_t per_row = 7 + cols + pools.ring;
    b.host_in = host_buffer(rows * per_row, at::kLong);
    b.dev_in = at::empty({rows * per_row}, at::TensorOptions().dtype(at::kLong).device(model.device()));
    auto field = [&](int64_t i) { return b.dev_in.narrow(0, i * rows, rows); };
    b.tokens = field(0);
    b.positions = field(1);
    b.write_full = field(2);
    b.write_win = field(3);
    b.temperature = field(4).view(at::kDouble);
    b.seeds = field(5);
    b.valid = field(6);
    b.table_full = b.dev_in.narrow(0, 7 * rows, rows * cols).view({rows, cols});
    b.table_ring = b.dev_in.narrow(0, (7 + cols) * rows, rows * pools.ring).view({rows, pools.ring});
    const int64_t per_token = model.config().num_layers * model.config().top_k;
    b.host_ids = host_buffer(rows, at::kLong);
    b.host_lps = host_buffer(rows, at::kFloat);
    b.host_routing = host_buffer(rows * per_token, at::kByte);
    return b;
  }

  void fill(Bucket& b, const DecodeStep& step) {
    const int64_t R = b.rows, B = pools.block_size;
    int64_t* h = b.host_in.data_ptr<int64_t>();
    std::fill(h, h + b.host_in.numel(), 0);
    int64_t* table_full = h + 7 * R;
    int64_t* table_ring = h + (7 + b.cols) * R;
    std::fill(table_full, table_full + R * b.cols, pools.scratch_full);
    std::fill(table_ring, table_ring + R * pools.ring, pools.scratch_win);
    for (int64_t i = 0; i < R; ++i) {
      h[2 * R + i] = pools.scratch_full * B;  // pad rows: position 0, scratch blocks
      h[3 * R + i] = pools.scratch_win * B;
      const double one = 1.0;
      std::memcpy(&h[4 * R + i], &one, sizeof(double));
    }
    for (size_t r = 0; r < step.rows.size(); ++r) {
      const DecodeStep::Row& row = step.rows[r];
      const int64_t i = int64_t(r), p = row.position;
      h[i] = row.token;
      h[R + i] = p;
      h[6 * R + i] = 1;  // a real row (padding rows stay 0)
      const auto& fb = *row.full_blocks;
      std::copy(fb.begin(), fb.end(), table_full + i * b.cols);
      h[2 * R + i] = fb[size_t(p / B)] * B + p % B;
      if (pools.ring > 0 && row.ring && !row.ring->empty()) {
        const auto& rg = *row.ring;
        for (int64_t s = 0; s < pools.ring; ++s)  // slots not yet written point at the scratch block
          table_ring[i * pools.ring + s] = rg[size_t(s)] >= 0 ? rg[size_t(s)] : pools.scratch_win;
        h[3 * R + i] = rg[size_t((p / B) % pools.ring)] * B + p % B;
      }
      std::memcpy(&h[4 * R + i], &row.temperature, sizeof(double));
      std::memcpy(&h[5 * R + i], &row.stream_seed, sizeof(uint64_t));
    }
  }

#if KILN_GRAPH_CAPTURE
  // Captures b's step after a warm-up run on a side stream, whose outputs are this step's: the
  // step runs once, so that an expert shard's exchanges match a rank that only replays. Fills the
  // host outputs and returns the warm-up's logits.
  at::Tensor capture_step(Bucket& b) {
    c10::cuda::device_synchronize();
    c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
    at::Tensor ids, logprobs, routing, logits;
    {
      c10::cuda::CUDAStreamGuard guard(side);
      b.forward();  // warm-up: lazy library state is created outside the capture
      ids = b.ids, logprobs = b.logprobs, routing = b.routing, logits = b.logits;
      side.synchronize();
      b.graph = std::make_unique<at::cuda::CUDAGraph>();
      // Thread-local: a trainer thread (grpo.async) may allocate or sync while this thread captures.
      b.graph->capture_begin(pool, cudaStreamCaptureModeThreadLocal);
      b.forward();
      b.graph->capture_end();
    }
    c10::cuda::device_synchronize();
    logits.record_stream(at::cuda::getCurrentCUDAStream());  // the side stream's memory, read on this one
    b.host_ids.copy_(ids);
    b.host_lps.copy_(logprobs);
    b.host_routing.copy_(routing.reshape({-1}));
    read_overflow(false);
    return logits;
  }
#endif

  DecodeResult run(const DecodeStep& step, int64_t min_rows) {
    at::NoGradGuard no_grad;
    const int64_t n = int64_t(step.rows.size()), want = std::max(n, min_rows);
    KILN_CHECK(want >= 1 && want <= max_rows, "rollout: a graph decode step takes 1..", max_rows, " rows (got ", n,
               ", at least ", min_rows, ")");
    int64_t longest = 1;
    for (const auto& r : step.rows) longest = std::max<int64_t>(longest, int64_t(r.full_blocks->size()));
    Bucket& b = bucket(decode_bucket_rows(want), bucket_cols(longest));
    fill(b, step);
    const model::ModelConfig& c = model.config();
    DecodeResult r;
    if (opt.capture) {
#if KILN_GRAPH_CAPTURE
      const c10::cuda::CUDAGuard guard(model.device());
      b.dev_in.copy_(b.host_in, /*non_blocking=*/true);
      at::Tensor logits;
      if (!b.graph) {
        logits = capture_step(b);
      } else {
        b.graph->replay();
        b.host_ids.copy_(b.ids, true);
        b.host_lps.copy_(b.logprobs, true);
        b.host_routing.copy_(b.routing.view({-1}), true);
        read_overflow(true);
        at::cuda::getCurrentCUDAStream().synchronize();
        logits = b.logits;
      }
      r.ids = b.host_ids.narrow(0, 0, n);
      r.logprobs = b.host_lps.narrow(0, 0, n);
      r.logits = logits;
#endif
    } else {
      b.dev_in.copy_(b.host_in);
      b.forward();
      b.host_routing.copy_(b.routing.reshape({-1}));
      read_overflow(false);
      r.logits = b.logits;
    }
    r.overflowed = experts && host_overflow.data_ptr<int32_t>()[0] > 0;
    r.may_overflow = experts && capacity(b.rows) < b.rows * c.top_k;
    r.routing = b.host_routing.narrow(0, 0, n * c.num_layers * c.top_k).view({n, c.num_layers, c.top_k});
    return r;
  }
};

bool DecodeGraphs::available(const model::Muse& model, const comm::Group* expert_group, model::Numerics numerics) {
#if KILN_GRAPH_CAPTURE
  const auto& c = model.config();
  // Batch-invariant steps read their keys by the ranged attention (head_dim up to 256). The expert
  // GEMMs, grouped (torch's, or the invariant kernel) read no offsets on the host at widths of 8k.
  const bool attention = numerics == model::Numerics::kBitwise ? c.head_dim <= 256
                                         : kernels::paged_decode_attention_cuda_supports(
                                               model.dtype(), c.head_dim, c.num_q_heads / c.num_kv_heads);
  const bool experts = c.latent_size % 8 == 0 && c.expert_ffn_size % 8 == 0;
  // A group of one exchanges nothing; a larger one needs NCCL, which a graph can capture.
  const bool exchange = !expert_group || expert_group->size() == 1 || KILN_WITH_NCCL;
  return model.device().is_cuda() && model.dtype() == at::kBFloat16 && attention && experts && exchange;
#else
  (void)model, (void)expert_group, (void)numerics;
  return false;
#endif
}

DecodeGraphs::DecodeGraphs(const model::Muse& model, KvPools pools, int64_t max_rows, DecodeGraphOptions options)
    : impl_(std::make_unique<Impl>(model, std::move(pools), max_rows, options)) {}
DecodeGraphs::~DecodeGraphs() = default;

DecodeResult DecodeGraphs::run(const DecodeStep& step, int64_t min_rows) { return impl_->run(step, min_rows); }
int64_t DecodeGraphs::num_graphs() const { return impl_->opt.capture ? int64_t(impl_->buckets.size()) : 0; }

}  // namespace kiln::rollout
