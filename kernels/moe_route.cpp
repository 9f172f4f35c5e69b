// MoE routing: the ATen reference (differentiable through the scores) and the binding of the
// warp-per-token CUDA kernel in moe_route.cu.
#include "kernels/moe_route.h"

#include <ATen/ATen.h>

#include "core/error.h"
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda_binding.h"
#include "kernels/moe_route_cuda.h"
#endif

namespace kiln::kernels {
namespace {
void check_args(const at::Tensor& logits, int64_t k, const at::Tensor& bias, const at::Tensor& replay) {
  KILN_CHECK(logits.dim() == 2 && at::isFloatingType(logits.scalar_type()),
             "moe_route: logits must be floating [T, E] (got ", logits.sizes(), " ", logits.scalar_type(), ")");
  const int64_t T = logits.size(0), E = logits.size(1);
  KILN_CHECK(k >= 1 && k <= E, "moe_route: top_k=", k, " must be in [1, ", E, "]");
  KILN_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == E),
             "moe_route: bias must be [", E, "] (got ", bias.sizes(), ")");
  KILN_CHECK(!replay.defined() || (replay.scalar_type() == at::kLong && replay.dim() == 2 && replay.size(0) == T &&
                                   replay.size(1) == k),
             "moe_route: replay must be int64 [", T, ", ", k, "] (got ", replay.sizes(), " ", replay.scalar_type(), ")");
}
}  // namespace

MoeRoute moe_route_reference(const at::Tensor& logits, int64_t k, bool sigmoid, const at::Tensor& bias,
                             const at::Tensor& replay) {
  check_args(logits, k, bias, replay);
  MoeRoute r;
  r.scores = sigmoid ? at::sigmoid(logits) : at::softmax(logits, -1);
  if (replay.defined()) {
    r.ids = replay;
  } else {
    at::Tensor select = r.scores.detach();
    if (sigmoid && bias.defined()) select = select + bias;
    r.ids = std::get<1>(at::topk(select, k, -1, /*largest=*/true, /*sorted=*/true));
  }
  at::Tensor w = r.scores.gather(1, r.ids);
  r.weights = w / w.sum(-1, true);  // renormalised over the chosen set, so gradients reach the router
  return r;
}

MoeRoute moe_route(const at::Tensor& logits, int64_t k, bool sigmoid, const at::Tensor& bias,
                   const at::Tensor& replay) {
#if KILN_WITH_CUDA
  if (logits.is_cuda() && logits.scalar_type() == at::kFloat && !logits.requires_grad() && logits.dim() == 2 &&
      logits.size(1) <= kMoeRouteMaxExperts && k <= kMoeRouteMaxTopK)
    return moe_route_cuda(logits, k, sigmoid, bias, replay);
#endif
  return moe_route_reference(logits, k, sigmoid, bias, replay);
}

MoeRoute moe_route_cuda(const at::Tensor& logits, int64_t k, bool sigmoid, const at::Tensor& bias,
                        const at::Tensor& replay) {
#if KILN_WITH_CUDA
  check_args(logits, k, bias, replay);
  KILN_CHECK(logits.is_cuda() && logits.scalar_type() == at::kFloat,
             "moe_route_cuda: logits must be fp32 on a CUDA device (got ", logits.scalar_type(), " on ",
             logits.device(), ")");
  KILN_CHECK(logits.size(1) <= kMoeRouteMaxExperts && k <= kMoeRouteMaxTopK, "moe_route_cuda: at most ",
             kMoeRouteMaxExperts, " experts and top_k ", kMoeRouteMaxTopK, " (got ", logits.size(1), ", ", k, ")");
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t T = logits.size(0), E = logits.size(1);
  at::Tensor l = logits.contiguous();
  at::Tensor b = sigmoid && bias.defined() ? bias.to(l.options()).contiguous() : at::Tensor();
  at::Tensor rp = replay.defined() ? replay.to(l.device()).contiguous() : at::Tensor();
  MoeRoute r;
  r.ids = at::empty({T, k}, l.options().dtype(at::kLong));
  r.weights = at::empty({T, k}, l.options());
  check_launch(launch_moe_route(l.data_ptr<float>(), T, E, k, sigmoid, b.defined() ? b.data_ptr<float>() : nullptr,
                                rp.defined() ? rp.data_ptr<int64_t>() : nullptr, r.ids.data_ptr<int64_t>(),
                                r.weights.data_ptr<float>(), c10::cuda::getCurrentCUDAStream()),
               "moe_route_cuda");
  return r;
#else
  (void)logits, (void)k, (void)sigmoid, (void)bias, (void)replay;
  KILN_FAIL("moe_route_cuda: this build has no CUDA kernels (KILN_WITH_CUDA=0); rebuild with KILN_CUDA=ON");
#endif
}

}  // namespace kiln::kernels
