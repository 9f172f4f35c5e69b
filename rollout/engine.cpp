// Rollout engine implementation: block pools with reference counts and copy-on-write, the
// scheduler (continuous batching, chunked prefill, preemption by recompute), the paged attention
// backend that feeds model::Muse::forward, and sampling.
#include "rollout/engine.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <set>

#include "core/error.h"
#include "kernels/sampling.h"
#include "model/lora.h"
#include "model/nvfp4_model.h"
#include "rollout/decode_graph.h"

namespace kiln::rollout {
namespace {

// A pool of fixed-size KV blocks with reference counts (shared prompt blocks after a fork).
class BlockPool {
 public:
  void init(int64_t num_blocks) {
    refs_.assign(num_blocks, 0);
    free_.clear();
    for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
  }
  int64_t total() const { return int64_t(refs_.size()); }
  int64_t num_free() const { return int64_t(free_.size()); }
  int64_t used() const { return total() - num_free(); }
  int64_t allocate() {
    KILN_CHECK(!free_.empty(), "rollout: KV block pool exhausted (scheduler bug: blocks were not reserved)");
    int64_t b = free_.back();
    free_.pop_back();
    refs_[b] = 1;
    return b;
  }
  void retain(int64_t b) { ++refs_[b]; }
  void release(int64_t b) {
    if (--refs_[b] == 0) free_.push_back(b);
  }
  bool shared(int64_t b) const { return refs_[b] > 1; }

 private:
  std::vector<int64_t> refs_;
  std::vector<int64_t> free_;
};

}  // namespace

const char* finish_reason_name(FinishReason r) { return r == FinishReason::kStop ? "stop" : "length"; }

uint64_t sample_stream_seed(uint64_t seed, int64_t sample, int64_t step) {
  using kernels::mix64;
  return mix64(mix64(mix64(seed + 0x9e3779b97f4a7c15ull) ^ uint64_t(sample)) ^ uint64_t(step) * 0x2545f4914f6cdd1dull);
}

std::pair<int64_t, double> sample_token(const at::Tensor& logits, const SamplingParams& p, uint64_t stream_seed) {
  at::Tensor l = logits.detach().to(at::kCPU, at::kFloat).contiguous();
  const float* x = l.data_ptr<float>();
  const int64_t V = l.numel();
  if (p.temperature == 0 || (p.top_k == 0 && p.top_p >= 1.0))
    return kernels::sample_row_reference(x, V, p.temperature, stream_seed);  // what the GPU kernel does
  const double mx = *std::max_element(x, x + V);
  const double u = kernels::stream_uniform(stream_seed);
  auto weight = [&](int64_t i) { return std::exp((double(x[i]) - mx) / p.temperature); };
  // Filters: candidates by logit, descending, ties broken by the lower id (a strict total order,
  // so the result does not depend on the sort's stability).
  auto before = [&](int64_t a, int64_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  std::vector<int64_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  int64_t keep = p.top_k > 0 ? std::min<int64_t>(p.top_k, V) : V;
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), before);
  std::vector<double> prob(keep);
  double z = 0;
  for (int64_t i = 0; i < keep; ++i) z += (prob[i] = weight(order[i]));
  for (double& q : prob) q /= z;
  if (p.top_p < 1.0) {
    double mass = 0;
    int64_t n = 0;
    while (n < keep && mass < p.top_p) mass += prob[n++];
    keep = std::max<int64_t>(n, 1);
    const double kept = std::accumulate(prob.begin(), prob.begin() + keep, 0.0);
    for (int64_t i = 0; i < keep; ++i) prob[i] /= kept;
  }
  double c = 0;
  int64_t pick = keep - 1;
  for (int64_t i = 0; i < keep; ++i) {
    c += prob[i];
    if (u < c) {
      pick = i;
      break;
    }
  }
  return {order[pick], std::log(prob[pick])};
}

Quantization parse_quantization(const std::string& name) {
  if (name == "none") return Quantization::kNone;
  if (name == "nvfp4") return Quantization::kNvfp4;
  if (name == "w4a4") return Quantization::kW4a4;
  KILN_FAIL("quantization must be none, nvfp4 or w4a4 (got '", name, "')");
}

const char* quantization_name(Quantization q) {
  return q == Quantization::kNvfp4 ? "nvfp4" : q == Quantization::kW4a4 ? "w4a4" : "none";
}

namespace {

// The cache's block geometry for a model: bytes of one block of each pool (all full-attention
// layers, all window layers) and the window ring's blocks per sequence.
struct KvLayout {
  int64_t full_block_bytes = 0, window_block_bytes = 0, ring_blocks = 0;
};
KvLayout kv_layout(const model::ModelConfig& cfg, int64_t block_size, int64_t elem) {
  int64_t nf = 0;
  for (int64_t i = 0; i < cfg.num_layers; ++i) nf += cfg.is_full_attention(i) ? 1 : 0;
  const int64_t block = block_size * 2 * cfg.kv_size() * elem;  // K and V of one layer's block
  return {nf * block, (cfg.num_layers - nf) * block, (cfg.sliding_window + block_size - 1) / block_size + 1};
}

}  // namespace

