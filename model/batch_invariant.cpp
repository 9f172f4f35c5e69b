// Batch-invariant reductions (batch_invariant.h): rows through calls of one fixed shape, in
// zero-padded chunks where every step is exact IEEE arithmetic, one row at a time where it is not.
// Every chunk or row is a fresh tensor, so that its alignment, like its shape, is the same wherever
// it came from.
#include "model/batch_invariant.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "core/torch_version.h"
#include "kernels/invariant.h"
#include "kernels/rms_norm.h"
#include "model/muse.h"

namespace kiln::model {
namespace {

at::Tensor own_row(const at::Tensor& x, int64_t i) { return x.select(0, i).clone(at::MemoryFormat::Contiguous); }

at::ScalarType acc_of(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// f over x's rows in chunks of exactly kBatchInvariantRows rows (the last one padded with zero rows), each
// a fresh tensor: the library then picks one kernel, one tiling and one reduction order for every
// call, and a row's result depends on its own values alone, not on its neighbours or its place.
// For ops whose per-row arithmetic is exact IEEE (GEMM sums, x * x, the mean, 1 / sqrt), not for
// exp or cos (their vectorised and scalar paths differ: rowwise_apply).
at::Tensor chunked(const at::Tensor& x, const std::function<at::Tensor(const at::Tensor&, int64_t, int64_t)>& f) {
  const int64_t T = x.size(0), R = kBatchInvariantRows;
  std::vector<at::Tensor> parts;
  parts.reserve(size_t((T + R - 1) / R));
  for (int64_t a = 0; a < T; a += R) {
    const int64_t n = std::min(R, T - a);
    parts.push_back(f(padded_rows(x, a, n), a, n).narrow(0, 0, n));
  }
  return parts.size() == 1 ? parts[0] : at::cat(parts);
}

// x [M, K] . w^T on the CPU with every output one accumulator (fp32, fp64 for fp64) that adds
// x[t, k] * w[n, k] for k in order: a row's bits are its own on any CPU, with any BLAS (a BLAS's
// kernel for a row can depend on where the row sits in its tile, and differs between CPUs).
// Vectorisable across n (w transposed, in the accumulator's type, once), never across k; rows go
// four at a time so that each row of w^T is read once per four.
at::Tensor cpu_rows_linear(const at::Tensor& x, const at::Tensor& w) {
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  const at::ScalarType acc_type = acc_of(x.scalar_type());
  const at::Tensor xa = x.to(acc_type).contiguous(), wt = w.t().to(acc_type).contiguous();  // [K, N]
  at::Tensor y = at::empty({M, N}, x.options().dtype(acc_type));
  AT_DISPATCH_FLOATING_TYPES(acc_type, "cpu_rows_linear", [&] {
    using Acc = scalar_t;
    constexpr int64_t R = 4;
    const Acc* xp = xa.data_ptr<Acc>();
    const Acc* wp = wt.data_ptr<Acc>();
    Acc* yp = y.data_ptr<Acc>();
    at::parallel_for(0, (M + R - 1) / R, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t t0 = b * R, rows = std::min(R, M - t0);
        Acc* out = yp + t0 * N;  // the accumulators: y's own rows
        std::fill(out, out + rows * N, Acc(0));
        for (int64_t k = 0; k < K; ++k) {
          const Acc* wk = wp + k * N;
          for (int64_t r = 0; r < rows; ++r) {
            const Acc xv = xp[(t0 + r) * K + k];
            Acc* o = out + r * N;
            for (int64_t n = 0; n < N; ++n) o[n] += xv * wk[n];
          }
        }
      }
    });
  });
  return y.to(x.scalar_type());
}

// The batch-invariant linear: the forward by rows whose bits are their own (CUDA: one GEMM kernel
// whose reduction order does not depend on M; the CPU: cpu_rows_linear), the backward (which the
// rollout never runs, and whose bits no log-prob depends on) as two plain GEMMs over all rows.
struct FixedRowsLinear : public torch::autograd::Function<FixedRowsLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w) {
    ctx->save_for_backward({x, w});
    if (kernels::invariant_kernels_serve(x)) return kernels::invariant_linear_cuda(x, w);
    KILN_CHECK(x.is_cpu(), "rowwise_linear: tensors on ", x.device(), " need kiln's CUDA kernels (a CUDA build)");
    return cpu_rows_linear(x, w);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor g = grads[0].contiguous();
    return {g.matmul(saved[1]), g.t().matmul(saved[0])};
  }
};

