// Decode attention over a paged KV cache: one query token per sequence, keys found through a block
// table (full-attention layers) or a ring of blocks (window layers). ATen reference + CUDA kernel.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kiln::kernels {

// q [N, Hq, hd]; k_cache, v_cache [rows, Hkv, hd] with rows = blocks * block_size, q's dtype.
// block_table [N, cols] int64: the physical block of each logical block of sequence n.
// positions [N] int64: the query's position; it attends to its keys at positions [lo, pos], where
// lo = 0 when window == 0 and max(0, pos - window + 1) otherwise. ring == 0: logical block b is
// column b; ring > 0: column b % ring (a window layer's ring). The query's own key must already be
// in the cache. Returns [N, Hq, hd] in q's dtype; softmax in fp32 (fp64 for fp64).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& positions, int64_t block_size,
                                  int64_t window, int64_t ring);
// The reference: gathers each sequence's keys and runs a plain softmax (host loop; for tests).
at::Tensor paged_decode_attention_reference(const at::Tensor& q, const at::Tensor& k_cache,
                                            const at::Tensor& v_cache, const at::Tensor& block_table,
                                            const at::Tensor& positions, int64_t block_size, int64_t window,
                                            int64_t ring);
// Whether the CUDA kernel handles this shape: fp32 or bf16, head_dim 16/32/64/128/256, and a GQA
// group (Hq / Hkv) of at most 16 whose partial sums fit in 48 KiB of shared memory.
bool paged_decode_attention_cuda_supports(at::ScalarType dtype, int64_t head_dim, int64_t group);
// The CUDA kernels: SIMT (fp32 and bf16, every supported shape) and, for bf16 with head_dim 64 or
// 128, tensor cores (the group's query heads as an MMA's rows; P rounded to bf16 before P.V).
enum class PagedDecodeKernel { kAuto, kSimt, kTensorCores };
// The CUDA kernel (kAuto: tensor cores where they apply); throws in builds without CUDA or for
// unsupported shapes. No host sync.
at::Tensor paged_decode_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& block_table, const at::Tensor& positions,
                                       int64_t block_size, int64_t window, int64_t ring,
                                       PagedDecodeKernel kernel = PagedDecodeKernel::kAuto);

}  // namespace kiln::kernels
