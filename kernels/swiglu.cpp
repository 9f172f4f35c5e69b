// SwiGLU: the ATen reference and the autograd function over the CUDA kernels of swiglu.cu.
#include "kernels/swiglu.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "core/error.h"
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda_binding.h"
#include "kernels/swiglu_cuda.h"
#endif

namespace kiln::kernels {
namespace {

#if KILN_WITH_CUDA
struct SwigluFunction : public torch::autograd::Function<SwigluFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& g, const at::Tensor& u) {
    const c10::cuda::CUDAGuard guard(g.device());
    at::Tensor gc = g.contiguous(), uc = u.contiguous();
    ctx->save_for_backward({gc, uc});
    at::Tensor a = at::empty_like(gc);
    check_launch(launch_swiglu_forward(cuda_dtype_code(g), gc.data_ptr(), uc.data_ptr(), a.data_ptr(), a.numel(),
                                       c10::cuda::getCurrentCUDAStream()),
                 "swiglu");
    return a;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &g = saved[0], &u = saved[1];
    const c10::cuda::CUDAGuard guard(g.device());
    at::Tensor da = grads[0].contiguous().to(g.scalar_type());
    at::Tensor dg = at::empty_like(g), du = at::empty_like(u);
    check_launch(launch_swiglu_backward(cuda_dtype_code(g), g.data_ptr(), u.data_ptr(), da.data_ptr(), dg.data_ptr(),
                                        du.data_ptr(), g.numel(), c10::cuda::getCurrentCUDAStream()),
                 "swiglu backward");
    return {dg, du};
  }
};

// Contiguous buffers from the allocator start on 16-byte boundaries; views at odd offsets do not.
bool aligned(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }
#endif

}  // namespace

at::Tensor swiglu_reference(const at::Tensor& g, const at::Tensor& u) { return at::silu(g) * u; }

at::Tensor swiglu(const at::Tensor& g, const at::Tensor& u) {
  KILN_CHECK(g.sizes() == u.sizes() && g.scalar_type() == u.scalar_type() && g.device() == u.device(),
             "swiglu: gate and up must match (got ", g.sizes(), " ", g.scalar_type(), " and ", u.sizes(), " ",
             u.scalar_type(), ")");
#if KILN_WITH_CUDA
  if (g.is_cuda() && (g.scalar_type() == at::kFloat || g.scalar_type() == at::kBFloat16) && g.is_contiguous() &&
      u.is_contiguous() && aligned(g) && aligned(u))
    return SwigluFunction::apply(g, u);
#endif
  return swiglu_reference(g, u);
}

}  // namespace kiln::kernels
