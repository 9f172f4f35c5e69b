// Variable-length causal attention over packed sequences through libtorch's FlashAttention-2
// (aten::_flash_attention_forward, torch >= 2.5 CUDA builds): cu_seqlens instead of a mask, GQA
// without repeating the KV heads, and a left window for the sliding layers. Its derivative is
// libtorch's. Where it is missing (torch 1.13, the CPU, a signature it does not match) callers
// keep their reference attention.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kiln::kernels {

// Whether flash_varlen_attention runs on `device` for `dtype` and `head_dim`: compiled in, a CUDA
// device, bf16 or fp16, a head dim that is a multiple of 8 up to 256, and a one-time probe (a tiny
// forward and backward) succeeded.
bool flash_varlen_available(at::Device device, at::ScalarType dtype, int64_t head_dim);

// q [T, Hq, hd], k and v [T, Hkv, hd] (Hkv divides Hq), sequences packed at cu_seqlens [S + 1]
// int32 on q's device, max_len the longest. Query i of a sequence sees keys j <= i, and within
// `window` of it (i - j < window) unless window <= 0. Returns [T, Hq, hd].
at::Tensor flash_varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens, int64_t max_len, int64_t window);

// Queries and keys of other lengths: sequence s has the queries cu_q[s]..cu_q[s+1] of q and the keys
// cu_k[s]..cu_k[s+1] of k and v, its last query at the position of its last key (a context-parallel
// piece: its own tokens, and keys from earlier in the sequence). Query i of n against m keys sees
// keys j <= i + m - n, within `window` of it unless window <= 0: the bottom-right alignment.
at::Tensor flash_varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t max_q, int64_t max_k,
                                  int64_t window);

// Whether the form above runs on `device` as described: flash_varlen_available, and a one-time
// probe of more keys than queries agrees with the reference attention (a libtorch whose causal
// mask aligned queries and keys at the top left would not).
bool flash_varlen_offsets_available(at::Device device, at::ScalarType dtype, int64_t head_dim);

}  // namespace kiln::kernels
