// The Muse forward pass (docs/MODEL.md §1): embedding, sandwich-normed attention and latent-MoE blocks,
// final norm, lm_head. Packed variable-length batches; routing capture and replay.
#include "model/muse.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <memory>
#include <numeric>

#include "core/comm.h"
#include "core/error.h"
#include "core/torch_version.h"
#include "kernels/flash_varlen.h"
#include "kernels/logprob.h"
#include "kernels/moe_layout.h"
#include "kernels/moe_route.h"
#include "kernels/moe_rows.h"
#include "kernels/nvfp4.h"
#include "kernels/rms_norm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"
#include "model/batch_invariant.h"
#include "model/expert_parallel.h"
#include "model/names.h"


namespace kiln::model {
namespace {

constexpr int64_t kQueryChunk = 1024;   // queries per attention block: bounds scores memory
constexpr int64_t kGroupAlign = 16;     // grouped-GEMM row alignment per expert segment
constexpr int64_t kPaddedScoreBytes = int64_t(256) << 20;  // padded batch attention up to this size

at::ScalarType acc_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

kernels::Nvfp4LinearOptions nvfp4_options(const kernels::Nvfp4Tensor& q, bool w4a4) {
  kernels::Nvfp4LinearOptions o;
  o.w4a4 = w4a4;
  // A stack's static scales act as one: the grouped call quantises its whole input with the largest.
  if (q.input_scale.defined()) o.input_scale = q.stacked() ? q.input_scale.max() : q.input_scale;
  return o;
}

// x [T, K] . w^T, one row at a time under batch-invariant numerics (model/batch_invariant.h).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, bool rowwise) {
  return rowwise ? rowwise_linear(x, w) : at::linear(x, w);
}

// RMSNorm as the forward applies it: each row alone under batch-invariant numerics.
at::Tensor norm(const at::Tensor& x, const at::Tensor& w, double eps, const ForwardOptions& opt) {
  return opt.bitwise() ? rowwise_rms_norm(x, w, eps) : rms_norm(x, w, eps);
}

// x [T, K] . W^T from the dense weight, or from its NVFP4 copy when the dense one was released,
// plus the LoRA term scale * B (A x) when the layer has adapters there.
at::Tensor project(const at::Tensor& x, const LayerWeights& lw, detail::LinearIndex which, int64_t layer,
                   const ForwardOptions& opt) {
  const detail::LinearSlot& r = detail::linear_slots()[which];
  if (opt.observe_linear_input) opt.observe_linear_input(layer, r.module, x);
  const at::Tensor& dense = lw.*r.dense;
  const kernels::Nvfp4Tensor& q = lw.nvfp4.*r.q;
  const bool rowwise = opt.bitwise();
  at::Tensor y;
  if (dense.defined()) {
    y = linear(x, dense, rowwise);
  } else {
    KILN_CHECK(q.packed.defined(), "muse: layer ", layer, " ", r.module, " has neither dense nor NVFP4 weights");
    KILN_CHECK(!rowwise, "muse: batch-invariant numerics serve dense weights, not NVFP4 (layer ", layer, " ", r.module, ")");
    y = kernels::nvfp4_linear(x, q, nvfp4_options(q, lw.nvfp4.w4a4));
  }
  const at::Tensor& a = lw.lora.*r.a;
  if (!a.defined() || opt.disable_lora) return y;
  return y + linear(linear(x, a, rowwise), lw.lora.*r.b, rowwise) * lw.lora.scale;
}

// The experts' LoRA term scale * B_e (A_e x) for rows grouped into padded per-expert segments
// (offs: segment ends, int32): two torch grouped GEMMs, no host sync. Callers check
// Lora::experts_grouped, which is false before torch 2.8.
at::Tensor grouped_lora(const at::Tensor& xp, const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets,
                        double scale) {
#if KILN_TORCH_AT_LEAST(2, 8)
  at::Tensor ax = at::_grouped_mm(xp, a.transpose(1, 2), offsets);
  return at::_grouped_mm(ax, b.transpose(1, 2), offsets) * scale;
#else
  (void)xp, (void)a, (void)b, (void)offsets, (void)scale;
  KILN_FAIL("muse: grouped expert adapters need torch >= 2.8");
#endif
}

// One projection of a layer's experts as the forward applies it: the dense stack [E, N, K] or,
// when that was released, its NVFP4 copy, plus the LoRA pair when adapters are on. Each way the
// experts run (grouped over the padded layout, grouped over sorted rows, one expert at a time) is
// one call here, so the callers do not branch on which tensors are set.
struct ExpertProj {
  const at::Tensor& dense;
  const kernels::Nvfp4Tensor& q;
  const at::Tensor& a;  // undefined: no adapter here, or adapters disabled
  const at::Tensor& b;
  double scale;
  bool w4a4;
  bool rowwise;  // batch-invariant numerics (one() only)
  int64_t live_rows = 0;  // Nvfp4LinearOptions::live_rows