// The grouped form: one launch where the kernel serves, else rowwise_linear per group; the
// backward two plain GEMMs per group.
struct GroupedRowsLinear : public torch::autograd::Function<GroupedRowsLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& offsets) {
    ctx->save_for_backward({x, w, offsets});
    const at::Tensor xc = x.contiguous(), wc = w.contiguous();
    if (kernels::invariant_grouped_linear_serves(xc, wc)) return kernels::invariant_grouped_linear_cuda(xc, wc, offsets);
    const at::Tensor host = offsets.cpu();
    const int64_t* o = host.data_ptr<int64_t>();
    at::Tensor y = at::zeros({x.size(0), w.size(1)}, x.options());  // rows past the groups stay zero
    for (int64_t e = 0; e < w.size(0); ++e)
      if (o[e + 1] > o[e]) y.narrow(0, o[e], o[e + 1] - o[e]).copy_(rowwise_linear(xc.narrow(0, o[e], o[e + 1] - o[e]), wc[e]));
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const at::Tensor g = grads[0].contiguous();
    // Only the gradients wanted (frozen experts under LoRA want none for w).
    const bool want_dx = ctx->needs_input_grad(0), want_dw = ctx->needs_input_grad(1);
#if KILN_TORCH_AT_LEAST(2, 8)
    // On CUDA in bf16, torch's grouped GEMM, no host sync: dx = g_e . w_e for each group's rows
    // (offsets along M), dw_e = g_e^T . x_e (offsets along the contraction). Its rounding is as
    // good as any: no log-prob reads a gradient's bits.
    if (g.is_cuda() && g.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && w.size(1) % 8 == 0 &&
        w.size(2) % 8 == 0) {
      const at::Tensor& offsets = saved[2];
      const at::Tensor ends = offsets.narrow(0, 1, w.size(0)).to(at::kInt);
      at::Tensor dw;
      if (want_dw) {
        // A group without rows gets zeros, whatever the kernel leaves there (pytorch#172439).
        const at::Tensor has_rows = (offsets.narrow(0, 1, w.size(0)) > offsets.narrow(0, 0, w.size(0))).view({-1, 1, 1});
        dw = at::where(has_rows, at::_grouped_mm(g.t(), x.contiguous(), ends), at::zeros({}, w.options()));
      }
      return {want_dx ? at::_grouped_mm(g, w.contiguous(), ends) : at::Tensor(), dw, at::Tensor()};
    }
#endif
    const at::Tensor host = saved[2].cpu();
    const int64_t* o = host.data_ptr<int64_t>();
    // dx: one grouped launch over the transposed stack where the kernel serves; dw: a GEMM per
    // group.
    const at::Tensor wt = want_dx ? w.transpose(1, 2).contiguous() : at::Tensor();
    const bool grouped_dx = want_dx && kernels::invariant_grouped_linear_serves(g, wt);
    at::Tensor dx = grouped_dx ? kernels::invariant_grouped_linear_cuda(g, wt, saved[2])
                    : want_dx  ? at::zeros_like(x)
                               : at::Tensor();
    at::Tensor dw = want_dw ? at::zeros_like(w) : at::Tensor();
    for (int64_t e = 0; e < w.size(0); ++e) {
      if (o[e + 1] == o[e]) continue;
      const at::Tensor ge = g.narrow(0, o[e], o[e + 1] - o[e]);
      if (want_dx && !grouped_dx) {
        at::Tensor dxe = dx.narrow(0, o[e], o[e + 1] - o[e]);
        at::mm_out(dxe, ge, w[e]);
      }
      if (want_dw) {
        at::Tensor dwe = dw[e];
        at::mm_out(dwe, ge.t(), x.narrow(0, o[e], o[e + 1] - o[e]));
      }
    }
    return {dx, dw, at::Tensor()};
  }
};

}  // namespace

KeyRanges causal_key_ranges(const std::vector<int64_t>& cu_seqlens, int64_t window) {
  KeyRanges r;
  r.begin.reserve(size_t(cu_seqlens.back()));
  r.count.reserve(size_t(cu_seqlens.back()));
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s)
    for (int64_t j = 0; j < cu_seqlens[s + 1] - cu_seqlens[s]; ++j) {
      const int64_t lo = window > 0 ? std::max<int64_t>(0, j - window + 1) : 0;
      r.begin.push_back(cu_seqlens[s] + lo);
      r.count.push_back(j - lo + 1);
    }
  return r;
}

