// RMSNorm, Llama convention: y = cast(x_f32 * rsqrt(mean(x_f32^2) + eps)) * w. The reference runs
// anywhere through ATen ops (autograd included); a fused CUDA kernel serves inference on GPU.
#pragma once
#include <ATen/core/Tensor.h>

namespace kiln::kernels {

// x [..., n], weight [n] or broadcastable to x (e.g. per-row weights [rows, n]).
// Normalises in fp32 (fp64 for fp64 inputs). Dispatches to the CUDA kernel when x is a CUDA
// float/bf16 tensor, weight is [n] (or, for 2-D x, one weight row per row: the per-expert norms),
// and no gradient is needed; otherwise runs the reference.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// The ATen reference, always available.
at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps);

// The CUDA kernel; throws in builds without CUDA.
at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps);

}  // namespace kiln::kernels