int64_t kv_cache_bytes_for(const model::ModelConfig& cfg, const EngineConfig& ec, int64_t elem, int64_t tokens) {
  const KvLayout k = kv_layout(cfg, ec.block_size, elem);
  return ec.max_num_seqs * (k.ring_blocks * k.window_block_bytes + (tokens + ec.block_size - 1) / ec.block_size * k.full_block_bytes);
}

void EngineConfig::validate() const {
  KILN_CHECK(kv_cache_bytes > 0, "rollout config: kv_cache_bytes must be positive (got ", kv_cache_bytes, ")");
  KILN_CHECK(block_size > 0, "rollout config: block_size must be positive (got ", block_size, ")");
  KILN_CHECK(max_num_seqs > 0, "rollout config: max_num_seqs must be positive (got ", max_num_seqs, ")");
  KILN_CHECK(max_batch_tokens > 0, "rollout config: max_batch_tokens must be positive (got ", max_batch_tokens, ")");
  KILN_CHECK(prefill_chunk > 0, "rollout config: prefill_chunk must be positive (got ", prefill_chunk, ")");
  KILN_CHECK(quantization == Quantization::kNone || !expert_group, "rollout config: quantization '",
             quantization_name(quantization),
             "' is not supported with sharded (expert-parallel) engines yet; use parallel.rollout: replica");
}

// One sequence in the engine: a prompt being prefilled for its samples (a parent), or one sample.
struct Seq {
  int64_t request = 0;
  int64_t sample = -1;              // -1: the shared-prefill parent of a request
  std::vector<int64_t> tokens;      // prompt + generated
  int64_t prompt_len = 0;
  int64_t computed = 0;             // tokens whose K/V are in the cache
  int64_t routed = 0;               // tokens whose routing is recorded (kept across preemption)
  std::vector<int64_t> full_blocks; // logical block b -> pool block, positions [b*B, (b+1)*B)
  std::vector<int64_t> ring;        // window ring slot -> pool block (-1: none yet)
  std::vector<float> logprobs;
  std::vector<uint8_t> routing;     // [tokens, L, k], filled as tokens are first computed
  bool finalizing = false;          // finished sampling; computing the last token's routing
  FinishReason finish = FinishReason::kLength;
  int64_t preemptions = 0;
};

struct RequestState {
  Request request;
  std::vector<Sample> samples;
  int64_t done = 0;
};

// A scheduled piece of work for one step: `n` tokens of `seq` starting at position seq->computed.
struct Work {
  Seq* seq = nullptr;
  int64_t start = 0;
  int64_t n = 0;
  int64_t offset = 0;                   // first row in the step's packed batch
  int64_t window_lo = 0;                // first cached position window layers read
  int64_t window_write_from = 0;        // first new position window layers keep
};

// How one kind of layer (full or window) reads and writes the cache in a step. Decode items (one
// new token each) run as one padded batch; prefill pieces run one by one.
struct GroupPlan {
  at::Tensor decode_read;               // cache rows the decode items read, concatenated
  model::PaddedLayout decode;           // over cat(cache rows decode_read, the batch's new K/V)
  at::Tensor decode_out;                // batch rows of the decode items' queries
  std::vector<at::Tensor> piece_read;   // per work item: cache rows a prefill piece reads
  at::Tensor write_rows;                // cache rows written this step
  at::Tensor write_src;                 // batch rows whose new K/V go there
};

struct Engine::Impl : model::AttentionBackend {
  model::Muse model;
  model::ModelConfig cfg;
  EngineConfig ec;
  int64_t B, W, R;                       // block size, window, ring blocks per sequence
  std::vector<int64_t> group_index;      // layer -> index within its group (full or window)
  at::Tensor k_full, v_full;             // [n_full, blocks * B, Hkv, hd]
  at::Tensor k_win, v_win;               // [n_window, blocks * B, Hkv, hd]
  BlockPool full_pool, win_pool;
  std::deque<std::unique_ptr<Seq>> waiting;
  std::vector<std::unique_ptr<Seq>> running;  // admission order
  std::map<int64_t, RequestState> requests;
  int64_t next_request = 0;
  std::vector<Work> work;                // the current step's schedule
  GroupPlan plan[2];                     // [0] full-attention layers, [1] window layers
  bool use_graph = false;                // the current step replays a CUDA graph (set by schedule)
  EngineStats st;
  std::unique_ptr<DecodeGraphs> graphs;  // CUDA-graph decode steps, when available
  std::function<void(const StepTrace&)> trace;

