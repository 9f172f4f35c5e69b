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

}  // namespace kiln::kernels