  kernels::Nvfp4LinearOptions options() const {
    kernels::Nvfp4LinearOptions o = nvfp4_options(q, w4a4);
    o.live_rows = live_rows;
    return o;
  }
  // Rows in the padded layout of kernels::moe_layout (ends: its int32 segment ends, MoeLayout's
  // offsets or ends; segments: 0 then ends as int64, or undefined), on torch's grouped GEMM, or
  // NVFP4's (kernels::nvfp4_grouped_linear_aligned: W4A16 at decode sizes, the dequantised stack above).
  at::Tensor padded(const at::Tensor& xp, const at::Tensor& ends, const at::Tensor& segments = {}) const {
#if KILN_TORCH_AT_LEAST(2, 8)
    at::Tensor y = dense.defined()
                       ? at::_grouped_mm(xp, dense.transpose(1, 2), ends)
                       : kernels::nvfp4_grouped_linear_aligned(xp, q, ends, options(), segments);
    return a.defined() ? y + grouped_lora(xp, a, b, ends, scale) : y;
#else
    (void)xp, (void)ends, (void)segments;
    KILN_FAIL("muse: grouped experts need torch >= 2.8");
#endif
  }
  // NVFP4 rows sorted by expert, unpadded (offsets [E + 1] int64: the fused W4A16 kernel at decode
  // sizes; rows past offsets[E] belong to no expert); adapters run on a padded copy through `l`
  // (kernels::moe_layout) and its experts' segment ends.
  at::Tensor sorted(const at::Tensor& xs, const at::Tensor& offsets, const kernels::MoeLayout& l,
                    const at::Tensor& ends) const {
    at::Tensor y = kernels::nvfp4_grouped_linear(xs, q, offsets, options());
    if (!a.defined()) return y;
    at::Tensor xp = at::zeros({l.bound, xs.size(1)}, xs.options()).index_copy(0, l.dest, xs);
    return y + grouped_lora(xp, a, b, ends, scale).index_select(0, l.dest);
  }
  // Rows sorted by expert (offsets [E + 1] int64 on the device), under batch-invariant numerics:
  // each row as one() would give it, in one launch per GEMM on CUDA.
  at::Tensor invariant(const at::Tensor& xs, const at::Tensor& offsets) const {
    at::Tensor y = grouped_rowwise_linear(xs, dense, offsets);
    if (!a.defined()) return y;
    return y + grouped_rowwise_linear(grouped_rowwise_linear(xs, a, offsets), b, offsets) * scale;
  }
  // Expert e alone on its rows x.
  at::Tensor one(const at::Tensor& x, int64_t e) const {
    at::Tensor y;
    if (dense.defined()) {
      y = linear(x, dense[e], rowwise);
    } else {
      KILN_CHECK(!rowwise, "muse: batch-invariant numerics serve dense experts, not NVFP4");
      kernels::Nvfp4Tensor qe{q.packed[e], q.block_scale[e], q.tensor_scale[e], q.kernel_layout,
                              q.input_scale.defined() ? q.input_scale[e] : at::Tensor()};
      y = kernels::nvfp4_linear(x, qe, nvfp4_options(qe, w4a4));
    }
    return a.defined() ? y + linear(linear(x, a[e], rowwise), b[e], rowwise) * scale : y;
  }
};

struct ExpertStack {
  ExpertProj gate, up, down;
  bool lora;  // some expert adapter applies
  bool quantized() const { return !gate.dense.defined(); }  // the dense stacks were released: NVFP4 serving
  int64_t experts() const { return quantized() ? gate.q.packed.size(0) : gate.dense.size(0); }
};

ExpertStack expert_stack(const LayerWeights& lw, int64_t layer, const ForwardOptions& opt) {
  static const at::Tensor kNone;
  const auto& nv = lw.nvfp4;
  const auto& lo = lw.lora;
  const bool lora = !opt.disable_lora && lo.on_experts();
  KILN_CHECK(lw.expert_gate.defined() || nv.expert_gate.packed.defined(), "muse: layer ", layer,
             " experts have neither dense nor NVFP4 weights");
  auto proj = [&](const at::Tensor& dense, const kernels::Nvfp4Tensor& q, const at::Tensor& a,
                  const at::Tensor& b) -> ExpertProj {
    return {dense, q, lora ? a : kNone, lora ? b : kNone, lo.scale, nv.w4a4, opt.bitwise()};
  };
  return {proj(lw.expert_gate, nv.expert_gate, lo.gate_a, lo.gate_b),
          proj(lw.expert_up, nv.expert_up, lo.up_a, lo.up_b),
          proj(lw.expert_down, nv.expert_down, lo.down_a, lo.down_b), lora};
}

// The packed batch for varlen flash attention: cu_seqlens on the device and the longest sequence;
// under batch-invariant numerics each query's keys instead, built once for every layer.
struct FlashPlan {
  at::Tensor cu_seqlens;  // [S + 1] int32; undefined: flash attention is not used
  int64_t max_len = 0;
  KeyRanges invariant[2];  // batch-invariant: [0] full-attention layers, [1] window layers
};

// The standard numerics' plans for packed causal sequences, built once for every layer: varlen
// flash where it runs; otherwise, for many sequences, one padded batch.
FlashPlan flash_plan(const std::vector<int64_t>& cu_seqlens, at::Device device) {
  FlashPlan flash;
  std::vector<int32_t> cu(cu_seqlens.begin(), cu_seqlens.end());
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s)
    flash.max_len = std::max(flash.max_len, cu_seqlens[s + 1] - cu_seqlens[s]);
  flash.cu_seqlens = at::tensor(cu, at::kInt).to(device);
  return flash;
}

PaddedLayout causal_layout(const std::vector<int64_t>& cu_seqlens, at::Device device) {
  std::vector<std::vector<int64_t>> rows, pos;
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t b = cu_seqlens[s], n = cu_seqlens[s + 1] - b;
    if (n == 0) continue;
    rows.emplace_back(n);
    pos.emplace_back(n);
    std::iota(rows.back().begin(), rows.back().end(), b);
    std::iota(pos.back().begin(), pos.back().end(), 0);
  }
  return PaddedLayout::build(rows, pos, rows, pos, device);
}

// q [T, Hq, hd], k and v [T, Hkv, hd] of packed sequences by the standard numerics: varlen flash
// (flash planned), one padded batch (its scores small enough), else sequence by sequence.
at::Tensor standard_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::vector<int64_t>& cu_seqlens, int64_t window, const FlashPlan& flash,
                              const PaddedLayout& padded) {
  const bool full = window <= 0;
  if (flash.cu_seqlens.defined()) return kernels::flash_varlen_attention(q, k, v, flash.cu_seqlens, flash.max_len, window);
  if (padded.num_problems > 1 && padded.score_bytes(q.size(1)) <= kPaddedScoreBytes)
    return padded_attention(padded, q, k, v, full, window);
  const int64_t group = q.size(1) / k.size(1);
  std::vector<at::Tensor> outs;
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t start = cu_seqlens[s], n = cu_seqlens[s + 1] - start;
    if (n == 0) continue;
    at::Tensor qs = q.narrow(0, start, n).transpose(0, 1);  // [Hq, n, hd]
    at::Tensor ks = expand_kv_heads(k.narrow(0, start, n).transpose(0, 1), group);
    at::Tensor vs = expand_kv_heads(v.narrow(0, start, n).transpose(0, 1), group);
    outs.push_back(sequence_attention(qs, ks, vs, full, window).transpose(0, 1));
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs, 0);
}

at::Tensor attention(const ModelConfig& cfg, const LayerWeights& lw, int64_t layer, const at::Tensor& h,
                     const PackedBatch& batch, const at::Tensor& cos, const at::Tensor& sin,
                     AttentionBackend* backend, const PaddedLayout& padded, const FlashPlan& flash,
                     const ForwardOptions& opt) {
  const int64_t T = h.size(0), hd = cfg.head_dim;
  const bool full = cfg.is_full_attention(layer);
  at::Tensor q = project(h, lw, detail::kQProj, layer, opt).view({T, cfg.num_q_heads, hd});
  at::Tensor k = project(h, lw, detail::kKProj, layer, opt).view({T, cfg.num_kv_heads, hd});
  at::Tensor v = project(h, lw, detail::kVProj, layer, opt).view({T, cfg.num_kv_heads, hd});
  at::Tensor o;
  if (backend) {  // the rollout's KV cache: RoPE may be fused with its cache write
    o = backend->attend_unrotated(layer, full, batch, q, k, v, cos, sin);
    return project(o.reshape({T, cfg.q_size()}), lw, detail::kOProj, layer, opt);
  }
  q = apply_rope(q, cos, sin);
  k = apply_rope(k, cos, sin);
  if (opt.bitwise()) {  // each query alone over exactly its keys, as the engine's cache attention
    o = causal_query_attention(q, k, v, batch.cu_seqlens, full ? 0 : cfg.sliding_window, flash.invariant[full ? 0 : 1]);
  } else {
    o = standard_attention(q, k, v, batch.cu_seqlens, full ? 0 : cfg.sliding_window, flash, padded);
  }
  return project(o.reshape({T, cfg.q_size()}), lw, detail::kOProj, layer, opt);
}

// torch's grouped GEMM reads bf16 operands whose row strides are multiples of 16 bytes, so the
// latent and the experts' hidden widths must be multiples of 8 (small test configs are not).
bool grouped_mm_widths_fit(const LayerWeights& lw, const at::Tensor& z) {
  const int64_t hidden = lw.expert_gate.defined()               ? lw.expert_gate.size(1)
                         : lw.nvfp4.expert_gate.packed.defined() ? lw.nvfp4.expert_gate.rows()
                                                                 : 0;
  return z.size(1) % 8 == 0 && hidden % 8 == 0;
}