  Impl(const model::Muse& m, EngineConfig config) : model(m.clone()), cfg(m.config()), ec(config) {
    ec.validate();
    if (ec.quantization != Quantization::kNone) {
      // The GEMM kernels read their own sign-bit layout; the CPU reference reads ModelOpt's.
      model::quantize_model(model, /*kernel_layout=*/model.device().is_cuda(), /*drop_dense=*/true);
      for (auto& l : model.weights().layers) l.nvfp4.w4a4 = ec.quantization == Quantization::kW4a4;
    }
    B = ec.block_size;
    W = cfg.sliding_window;
    int64_t nf = 0, nw = 0;
    for (int64_t i = 0; i < cfg.num_layers; ++i) group_index.push_back(cfg.is_full_attention(i) ? nf++ : nw++);
    const KvLayout layout = kv_layout(cfg, B, int64_t(c10::elementSize(model.dtype())));
    R = layout.ring_blocks;
    st.full_block_bytes = layout.full_block_bytes;
    st.window_block_bytes = layout.window_block_bytes;
    st.window_ring_blocks = R;
    const int64_t win_blocks = nw > 0 ? ec.max_num_seqs * R : 0;
    const int64_t left = ec.kv_cache_bytes - win_blocks * st.window_block_bytes;
    const int64_t full_blocks = left / st.full_block_bytes;
    KILN_CHECK(full_blocks >= 1, "rollout: kv_cache_bytes=", ec.kv_cache_bytes, " cannot hold the window rings (",
               win_blocks, " blocks of ", st.window_block_bytes, " bytes for max_num_seqs=", ec.max_num_seqs,
               ") and one full-attention block of ", st.full_block_bytes, " bytes; raise kv_cache_bytes or lower max_num_seqs");
    full_pool.init(full_blocks);
    win_pool.init(win_blocks);
    auto opts = at::TensorOptions().dtype(model.dtype()).device(model.device());
    // One spare block at the end of each pool: padded rows of a graph decode step use it.
    k_full = at::zeros({nf, (full_blocks + 1) * B, cfg.num_kv_heads, cfg.head_dim}, opts);
    v_full = at::zeros_like(k_full);
    k_win = at::zeros({nw, (win_blocks + 1) * B, cfg.num_kv_heads, cfg.head_dim}, opts);
    v_win = at::zeros_like(k_win);
    st.full_blocks_total = full_blocks;
    st.window_blocks_total = win_blocks;
    // Adapters on NVFP4 experts read the expert counts on the host unless torch's grouped GEMM
    // takes them (Lora::experts_grouped): no graph capture then. So do NVFP4 experts when a decode step's rows (at most max_num_seqs rounded up to a bucket of
    // 16, times top_k) can exceed 64 per expert: the grouped GEMM's prefill path reads offsets.
    const bool many_rows = (ec.max_num_seqs + 15) * cfg.top_k > 64 * cfg.num_experts;
    bool host_sync = false;
    for (const auto& l : model.weights().layers) {
      const bool nvfp4_experts = !l.expert_gate.defined();
      host_sync |= nvfp4_experts && l.lora.on_experts() && !l.lora.experts_grouped();
      host_sync |= nvfp4_experts && many_rows;
    }
    if (ec.cuda_graphs && !ec.expert_group && !host_sync && DecodeGraphs::available(model)) {
      KvPools p{k_full, v_full, k_win, v_win, B, W, R, full_blocks, win_blocks, group_index};
      graphs = std::make_unique<DecodeGraphs>(model, std::move(p), ec.max_num_seqs);
    }
  }

  // ---- blocks -------------------------------------------------------------------------------

  void release(Seq& s) {
    for (int64_t b : s.full_blocks) full_pool.release(b);
    for (int64_t b : s.ring)
      if (b >= 0) win_pool.release(b);
    s.full_blocks.clear();
    s.ring.clear();
  }

  int64_t first_window_write(int64_t start, int64_t n) const { return std::max(start, start + n - W); }

  // Blocks (full, window) that computing positions [start, start + n) of s would take.
  std::pair<int64_t, int64_t> blocks_needed(const Seq& s, int64_t start, int64_t n) const {
    int64_t full = 0, win = 0;
    const int64_t first = start / B, last = (start + n - 1) / B;
    for (int64_t b = first; b <= last; ++b) {
      if (b >= int64_t(s.full_blocks.size())) ++full;
      else if (full_pool.shared(s.full_blocks[b])) ++full;  // copy on write
    }
    if (win_pool.total() > 0) {
      std::vector<bool> seen(R, false);
      for (int64_t b = first_window_write(start, n) / B; b <= last; ++b) {
        const int64_t slot = b % R;
        if (seen[slot]) continue;
        seen[slot] = true;
        if (slot >= int64_t(s.ring.size()) || s.ring[slot] < 0 || win_pool.shared(s.ring[slot])) ++win;
      }
    }
    return {full, win};
  }

  // Gives s its own writable blocks for positions [start, start + n); copies shared ones.
  void make_writable(Seq& s, int64_t start, int64_t n) {
    const int64_t first = start / B, last = (start + n - 1) / B;
    for (int64_t b = first; b <= last; ++b) {
      if (b >= int64_t(s.full_blocks.size())) {
        s.full_blocks.push_back(full_pool.allocate());
      } else if (full_pool.shared(s.full_blocks[b])) {
        const int64_t fresh = full_pool.allocate();
        copy_block(k_full, v_full, s.full_blocks[b], fresh);
        full_pool.release(s.full_blocks[b]);
        s.full_blocks[b] = fresh;
      }
    }
    if (win_pool.total() == 0) return;
    if (s.ring.empty()) s.ring.assign(R, -1);
    for (int64_t b = first_window_write(start, n) / B; b <= last; ++b) {
      int64_t& slot = s.ring[b % R];
      if (slot < 0) {
        slot = win_pool.allocate();
      } else if (win_pool.shared(slot)) {
        const int64_t fresh = win_pool.allocate();
        copy_block(k_win, v_win, slot, fresh);
        win_pool.release(slot);
        slot = fresh;
      }
    }
  }

