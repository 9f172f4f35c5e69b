// CUDA-graph decode steps: static input buffers per (padded rows, table width), one warm-up run and
// one capture per bucket, then per step a single host-to-device copy, a replay and one copy back.
#include "rollout/decode_graph.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "core/error.h"
#include "core/torch_version.h"
#include "kernels/paged_attention.h"
#include "kernels/rope.h"
#include "kernels/sampling.h"
#if KILN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace kiln::rollout {

#if KILN_WITH_CUDA && KILN_TORCH_AT_LEAST(2, 8)

namespace {
// Padded row counts: small batches exactly by powers of two, then steps of 16.
int64_t bucket_rows(int64_t n) {
  if (n <= 8) {
    int64_t b = 1;
    while (b < n) b *= 2;
    return b;
  }
  return (n + 15) / 16 * 16;
}
int64_t bucket_cols(int64_t n) {
  int64_t b = 4;
  while (b < n) b *= 2;
  return b;
}
}  // namespace

struct DecodeGraphs::Impl {
  // One captured step. The input buffer packs, per row: token, position, full-pool write row,
  // window-pool write row, temperature (fp64 bits), stream seed, then the two block tables.
  struct Bucket : model::AttentionBackend {
    Impl* owner = nullptr;
    int64_t rows = 0, cols = 0;
    at::Tensor host_in, dev_in;
    at::Tensor tokens, positions, write_full, write_win, temperature, seeds, table_full, table_ring;
    at::Tensor ids, logprobs, routing, logits;  // graph outputs (static addresses)
    at::Tensor host_ids, host_lps, host_routing;
    std::unique_ptr<at::cuda::CUDAGraph> graph;

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
      if (!owner->fuse_rope_cache) return model::AttentionBackend::attend_unrotated(layer, full, batch, q, k, v, cos, sin);
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
      return kernels::paged_decode_attention_cuda(q, kl, vl, full ? table_full : table_ring, positions, p.block_size,
                                                  full ? 0 : p.window, full ? 0 : p.ring);
    }