// SwiGLU experts, W_down_e . (silu(W_gate_e . z) * (W_up_e . z)), for every slot; [T * k, d_l] in
// slot order. ids [T * k]: the expert of each slot (kernels::moe_layout sorts them). With `spare`,
// an id equal to the number of experts marks a row no expert runs (ExpertDispatcher::Routed): it
// sorts after every expert's rows, the GEMMs stop before it, and its output is zero or garbage.
at::Tensor run_experts(const LayerWeights& lw, int64_t layer, const at::Tensor& z, const at::Tensor& ids, int64_t k,
                       at::Tensor& counts, const ForwardOptions& opt, bool spare = false, int64_t live_rows = 0) {
  ExpertStack s = expert_stack(lw, layer, opt);
  for (ExpertProj* p : {&s.gate, &s.up, &s.down}) p->live_rows = live_rows;
  const int64_t n = ids.size(0), E = s.experts();
  const kernels::MoeLayout l = kernels::moe_layout(ids, spare ? E + 1 : E, k, kGroupAlign);
  counts = spare ? l.counts.narrow(0, 0, E) : l.counts;
  const at::Tensor ends = spare ? l.offsets.narrow(0, 0, E) : l.offsets;  // the experts' segments (int32)
  const bool grouped = opt.grouped_mm() && (!s.lora || lw.lora.experts_grouped()) && !opt.observe_linear_input &&
                       !opt.bitwise() && z.is_cuda() && z.scalar_type() == at::kBFloat16 &&
                       grouped_mm_widths_fit(lw, z);
  if (grouped && (!s.quantized() || kernels::nvfp4_grouped_dequantizes(s.gate.q, live_rows > 0 ? live_rows : n, z))) {
    // torch's grouped GEMM over segments that each start on a kGroupAlign boundary; the last runs
    // to a static bound (with `spare`, to its own end: rows past it are left unwritten), so nothing
    // syncs with the host. Padding rows are zero and never read back.
    at::Tensor zp = at::zeros({l.bound, z.size(1)}, z.options()).index_copy(0, l.dest, z.index_select(0, l.src_token));
    at::Tensor act = at::silu(s.gate.padded(zp, ends)) * s.up.padded(zp, ends);
    return s.down.padded(act, ends).index_select(0, l.slot_row);
  }
  at::Tensor inverse = at::empty_like(l.order).scatter_(0, l.order, at::arange(n, l.order.options()));
  // Rows sorted by expert. Under batch-invariant numerics the moves' backward gathers: token t's
  // k slots lie at sorted rows inverse[t * k + j].
  at::Tensor zs = opt.bitwise() ? gather_rows(z, l.src_token, inverse, k) : z.index_select(0, l.src_token);
  // Each expert's first sorted row, and the end, on the device (no host sync).
  auto sorted_offsets = [&] { return at::cat({at::zeros({1}, counts.options()), counts.cumsum(0)}); };
  if (opt.bitwise() && !s.quantized() && !opt.observe_linear_input) {
    // Batch-invariant experts: grouped GEMMs whose rows do not depend on the batch (one launch
    // each on CUDA).
    const at::Tensor offsets = sorted_offsets();
    at::Tensor act = rowwise_silu(s.gate.invariant(zs, offsets)) * s.up.invariant(zs, offsets);
    return gather_rows(s.down.invariant(act, offsets), inverse, l.order, 1);  // sorted row i is slot order[i]
  }
  if (s.quantized() && !opt.observe_linear_input && !opt.bitwise() && (!s.lora || grouped)) {
    // NVFP4 grouped GEMMs over expert-sorted rows.
    const at::Tensor offsets = sorted_offsets();
    at::Tensor act = at::silu(s.gate.sorted(zs, offsets, l, ends)) * s.up.sorted(zs, offsets, l, ends);
    return s.down.sorted(act, offsets, l, ends).index_select(0, inverse);
  }
  // A loop over non-empty experts, on expert-sorted rows.
  at::Tensor host_counts = counts.cpu();
  const int64_t* c = host_counts.data_ptr<int64_t>();
  std::vector<at::Tensor> parts;
  int64_t start = 0;
  for (int64_t e = 0; e < s.experts(); ++e) {
    if (c[e] == 0) continue;
    at::Tensor seg = zs.narrow(0, start, c[e]);
    const std::string prefix = "mlp.experts." + std::to_string(e) + ".";
    if (opt.observe_linear_input) {
      opt.observe_linear_input(layer, prefix + "gate_proj", seg);
      opt.observe_linear_input(layer, prefix + "up_proj", seg);
    }
    at::Tensor g = s.gate.one(seg, e);
    at::Tensor a = (opt.bitwise() ? rowwise_silu(g) : at::silu(g)) *
                   s.up.one(seg, e);
    if (opt.observe_linear_input) opt.observe_linear_input(layer, prefix + "down_proj", a);
    parts.push_back(s.down.one(a, e));
    start += c[e];
  }
  KILN_CHECK(start == n || spare, "latent_moe: expert counts do not cover the rows (rows=", n, ", counted=", start, ")");
  // Spare rows: zeros, still tied to the input, so that a backward through them reaches the
  // exchange that brought them (every rank must join it; see dispatched_experts).
  if (start < n) parts.push_back(zs.narrow(0, start, n - start) * 0);
  at::Tensor ys = parts.size() == 1 ? parts[0] : at::cat(parts, 0);
  return ys.index_select(0, inverse);  // back to slot order
}

// The experts of every slot under expert parallelism: the dispatcher takes each slot's row to the
// rank holding its expert, this rank runs its experts (SwiGLU and the per-expert norm) on what it
// gets, and the outputs go back; [T * k, d_l] in slot order. The weights hold E / ranks() experts.
at::Tensor dispatched_experts(const ModelConfig& cfg, const LayerWeights& lw, int64_t layer, const at::Tensor& z,
                              const at::Tensor& flat, int64_t k, const ExpertDispatcher& dispatcher,
                              const ForwardOptions& opt) {
  const int64_t E = cfg.num_experts, S = dispatcher.ranks();
  const int64_t local = lw.expert_gate.defined() ? lw.expert_gate.size(0) : lw.nvfp4.expert_gate.packed.size(0);
  for (const at::Tensor* a : {&lw.lora.gate_a, &lw.lora.up_a, &lw.lora.down_a})
    KILN_CHECK(!a->defined() || a->size(0) == local, "latent_moe: layer ", layer, " holds expert adapters for ",
               a->size(0), " experts but ", local, " expert weights (shard the adapters with model::shard_experts)");
  KILN_CHECK(local * S == E, "latent_moe: expert parallel over ", S, " ranks needs ", E / S,
             " experts per rank, the weights hold ", local, " (use model::shard_experts)");
  const ExpertDispatcher::Routed routed = dispatcher.dispatch(z, flat, k, local);
  at::Tensor y;
  if (routed.rows.size(0) == 0) {
    y = routed.rows * 0;  // keeps this rank's backward exchange in the graph: every rank must join it
  } else {
    at::Tensor counts;
    y = run_experts(lw, layer, routed.rows, routed.ids, 1, counts, opt, routed.spare, routed.live_rows);
    // Spare rows: no expert wrote them (on CUDA their memory is whatever was there), so zero them,
    // which also keeps any gradient off the norm weights; a zero row normalises to zero. Only the
    // sender's masked or dropped slots read them back.
    if (routed.spare) y = at::where((routed.ids < local).unsqueeze(1), y, at::zeros({}, y.options()));
    const at::Tensor norm_ids = routed.spare ? routed.ids.clamp_max(local - 1) : routed.ids;
    // Under batch-invariant numerics the norm weights' gradient is one GEMM (table_rows), as on one
    // rank: index_select's CUDA backward adds rows with atomics, in no fixed order.
    const at::Tensor norm_w =
        opt.bitwise() ? table_rows(lw.expert_norm, norm_ids) : lw.expert_norm.index_select(0, norm_ids);
    y = norm(y, norm_w, cfg.rms_norm_eps, opt);
  }
  return dispatcher.combine(y, routed);
}

