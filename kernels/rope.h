// Rotary position embedding, rotate-half (HF) convention: y = x * cos + rotate_half(x) * sin, with
// every product and the sum rounded to x's dtype as ATen does. Reference + fused CUDA kernel.
#pragma once
#include <ATen/core/Tensor.h>

namespace kiln::kernels {

// x [T, H, hd]; cos and sin [T, hd] in x's dtype. Dispatches to the CUDA kernel for CUDA
// fp32/bf16 inputs, forward only or, when x needs a gradient (not cos or sin), through an autograd
// function whose backward is the kernel with -sin; otherwise runs the reference.
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor apply_rope_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// The CUDA kernel (bitwise equal to the reference); throws in builds without CUDA.
at::Tensor apply_rope_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// A decode step's RoPE fused with its KV-cache write: returns q rotated, and writes k rotated and v
// into k_cache and v_cache ([R, Hkv, hd], in place) at rows [T] (int64, on their device). On CUDA
// (fp32/bf16, contiguous caches) one kernel, bitwise the composition: apply_rope on q and k, then
// index_copy_ of k and v. Elsewhere that composition.
at::Tensor rope_cache_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                            const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& rows);
at::Tensor rope_cache_write_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                                      at::Tensor& v_cache, const at::Tensor& rows);

}  // namespace kiln::kernels
