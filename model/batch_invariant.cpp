// Batch-invariant reductions (batch_invariant.h): each row through its own call of fixed shape.
// A row is copied into a fresh tensor first, so that its alignment, like its shape, is the same
// wherever it came from.
#include "model/batch_invariant.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/rms_norm.h"

namespace kiln::model {
namespace {

at::Tensor own_row(const at::Tensor& x, int64_t i) { return x.select(0, i).clone(at::MemoryFormat::Contiguous); }

at::ScalarType acc_of(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

constexpr int64_t kLinearRows = 64;  // rows per GEMM of rowwise_linear

}  // namespace

at::Tensor rowwise_linear(const at::Tensor& x, const at::Tensor& w) {
  KILN_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "rowwise_linear: x [T, K] and w [N, K] (got ",
             x.sizes(), " and ", w.sizes(), ")");
  const int64_t T = x.size(0);
  if (T == 0) return at::empty({0, w.size(0)}, x.options());
  // Every GEMM multiplies exactly kLinearRows rows (the last chunk padded with zeros), in a fresh
  // tensor: the library then picks one kernel, one tiling and one reduction order over K for every
  // call, and a row's result depends on its own values alone, not on its neighbours or its place.
  const at::Tensor wc = w.contiguous();
  std::vector<at::Tensor> parts;
  parts.reserve(size_t((T + kLinearRows - 1) / kLinearRows));
  for (int64_t a = 0; a < T; a += kLinearRows) {
    const int64_t n = std::min(kLinearRows, T - a);
    at::Tensor chunk = at::zeros({kLinearRows, x.size(1)}, x.options());
    chunk = chunk.index_copy(0, at::arange(n, x.options().dtype(at::kLong)), x.narrow(0, a, n));
    parts.push_back(at::linear(chunk, wc).narrow(0, 0, n));
  }
  return parts.size() == 1 ? parts[0] : at::cat(parts);
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
  std::vector<at::Tensor> rows;
  rows.reserve(size_t(x.size(0)));
  for (int64_t i = 0; i < x.size(0); ++i) {
    const at::Tensor w = weight.dim() == 1 ? weight : own_row(weight, i);
    rows.push_back(kernels::rms_norm_reference(own_row(x, i).unsqueeze(0), w, eps).squeeze(0));
  }
  return at::stack(rows);
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
  const at::Tensor ids = targets.to(at::kCPU, at::kLong);
  std::vector<at::Tensor> rows;
  rows.reserve(size_t(logits.size(0)));
  for (int64_t i = 0; i < logits.size(0); ++i) {
    at::Tensor row = own_row(logits, i);
    if (temperature != 1.0) row = row / temperature;
    rows.push_back(row.select(0, ids[i].item<int64_t>()) - at::logsumexp(row, {0}));
  }
  return at::stack(rows);
}

}  // namespace kiln::model