// The fused training path of the latent MoE: dense experts on CUDA in bf16 through torch's
// grouped GEMM, no expert parallelism, no observer.
bool fused_moe_applies(const LayerWeights& lw, const at::Tensor& z, int64_t k, const ForwardOptions& opt) {
#if KILN_TORCH_AT_LEAST(2, 8)
  const bool lora = !opt.disable_lora && lw.lora.on_experts();
  const bool expert_parallel = opt.experts && opt.experts->ranks() > 1;
  // NVFP4 experts join at every size: the W4A16 grouped kernel (decode) or torch's grouped GEMM on
  // the dequantised stack (prefill) runs on the same padded layout, so no row moves of their own.
  const bool weights = lw.expert_gate.defined() || kernels::nvfp4_grouped_on_device(lw.nvfp4.expert_gate, z);
  return opt.kernel_path == KernelPath::kFused && !opt.bitwise() && !expert_parallel && weights && z.is_cuda() &&
         z.scalar_type() == at::kBFloat16 && !opt.observe_linear_input && (!lora || lw.lora.experts_grouped()) &&
         k <= 16 && grouped_mm_widths_fit(lw, z);
#else
  (void)lw, (void)z, (void)k, (void)opt;
  return false;
#endif
}

// Experts, per-expert norm and the FP32 weighted combine, [T, d_l] in z's dtype: z goes to its
// experts' padded rows (kernels::moe_dispatch), three grouped GEMMs with a fused SwiGLU, the
// norm over each expert's segment of rows (kernels::segment_rms_norm) and the weighted sum of
// every token's k rows (kernels::moe_combine), each one kernel forward and backward. NVFP4
// experts multiply by their dequantised stacks, which equal a dequantised model's weights.
at::Tensor fused_experts(const ModelConfig& cfg, const LayerWeights& lw, int64_t layer, const at::Tensor& z,
                         const at::Tensor& flat, const at::Tensor& w, at::Tensor& counts, const ForwardOptions& opt) {
#if KILN_TORCH_AT_LEAST(2, 8)
  const ExpertStack s = expert_stack(lw, layer, opt);
  const int64_t k = cfg.top_k;
  kernels::MoeLayout l = kernels::moe_layout(flat, s.experts(), k, kGroupAlign);
  counts = l.counts;
  at::Tensor zp = kernels::moe_dispatch(z, l.slot_row, k, l.bound);
  // The rollout's GEMMs stop at the last real segment (MoeLayout::ends): the rows up to the static
  // bound are padding no one reads. Elsewhere the last segment runs to the bound, so that every row
  // a backward touches was computed, and the trainer's scoring runs its training forward's GEMMs.
  const bool infer = opt.rollout && !torch::autograd::GradMode::is_enabled();
  const at::Tensor& ends = infer ? l.ends : l.offsets;
  const at::Tensor segments = infer ? l.segments : at::Tensor();
  at::Tensor act = kernels::swiglu(s.gate.padded(zp, ends, segments), s.up.padded(zp, ends, segments));
  at::Tensor y = s.down.padded(act, ends, segments);
  at::Tensor yn = kernels::segment_rms_norm(y, lw.expert_norm, l.offsets, cfg.rms_norm_eps);
  return kernels::moe_combine(yn, w, l.slot_row);
#else
  (void)cfg, (void)lw, (void)layer, (void)z, (void)flat, (void)w, (void)counts, (void)opt;
  KILN_FAIL("muse: the fused MoE path needs torch >= 2.8");
#endif
}

// The router's choice for each token as if alone (batch-invariant numerics). A softmax router's
// every step works along a row (softmax, top-k, gather, the sum over k, a division), so rows go
// through the reference in zero-padded chunks of a fixed 64; a sigmoid's is elementwise over the
// whole tensor (its vectorised and scalar paths round differently), so one row at a time.
kernels::MoeRoute rowwise_route(const at::Tensor& logits, int64_t k, bool sigmoid, const at::Tensor& bias,
                                const at::Tensor& replay, bool need_scores) {
  if (logits.is_cuda() && logits.scalar_type() == at::kFloat) {
    // On CUDA the route kernel (a warp per token) decides each token alone; the weights' gradient,
    // and the scores the balance loss reads, are the reference's for the same experts.
    kernels::MoeRoute r;
    {
      at::NoGradGuard no_grad;
      r = kernels::moe_route_cuda(logits.detach(), k, sigmoid, bias, replay);
    }
    if (logits.requires_grad() && at::GradMode::is_enabled()) {
      const kernels::MoeRoute ref = kernels::moe_route_reference(logits, k, sigmoid, bias, r.ids);
      r.weights = straight_through(r.weights, ref.weights);
      r.scores = ref.scores;
    } else if (need_scores) {
      r.scores = kernels::moe_route_reference(logits, k, sigmoid, bias, r.ids).scores;
    }
    return r;
  }
  const int64_t rows = sigmoid ? 1 : kBatchInvariantRows;
  std::vector<at::Tensor> ids, weights, scores;
  for (int64_t t = 0; t < logits.size(0); t += rows) {
    const int64_t n = std::min(rows, logits.size(0) - t);
    const kernels::MoeRoute r = kernels::moe_route_reference(padded_rows(logits, t, n, rows), k, sigmoid, bias,
                                                             replay.defined() ? padded_rows(replay, t, n, rows) : replay);
    ids.push_back(r.ids.narrow(0, 0, n));
    weights.push_back(r.weights.narrow(0, 0, n));
    scores.push_back(r.scores.narrow(0, 0, n));
  }
  if (ids.empty()) return kernels::moe_route_reference(logits, k, sigmoid, bias, replay);
  return {at::cat(ids), at::cat(weights), at::cat(scores)};
}

struct MoeOut {
  at::Tensor out;         // [T, d]
  at::Tensor ids;         // [T, k] int64
  at::Tensor balance;     // scalar
};