  void copy_block(at::Tensor& k, at::Tensor& v, int64_t from, int64_t to) {
    k.narrow(1, to * B, B).copy_(k.narrow(1, from * B, B));
    v.narrow(1, to * B, B).copy_(v.narrow(1, from * B, B));
  }

  // Appends the cache rows of positions [lo, hi) of s to `out`.
  void rows(const Seq& s, int64_t lo, int64_t hi, bool full, std::vector<int64_t>& out) const {
    for (int64_t p = lo; p < hi; ++p) {
      const int64_t block = full ? s.full_blocks[p / B] : s.ring[(p / B) % R];
      out.push_back(block * B + p % B);
    }
  }

  // ---- scheduling -----------------------------------------------------------------------------

  void preempt(std::unique_ptr<Seq> s) {
    release(*s);
    s->computed = 0;
    s->preemptions++;
    st.preemptions++;
    waiting.push_front(std::move(s));
  }

  // Reserves blocks for n tokens of running[i], preempting the newest other sequences as needed.
  // Returns false when running[i] itself had to go back to the queue.
  bool reserve(size_t i, int64_t n) {
    while (true) {
      Seq& s = *running[i];
      auto [full, win] = blocks_needed(s, s.computed, n);
      if (full <= full_pool.num_free() && win <= win_pool.num_free()) {
        make_writable(s, s.computed, n);
        return true;
      }
      std::unique_ptr<Seq> victim = std::move(running.back());
      running.pop_back();
      const bool self = i == running.size();
      preempt(std::move(victim));
      if (self) return false;
    }
  }

  void schedule() {
    work.clear();
    int64_t budget = ec.max_batch_tokens;
    // Admit queued sequences while there is room; a prompt counts as the n samples it becomes.
    auto slots = [&](const Seq& s) { return s.sample == -1 ? requests.at(s.request).request.params.n : 1; };
    int64_t used = 0;
    for (const auto& s : running) used += slots(*s);
    while (!waiting.empty() && (running.empty() || used + slots(*waiting.front()) <= ec.max_num_seqs)) {
      used += slots(*waiting.front());
      running.push_back(std::move(waiting.front()));
      waiting.pop_front();
    }
    for (size_t i = 0; i < running.size() && budget > 0; ++i) {
      Seq& s = *running[i];
      const int64_t pending = int64_t(s.tokens.size()) - s.computed;
      const int64_t n = std::min({pending, ec.prefill_chunk, budget});
      if (n <= 0) continue;
      if (!reserve(i, n)) break;
      budget -= n;
      Work w;
      w.seq = &s;
      w.start = s.computed;
      w.n = n;
      work.push_back(std::move(w));
    }
    // Sequences preempted after being scheduled drop out (their blocks are gone).
    work.erase(std::remove_if(work.begin(), work.end(), [&](const Work& w) {
                 return std::none_of(running.begin(), running.end(), [&](const auto& r) { return r.get() == w.seq; });
               }),
               work.end());
    int64_t offset = 0;
    for (Work& w : work) {
      w.offset = offset;
      offset += w.n;
      w.window_lo = std::max<int64_t>(0, w.start - W + 1);
      w.window_write_from = first_window_write(w.start, w.n);
    }
    use_graph = graph_step();
    if (!use_graph) {  // a graph step finds its keys through block tables instead
      plan_group(0);
      if (win_pool.total() > 0) plan_group(1);
    }
    st.peak_full_blocks = std::max(st.peak_full_blocks, full_pool.used());
    st.peak_window_blocks = std::max(st.peak_window_blocks, win_pool.used());
  }

  // Builds plan[g] for the scheduled work: every cache row read or written, in few host-to-device
  // copies, and the padded layout of the decode items.
  void plan_group(int g) {
    const bool full = g == 0;
    GroupPlan& p = plan[g];
    std::vector<int64_t> decode_read, write_rows, write_src, piece_rows, decode_out;
    std::vector<std::vector<int64_t>> q_rows, q_pos, k_rows, k_pos;
    std::vector<std::pair<int64_t, int64_t>> pieces(work.size(), {0, 0});
    for (size_t i = 0; i < work.size(); ++i) {
      const Work& w = work[i];
      const Seq& s = *w.seq;
      const int64_t lo = full ? 0 : w.window_lo;
      if (w.n == 1) {
        const int64_t first = int64_t(decode_read.size());
        rows(s, lo, w.start, full, decode_read);
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
        rows(s, lo, w.start, full, piece_rows);
        pieces[i] = {first, int64_t(piece_rows.size()) - first};
      }
      const int64_t keep_from = full ? w.start : w.window_write_from;
      rows(s, keep_from, w.start + w.n, full, write_rows);
      for (int64_t p2 = keep_from; p2 < w.start + w.n; ++p2) write_src.push_back(w.offset + p2 - w.start);
    }
    const int64_t cached = int64_t(decode_read.size());
    for (auto& r : k_rows)
      for (int64_t& x : r)
        if (x < 0) x = cached + (-1 - x);  // new keys follow the cached ones in the key source
    const at::Device dev = model.device();
    auto to_dev = [&](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong).to(dev); };
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

