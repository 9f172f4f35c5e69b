// The latent MoE's row movement between token order and the grouped GEMM's expert-sorted, padded
// rows (kernels/moe_layout.h gives slot_row): dispatch (each token's row to its k expert rows) and
// the weighted FP32 combine (k expert rows back to one token row). Differentiable; on CUDA each
// direction is one kernel with a fixed summation order (deterministic, no atomics); the ATen
// references run anywhere.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kiln::kernels {

// z [T, C], slot_row [T * k] int64 (slot t * k + j's padded row): a [bound, C] tensor whose row
// slot_row[t * k + j] is z[t]; every other row is zero. The gradient sums each token's k rows.
at::Tensor moe_dispatch(const at::Tensor& z, const at::Tensor& slot_row, int64_t k, int64_t bound);
at::Tensor moe_dispatch_reference(const at::Tensor& z, const at::Tensor& slot_row, int64_t k, int64_t bound);

// y [bound, C], weights [T, k] float32: out[t] = sum_j weights[t, j] * y[slot_row[t * k + j]],
// summed in fp32 and returned in y's dtype. Gradients reach y and the weights.
at::Tensor moe_combine(const at::Tensor& y, const at::Tensor& weights, const at::Tensor& slot_row);
// Whether moe_combine runs its CUDA kernel for these (a block per token adding its k rows in slot
// order: each token's bits do not depend on the others, so batch-invariant numerics may use it).
bool moe_combine_on_kernel(const at::Tensor& y, const at::Tensor& weights);
at::Tensor moe_combine_reference(const at::Tensor& y, const at::Tensor& weights, const at::Tensor& slot_row);

}  // namespace kiln::kernels