// route -> pool -> dispatch (sort by expert) -> experts -> per-expert norm -> FP32 combine -> unpool
MoeOut latent_moe(const ModelConfig& cfg, const LayerWeights& lw, int64_t layer, const at::Tensor& h,
                  const at::Tensor& replay, const ForwardOptions& opt) {
  const int64_t T = h.size(0), k = cfg.top_k, E = cfg.num_experts;
  at::Tensor logits = linear(h.to(lw.router.scalar_type()), lw.router, opt.bitwise());  // [T, E] fp32
  const bool sigmoid = cfg.router_score == RouterScore::kSigmoid;
  // Without a gradient or the balance loss (the rollout), one kernel on CUDA; else the ATen ops
  // (each token alone under batch-invariant numerics).
  const bool plain = opt.rollout && opt.fused_kernels() && !opt.load_balance && !logits.requires_grad() && !opt.bitwise();
  const kernels::MoeRoute route = plain                  ? kernels::moe_route(logits, k, sigmoid, lw.router_bias, replay)
                                  : opt.bitwise() ? rowwise_route(logits, k, sigmoid, lw.router_bias, replay, opt.load_balance)
                                                        : kernels::moe_route_reference(logits, k, sigmoid, lw.router_bias, replay);
  const at::Tensor &ids = route.ids, &w = route.weights;

  at::Tensor z = project(h, lw, detail::kPooler, layer, opt);  // [T, d_l]
  at::Tensor flat = ids.reshape(-1);        // [T * k], slot order
  at::Tensor counts;  // [E] slots per expert
  at::Tensor m;       // [T, d_l]: the FP32 weighted sum of each token's k normed expert rows
  if (fused_moe_applies(lw, z, k, opt)) {
    m = fused_experts(cfg, lw, layer, z, flat, w, counts, opt);  // summed in fp32, stored in z's dtype
  } else {
    const bool ep = opt.experts && opt.experts->ranks() > 1;
    at::Tensor y;
    if (ep) {
      y = dispatched_experts(cfg, lw, layer, z, flat, k, *opt.experts, opt).view({T, k, -1});
      counts = at::zeros({E}, flat.options()).index_add_(0, flat, at::ones_like(flat));
    } else {
      y = run_experts(lw, layer, z, flat, k, counts, opt);
      const at::Tensor norm_rows =
          opt.bitwise() ? table_rows(lw.expert_norm, flat) : lw.expert_norm.index_select(0, flat);
      y = norm(y, norm_rows, cfg.rms_norm_eps, opt).view({T, k, -1});
    }
    // Bitwise numerics (engine and trainer alike, fused kernels or not) and expert parallelism with
    // fused kernels take the fused path's combine kernel on CUDA: a block per token adds its k rows
    // in slot order in fp32 (stored in y's dtype), without the fp32 products in memory; each token
    // alone, so batch-invariant.
    const at::Tensor rows = y.view({T * k, -1});
    if ((opt.bitwise() || (ep && opt.fused_kernels())) && kernels::moe_combine_on_kernel(rows, w)) {
      m = kernels::moe_combine(rows, w, at::arange(T * k, flat.options()));
    } else if (opt.bitwise()) {  // the k terms added in slot order, each row alone by construction
      // The products in one op (each the same IEEE product as alone), then k - 1 adds in order;
      // unbind, not select: the backward is one stack and one product, not k of each.
      const std::vector<at::Tensor> terms = (y.to(w.scalar_type()) * w.unsqueeze(-1)).unbind(1);
      m = terms[0];
      for (int64_t j = 1; j < k; ++j) m = m + terms[size_t(j)];
    } else {
      m = (y.to(w.scalar_type()) * w.unsqueeze(-1)).sum(1);  // FP32 weighted sum
    }
  }
  const auto acc = w.scalar_type();
  MoeOut r;
  r.out = project(m.to(h.scalar_type()), lw, detail::kUnpooler, layer, opt);
  r.ids = ids;
  if (opt.load_balance) r.balance = load_balance_term(counts.to(acc), route.scores, k, opt.batch_reduce);
  return r;
}

// Everything a layer's forward reads besides its weights and input.
struct LayerContext {
  const ModelConfig& cfg;
  const PackedBatch& batch;
  const at::Tensor &cos, &sin;
  const PaddedLayout& padded;
  const FlashPlan& flash;
  const ForwardOptions& opt;
};

// The same held by value, for a recompute in the backward, which must not depend on the caller's
// objects still being alive. Built only when recomputing: the forward of every step (the rollout's
// too) reads the caller's objects directly.
struct OwnedLayerContext {
  ModelConfig cfg;
  PackedBatch batch;
  at::Tensor cos, sin;
  PaddedLayout padded;
  FlashPlan flash;
  ForwardOptions opt;
  LayerContext view() const { return {cfg, batch, cos, sin, padded, flash, opt}; }
};

struct LayerOut {
  at::Tensor x, ids, balance;  // the residual stream after the layer, its expert ids [T, k], its balance term
  at::Tensor xn;               // rms_norm(x, next_norm), when run_layer was given one and fused it
};

// One sandwich-normed block: attention, then the latent MoE, each added to the residual stream.
// xn: x already normed by this layer's input norm (undefined: norm it here). The rollout fuses each
// residual add with the norm after it (kernels::add_rms_norm, bitwise the composition), that of the
// MoE's output with `next_norm`, the next layer's input norm or the final one, when given.
LayerOut run_layer(const LayerContext& c, const LayerWeights& lw, int64_t i, const at::Tensor& x,
                   const at::Tensor& replay, const at::Tensor& xn = {}, const at::Tensor& next_norm = {}) {
  const double eps = c.cfg.rms_norm_eps;
  const bool fuse = c.opt.rollout && !c.opt.bitwise();
  at::Tensor a = attention(c.cfg, lw, i, xn.defined() ? xn : norm(x, lw.input_norm, eps, c.opt), c.batch, c.cos, c.sin,
                           c.opt.attention, c.padded, c.flash, c.opt);
  at::Tensor h, hn;
  if (fuse) {
    std::tie(h, hn) = kernels::add_rms_norm(a, x, lw.post_attn_norm, lw.pre_moe_norm, eps);
  } else {
    h = x + norm(a, lw.post_attn_norm, eps, c.opt);
    hn = norm(h, lw.pre_moe_norm, eps, c.opt);
  }
  MoeOut moe = latent_moe(c.cfg, lw, i, hn, replay, c.opt);
  LayerOut r{at::Tensor(), moe.ids, moe.balance, at::Tensor()};
  if (fuse && next_norm.defined()) std::tie(r.x, r.xn) = kernels::add_rms_norm(moe.out, h, lw.post_moe_norm, next_norm, eps);
  else r.x = h + norm(moe.out, lw.post_moe_norm, eps, c.opt);
  return r;
}

// Activation recompute of one layer (ForwardOptions::recompute): the forward ran without a graph
// and kept only the layer's input and expert ids. This node runs the layer again with a graph,
// the same experts replayed, and backpropagates through it (a reentrant backward): the layer's
// parameter gradients accumulate as usual and the input's gradient is returned.
struct LayerRecompute : public torch::autograd::Node {
  std::shared_ptr<const OwnedLayerContext> context;
  LayerWeights weights;
  int64_t layer = 0;
  at::Tensor input, ids;
  bool has_balance = false;

  std::string name() const override { return "kiln::LayerRecompute"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    torch::autograd::AutoGradMode grad_on(true);
    at::Tensor x = input.detach().requires_grad_(true);
    // Sharded weights (ZeRO-3) are gathered again here, and their gradients go to their owners
    // after the layer's backward: every rank runs these nodes in the same order (layer by layer).
    const WeightGather* g = context->opt.gather;
    const LayerWeights lw = g ? g->gather_layer(layer, weights) : weights;
    LayerOut r = run_layer(context->view(), lw, layer, x, ids);
    torch::autograd::variable_list outs, gs;
    if (grads[0].defined()) outs.push_back(r.x), gs.push_back(grads[0]);
    if (has_balance && grads.size() > 1 && grads[1].defined() && r.balance.requires_grad())
      outs.push_back(r.balance), gs.push_back(grads[1]);
    if (!outs.empty()) torch::autograd::backward(outs, gs);
    if (g) g->finish_layer(layer, lw, weights);
    input = at::Tensor();  // the graph is consumed: release the saved activation now
    return {x.grad()};
  }
};

LayerOut recomputed_layer(const std::shared_ptr<const OwnedLayerContext>& c, const LayerWeights& lw, int64_t i,
                          const at::Tensor& x, const at::Tensor& replay) {
  LayerOut r;
  {
    at::NoGradGuard no_grad;
    r = run_layer(c->view(), c->opt.gather ? c->opt.gather->gather_layer(i, lw) : lw, i, x, replay);
  }
  auto node = std::shared_ptr<LayerRecompute>(new LayerRecompute(), torch::autograd::deleteNode);
  node->context = c;
  node->weights = lw;
  node->layer = i;
  node->input = x.detach();
  node->ids = r.ids;
  node->has_balance = r.balance.defined();
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  torch::autograd::set_history(r.x, node);  // the node's first gradient
  if (r.balance.defined()) torch::autograd::set_history(r.balance, node);
  return r;
}

}  // namespace