  // ---- attention over the cache (model::AttentionBackend) -------------------------------------

  at::Tensor attend(int64_t layer, bool full, const model::PackedBatch& batch, const at::Tensor& q,
                    const at::Tensor& k, const at::Tensor& v) override {
    const int64_t g = group_index[layer], group = cfg.num_q_heads / cfg.num_kv_heads;
    const GroupPlan& p = plan[full ? 0 : 1];
    at::Tensor kl = (full ? k_full : k_win)[g], vl = (full ? v_full : v_win)[g];  // [blocks * B, Hkv, hd]
    at::Tensor o = at::empty_like(q);
    if (p.decode.num_problems > 0) {
      at::Tensor ks = at::cat({kl.index_select(0, p.decode_read), k}, 0);
      at::Tensor vs = at::cat({vl.index_select(0, p.decode_read), v}, 0);
      o.index_copy_(0, p.decode_out, model::padded_attention(p.decode, q, ks, vs, full, W));
    }
    for (size_t i = 0; i < work.size(); ++i) {
      const Work& w = work[i];
      if (w.n == 1) continue;
      at::Tensor kn = k.narrow(0, w.offset, w.n), vn = v.narrow(0, w.offset, w.n);
      const at::Tensor& read = p.piece_read[i];
      at::Tensor keys = read.numel() > 0 ? at::cat({kl.index_select(0, read), kn}, 0) : kn;
      at::Tensor values = read.numel() > 0 ? at::cat({vl.index_select(0, read), vn}, 0) : vn;
      at::Tensor qs = q.narrow(0, w.offset, w.n).transpose(0, 1);
      at::Tensor ks = model::expand_kv_heads(keys.transpose(0, 1), group);
      at::Tensor vs = model::expand_kv_heads(values.transpose(0, 1), group);
      const int64_t lo = full ? 0 : w.window_lo;
      o.narrow(0, w.offset, w.n).copy_(model::sequence_attention(qs, ks, vs, full, W, w.start, lo).transpose(0, 1));
    }
    // Keep the new keys (every position for full layers, the last W for window layers) only after
    // every read of this layer.
    kl.index_copy_(0, p.write_rows, k.index_select(0, p.write_src));
    vl.index_copy_(0, p.write_rows, v.index_select(0, p.write_src));
    return o;
  }

  // ---- requests and steps ---------------------------------------------------------------------

  int64_t add(const Request& r) {
    const auto& p = r.params;
    KILN_CHECK(!r.prompt.empty(), "rollout: request has an empty prompt; give at least one token");
    for (size_t i = 0; i < r.prompt.size(); ++i)
      KILN_CHECK(r.prompt[i] >= 0 && r.prompt[i] < cfg.vocab_size, "rollout: prompt token ", i, " is ", r.prompt[i],
                 ", outside [0, vocab_size=", cfg.vocab_size, ")");
    KILN_CHECK(p.n >= 1, "rollout: n must be at least 1 (got ", p.n, ")");
    KILN_CHECK(p.max_tokens >= 1, "rollout: max_tokens must be at least 1 (got ", p.max_tokens, ")");
    KILN_CHECK(p.temperature >= 0, "rollout: temperature must be >= 0 (got ", p.temperature, ")");
    KILN_CHECK(p.top_p > 0 && p.top_p <= 1, "rollout: top_p must be in (0, 1] (got ", p.top_p, ")");
    KILN_CHECK(p.top_k >= 0, "rollout: top_k must be >= 0 (got ", p.top_k, ")");
    for (int64_t t : p.stop_token_ids)
      KILN_CHECK(t >= 0 && t < cfg.vocab_size, "rollout: stop token ", t, " is outside [0, vocab_size=", cfg.vocab_size, ")");
    const int64_t longest = int64_t(r.prompt.size()) + p.max_tokens;
    KILN_CHECK(longest <= cfg.max_position_embeddings, "rollout: prompt (", r.prompt.size(), ") + max_tokens (",
               p.max_tokens, ") exceeds max_position_embeddings=", cfg.max_position_embeddings);
    const int64_t blocks = (longest + B - 1) / B;
    KILN_CHECK(blocks <= full_pool.total(), "rollout: one sample of ", longest, " tokens needs ", blocks,
               " KV blocks but the cache holds ", full_pool.total(), "; raise kv_cache_bytes");
    const int64_t id = next_request++;
    RequestState& rs = requests[id];
    rs.request = r;
    rs.samples.resize(p.n);
    auto parent = std::make_unique<Seq>();
    parent->request = id;
    parent->tokens = r.prompt;
    parent->prompt_len = int64_t(r.prompt.size());
    waiting.push_back(std::move(parent));
    return id;
  }

  const SamplingParams& params(const Seq& s) const { return requests.at(s.request).request.params; }
  static bool filtered(const SamplingParams& p) { return p.temperature > 0 && (p.top_k > 0 || p.top_p < 1.0); }
  uint64_t stream_seed(const Seq& s) const {
    return sample_stream_seed(params(s).seed, s.sample, int64_t(s.tokens.size()) - s.prompt_len);
  }