namespace {

struct CausalQueryAttention : public torch::autograd::Function<CausalQueryAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const std::vector<int64_t>& cu_seqlens, int64_t window,
                            const KeyRanges& ranges) {
    ctx->save_for_backward({q, k, v});
    ctx->saved_data["window"] = window;
    ctx->saved_data["cu_seqlens"] = c10::List<int64_t>(cu_seqlens);
    return ranged_attention(q, k, v, at::Tensor(), at::Tensor(), ranges);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const int64_t window = ctx->saved_data["window"].toInt();
    const c10::List<int64_t> cu = ctx->saved_data["cu_seqlens"].toIntList();
    at::AutoGradMode on(true);
    at::Tensor q = saved[0].detach().requires_grad_(true), k = saved[1].detach().requires_grad_(true),
               v = saved[2].detach().requires_grad_(true);
    // The standard forward's attention (varlen flash, one padded batch, or sequence by sequence).
    const at::Tensor o = packed_causal_attention(q, k, v, std::vector<int64_t>(cu.begin(), cu.end()), window);
    const auto g = torch::autograd::grad({o}, {q, k, v}, {grads[0]});
    return {g[0], g[1], g[2], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// ranged_attention on the CPU (contiguous tensors): per (query, head) the keys in order, the score
// a sum over head dims in order, an online softmax in Acc (fp32, fp64 for fp64).
at::Tensor ranged_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kf,
                                const at::Tensor& vf, const KeyRanges& r) {
  const int64_t n = q.size(0), Hq = q.size(1), hd = q.size(2), Hkv = k.size(1), group = Hq / Hkv;
  at::Tensor o = at::empty(q.sizes(), q.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "ranged_attention_cpu", [&] {
    using Acc = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t *qp = q.data_ptr<scalar_t>(), *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
    const scalar_t *kfp = kf.defined() ? kf.data_ptr<scalar_t>() : nullptr, *vfp = vf.defined() ? vf.data_ptr<scalar_t>() : nullptr;
    scalar_t* op = o.data_ptr<scalar_t>();
    const Acc scale = Acc(1.0 / std::sqrt(double(hd)));
    at::parallel_for(0, n * Hq, 1, [&](int64_t from, int64_t to) {
      std::vector<Acc> acc(static_cast<size_t>(hd));
      for (int64_t pair = from; pair < to; ++pair) {
        const int64_t i = pair / Hq, h = pair % Hq, kvh = h / group;
        const scalar_t* qi = qp + (i * Hq + h) * hd;
        std::fill(acc.begin(), acc.end(), Acc(0));
        Acc m = -std::numeric_limits<Acc>::infinity(), l = 0;
        for (int64_t j = 0; j < r.count[size_t(i)]; ++j) {
          int64_t key = r.begin[size_t(i)] + j;
          const scalar_t *kb = kp, *vb = vp;
          if (!r.table.empty()) {
            const int64_t e = r.table[size_t(key)];
            key = e >= 0 ? e : -1 - e;
            if (e < 0) kb = kfp, vb = vfp;
          }
          const scalar_t *kr = kb + (key * Hkv + kvh) * hd, *vr = vb + (key * Hkv + kvh) * hd;
          Acc sc = 0;
          for (int64_t d = 0; d < hd; ++d) sc += Acc(qi[d]) * Acc(kr[d]);
          sc *= scale;
          const Acc mn = std::max(m, sc), corr = std::exp(m - mn), e = std::exp(sc - mn);
          l = l * corr + e;
          for (int64_t d = 0; d < hd; ++d) acc[size_t(d)] = acc[size_t(d)] * corr + e * Acc(vr[d]);
          m = mn;
        }
        scalar_t* out = op + (i * Hq + h) * hd;
        for (int64_t d = 0; d < hd; ++d) out[d] = scalar_t(l > 0 ? acc[size_t(d)] / l : Acc(0));
      }
    });
  });
  return o;
}

// straight_through's node. `values` is returned as it is (autograd gives the output an alias of
// it with this node), not copied: it is a fresh result no one else writes.
struct ValuesOf : public torch::autograd::Function<ValuesOf> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& values, const at::Tensor&) {
    return values;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {at::Tensor(), grads[0]};
  }
};