at::ScalarType router_dtype(at::ScalarType dtype) { return acc_dtype(dtype); }

at::Tensor sequence_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool full,
                              int64_t window, int64_t q_start, int64_t k_start) {
  const int64_t n = q.size(1);
  KILN_CHECK(k_start <= q_start && k_start + k.size(1) >= q_start + n, "attention: keys at positions [",
             k_start, ", ", k_start + k.size(1), ") do not cover queries at [", q_start, ", ", q_start + n, ")");
  const double scale = 1.0 / std::sqrt(double(q.size(2)));
  auto idx = at::TensorOptions().dtype(at::kLong).device(q.device());
  std::vector<at::Tensor> blocks;
  for (int64_t a = 0; a < n; a += kQueryChunk) {
    const int64_t b = std::min(n, a + kQueryChunk);
    // Absolute positions: queries [qa, qb), keys [ka, qb).
    const int64_t qa = q_start + a, qb = q_start + b;
    const int64_t ka = full ? k_start : std::max(k_start, qa - window + 1);
    at::Tensor qc = q.narrow(1, a, b - a);
    at::Tensor kc = k.narrow(1, ka - k_start, qb - ka);
    at::Tensor vc = v.narrow(1, ka - k_start, qb - ka);
    at::Tensor qi = at::arange(qa, qb, idx).unsqueeze(1);
    at::Tensor kj = at::arange(ka, qb, idx).unsqueeze(0);
    at::Tensor allowed = kj.le(qi);
    if (!full) allowed = allowed.logical_and(kj.gt(qi - window));
#if KILN_TORCH_AT_LEAST(2, 0)
    if (q.is_cuda()) {
      // Fused kernel on GPU; the explicit mask keeps window semantics identical to the CPU path.
      blocks.push_back(at::scaled_dot_product_attention(qc.unsqueeze(0), kc.unsqueeze(0),
                                                        vc.unsqueeze(0), allowed).squeeze(0));
      continue;
    }
#endif
    at::Tensor scores = at::matmul(qc, kc.transpose(1, 2)).to(acc_dtype(q.scalar_type())) * scale;
    scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
    at::Tensor p = at::softmax(scores, -1).to(q.scalar_type());
    blocks.push_back(at::matmul(p, vc));
  }
  return blocks.size() == 1 ? blocks[0] : at::cat(blocks, 1);
}

at::Tensor expand_kv_heads(const at::Tensor& x, int64_t group) {
  return group == 1 ? x : x.repeat_interleave(group, 0);
}

PaddedLayout PaddedLayout::build(const std::vector<std::vector<int64_t>>& q_rows,
                                 const std::vector<std::vector<int64_t>>& q_positions,
                                 const std::vector<std::vector<int64_t>>& k_rows,
                                 const std::vector<std::vector<int64_t>>& k_positions, at::Device device) {
  PaddedLayout p;
  p.num_problems = int64_t(q_rows.size());
  for (size_t b = 0; b < q_rows.size(); ++b) {
    p.max_queries = std::max<int64_t>(p.max_queries, int64_t(q_rows[b].size()));
    p.max_keys = std::max<int64_t>(p.max_keys, int64_t(k_rows[b].size()));
  }
  const int64_t B = p.num_problems, Lq = p.max_queries, Lk = p.max_keys;
  std::vector<int64_t> qi(B * Lq, 0), qp(B * Lq, -1), ki(B * Lk, 0), kp(B * Lk, -1), out;
  for (int64_t b = 0; b < B; ++b) {
    for (size_t i = 0; i < q_rows[b].size(); ++i) {
      qi[b * Lq + i] = q_rows[b][i];
      qp[b * Lq + i] = q_positions[b][i];
      out.push_back(b * Lq + int64_t(i));
    }
    for (size_t j = 0; j < k_rows[b].size(); ++j) {
      ki[b * Lk + j] = k_rows[b][j];
      kp[b * Lk + j] = k_positions[b][j];
    }
  }
  auto dev = [&](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong).to(device); };
  p.q_index = dev(qi);
  p.q_pos = dev(qp).view({B, Lq});
  p.k_index = dev(ki);
  p.k_pos = dev(kp).view({B, Lk});
  p.out_index = dev(out);
  return p;
}

at::Tensor padded_attention(const PaddedLayout& layout, const at::Tensor& q_src, const at::Tensor& k_src,
                            const at::Tensor& v_src, bool full, int64_t window) {
  const int64_t B = layout.num_problems, Lq = layout.max_queries, Lk = layout.max_keys;
  const int64_t Hq = q_src.size(1), hd = q_src.size(2), Hkv = k_src.size(1), group = Hq / Hkv;
  at::Tensor q = q_src.index_select(0, layout.q_index).view({B, Lq, Hq, hd});
  at::Tensor k = k_src.index_select(0, layout.k_index).view({B, Lk, Hkv, hd}).transpose(1, 2);
  at::Tensor v = v_src.index_select(0, layout.k_index).view({B, Lk, Hkv, hd}).transpose(1, 2);
  at::Tensor qpos = layout.q_pos.unsqueeze(2), kpos = layout.k_pos.unsqueeze(1);  // [B, Lq, 1], [B, 1, Lk]
  at::Tensor allowed = kpos.ge(0).logical_and(kpos.le(qpos));
  if (!full) allowed = allowed.logical_and(kpos.gt(qpos - window));
  // Pad queries see key column 0: finite rows, thrown away, with zero gradient (no NaN to leak).
  at::Tensor col0 = at::arange(Lk, layout.k_pos.options()).eq(0).view({1, 1, Lk});
  allowed = allowed.logical_or(qpos.lt(0).logical_and(col0)).unsqueeze(1);  // [B, 1, Lq, Lk]
  const double scale = 1.0 / std::sqrt(double(hd));
  const double masked = -std::numeric_limits<double>::infinity();
  if (Lq == 1 && !q.is_cuda()) {
    // A decode batch on the CPU: each KV head's `group` query heads as rows against its keys,
    // unexpanded (q head h reads KV head h / group, as repeat_interleave gives), where the
    // expansion would copy every cached key and value `group` times (at 64 sequences of 1K
    // tokens, half a GB per layer). Prefill and training keep the expanded form: there the
    // queries are as many as the keys, and the gradient tests pin its numerics.
    at::Tensor qg = q.view({B, Hkv, group, hd});
    at::Tensor scores = at::matmul(qg, k.transpose(2, 3)).to(acc_dtype(q.scalar_type())) * scale;  // [B, Hkv, group, Lk]
    at::Tensor p = at::softmax(scores.masked_fill(allowed.logical_not(), masked), -1).to(q.scalar_type());
    return at::matmul(p, v).view({B, Hq, hd}).index_select(0, layout.out_index);
  }
  q = q.transpose(1, 2);
  k = k.repeat_interleave(group, 1);
  v = v.repeat_interleave(group, 1);
  at::Tensor o;
#if KILN_TORCH_AT_LEAST(2, 0)
  if (q.is_cuda()) o = at::scaled_dot_product_attention(q, k, v, allowed);
#endif
  if (!o.defined()) {
    at::Tensor scores = at::matmul(q, k.transpose(2, 3)).to(acc_dtype(q.scalar_type())) * scale;
    o = at::matmul(at::softmax(scores.masked_fill(allowed.logical_not(), masked), -1).to(q.scalar_type()), v);
  }
  return o.transpose(1, 2).reshape({B * Lq, Hq, hd}).index_select(0, layout.out_index);  // o: [B, Hq, Lq, hd]
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return kernels::rms_norm(x, weight, eps);
}