  // Appends one drawn token to a sample; marks it finalizing when it stops or hits max_tokens.
  void append(Seq& s, int64_t id, double lp) {
    const SamplingParams& p = params(s);
    const int64_t step = int64_t(s.tokens.size()) - s.prompt_len;
    s.tokens.push_back(id);
    s.logprobs.push_back(float(lp));
    st.sampled_tokens++;
    const bool stop = std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), id) != p.stop_token_ids.end();
    if (stop || step + 1 >= p.max_tokens) {
      s.finalizing = true;
      s.finish = stop ? FinishReason::kStop : FinishReason::kLength;
    }
  }

  // A step that only decodes samples (no prefill piece, no prompt) can replay a CUDA graph.
  bool graph_step() const {
    if (!graphs || int64_t(work.size()) > ec.max_num_seqs) return false;
    return std::all_of(work.begin(), work.end(), [](const Work& w) { return w.n == 1 && w.seq->sample >= 0; });
  }

  DecodeResult run_graph() {
    DecodeStep d;
    for (const Work& w : work) {
      const Seq& s = *w.seq;
      DecodeStep::Row r;
      r.token = s.tokens[size_t(w.start)];
      r.position = w.start;
      r.full_blocks = &s.full_blocks;
      r.ring = &s.ring;
      r.temperature = params(s).temperature;
      r.stream_seed = stream_seed(s);
      d.rows.push_back(r);
    }
    const int64_t before = graphs->num_graphs();
    DecodeResult r = graphs->run(d);
    st.graph_steps++;
    st.graphs_captured += graphs->num_graphs() - before;
    return r;
  }

  // Draws the next token of each (sample, row). Rows index `logits` (device [rows, V]); with a
  // graph result, unfiltered draws take the ids it sampled on the GPU.
  void draw(const std::vector<std::pair<Seq*, int64_t>>& draws, const at::Tensor& logits, const DecodeResult* graph) {
    if (draws.empty()) return;
    std::vector<std::pair<int64_t, double>> picked(draws.size(), {-1, 0.0});
    std::vector<size_t> gpu;  // draws for the sampling kernel (CUDA, no top-k/top-p filter)
    for (size_t i = 0; i < draws.size(); ++i) {
      const Seq& s = *draws[i].first;
      if (graph && !filtered(params(s))) {
        picked[i] = {graph->ids.data_ptr<int64_t>()[draws[i].second], graph->logprobs.data_ptr<float>()[draws[i].second]};
      } else if (logits.is_cuda() && logits.scalar_type() == at::kFloat && !filtered(params(s))) {
        gpu.push_back(i);
      }
    }
    if (!gpu.empty()) {
      std::vector<int64_t> rows, seeds;
      std::vector<double> temps;
      for (size_t i : gpu) {
        rows.push_back(draws[i].second);
        temps.push_back(params(*draws[i].first).temperature);
        seeds.push_back(int64_t(stream_seed(*draws[i].first)));
      }
      const at::Device dev = logits.device();
      auto [ids, lps] = kernels::sample_rows(logits.index_select(0, at::tensor(rows, at::kLong).to(dev)),
                                             at::tensor(temps, at::kDouble).to(dev), at::tensor(seeds, at::kLong).to(dev));
      ids = ids.cpu();
      lps = lps.cpu();
      for (size_t j = 0; j < gpu.size(); ++j) picked[gpu[j]] = {ids.data_ptr<int64_t>()[j], lps.data_ptr<float>()[j]};
    }
    at::Tensor host;  // CPU sampling: every draw on a CPU model, filtered draws on CUDA
    for (size_t i = 0; i < draws.size(); ++i) {
      if (picked[i].first >= 0) continue;
      if (!host.defined()) host = logits.cpu();
      Seq& s = *draws[i].first;
      picked[i] = sample_token(host[draws[i].second], params(s), stream_seed(s));
    }
    for (size_t i = 0; i < draws.size(); ++i) append(*draws[i].first, picked[i].first, picked[i].second);
  }

  // Expert sharding: a rank with nothing to generate still joins the group's expert exchanges
  // (one per step of the busy ranks) with a one-token forward whose result is dropped.
  void idle_exchange() {
    at::NoGradGuard no_grad;
    model::ForwardOptions opt;
    opt.expert_group = ec.expert_group;
    opt.skip_head = true;
    opt.load_balance = false;
    model.forward(model::PackedBatch::from_sequences({{0}}, model.device()), opt);
  }

  void emit_trace(const at::Tensor& routing, const std::vector<int64_t>& cu_seqlens,
                  const std::vector<std::pair<Seq*, int64_t>>& draws, const std::vector<const Seq*>& drawn_from) {
    StepTrace t;
    for (size_t i = 0; i < work.size(); ++i) {
      const Work& w = work[i];
      StepTrace::Item item;
      item.request_id = w.seq->request;
      item.sample = w.seq->sample == -2 ? -1 : w.seq->sample;  // -2: a parent that forked now
      item.start = w.start;
      item.n = w.n;
      item.routing = routing.narrow(0, cu_seqlens[i], w.n).clone();
      for (size_t d = 0; d < draws.size(); ++d)
        if (drawn_from[d] == w.seq) item.drawn.push_back({draws[d].first->sample, draws[d].first->tokens.back()});
      t.items.push_back(std::move(item));
    }
    trace(t);
  }

  std::vector<RequestOutput> step() {
    at::NoGradGuard no_grad;
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    schedule();
    const auto t1 = clock::now();
    std::vector<RequestOutput> finished;
    if (work.empty()) {
      KILN_CHECK(waiting.empty() && running.empty(), "rollout: nothing could be scheduled although ",
                 waiting.size() + running.size(), " sequences wait; the KV cache is too small for one of them");
      return finished;
    }
    std::vector<int64_t> cu_seqlens = {0};
    for (const Work& w : work) cu_seqlens.push_back(cu_seqlens.back() + w.n);
    DecodeResult graph;
    at::Tensor routing, hidden;  // routing [T, L, k] on the CPU
    if (use_graph) {
      graph = run_graph();
      routing = graph.routing;
    } else {
      model::PackedBatch batch;
      batch.cu_seqlens = cu_seqlens;
      std::vector<int64_t> flat;
      for (const Work& w : work) {
        flat.insert(flat.end(), w.seq->tokens.begin() + w.start, w.seq->tokens.begin() + w.start + w.n);
        batch.start_positions.push_back(w.start);
      }
      batch.tokens = at::tensor(flat, at::kLong).to(model.device());
      model::ForwardOptions opt;
      opt.attention = this;
      opt.expert_group = ec.expert_group;
      opt.skip_head = true;
      opt.check_inputs = false;  // ids were checked when the requests came in; skips device syncs
      opt.load_balance = false;
      model::ForwardOutput out = model.forward(batch, opt);
      routing = out.routing.cpu().contiguous();
      hidden = out.hidden;
    }
    const auto t2 = clock::now();  // the routing copy above waited for the device
    st.steps++;
    st.model_tokens += cu_seqlens.back();
    const int64_t per_token = cfg.num_layers * cfg.top_k;
    // Rows whose next token is drawn now: the last computed row of a complete sequence.
    std::vector<int64_t> rows;
    std::vector<Seq*> ready;
    for (size_t i = 0; i < work.size(); ++i) {
      Work& w = work[i];
      Seq& s = *w.seq;
      // Only positions routed for the first time: a recompute after preemption can route a token
      // differently (bf16, other batch shapes), but its next token was drawn under the first.
      const int64_t from = std::max(w.start, s.routed), to = w.start + w.n;
      s.routing.resize(size_t(s.tokens.size() * per_token));
      if (to > from) {
        const uint8_t* r = routing.data_ptr<uint8_t>() + (cu_seqlens[i] + from - w.start) * per_token;
        std::copy(r, r + (to - from) * per_token, s.routing.begin() + from * per_token);
        s.routed = to;
      }
      s.computed += w.n;
      if (s.computed == int64_t(s.tokens.size()) && !s.finalizing) {
        rows.push_back(cu_seqlens[i + 1] - 1);
        ready.push_back(&s);
      }
    }
    at::Tensor logits;
    std::vector<int64_t> logit_row(rows.size());
    if (graph.logits.defined()) {
      logits = graph.logits;
      logit_row = rows;
    } else if (!rows.empty()) {
      logits = model.logits(hidden.index_select(0, at::tensor(rows, at::kLong).to(model.device())));
      std::iota(logit_row.begin(), logit_row.end(), 0);
    }
    std::vector<std::pair<Seq*, int64_t>> draws;
    std::vector<const Seq*> drawn_from;  // per draw: the sequence whose row it came from
    for (size_t j = 0; j < ready.size(); ++j) {
      Seq& s = *ready[j];
      if (s.sample >= 0) {
        draws.push_back({&s, logit_row[j]});
        drawn_from.push_back(&s);
        continue;
      }
      // A prefilled prompt: fork its samples, which share its blocks until they write.
      const int64_t n = params(s).n;
      for (int64_t k = 0; k < n; ++k) {
        auto child = std::make_unique<Seq>(s);
        child->sample = k;
        for (int64_t b : child->full_blocks) full_pool.retain(b);
        for (int64_t b : child->ring)
          if (b >= 0) win_pool.retain(b);
        draws.push_back({child.get(), logit_row[j]});
        drawn_from.push_back(&s);
        running.push_back(std::move(child));
      }
      s.finalizing = true;  // the parent's work is done; released below
      s.sample = -2;
    }
    draw(draws, logits, graph.logits.defined() ? &graph : nullptr);
    const auto t3 = clock::now();
    if (trace) {  // outside the phases above, and timed apart so that benchmarks can take it out
      emit_trace(routing, cu_seqlens, draws, drawn_from);
      st.trace_seconds += std::chrono::duration<double>(clock::now() - t3).count();
    }
    st.schedule_seconds += std::chrono::duration<double>(t1 - t0).count();
    st.model_seconds += std::chrono::duration<double>(t2 - t1).count();
    st.sample_seconds += std::chrono::duration<double>(t3 - t2).count();
    if (std::all_of(work.begin(), work.end(), [](const Work& w) { return w.n == 1; })) {
      st.decode_steps++;
      st.decode_rows += int64_t(work.size());
      st.decode_seconds += std::chrono::duration<double>(t3 - t0).count();
    }
    // Retire parents that forked and samples whose last token's routing is now known.
    for (auto it = running.begin(); it != running.end();) {
      Seq& s = **it;
      const bool complete = s.computed == int64_t(s.tokens.size());
      if (s.sample == -2 || (s.finalizing && complete)) {
        if (s.sample >= 0) {
          RequestState& rs = requests.at(s.request);
          Sample& out_s = rs.samples[s.sample];
          out_s.tokens.assign(s.tokens.begin() + s.prompt_len, s.tokens.end());
          out_s.logprobs = s.logprobs;
          out_s.finish = s.finish;
          out_s.num_preemptions = s.preemptions;
          out_s.routing = at::from_blob(s.routing.data(), {int64_t(s.tokens.size()), cfg.num_layers, cfg.top_k},
                                        at::kByte).clone();
          if (++rs.done == int64_t(rs.samples.size())) {
            finished.push_back({s.request, std::move(rs.samples)});
            requests.erase(s.request);
          }
        }
        release(s);
        it = running.erase(it);
      } else {
        ++it;
      }
    }
    return finished;
  }
};

