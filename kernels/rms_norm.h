// RMSNorm, Llama convention: y = cast(x_f32 * rsqrt(mean(x_f32^2) + eps)) * w. The reference runs
// anywhere through ATen ops (autograd included); fused CUDA kernels serve inference and, through an
// autograd function with its own backward kernel, training.
#pragma once
#include <ATen/core/Tensor.h>

#include <utility>

namespace kiln::kernels {

// x [..., n], weight [n] or broadcastable to x (e.g. per-row weights [rows, n]).
// Normalises in fp32 (fp64 for fp64 inputs). On a CUDA float/bf16 tensor: the forward kernel when
// no gradient is needed (weight [n], or for 2-D x one weight row per row); with a gradient and a
// weight [n], n <= 8192, the fused forward and backward kernels. Otherwise the reference.
// The fused backward computes in fp32 from x (the reference's autograd rounds each op to x's
// dtype), and its weight gradient is summed in a fixed order: deterministic.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// Rows in segments, each with its own weight row: x [rows, n], weight [S, n], ends [S] int32 (the
// sorted end row of each segment; the last is rows). Row r uses weight row s, the first with
// ends[s] > r: the per-expert norm over expert-sorted rows. Differentiable; fused kernels on CUDA
// (float/bf16, n <= 8192), where the weight gradient is one ordered sum per segment.
at::Tensor segment_rms_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& ends, double eps);
at::Tensor segment_rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& ends,
                                      double eps);

// The sandwich norm's residual step and the next norm in one pass, for inference:
// h = x + rms_norm(a, w_add) and hn = rms_norm(h, w_next). a, x [rows, n]; w_add, w_next [n]. On
// CUDA float/bf16 without a gradient one kernel, bitwise the composition (rms_norm twice and an
// add); elsewhere that composition.
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& a, const at::Tensor& x, const at::Tensor& w_add,
                                               const at::Tensor& w_next, double eps);
std::pair<at::Tensor, at::Tensor> add_rms_norm_reference(const at::Tensor& a, const at::Tensor& x,
                                                         const at::Tensor& w_add, const at::Tensor& w_next, double eps);

// The norm's gradient by its formula, for an autograd node whose forward is computed elsewhere (the
// batch-invariant norms): x and dy [rows, n]; weight [n], or one row per row [rows, n] (the
// experts' norms over every slot). With r = rsqrt(mean(x^2) + eps), xhat = x * r, u = g * w:
// dx = r * (u - xhat * mean(u * xhat)) and dw = g * cast(xhat), summed over the rows for a shared
// weight. Each is returned where asked (else undefined), dw in the weight's shape. On CUDA float or
// bf16 with n <= 8192, the backward kernels: u kept in fp32, where the reference rounds g * w to
// x's dtype first; a shared row's dw adds the unrounded fp32 products g * cast(xhat) in per-block
// partial sums, then sums those in a fixed order (deterministic for a GPU model and row count),
// and that path computes dx even when only dw is asked. Elsewhere, or when this gradient must
// itself be differentiable (grad mode on and an input requiring grad), the reference, in fp32
// (fp64 for fp64) ATen ops.
std::pair<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& dy,
                                                    double eps, bool need_dx, bool need_dw);
std::pair<at::Tensor, at::Tensor> rms_norm_backward_reference(const at::Tensor& x, const at::Tensor& weight,
                                                              const at::Tensor& dy, double eps, bool need_dx,
                                                              bool need_dw);

// The training path alone (fused forward + backward kernels), for tests and benches; throws
// where it does not apply.
at::Tensor rms_norm_train_cuda(const at::Tensor& x, const at::Tensor& weight, double eps);

// The ATen reference, always available.
at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps);

// The CUDA kernel; throws in builds without CUDA.
at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps);

}  // namespace kiln::kernels
