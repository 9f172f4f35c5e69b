// Batch-invariant forms of the forward's reductions (rollout.numerics: bitwise, issue 22): every
// row, and every query position, is computed alone by a call whose shapes do not depend on the
// batch around it, so the trainer's forward and the rollout engine give the same bits for the same
// token whatever else they run with (batch composition, chunked prefill, preemption).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

namespace kiln::model {

// Rows per call of the chunked batch-invariant forms.
constexpr int64_t kBatchInvariantRows = 64;
// Rows [first, first + n) of x in a fresh zero tensor of `rows` rows (n <= rows): a chunk of one
// fixed shape whatever n is.
at::Tensor padded_rows(const at::Tensor& x, int64_t first, int64_t n, int64_t rows = kBatchInvariantRows);
// x [T, K] . w^T ([N, K]): [T, N] in x's dtype, by GEMMs of a fixed number of rows (zero-padded),
// so that every row goes through the same kernel and reduction order. Differentiable.
at::Tensor rowwise_linear(const at::Tensor& x, const at::Tensor& w);
// f of each row of x alone (a [1, ...] copy of its own), stacked: for elementwise ops such as exp
// or cos, whose vectorised and scalar paths round differently, so that an element's result would
// otherwise depend on where it sits in the tensor (and in the threads' split of it).
at::Tensor rowwise_apply(const at::Tensor& x, const std::function<at::Tensor(const at::Tensor&)>& f);
// SiLU of each row alone (rowwise_apply), differentiable with the plain backward.
at::Tensor rowwise_silu(const at::Tensor& x);
// RMSNorm of each row of x [T, n] alone; weight [n] or one row per row [T, n].
at::Tensor rowwise_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// One query position's attention over exactly the keys it sees, in position order: q [Hq, hd],
// k and v [n, Hkv, hd] -> [Hq, hd] (GQA: query head h reads KV head h / (Hq / Hkv)). Scores and
// softmax in fp32 (fp64 for fp64), the probabilities in q's dtype before the product with v.
at::Tensor query_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
// Causal attention of one sequence, q [n, Hq, hd], k and v [n, Hkv, hd] -> [n, Hq, hd]: query j
// over keys [j - window + 1, j] (window 0: [0, j]), each by query_attention, as the engine's cache
// attention computes it. Differentiable: the backward recomputes the whole sequence's masked
// attention with a graph (its bits do not matter to any log-prob).
at::Tensor causal_query_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t window);
// log softmax(logits[t] / temperature)[targets[t]] of each row of logits [T, V] (fp32 or fp64)
// alone: [T]. Differentiable. The engine records a sampled token's log-prob with the same call.
at::Tensor rowwise_token_logprobs(const at::Tensor& logits, const at::Tensor& targets, double temperature);

}  // namespace kiln::model