// rowwise_rms_norm's node: the values come from the batch-invariant forward; the gradient is the
// one autograd takes through kernels::rms_norm_reference at (x, weight), by its formula
// (kernels::rms_norm_backward: on CUDA the backward kernels, a block per row), so the forward
// neither recomputes the reference nor keeps its fp32 intermediates (per-row weights are the
// experts' norms, over every slot).
struct RmsNormGradOf : public torch::autograd::Function<RmsNormGradOf> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& values, const at::Tensor& x,
                            const at::Tensor& weight, double eps) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["eps"] = eps;
    return values;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw] = kernels::rms_norm_backward(saved[0], saved[1], grads[0], ctx->saved_data["eps"].toDouble(),
                                               ctx->needs_input_grad(1), ctx->needs_input_grad(2));
    return {at::Tensor(), dx, dw, at::Tensor()};
  }
};

// SiLU on the CPU, x / (1 + exp(-x)) in Acc, one scalar expression per element: no vector path
// whose rounding would depend on where an element sits (ATen's CPU silu has one).
at::Tensor silu_each(const at::Tensor& x) {
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "silu_each", [&] {
    using Acc = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* in = xc.data_ptr<scalar_t>();
    scalar_t* out = y.data_ptr<scalar_t>();
    at::parallel_for(0, xc.numel(), 4096, [&](int64_t from, int64_t to) {
      for (int64_t i = from; i < to; ++i) {
        const Acc v = Acc(in[i]);
        out[i] = scalar_t(v / (Acc(1) + std::exp(-v)));
      }
    });
  });
  return y;
}

struct RowwiseSilu : public torch::autograd::Function<RowwiseSilu> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    ctx->save_for_backward({x});
    // On CUDA an elementwise kernel runs one code path for every element already.
    return x.is_cuda() ? at::silu(x) : silu_each(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // ATen's SiLU gradient, as the standard forward's: in fp32 for bf16, rounded once.
    return {at::silu_backward(grads[0], ctx->get_saved_variables()[0])};
  }
};

// log softmax(logits / T)[target] per row, in the fixed chunks (log_softmax works along each row,
// the division is exact); the backward (1[target] - softmax(logits / T)) / T.
struct RowwiseTokenLogprobs : public torch::autograd::Function<RowwiseTokenLogprobs> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            double temperature) {
    ctx->save_for_backward({logits, targets});
    ctx->saved_data["temperature"] = temperature;
    const at::Tensor ids = targets.to(logits.device(), at::kLong);
    if (logits.is_cuda()) {
      // log_softmax's CUDA kernels take a row per block or warp, chosen by V alone, but the block
      // kernel splits a row by the row's own 16-byte alignment: rows padded with -inf to a
      // multiple of 16 bytes all start aligned, wherever they sit.
      const int64_t per16 = 16 / int64_t(logits.element_size()), pad = (per16 - logits.size(1) % per16) % per16;
      at::Tensor own = pad > 0 ? at::constant_pad_nd(logits, {0, pad}, -std::numeric_limits<double>::infinity())
                       : reinterpret_cast<uintptr_t>(logits.data_ptr()) % 256 == 0 ? logits
                                                                               : logits.clone();
      return at::log_softmax(temperature != 1.0 ? own / temperature : own, -1).gather(1, ids.unsqueeze(1)).squeeze(1);
    }
    return chunked(logits, [&](const at::Tensor& c, int64_t a, int64_t n) {
      const at::Tensor lp = at::log_softmax(temperature != 1.0 ? c / temperature : c, -1);
      at::Tensor picked = at::zeros({c.size(0)}, lp.options());
      picked.narrow(0, 0, n).copy_(lp.narrow(0, 0, n).gather(1, ids.narrow(0, a, n).unsqueeze(1)).squeeze(1));
      return picked;
    });
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const double T = ctx->saved_data["temperature"].toDouble();
    const at::Tensor& logits = saved[0];
    at::Tensor g = -at::softmax(logits / T, -1);
    g.scatter_add_(1, saved[1].to(logits.device(), at::kLong).unsqueeze(1), at::ones({logits.size(0), 1}, g.options()));
    return {g * (grads[0].unsqueeze(1) / T), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor rowwise_silu(const at::Tensor& x) { return x.size(0) == 0 ? at::silu(x) : RowwiseSilu::apply(x); }

at::Tensor causal_query_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const std::vector<int64_t>& cu_seqlens, int64_t window, const KeyRanges& ranges) {
  KILN_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == q.size(0) &&
                 !cu_seqlens.empty() && cu_seqlens.back() == q.size(0),
             "causal_query_attention: q [T, Hq, hd], k and v [T, Hkv, hd], cu_seqlens ending at T (got ", q.sizes(),
             ", ", k.sizes(), ")");
  if (q.size(0) == 0) return q * 1;
  return CausalQueryAttention::apply(q, k, v, cu_seqlens, window, ranges);
}