    // The step itself: what is captured.
    void forward() {
      const model::Muse& m = owner->model;
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
      model::ForwardOutput out = m.forward(batch, opt);
      routing = out.routing;
      logits = m.logits(out.hidden);
      std::tie(ids, logprobs) = kernels::sample_rows_cuda(logits, temperature, seeds);
    }
  };

  model::Muse model;
  KvPools pools;
  int64_t max_rows;
  decltype(at::cuda::graph_pool_handle()) pool;  // one memory pool shared by every captured graph
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<Bucket>> buckets;
  bool fuse_rope_cache = true;

  Bucket& bucket(int64_t rows, int64_t cols) {
    auto& slot = buckets[{rows, cols}];
    if (slot) return *slot;
    slot = std::make_unique<Bucket>();
    Bucket& b = *slot;
    b.owner = this;
    b.rows = rows;
    b.cols = cols;
    const int64_t per_row = 6 + cols + pools.ring;
    b.host_in = at::empty({rows * per_row}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    b.dev_in = at::empty({rows * per_row}, at::TensorOptions().dtype(at::kLong).device(model.device()));
    auto field = [&](int64_t i) { return b.dev_in.narrow(0, i * rows, rows); };
    b.tokens = field(0);
    b.positions = field(1);
    b.write_full = field(2);
    b.write_win = field(3);
    b.temperature = field(4).view(at::kDouble);
    b.seeds = field(5);
    b.table_full = b.dev_in.narrow(0, 6 * rows, rows * cols).view({rows, cols});
    b.table_ring = b.dev_in.narrow(0, (6 + cols) * rows, rows * pools.ring).view({rows, pools.ring});
    const int64_t per_token = model.config().num_layers * model.config().top_k;
    auto pinned = [](int64_t n, at::ScalarType t) {
      return at::empty({n}, at::TensorOptions().dtype(t).pinned_memory(true));
    };
    b.host_ids = pinned(rows, at::kLong);
    b.host_lps = pinned(rows, at::kFloat);
    b.host_routing = pinned(rows * per_token, at::kByte);
    return b;
  }

  void fill(Bucket& b, const DecodeStep& step) {
    const int64_t R = b.rows, B = pools.block_size;
    int64_t* h = b.host_in.data_ptr<int64_t>();
    std::fill(h, h + b.host_in.numel(), 0);
    int64_t* table_full = h + 6 * R;
    int64_t* table_ring = h + (6 + b.cols) * R;
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

  void capture(Bucket& b) {
    c10::cuda::device_synchronize();
    c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
    {
      c10::cuda::CUDAStreamGuard guard(side);
      b.forward();  // warm-up: lazy library state is created outside the capture
      side.synchronize();
      b.graph = std::make_unique<at::cuda::CUDAGraph>();
      // Thread-local: a trainer thread (grpo.async) may allocate or sync while this thread captures.
      b.graph->capture_begin(pool, cudaStreamCaptureModeThreadLocal);
      b.forward();
      b.graph->capture_end();
    }
    c10::cuda::device_synchronize();
  }

  DecodeResult run(const DecodeStep& step) {
    at::NoGradGuard no_grad;
    const c10::cuda::CUDAGuard guard(model.device());
    const int64_t n = int64_t(step.rows.size());
    KILN_CHECK(n >= 1 && n <= max_rows, "rollout: a graph decode step takes 1..", max_rows, " rows (got ", n, ")");
    int64_t longest = 1;
    for (const auto& r : step.rows) longest = std::max<int64_t>(longest, int64_t(r.full_blocks->size()));
    Bucket& b = bucket(bucket_rows(n), bucket_cols(longest));
    fill(b, step);
    b.dev_in.copy_(b.host_in, /*non_blocking=*/true);
    if (!b.graph) capture(b);  // the warm-up computes this step; the replay below redoes it
    b.graph->replay();
    const int64_t per_token = model.config().num_layers * model.config().top_k;
    b.host_ids.copy_(b.ids, true);
    b.host_lps.copy_(b.logprobs, true);
    b.host_routing.copy_(b.routing.view({-1}), true);
    at::cuda::getCurrentCUDAStream().synchronize();
    DecodeResult r;
    r.ids = b.host_ids.narrow(0, 0, n);
    r.logprobs = b.host_lps.narrow(0, 0, n);
    r.routing = b.host_routing.narrow(0, 0, n * per_token).view({n, model.config().num_layers, model.config().top_k});
    r.logits = b.logits;
    return r;
  }
};

bool DecodeGraphs::available(const model::Muse& model) {
  const auto& c = model.config();
  return model.device().is_cuda() && model.dtype() == at::kBFloat16 &&
         kernels::paged_decode_attention_cuda_supports(model.dtype(), c.head_dim, c.num_q_heads / c.num_kv_heads);
}

DecodeGraphs::DecodeGraphs(const model::Muse& model, KvPools pools, int64_t max_rows, bool fuse_rope_cache)
    : impl_(std::make_unique<Impl>(Impl{model, std::move(pools), bucket_rows(max_rows), at::cuda::graph_pool_handle(),
                                        {}, fuse_rope_cache})) {}

DecodeResult DecodeGraphs::run(const DecodeStep& step) { return impl_->run(step); }
int64_t DecodeGraphs::num_graphs() const { return int64_t(impl_->buckets.size()); }

#else  // no CUDA graphs in this build

struct DecodeGraphs::Impl {};
bool DecodeGraphs::available(const model::Muse&) { return false; }
DecodeGraphs::DecodeGraphs(const model::Muse&, KvPools, int64_t, bool) {
  KILN_FAIL("rollout: CUDA-graph decode needs a CUDA build on torch >= 2.8");
}
DecodeResult DecodeGraphs::run(const DecodeStep&) { KILN_FAIL("rollout: CUDA-graph decode is not built"); }
int64_t DecodeGraphs::num_graphs() const { return 0; }

#endif

DecodeGraphs::~DecodeGraphs() = default;

}  // namespace kiln::rollout