Engine::Engine(const model::Muse& model, EngineConfig config) : impl_(std::make_unique<Impl>(model, config)) {}
Engine::~Engine() = default;

int64_t Engine::add_request(const Request& request) { return impl_->add(request); }
std::vector<RequestOutput> Engine::step() { return impl_->step(); }
bool Engine::has_unfinished() const { return !impl_->waiting.empty() || !impl_->running.empty(); }
const model::Muse& Engine::model() const { return impl_->model; }
void Engine::set_trace(std::function<void(const StepTrace&)> trace) { impl_->trace = std::move(trace); }

std::vector<RequestOutput> Engine::generate(const std::vector<Request>& requests,
                                            const std::function<void(int64_t, int64_t)>& progress) {
  std::map<int64_t, size_t> slot;
  int64_t total = 0, done = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    slot[add_request(requests[i])] = i;
    total += requests[i].params.n;
  }
  std::vector<RequestOutput> out(requests.size());
  const comm::Group* group = impl_->ec.expert_group;
  auto any_work = [&] {  // under expert sharding: while any engine of the group has work
    const double mine = has_unfinished() ? 1.0 : 0.0;
    return group ? group->all_reduce(mine, comm::ReduceOp::kMax) > 0 : mine > 0;
  };
  while (any_work()) {
    if (!has_unfinished()) {
      impl_->idle_exchange();
      continue;
    }
    for (RequestOutput& r : step()) {
      done += int64_t(r.samples.size());
      auto it = slot.find(r.request_id);
      if (it != slot.end()) out[it->second] = std::move(r);
    }
    if (progress) progress(done, total);
  }
  return out;
}