void KeyRanges::upload(at::Device device) {
  std::vector<int32_t> all;
  all.reserve(begin.size() + count.size() + table.size());
  for (const auto* part : {&begin, &count, &table})
    for (int64_t x : *part) {
      KILN_CHECK(x >= INT32_MIN && x <= INT32_MAX, "KeyRanges: ", x, " does not fit the kernel's int32 ranges");
      all.push_back(int32_t(x));
    }
  packed = at::tensor(c10::ArrayRef<int32_t>(all), at::kInt).to(device);
  checked_main = checked_fresh = -1;
}

at::Tensor ranged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kf,
                            const at::Tensor& vf, const KeyRanges& r) {
  auto kv_like = [&](const at::Tensor& t) {
    return t.dim() == 3 && t.size(1) == k.size(1) && t.size(2) == q.size(2) && t.scalar_type() == q.scalar_type() &&
           t.device() == q.device();
  };
  KILN_CHECK(q.dim() == 3 && k.dim() == 3 && kv_like(k) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 &&
                 v.sizes() == k.sizes() && kv_like(v),
             "ranged_attention: q [n, Hq, hd], k and v [m, Hkv, hd] of q's dtype and device, Hkv dividing Hq (got ",
             q.sizes(), ", ", k.sizes(), ", ", v.sizes(), ")");
  KILN_CHECK(!kf.defined() || (kv_like(kf) && vf.defined() && vf.sizes() == kf.sizes() && kv_like(vf)),
             "ranged_attention: the fresh keys kf and vf must both be [*, Hkv, hd] like k");
  const int64_t list = r.table.empty() ? k.size(0) : int64_t(r.table.size());
  KILN_CHECK(r.begin.size() == size_t(q.size(0)) && r.count.size() == r.begin.size(),
             "ranged_attention: q [n, Hq, hd] and n ranges (got ", q.sizes(), " and ", r.begin.size(), ")");
  const int64_t fresh = kf.defined() ? kf.size(0) : 0;
  if (!r.packed.defined() || r.checked_main != k.size(0) || r.checked_fresh != fresh) {  // uploaded: once, not per layer
    for (size_t i = 0; i < r.begin.size(); ++i)
      KILN_CHECK(r.count[i] > 0 && r.begin[i] >= 0 && r.begin[i] + r.count[i] <= list, "ranged_attention: query ", i,
                 " reads keys [", r.begin[i], ", ", r.begin[i] + r.count[i], ") of ", list);
    for (int64_t e : r.table)
      KILN_CHECK(e >= 0 ? e < k.size(0) : -1 - e < fresh, "ranged_attention: table entry ", e,
                 " is outside the keys (", k.size(0), " main, ", fresh, " fresh)");
    r.checked_main = k.size(0);
    r.checked_fresh = fresh;
  }
  if (kernels::invariant_kernels_serve(q)) {
    KeyRanges local;
    const KeyRanges* up = &r;
    if (!r.packed.defined() || r.packed.device() != q.device()) {
      local = r;
      local.upload(q.device());
      up = &local;
    }
    return kernels::ranged_attention_cuda(q, k, v, kf, vf, up->packed, int64_t(r.table.size()));
  }
  // The CPU: the same walk as the CUDA kernel, one (query, head) at a time, keys in order with an
  // online softmax; each pair's arithmetic is its own whatever the batch or the threads' split.
  KILN_CHECK(q.is_cpu(), "ranged_attention: tensors on ", q.device(), " need kiln's CUDA kernels (a CUDA build)");
  return ranged_attention_cpu(q.contiguous(), k.contiguous(), v.contiguous(),
                              kf.defined() ? kf.contiguous() : at::Tensor(), vf.defined() ? vf.contiguous() : at::Tensor(), r);
}

