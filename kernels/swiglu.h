// SwiGLU's gate, silu(g) * u, for the experts: the ATen reference and, on CUDA, one fused kernel
// each way (fp32 math, one rounding to the storage dtype) behind an autograd function.
#pragma once
#include <ATen/core/Tensor.h>

namespace kiln::kernels {

// g, u of one shape and dtype. Differentiable.
at::Tensor swiglu(const at::Tensor& g, const at::Tensor& u);
at::Tensor swiglu_reference(const at::Tensor& g, const at::Tensor& u);

}  // namespace kiln::kernels
