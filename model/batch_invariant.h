// Batch-invariant forms of the forward's reductions (rollout.numerics: bitwise, issue 22): every
// row, and every query position, is computed alone by a call whose shapes do not depend on the
// batch around it, so the trainer's forward and the rollout engine give the same bits for the same
// token whatever else they run with (batch composition, chunked prefill, preemption).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace kiln::model {

// Rows per call of the chunked batch-invariant forms.
constexpr int64_t kBatchInvariantRows = 64;
// Rows [first, first + n) of x in a fresh zero tensor of `rows` rows (n <= rows): a chunk of one
// fixed shape whatever n is.
at::Tensor padded_rows(const at::Tensor& x, int64_t first, int64_t n, int64_t rows = kBatchInvariantRows);
// x [T, K] . w^T ([N, K]): [T, N] in x's dtype, by GEMMs of a fixed number of rows (zero-padded),
// so that every row goes through the same kernel and reduction order; on CUDA one GEMM kernel
// whose reduction order does not depend on T (kernels::invariant_linear_cuda). Differentiable.
at::Tensor rowwise_linear(const at::Tensor& x, const at::Tensor& w);
// Rows sorted by group (an expert's rows together): x [rows, K], w [G, N, K], offsets [G + 1]
// int64 on x's device; group e's rows times w[e]^T -> [rows, N], each row with the bits
// rowwise_linear gives it with w[e] (one launch on CUDA in bf16, else a loop over the groups).
// Rows past offsets[G] belong to no group: zero on the CPU, unwritten on CUDA (their gradient
// too). Differentiable in x and w, with the plain backward.
at::Tensor grouped_rowwise_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offsets);
// f of each row of x alone (a [1, ...] copy of its own), stacked: for elementwise ops such as exp
// or cos, whose vectorised and scalar paths round differently on the CPU, so that an element's
// result would otherwise depend on where it sits in the tensor (and in the threads' split of it).
// On CUDA f(x) at once: a CUDA elementwise kernel runs one code path for every element.
at::Tensor rowwise_apply(const at::Tensor& x, const std::function<at::Tensor(const at::Tensor&)>& f);
// SiLU with each element computed alone: one scalar expression per element on the CPU (whose
// vector path rounds differently), the elementwise kernel on CUDA. Differentiable, with the plain
// backward.
at::Tensor rowwise_silu(const at::Tensor& x);
// RMSNorm of each row of x [T, n] alone; weight [n] or one row per row [T, n]. On CUDA (float,
// bf16) the forward kernel, a block per row; the gradient is the reference's.
at::Tensor rowwise_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// One query position's attention over exactly the keys it sees, in position order: q [Hq, hd],
// k and v [n, Hkv, hd] -> [Hq, hd] (GQA: query head h reads KV head h / (Hq / Hkv)). Scores and
// softmax in fp32 (fp64 for fp64), the probabilities in q's dtype before the product with v.
at::Tensor query_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
// Which keys each query of a batch-invariant attention reads: entries [begin[i], begin[i] +
// count[i]) of a key list, in order. Without a table the list is the main keys' rows; with one,
// entry r is row table[r] of the main keys when >= 0 and row -1 - table[r] of the fresh keys when
// < 0 (the engine: cached rows, then the step's new ones, without gathering them).
struct KeyRanges {
  std::vector<int64_t> begin, count, table;
  at::Tensor packed;  // int32 [begin | count | table] on the device, after upload(); change nothing after it
  // The key counts the uploaded ranges were last checked against (ranged_attention checks them once).
  mutable int64_t checked_main = -1, checked_fresh = -1;
  void upload(at::Device device);
};
// Each query of q [n, Hq, hd] over its keys (KeyRanges) of k, v (main) and kf, vf (fresh; may be
// undefined without a table), [*, Hkv, hd]: per (query, head) the keys in order with an online
// softmax in fp32 (fp64 for fp64), a C++ loop on the CPU and one kernel on CUDA
// (kernels::ranged_attention_cuda); query_attention is the same function by ATen ops, rounded
// differently. The engine's cache attention and the trainer's forward both come here. Not
// differentiable.
at::Tensor ranged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kf,
                            const at::Tensor& vf, const KeyRanges& ranges);
// The keys of each query of packed sequences (cu_seqlens [S + 1]) under causal attention: query j
// of a sequence over its rows [j - window + 1, j] (window 0: [0, j]). Built once per forward and
// uploaded for every layer of that window.
KeyRanges causal_key_ranges(const std::vector<int64_t>& cu_seqlens, int64_t window);
// Causal attention of packed sequences, q [T, Hq, hd], k and v [T, Hkv, hd] -> [T, Hq, hd], over
// `ranges` (causal_key_ranges of the same cu_seqlens and window), by ranged_attention, as the
// engine's cache attention computes it. Differentiable: the backward recomputes the standard
// attention (model::packed_causal_attention) with a graph; its bits reach no log-prob.
at::Tensor causal_query_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const std::vector<int64_t>& cu_seqlens, int64_t window, const KeyRanges& ranges);
// x.index_select(0, index), whose backward gathers instead of scattering (no atomics, a fixed
// order): every row r of x went to exactly `per` rows of the result, back[r * per + j], so its
// gradient is their sum over j. For the MoE's moves of rows between token and expert order.
at::Tensor gather_rows(const at::Tensor& x, const at::Tensor& index, const at::Tensor& back, int64_t per);
// table.index_select(0, ids) for a small table (the per-expert norm weights [E, d] picked per
// slot), whose gradient is one GEMM with the one-hot ids, not scattered adds that collide.
at::Tensor table_rows(const at::Tensor& table, const at::Tensor& ids);
// values' bits forward (values themselves, aliased: do not modify the result in place), while
// the gradient flows into `differentiable` (the plain form of the same function at the same
// inputs) as if it had produced them: for forms whose backward is the plain one. values must not
// require a gradient.
at::Tensor straight_through(const at::Tensor& values, const at::Tensor& differentiable);
// log softmax(logits[t] / temperature)[targets[t]] of each row of logits [T, V] (fp32 or fp64)
// alone: [T]. Differentiable. The engine records a sampled token's log-prob with the same call.
at::Tensor rowwise_token_logprobs(const at::Tensor& logits, const at::Tensor& targets, double temperature);

}  // namespace kiln::model