namespace {

// index_select whose backward gathers: row r of x went to rows back[r * per + j] of the result.
struct GatherRows : public torch::autograd::Function<GatherRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& index,
                            const at::Tensor& back, int64_t per) {
    ctx->save_for_backward({back});
    ctx->saved_data["per"] = per;
    ctx->saved_data["rows"] = x.size(0);
    return x.index_select(0, index);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor back = ctx->get_saved_variables()[0];
    const int64_t per = ctx->saved_data["per"].toInt(), rows = ctx->saved_data["rows"].toInt();
    std::vector<int64_t> shape = grads[0].sizes().vec();
    shape[0] = per;
    shape.insert(shape.begin(), rows);
    const at::Tensor g = grads[0].index_select(0, back);
    return {per == 1 ? g : g.view(shape).sum(1), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Rows of a small table (weight [E, ...]) picked by ids; the table's gradient is GEMMs with the
// one-hot ids (in chunks of rows), in fp32 (fp64 for fp64).
struct TableRows : public torch::autograd::Function<TableRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& table, const at::Tensor& ids) {
    ctx->save_for_backward({ids});
    ctx->saved_data["rows"] = table.size(0);
    return table.index_select(0, ids);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor ids = ctx->get_saved_variables()[0];
    const at::Tensor& g = grads[0];
    const at::ScalarType acc = acc_of(g.scalar_type());
    const int64_t E = ctx->saved_data["rows"].toInt(), n = ids.size(0), width = n > 0 ? g.numel() / n : 0;
    std::vector<int64_t> shape = g.sizes().vec();
    shape[0] = E;
    // In chunks of rows, so that the one-hot stays small whatever the batch.
    constexpr int64_t kChunk = 16384;
    const at::Tensor g2 = g.reshape({n, width});
    at::Tensor dt = at::zeros({E, width}, g.options().dtype(acc));
    for (int64_t a = 0; a < n; a += kChunk) {
      const int64_t c = std::min(kChunk, n - a);
      const at::Tensor one_hot =
          at::zeros({c, E}, g.options().dtype(acc)).scatter_(1, ids.narrow(0, a, c).view({-1, 1}), 1.0);
      dt.addmm_(one_hot.t(), g2.narrow(0, a, c).to(acc));
    }
    return {dt.view(shape).to(g.scalar_type()), at::Tensor()};
  }
};

}  // namespace

at::Tensor gather_rows(const at::Tensor& x, const at::Tensor& index, const at::Tensor& back, int64_t per) {
  KILN_CHECK(per >= 1 && back.dim() == 1 && back.size(0) == x.size(0) * per && index.dim() == 1 &&
                 index.size(0) == back.size(0),
             "gather_rows: x [n, ...] whose every row goes to `per` rows of the result: index and back of n * per ",
             "(got x ", x.sizes(), ", per ", per, ", index ", index.sizes(), ", back ", back.sizes(), ")");
  return GatherRows::apply(x, index, back, per);
}

at::Tensor table_rows(const at::Tensor& table, const at::Tensor& ids) {
  KILN_CHECK(ids.dim() == 1, "table_rows: ids must be a vector (got ", ids.sizes(), ")");
  return TableRows::apply(table, ids);
}

at::Tensor straight_through(const at::Tensor& values, const at::Tensor& differentiable) {
  if (!differentiable.requires_grad()) return values;
  return ValuesOf::apply(values, differentiable);
}

at::Tensor padded_rows(const at::Tensor& x, int64_t first, int64_t n, int64_t rows) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = rows;
  return at::zeros(shape, x.options()).index_copy(0, at::arange(n, x.options().dtype(at::kLong)), x.narrow(0, first, n));
}

at::Tensor rowwise_linear(const at::Tensor& x, const at::Tensor& w) {
  KILN_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "rowwise_linear: x [T, K] and w [N, K] (got ",
             x.sizes(), " and ", w.sizes(), ")");
  if (x.size(0) == 0) return at::empty({0, w.size(0)}, x.options());
  return FixedRowsLinear::apply(x, w);
}