namespace {

using Named = std::vector<std::pair<std::string, at::Tensor>>;

// Copies `named` into the same-named tensors of `own` in place, each once and with its shape; a
// name `own` lacks goes to `other`, which takes it (true) or refuses it. Every tensor of `own` must
// come. Returns the bytes copied. `what` names the call and `noun` the tensors in errors.
int64_t copy_by_name(const char* what, const char* noun, const Named& own, const Named& named,
                     const std::function<bool(const std::string&, const at::Tensor&)>& other) {
  at::NoGradGuard g;
  std::map<std::string, at::Tensor> by_name(own.begin(), own.end());
  std::set<std::string> seen;
  int64_t bytes = 0;
  for (const auto& [name, t] : named) {
    KILN_CHECK(seen.insert(name).second, "rollout: ", what, " got ", name, " twice");
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      KILN_CHECK(other && other(name, t), "rollout: ", what, " got ", name, ", which is not one of the engine's ", noun);
    } else {
      KILN_CHECK(t.sizes() == it->second.sizes(), "rollout: ", what, " tensor ", name, " has shape ", t.sizes(),
                 ", expected ", it->second.sizes());
      it->second.copy_(t);
    }
    bytes += int64_t(t.numel()) * int64_t(t.element_size());
  }
  for (const auto& [name, t] : own)
    KILN_CHECK(seen.count(name), "rollout: ", what, " did not get ", name, " (", named.size(), " ", noun,
               " given, the engine has ", own.size(), ")");
  return bytes;
}

}  // namespace

void Engine::update_weights(const Named& named) {
  // A linear served from NVFP4 has no dense tensor: it is re-quantised from the trainer's weights.
  copy_by_name("update_weights", "tensors", impl_->model.named_parameters(), named,
               [&](const std::string& name, const at::Tensor& t) { return model::requantize(impl_->model, name, t); });
}

int64_t Engine::update_adapters(const Named& named) {
  const Named own = model::lora_parameters(impl_->model);
  KILN_CHECK(!own.empty(), "rollout: update_adapters: the engine's model has no LoRA adapters");
  return copy_by_name("update_adapters", "adapters", own, named, {});
}

EngineStats Engine::stats() const {
  EngineStats s = impl_->st;
  s.full_blocks_used = impl_->full_pool.used();
  s.window_blocks_used = impl_->win_pool.used();
  return s;
}

}  // namespace kiln::rollout
