// Token log-probs: the ATen reference (fp32 logits, gather, logsumexp) and the autograd function
// over the CUDA kernels of logprob.cu.
#include "kernels/logprob.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "core/error.h"
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda_binding.h"
#include "kernels/logprob_cuda.h"
#endif

namespace kiln::kernels {
namespace {

#if KILN_WITH_CUDA
struct LogprobFunction : public torch::autograd::Function<LogprobFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& lm_head,
                            const at::Tensor& targets, double temperature) {
    const c10::cuda::CUDAGuard guard(hidden.device());
    at::Tensor logits = at::linear(hidden, lm_head).contiguous();  // [n, V] in the model's dtype
    at::Tensor t = targets.contiguous();
    const int64_t n = logits.size(0), V = logits.size(1);
    at::Tensor lp = at::empty({n}, hidden.options().dtype(at::kFloat)), lse = at::empty_like(lp);
    const float inv_temp = float(1.0 / temperature);
    check_launch(launch_token_logprob_forward(cuda_dtype_code(logits), logits.data_ptr(), t.data_ptr<int64_t>(), n, V,
                                              inv_temp, lp.data_ptr<float>(), lse.data_ptr<float>(),
                                              c10::cuda::getCurrentCUDAStream()),
                 "token_logprobs");
    ctx->save_for_backward({hidden, lm_head, t, logits, lse});
    ctx->saved_data["inv_temp"] = double(inv_temp);
    return lp;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &hidden = saved[0], &lm_head = saved[1], &t = saved[2], &logits = saved[3], &lse = saved[4];
    const c10::cuda::CUDAGuard guard(hidden.device());
    at::Tensor g = grads[0].contiguous().to(at::kFloat);
    at::Tensor dlogits = at::empty_like(logits);
    check_launch(launch_token_logprob_backward(cuda_dtype_code(logits), logits.data_ptr(), t.data_ptr<int64_t>(),
                                               lse.data_ptr<float>(), g.data_ptr<float>(), logits.size(0),
                                               logits.size(1), float(ctx->saved_data["inv_temp"].toDouble()),
                                               dlogits.data_ptr(), c10::cuda::getCurrentCUDAStream()),
                 "token_logprobs backward");
    at::Tensor dh = ctx->needs_input_grad(0) ? at::mm(dlogits, lm_head) : at::Tensor();
    at::Tensor dw = ctx->needs_input_grad(1) ? at::mm(dlogits.t(), hidden) : at::Tensor();
    return {dh, dw, at::Tensor(), at::Tensor()};
  }
};
#endif

}  // namespace

at::Tensor token_logprobs_reference(const at::Tensor& hidden, const at::Tensor& lm_head, const at::Tensor& targets,
                                    double temperature) {
  const auto acc = hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor logits = at::linear(hidden, lm_head).to(acc);
  if (temperature != 1.0) logits = logits / temperature;
  at::Tensor picked = logits.gather(1, targets.unsqueeze(1)).squeeze(1);
  return picked - at::logsumexp(logits, {-1});
}

at::Tensor token_logprobs(const at::Tensor& hidden, const at::Tensor& lm_head, const at::Tensor& targets,
                          double temperature) {
  KILN_CHECK(hidden.dim() == 2 && lm_head.dim() == 2 && hidden.size(1) == lm_head.size(1) && targets.dim() == 1 &&
                 targets.size(0) == hidden.size(0) && targets.scalar_type() == at::kLong && temperature > 0,
             "token_logprobs: hidden [n, d], lm_head [V, d], targets [n] int64 and a positive temperature (got ",
             hidden.sizes(), ", ", lm_head.sizes(), ", ", targets.sizes(), " ", targets.scalar_type(), ", ",
             temperature, ")");
#if KILN_WITH_CUDA
  if (hidden.is_cuda() && (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16) &&
      lm_head.scalar_type() == hidden.scalar_type() && targets.device() == hidden.device() && hidden.size(0) > 0)
    return LogprobFunction::apply(hidden, lm_head, targets, temperature);
#endif
  return token_logprobs_reference(hidden, lm_head, targets, temperature);
}

}  // namespace kiln::kernels