at::Tensor grouped_rowwise_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offsets) {
  KILN_CHECK(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(2) && offsets.dim() == 1 &&
                 offsets.size(0) == w.size(0) + 1 && offsets.scalar_type() == at::kLong,
             "grouped_rowwise_linear: x [rows, K], w [G, N, K] and int64 offsets [G + 1] (got ", x.sizes(), ", ",
             w.sizes(), ", ", offsets.sizes(), ")");
  if (x.size(0) == 0) return at::empty({0, w.size(1)}, x.options());
  return GroupedRowsLinear::apply(x, w, offsets);
}

at::Tensor rowwise_apply(const at::Tensor& x, const std::function<at::Tensor(const at::Tensor&)>& f) {
  if (x.size(0) == 0 || x.is_cuda()) return f(x);
  std::vector<at::Tensor> rows;
  rows.reserve(size_t(x.size(0)));
  for (int64_t i = 0; i < x.size(0); ++i) rows.push_back(f(own_row(x, i).unsqueeze(0)));
  return at::cat(rows);
}

at::Tensor rowwise_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  KILN_CHECK(x.dim() == 2 && (weight.dim() == 1 || weight.sizes() == x.sizes()), "rowwise_rms_norm: x [T, n] and ",
             "weight [n] or [T, n] (got ", x.sizes(), " and ", weight.sizes(), ")");
  if (x.size(0) == 0) return x * 1;
  // The values: on CUDA (float, bf16) the forward kernel, a block per row; elsewhere
  // x * 1/sqrt(mean(x * x) + eps) * w, exact IEEE steps, so fixed-size chunks suffice.
  at::Tensor values;
  {
    at::NoGradGuard no_grad;
    const at::Tensor xd = x.detach(), wd = weight.detach();
    values = x.is_cuda() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16)
                 ? kernels::rms_norm_cuda(xd.contiguous(), wd, eps)
                 : chunked(xd, [&](const at::Tensor& c, int64_t a, int64_t n) {
                     return kernels::rms_norm_reference(c, wd.dim() == 1 ? wd : padded_rows(wd, a, n), eps);
                   });
  }
  // The gradient: the plain norm's, by its formula (one node, not one graph per chunk).
  const bool grad = at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad());
  return grad ? RmsNormGradOf::apply(values, x, weight, eps) : values;
}

at::Tensor query_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  KILN_CHECK(q.dim() == 2 && k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) > 0 && k.size(2) == q.size(1) &&
                 q.size(0) % k.size(1) == 0,
             "query_attention: q [Hq, hd], k and v [n > 0, Hkv, hd] with Hkv dividing Hq (got ", q.sizes(), ", ",
             k.sizes(), ", ", v.sizes(), ")");
  const int64_t Hq = q.size(0), hd = q.size(1), Hkv = k.size(1);
  const double scale = 1.0 / std::sqrt(double(hd));
  at::Tensor qg = q.clone(at::MemoryFormat::Contiguous).view({Hkv, Hq / Hkv, hd});
  at::Tensor kt = k.permute({1, 2, 0}).clone(at::MemoryFormat::Contiguous);  // [Hkv, hd, n]
  at::Tensor vs = v.transpose(0, 1).clone(at::MemoryFormat::Contiguous);    // [Hkv, n, hd]
  at::Tensor scores = at::matmul(qg, kt).to(acc_of(q.scalar_type())) * scale;  // [Hkv, group, n]
  at::Tensor p = at::softmax(scores, -1).to(q.scalar_type());
  return at::matmul(p, vs).reshape({Hq, hd});
}

at::Tensor rowwise_token_logprobs(const at::Tensor& logits, const at::Tensor& targets, double temperature) {
  KILN_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0) && temperature > 0,
             "rowwise_token_logprobs: logits [T, V], targets [T] and a positive temperature (got ", logits.sizes(), ", ",
             targets.sizes(), ", ", temperature, ")");
  if (logits.size(0) == 0) return at::empty({0}, logits.options());
  return RowwiseTokenLogprobs::apply(logits, targets, temperature);
}

Numerics parse_numerics(const std::string& name) {
  if (name == "standard") return Numerics::kStandard;
  KILN_CHECK(name == "bitwise", "numerics: expected standard or bitwise (got '", name, "')");
  return Numerics::kBitwise;
}

const char* numerics_name(Numerics n) { return n == Numerics::kBitwise ? "bitwise" : "standard"; }

}  // namespace kiln::model