std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& positions, int64_t head_dim,
                                              double theta, at::ScalarType dtype) {
  // Angles in fp64 so that positions near 1M keep their precision.
  auto opts = positions.options().dtype(at::kDouble);
  at::Tensor inv_freq = at::pow(theta, at::arange(0, head_dim, 2, opts) / double(head_dim)).reciprocal();
  at::Tensor ang = positions.to(at::kDouble).unsqueeze(1) * inv_freq.unsqueeze(0);  // [T, hd/2]
  ang = at::cat({ang, ang}, 1);
  return {ang.cos().to(dtype), ang.sin().to(dtype)};
}

at::Tensor AttentionBackend::attend_unrotated(int64_t layer, bool full, const PackedBatch& batch, const at::Tensor& q,
                                              const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                              const at::Tensor& sin) {
  return attend(layer, full, batch, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v);
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return kernels::apply_rope(x, cos, sin);
}

PackedBatch PackedBatch::from_sequences(const std::vector<std::vector<int64_t>>& seqs, at::Device device) {
  PackedBatch b;
  b.cu_seqlens = {0};
  std::vector<int64_t> flat;
  for (const auto& s : seqs) {
    flat.insert(flat.end(), s.begin(), s.end());
    b.cu_seqlens.push_back(int64_t(flat.size()));
  }
  b.tokens = at::tensor(flat, at::kLong).to(device);
  return b;
}

at::Tensor PackedBatch::positions() const {
  std::vector<int64_t> pos(num_tokens());
  for (int64_t s = 0; s < num_sequences(); ++s)
    for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) pos[t] = start_position(s) + t - cu_seqlens[s];
  return at::tensor(pos, at::kLong).to(tokens.device());
}

bool LayerWeights::Lora::experts_grouped() const {
#if KILN_TORCH_AT_LEAST(2, 8)
  const at::Tensor& a = gate_a.defined() ? gate_a : up_a.defined() ? up_a : down_a;
  return a.defined() && a.size(1) % 8 == 0;
#else
  return false;
#endif
}

Muse::Muse(ModelConfig cfg, Weights weights) : cfg_(std::move(cfg)), w_(std::move(weights)) {
  cfg_.validate();
  KILN_CHECK(int64_t(w_.layers.size()) == cfg_.num_layers, "model: weights have ", w_.layers.size(),
             " layers but the config says num_layers=", cfg_.num_layers);
}

namespace {
at::Tensor head_logits(const at::Tensor& hidden, const at::Tensor& lm_head, bool rowwise) {
  return linear(hidden, lm_head, rowwise).to(router_dtype(lm_head.scalar_type()));
}
}  // namespace

at::Tensor Muse::logits(const at::Tensor& hidden, Numerics numerics) const {
  return head_logits(hidden, w_.lm_head, numerics == Numerics::kBitwise);
}

bool piece_flash_available(at::Device d, at::ScalarType t, int64_t hd) { return kernels::flash_varlen_offsets_available(d, t, hd); }

at::Tensor piece_flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
                                 const at::Tensor& cu_k, int64_t max_q, int64_t max_k, int64_t window) {
  return kernels::flash_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, window);
}

at::Tensor packed_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const std::vector<int64_t>& cu_seqlens, int64_t window) {
  FlashPlan flash;
  PaddedLayout padded;
  if (kernels::flash_varlen_available(q.device(), q.scalar_type(), q.size(2)))
    flash = flash_plan(cu_seqlens, q.device());
  else if (cu_seqlens.size() > 2)
    padded = causal_layout(cu_seqlens, q.device());
  return standard_attention(q, k, v, cu_seqlens, window, flash, padded);
}

namespace {

// The batch and the options checked against each other and the model, so that a bad input fails
// with its name before any work.
void check_forward_inputs(const ModelConfig& cfg, const PackedBatch& batch, const ForwardOptions& opt) {
  const int64_t T = batch.num_tokens(), L = cfg.num_layers, k = cfg.top_k;
  KILN_CHECK(T > 0, "forward: the batch holds no tokens; give at least one sequence with tokens");
  KILN_CHECK(batch.tokens.dim() == 1 && batch.tokens.size(0) == T && batch.tokens.scalar_type() == at::kLong,
             "forward: tokens must be int64 [", T, "] to match cu_seqlens (got ", batch.tokens.sizes(), " ",
             batch.tokens.scalar_type(), ")");
  for (int64_t s = 0; s < batch.num_sequences(); ++s) {
    KILN_CHECK(batch.cu_seqlens[s + 1] >= batch.cu_seqlens[s], "forward: cu_seqlens must not decrease (at ", s, ")");
    const int64_t end = (batch.start_positions.empty() ? 0 : batch.start_positions[size_t(s)]) +
                        batch.cu_seqlens[s + 1] - batch.cu_seqlens[s];
    KILN_CHECK(end <= cfg.max_position_embeddings, "forward: sequence ", s, " reaches position ", end,
               ", beyond the model's max_position_embeddings (", cfg.max_position_embeddings, ")");
  }
  KILN_CHECK(batch.start_positions.empty() || int64_t(batch.start_positions.size()) == batch.num_sequences(),
             "forward: start_positions must have one entry per sequence (got ", batch.start_positions.size(),
             " for ", batch.num_sequences(), " sequences)");
  for (int64_t s = 0; s < batch.num_sequences() && !opt.attention; ++s)
    KILN_CHECK(batch.start_position(s) == 0, "forward: sequence ", s, " starts at position ",
               batch.start_position(s), " but no AttentionBackend holds the positions before it");
  if (opt.check_inputs) {
    const int64_t lo = batch.tokens.min().item<int64_t>(), hi = batch.tokens.max().item<int64_t>();
    KILN_CHECK(lo >= 0 && hi < cfg.vocab_size, "forward: token ids must lie in [0, vocab_size) (min=", lo,
               ", max=", hi, ", vocab_size=", cfg.vocab_size, ")");
  }
  if (opt.replay_routing.defined()) {
    const auto& r = opt.replay_routing;
    KILN_CHECK(r.dim() == 3 && r.size(0) == T && r.size(1) == L && r.size(2) == k && r.scalar_type() == at::kByte,
               "forward: replay_routing must be uint8 [tokens=", T, ", layers=", L, ", k=", k, "] (got ",
               r.sizes(), " ", r.scalar_type(), ")");
    const int64_t max_id = r.max().item<int64_t>();
    KILN_CHECK(max_id < cfg.num_experts, "forward: replay_routing holds expert id ", max_id,
               " but num_experts=", cfg.num_experts);
  }
}

// RoPE's cos and sin for the tokens' positions.
std::pair<at::Tensor, at::Tensor> rope_for(const ModelConfig& cfg, const at::Tensor& positions, at::ScalarType dtype,
                                           bool batch_invariant) {
  // Batch-invariant numerics on the CPU: each position's table alone (there cos and sin round by
  // where they sit), once per distinct position, then gathered for the tokens. On CUDA every
  // element's cos and sin are its own wherever it sits (and a captured decode step could not read
  // back how many distinct positions there are).
  auto table = [&](const at::Tensor& pos) { return rope_tables(pos, cfg.head_dim, cfg.rope_theta, dtype); };
  at::Tensor cos, sin;
  if (batch_invariant && !positions.is_cuda()) {
    at::Tensor distinct, index;
    std::tie(distinct, index, std::ignore) = at::_unique2(positions, /*sorted=*/true, /*return_inverse=*/true);
    const at::Tensor both = rowwise_apply(distinct, [&](const at::Tensor& p) {
      const auto t = table(p.reshape({-1}));
      return at::cat({t.first, t.second}, -1);
    });
    const int64_t w = both.size(-1) / 2;
    cos = both.narrow(-1, 0, w).index_select(0, index.reshape({-1}));
    sin = both.narrow(-1, w, w).index_select(0, index.reshape({-1}));
  } else {
    std::tie(cos, sin) = table(positions);
  }
  return {cos, sin};
}

// The targets' log-probs under the head (0 where a target is ignore_index), from the logits when
// they were made (logits_all), else from the hidden states a chunk at a time.
at::Tensor target_logprobs(const ForwardOptions& opt, const at::Tensor& xn, const at::Tensor& head,
                           const at::Tensor& logits_all, int64_t T, int64_t vocab_size, at::Device device) {
  KILN_CHECK(opt.temperature > 0, "forward: temperature must be positive (got ", opt.temperature, ")");
  KILN_CHECK(opt.targets.dim() == 1 && opt.targets.size(0) == T, "forward: targets must be [", T,
             "] (got ", opt.targets.sizes(), ")");
  at::Tensor targets = opt.targets.to(device, at::kLong);
  at::Tensor ignored = targets.eq(opt.ignore_index);
  at::Tensor safe = targets.masked_fill(ignored, 0);
  const int64_t tmax = safe.max().item<int64_t>(), tmin = safe.min().item<int64_t>();
  KILN_CHECK(tmin >= 0 && tmax < vocab_size, "forward: targets must lie in [0, vocab_size) or equal ",
             "ignore_index (min=", tmin, ", max=", tmax, ")");
  std::vector<at::Tensor> lps;
  const int64_t chunk = std::max<int64_t>(1, opt.logprob_chunk);
  for (int64_t a = 0; a < T; a += chunk) {
    const int64_t n = std::min(chunk, T - a);
    // Only the chosen logit and the logsumexp are kept: no [T, V] log-softmax is built (and on
    // CUDA no fp32 copy of the logits: kernels::token_logprobs).
    at::Tensor target = safe.narrow(0, a, n);
    if (opt.bitwise()) {  // as the engine records a sampled token's: each row alone
      at::Tensor logits = logits_all.defined() ? logits_all.narrow(0, a, n) : head_logits(xn.narrow(0, a, n), head, true);
      lps.push_back(rowwise_token_logprobs(logits, target, opt.temperature));
      continue;
    }
    if (!logits_all.defined()) {
      lps.push_back(opt.fused_kernels() ? kernels::token_logprobs(xn.narrow(0, a, n), head, target, opt.temperature)
                                  : kernels::token_logprobs_reference(xn.narrow(0, a, n), head, target,
                                                                      opt.temperature));
      continue;
    }
    at::Tensor logits = logits_all.narrow(0, a, n);
    if (opt.temperature != 1.0) logits = logits / opt.temperature;
    at::Tensor picked = logits.gather(1, target.unsqueeze(1)).squeeze(1);
    lps.push_back(picked - at::logsumexp(logits, {-1}));
  }
  at::Tensor lp = lps.size() == 1 ? lps[0] : at::cat(lps, 0);
  return lp.masked_fill(ignored, 0.0);
}

}  // namespace

