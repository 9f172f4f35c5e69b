// Batch-invariant reductions (batch_invariant.h): rows through calls of one fixed shape, in
// zero-padded chunks where every step is exact IEEE arithmetic, one row at a time where it is not.
// Every chunk or row is a fresh tensor, so that its alignment, like its shape, is the same wherever
// it came from.
#include "model/batch_invariant.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "kernels/rms_norm.h"

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

// The batch-invariant linear: the forward in fixed-size GEMMs, the backward (which the rollout
// never runs, and whose bits no log-prob depends on) as two plain GEMMs over all rows.
struct FixedRowsLinear : public torch::autograd::Function<FixedRowsLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w) {
    ctx->save_for_backward({x, w});
    const at::Tensor wc = w.contiguous();
    return chunked(x, [&](const at::Tensor& c, int64_t, int64_t) { return at::linear(c, wc); });
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor g = grads[0].contiguous();
    return {g.matmul(saved[1]), g.t().matmul(saved[0])};
  }
};

// Standard masked attention of one sequence with GQA (the backward of causal_query_attention).
at::Tensor masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t window) {
  const int64_t n = q.size(0), group = q.size(1) / k.size(1);
  const double scale = 1.0 / std::sqrt(double(q.size(2)));
  at::Tensor qh = q.transpose(0, 1);                                   // [Hq, n, hd]
  at::Tensor kh = k.transpose(0, 1).repeat_interleave(group, 0);       // [Hq, n, hd]
  at::Tensor vh = v.transpose(0, 1).repeat_interleave(group, 0);
  at::Tensor scores = at::matmul(qh, kh.transpose(1, 2)).to(acc_of(q.scalar_type())) * scale;  // [Hq, n, n]
  at::Tensor i = at::arange(n, q.options().dtype(at::kLong)).unsqueeze(1), j = i.t();
  at::Tensor allowed = j.le(i);
  if (window > 0) allowed = allowed.logical_and(j.gt(i - window));
  scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(scores, -1).to(q.scalar_type()), vh).transpose(0, 1);  // [n, Hq, hd]
}

struct CausalQueryAttention : public torch::autograd::Function<CausalQueryAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, int64_t window) {
    ctx->save_for_backward({q, k, v});
    ctx->saved_data["window"] = window;
    std::vector<at::Tensor> rows;
    rows.reserve(size_t(q.size(0)));
    for (int64_t j = 0; j < q.size(0); ++j) {
      const int64_t lo = window > 0 ? std::max<int64_t>(0, j - window + 1) : 0;
      rows.push_back(query_attention(q[j], k.narrow(0, lo, j - lo + 1), v.narrow(0, lo, j - lo + 1)));
    }
    return at::stack(rows);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::AutoGradMode on(true);
    at::Tensor q = saved[0].detach().requires_grad_(true), k = saved[1].detach().requires_grad_(true),
               v = saved[2].detach().requires_grad_(true);
    const at::Tensor o = masked_attention(q, k, v, ctx->saved_data["window"].toInt());
    const auto g = torch::autograd::grad({o}, {q, k, v}, {grads[0]});
    return {g[0], g[1], g[2], at::Tensor()};
  }
};

struct RowwiseSilu : public torch::autograd::Function<RowwiseSilu> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    ctx->save_for_backward({x});
    return rowwise_apply(x, [](const at::Tensor& r) { return at::silu(r); });
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const at::Tensor s = at::sigmoid(x);
    return {grads[0] * s * (1 + x * (1 - s))};
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

at::Tensor causal_query_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t window) {
  KILN_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == q.size(0),
             "causal_query_attention: q [n, Hq, hd], k and v [n, Hkv, hd] (got ", q.sizes(), ", ", k.sizes(), ")");
  if (q.size(0) == 0) return q * 1;
  return CausalQueryAttention::apply(q, k, v, window);
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

at::Tensor rowwise_apply(const at::Tensor& x, const std::function<at::Tensor(const at::Tensor&)>& f) {
  if (x.size(0) == 0) return f(x);
  std::vector<at::Tensor> rows;
  rows.reserve(size_t(x.size(0)));
  for (int64_t i = 0; i < x.size(0); ++i) rows.push_back(f(own_row(x, i).unsqueeze(0)));
  return at::cat(rows);
}

at::Tensor rowwise_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  KILN_CHECK(x.dim() == 2 && (weight.dim() == 1 || weight.sizes() == x.sizes()), "rowwise_rms_norm: x [T, n] and ",
             "weight [n] or [T, n] (got ", x.sizes(), " and ", weight.sizes(), ")");
  if (x.size(0) == 0) return x * 1;
  // x * 1/sqrt(mean(x * x) + eps) * w: exact IEEE steps, so fixed-size chunks suffice.
  return chunked(x, [&](const at::Tensor& c, int64_t a, int64_t n) {
    return kernels::rms_norm_reference(c, weight.dim() == 1 ? weight : padded_rows(weight, a, n), eps);
  });
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

}  // namespace kiln::model
