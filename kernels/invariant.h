// Batch-invariant CUDA kernels for rollout.numerics: bitwise (model/batch_invariant.h uses them on
// the GPU): a GEMM and a ranged attention whose rows do not depend on the batch around them. The
// CPU forms, and the references the tests hold them to, are in model/batch_invariant.h.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>

namespace kiln::kernels {

// The instructions of the bf16 tensor-core GEMMs below: "wgmma" (Hopper's warpgroup MMA, the
// default where it runs) or "mma" (mma.sync). Rows' bits do not depend on the batch under either;
// the two gave the same bits on the H200, but a process uses one throughout. invariant_gemm: the
// instructions the next GEMM uses. set_invariant_gemm ("auto", "mma" or "wgmma"; the recipe's
// kernels.bitwise_gemm, the flag --bitwise-gemm) returns the previous setting and refuses other
// names; builds without CUDA have mma alone.
std::string invariant_gemm();
std::string set_invariant_gemm(const std::string& name);
// Whether wgmma runs on the current device: compute capability 9.0 and a build for sm_90a.
bool invariant_wgmma_available();

// Whether the kernels below serve t: a CUDA build and t on CUDA in float32, bfloat16 or float64.
bool invariant_kernels_serve(const at::Tensor& t);

// x [T, K] . w [N, K]^T -> [T, N] in x's dtype; fp32 accumulation (fp64 for fp64). Each row is
// summed over K in one fixed order whatever T is. No autograd. Throws where it does not serve.
at::Tensor invariant_linear_cuda(const at::Tensor& x, const at::Tensor& w);

// Rows sorted by group: x [rows, K], w [G, N, K], offsets [G + 1] int64 on x's device (0, ...,
// at most rows; rows past offsets[G] are left unwritten): group e's rows [offsets[e],
// offsets[e + 1]) times w[e]^T -> [rows, N], each row the bits
// invariant_linear_cuda gives it with w[e], in one launch without a host sync. Where
// invariant_grouped_linear_serves(x, w): bf16, K % 8 == 0, 16-byte aligned. No autograd.
bool invariant_grouped_linear_serves(const at::Tensor& x, const at::Tensor& w);
at::Tensor invariant_grouped_linear_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offsets);

// q [n, Hq, hd]; k and v [*, Hkv, hd] (Hkv divides Hq, hd <= 256); ranges int32 on q's device,
// [2n + m]: begin [n], count [n], then a table [m] (m = table_size, 0: none). Query i attends over
// entries [begin[i], begin[i] + count[i]) of a key list, in order, scores and softmax in fp32 (fp64
// for fp64). Entry r is row r of k, v without a table; with one, row table[r] of k, v when >= 0 and
// row -1 - table[r] of kf, vf (the second source, [*, Hkv, hd]) when < 0. -> [n, Hq, hd]. No autograd.
at::Tensor ranged_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kf,
                                 const at::Tensor& vf, const at::Tensor& ranges, int64_t table_size);

}  // namespace kiln::kernels