ForwardOutput Muse::forward(const PackedBatch& batch, const ForwardOptions& opt) const {
  const int64_t T = batch.num_tokens(), L = cfg_.num_layers;
  check_forward_inputs(cfg_, batch, opt);
  at::Tensor replay = opt.replay_routing.defined() ? opt.replay_routing.to(device(), at::kLong) : at::Tensor();

  if (opt.positions.defined())
    KILN_CHECK(opt.positions.dim() == 1 && opt.positions.size(0) == T && opt.positions.scalar_type() == at::kLong &&
                   opt.positions.device() == device(),
               "forward: positions must be int64 [", T, "] on ", device(), " (got ", opt.positions.sizes(), " ",
               opt.positions.scalar_type(), " on ", opt.positions.device(), ")");
  at::Tensor positions = opt.positions.defined() ? opt.positions : batch.positions();
  at::Tensor cos, sin;
  std::tie(cos, sin) = rope_for(cfg_, positions, dtype(), opt.bitwise());
  // Varlen flash attention where libtorch has it (CUDA bf16); otherwise, for many sequences, one
  // padded attention per layer instead of a loop over sequences.
  FlashPlan flash;
  if (!opt.attention && opt.bitwise()) {
    for (int w = 0; w < 2; ++w) {
      flash.invariant[w] = causal_key_ranges(batch.cu_seqlens, w == 0 ? 0 : cfg_.sliding_window);
      if (device().is_cuda()) flash.invariant[w].upload(device());
    }
  } else if (!opt.attention && opt.fused_kernels() &&
             kernels::flash_varlen_available(device(), dtype(), cfg_.head_dim)) {
    flash = flash_plan(batch.cu_seqlens, device());
  }
  PaddedLayout padded;
  if (!opt.attention && !opt.bitwise() && !flash.cu_seqlens.defined() && batch.num_sequences() > 1)
    padded = causal_layout(batch.cu_seqlens, device());
  const WeightGather* gather = opt.gather;  // sharded dense weights: gathered where they are read
  at::Tensor x = at::embedding(gather ? gather->gather(w_.embed) : w_.embed, batch.tokens);  // [T, d]
  std::vector<at::Tensor> routing;
  at::Tensor balance = opt.load_balance
                           ? at::zeros({}, at::TensorOptions().dtype(router_dtype(dtype())).device(device()))
                           : at::Tensor();
  const LayerContext context{cfg_, batch, cos, sin, padded, flash, opt};
  const auto owned = (opt.recompute || gather) && torch::autograd::GradMode::is_enabled()
                         ? std::make_shared<const OwnedLayerContext>(OwnedLayerContext{cfg_, batch, cos, sin, padded, flash, opt})
                         : nullptr;
  at::Tensor xn;  // the residual stream normed for what reads it next, when the layer before fused that
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor replay_i = replay.defined() ? replay.select(1, i) : at::Tensor();
    const at::Tensor& next_norm = i + 1 < L ? w_.layers[size_t(i + 1)].input_norm : w_.final_norm;
    LayerOut r = owned    ? recomputed_layer(owned, w_.layers[i], i, x, replay_i)
                 : gather ? run_layer(context, gather->gather_layer(i, w_.layers[i]), i, x, replay_i)
                          : run_layer(context, w_.layers[i], i, x, replay_i, xn, next_norm);
    x = r.x;
    xn = r.xn;
    routing.push_back(r.ids);
    if (balance.defined()) balance = balance + r.balance;
  }
  if (!xn.defined()) xn = norm(x, gather ? gather->gather(w_.final_norm) : w_.final_norm, cfg_.rms_norm_eps, opt);
  const at::Tensor head = gather && !opt.skip_head ? gather->gather(w_.lm_head) : w_.lm_head;

  ForwardOutput out;
  out.routing = at::stack(routing, 1).to(at::kByte);  // [T, L, k]
  if (opt.load_balance) out.load_balance_loss = balance / double(L);
  if (opt.skip_head) {
    out.hidden = xn;
    return out;
  }
  if (opt.return_logits) out.logits = head_logits(xn, head, opt.bitwise());
  if (opt.targets.defined()) {
    out.logprobs = target_logprobs(opt, xn, head, out.logits, T, cfg_.vocab_size, device());
  }
  return out;
}

}  // namespace kiln::model
