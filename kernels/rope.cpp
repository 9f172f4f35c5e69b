// RoPE: the ATen reference, the binding of the CUDA kernel in rope.cu, and an autograd function
// whose backward is the same kernel with the sine negated.
#include "kernels/rope.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "core/error.h"
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/rope_cuda.h"
#endif

namespace kiln::kernels {
namespace {

#if KILN_WITH_CUDA
// y = x * cos + rotate_half(x) * sin is linear in x with the transpose x -> x * cos - rotate_half(x * sin);
// since sin repeats across the two halves, rotate_half(x * sin) = rotate_half(x) * sin, so the
// backward is the forward with -sin.
struct RopeFunction : public torch::autograd::Function<RopeFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return apply_rope_cuda(x, cos, sin);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {apply_rope_cuda(grads[0].contiguous(), saved[0], saved[1].neg()), at::Tensor(), at::Tensor()};
  }
};
#endif

}  // namespace

at::Tensor apply_rope_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor rotated = at::cat({x.narrow(-1, half, half).neg(), x.narrow(-1, 0, half)}, -1);
  return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
#if KILN_WITH_CUDA
  const bool needs_grad = at::GradMode::is_enabled() && (x.requires_grad() || cos.requires_grad() || sin.requires_grad());
  const bool supported = (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                         cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type();
  const bool shapes = x.dim() == 3 && x.size(2) % 2 == 0 && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                      cos.size(0) == x.size(0) && cos.size(1) == x.size(2);
  if (x.is_cuda() && supported && shapes) {
    if (!needs_grad) return apply_rope_cuda(x, cos, sin);
    if (!cos.requires_grad() && !sin.requires_grad()) return RopeFunction::apply(x, cos, sin);
  }
#endif
  return apply_rope_reference(x, cos, sin);
}

at::Tensor apply_rope_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
#if KILN_WITH_CUDA
  KILN_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "apply_rope_cuda: x must be [T, H, even head_dim] (got ",
             x.sizes(), ")");
  KILN_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.size(1) == x.size(2),
             "apply_rope_cuda: cos and sin must be [", x.size(0), ", ", x.size(2), "] (got ", cos.sizes(), " and ",
             sin.sizes(), ")");
  KILN_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
             "apply_rope_cuda: cos and sin must be ", x.scalar_type(), " like x (got ", cos.scalar_type(), ")");
  KILN_CHECK(x.is_cuda() && cos.device() == x.device() && sin.device() == x.device(),
             "apply_rope_cuda: x, cos and sin must be on one CUDA device");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor xc = x.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  at::Tensor y = at::empty_like(xc);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  if (x.scalar_type() == at::kFloat) {
    err = launch_rope_f32(xc.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), y.data_ptr<float>(),
                          x.size(0), x.size(1), x.size(2), stream);
  } else {
    KILN_CHECK(x.scalar_type() == at::kBFloat16, "apply_rope_cuda: only float32 and bfloat16 (got ", x.scalar_type(), ")");
    err = launch_rope_bf16(xc.data_ptr(), c.data_ptr(), s.data_ptr(), y.data_ptr(), x.size(0), x.size(1), x.size(2), stream);
  }
  KILN_CHECK(err == cudaSuccess, "apply_rope_cuda: kernel launch failed: ", cudaGetErrorString(err));
  return y;
#else
  KILN_FAIL("apply_rope_cuda: this build has no CUDA kernels (KILN_WITH_CUDA=0); rebuild with KILN_CUDA=ON");
#endif
}

}  // namespace kiln::kernels
