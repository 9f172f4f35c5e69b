// RMSNorm reference (ATen ops) and the dispatch/binding for the CUDA kernel in rms_norm.cu.
#include "kernels/rms_norm.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "core/error.h"
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/rms_norm_cuda.h"
#endif

namespace kiln::kernels {

at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor xf = x.to(acc);
  at::Tensor y = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return y.to(x.scalar_type()) * weight;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
#if KILN_WITH_CUDA
  const bool needs_grad = at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad());
  const bool supported = x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16;
  const bool per_row = weight.dim() == 2 && x.dim() == 2 && weight.sizes() == x.sizes();
  if (x.is_cuda() && !needs_grad && supported && (weight.dim() == 1 || per_row) && x.numel() > 0)
    return rms_norm_cuda(x, weight, eps);
#endif
  return rms_norm_reference(x, weight, eps);
}

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps) {
#if KILN_WITH_CUDA
  KILN_CHECK(x.is_cuda() && weight.is_cuda() && x.device() == weight.device(),
             "rms_norm_cuda: x and weight must be on the same CUDA device (x=", x.device(), ", weight=",
             weight.device(), ")");
  KILN_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm_cuda: dtype mismatch (x=", x.scalar_type(),
             ", weight=", weight.scalar_type(), ")");
  const bool per_row = weight.dim() == 2 && x.dim() == 2 && weight.sizes() == x.sizes();
  KILN_CHECK((weight.dim() == 1 && x.dim() >= 1 && x.size(-1) == weight.size(0)) || per_row,
             "rms_norm_cuda: weight must be [", x.size(-1), "] or, for 2-D x, x's shape ", x.sizes(), " (got ",
             weight.sizes(), ")");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t cols = x.size(-1), rows = x.numel() / cols, w_stride = per_row ? cols : 0;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  if (x.scalar_type() == at::kFloat) {
    err = launch_rms_norm_f32(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), rows, cols,
                              w_stride, float(eps), stream);
  } else {
    KILN_CHECK(x.scalar_type() == at::kBFloat16, "rms_norm_cuda: only float32 and bfloat16 (got ",
               x.scalar_type(), ")");
    err = launch_rms_norm_bf16(xc.data_ptr(), wc.data_ptr(), y.data_ptr(), rows, cols, w_stride, float(eps), stream);
  }
  KILN_CHECK(err == cudaSuccess, "rms_norm_cuda: kernel launch failed: ", cudaGetErrorString(err));
  return y;
#else
  KILN_FAIL("rms_norm_cuda: this build has no CUDA kernels (KILN_WITH_CUDA=0); rebuild with KILN_CUDA=ON");
#endif
}

}  // namespace kiln::kernels
