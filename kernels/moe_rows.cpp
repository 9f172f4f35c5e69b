// MoE dispatch and combine: ATen references and the autograd functions over the CUDA kernels of
// moe_rows.cu.
#include "kernels/moe_rows.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "core/error.h"
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda_binding.h"
#include "kernels/moe_rows_cuda.h"
#endif

namespace kiln::kernels {
namespace {

void check_slots(const at::Tensor& slot_row, int64_t tokens, int64_t k, const char* what) {
  KILN_CHECK(k >= 1 && slot_row.dim() == 1 && slot_row.size(0) == tokens * k && slot_row.scalar_type() == at::kLong,
             what, ": slot_row must be int64 [tokens * k = ", tokens * k, "] (got ", slot_row.sizes(), " ",
             slot_row.scalar_type(), ", k=", k, ")");
}

#if KILN_WITH_CUDA
bool kernel_applies(const at::Tensor& x, int64_t k) {
  return x.is_cuda() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && k <= kMoeRowsMaxTopK;
}

// out (pre-filled) gets x's rows at slot_row, scaled by w when given; dots gets <x[t], y[row]>.
// `what` names the caller in a launch error (the dispatch, or the combine's backward).
void expand_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& slot_row, int64_t k, at::Tensor& out,
                 const at::Tensor& y, at::Tensor* dots, const char* what) {
  const int64_t T = x.size(0), C = x.size(1);
  at::Tensor xc = x.contiguous(), sc = slot_row.contiguous();
  at::Tensor wc = w.defined() ? w.contiguous() : w, yc = y.defined() ? y.contiguous() : y;
  if (dots) *dots = at::empty({T, k}, x.options().dtype(at::kFloat));
  check_launch(launch_moe_expand(cuda_dtype_code(x), xc.data_ptr(), wc.defined() ? wc.data_ptr<float>() : nullptr,
                                 sc.data_ptr<int64_t>(), T, int(k), C, out.data_ptr(),
                                 yc.defined() ? yc.data_ptr() : nullptr, dots ? dots->data_ptr<float>() : nullptr,
                                 c10::cuda::getCurrentCUDAStream()),
               what);
}

at::Tensor reduce_rows(const at::Tensor& y, const at::Tensor& w, const at::Tensor& slot_row, int64_t tokens, int64_t k) {
  at::Tensor yc = y.contiguous(), sc = slot_row.contiguous(), wc = w.defined() ? w.contiguous() : w;
  at::Tensor out = at::empty({tokens, y.size(1)}, y.options());
  check_launch(launch_moe_reduce(cuda_dtype_code(y), yc.data_ptr(), wc.defined() ? wc.data_ptr<float>() : nullptr,
                                 sc.data_ptr<int64_t>(), tokens, int(k), y.size(1), out.data_ptr(),
                                 c10::cuda::getCurrentCUDAStream()),
               "moe_combine");
  return out;
}

struct DispatchFunction : public torch::autograd::Function<DispatchFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& z, const at::Tensor& slot_row,
                            int64_t k, int64_t bound) {
    const c10::cuda::CUDAGuard guard(z.device());
    ctx->save_for_backward({slot_row});
    ctx->saved_data["k"] = k;
    at::Tensor out = at::zeros({bound, z.size(1)}, z.options());
    expand_into(z, at::Tensor(), slot_row, k, out, at::Tensor(), nullptr, "moe_dispatch");
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor slot_row = ctx->get_saved_variables()[0];
    const int64_t k = ctx->saved_data["k"].toInt();
    const c10::cuda::CUDAGuard guard(slot_row.device());
    at::Tensor dz = reduce_rows(grads[0], at::Tensor(), slot_row, slot_row.size(0) / k, k);
    return {dz, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct CombineFunction : public torch::autograd::Function<CombineFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y, const at::Tensor& weights,
                            const at::Tensor& slot_row) {
    const c10::cuda::CUDAGuard guard(y.device());
    ctx->save_for_backward({y, weights, slot_row});
    return reduce_rows(y, weights, slot_row, weights.size(0), weights.size(1));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &y = saved[0], &weights = saved[1], &slot_row = saved[2];
    const c10::cuda::CUDAGuard guard(y.device());
    at::Tensor dm = grads[0].to(y.scalar_type());
    at::Tensor dy = at::zeros_like(y), dw;
    expand_into(dm, weights, slot_row, weights.size(1), dy, y, &dw, "moe_combine backward");
    return {dy, dw, at::Tensor()};
  }
};
#endif

}  // namespace

at::Tensor moe_dispatch_reference(const at::Tensor& z, const at::Tensor& slot_row, int64_t k, int64_t bound) {
  check_slots(slot_row, z.size(0), k, "moe_dispatch");
  at::Tensor token = at::div(at::arange(slot_row.size(0), slot_row.options()), k, "floor");
  return at::zeros({bound, z.size(1)}, z.options()).index_copy(0, slot_row, z.index_select(0, token));
}

at::Tensor moe_dispatch(const at::Tensor& z, const at::Tensor& slot_row, int64_t k, int64_t bound) {
  KILN_CHECK(z.dim() == 2, "moe_dispatch: z must be [tokens, C] (got ", z.sizes(), ")");
  check_slots(slot_row, z.size(0), k, "moe_dispatch");
#if KILN_WITH_CUDA
  if (kernel_applies(z, k) && slot_row.device() == z.device()) return DispatchFunction::apply(z, slot_row, k, bound);
#endif
  return moe_dispatch_reference(z, slot_row, k, bound);
}

at::Tensor moe_combine_reference(const at::Tensor& y, const at::Tensor& weights, const at::Tensor& slot_row) {
  const int64_t T = weights.size(0), k = weights.size(1);
  check_slots(slot_row, T, k, "moe_combine");
  at::Tensor rows = y.index_select(0, slot_row).view({T, k, y.size(1)});
  return (rows.to(weights.scalar_type()) * weights.unsqueeze(-1)).sum(1).to(y.scalar_type());
}

bool moe_combine_on_kernel(const at::Tensor& y, const at::Tensor& weights) {
#if KILN_WITH_CUDA
  return weights.dim() == 2 && kernel_applies(y, weights.size(1)) && weights.scalar_type() == at::kFloat &&
         weights.device() == y.device();
#else
  (void)y, (void)weights;
  return false;
#endif
}

at::Tensor moe_combine(const at::Tensor& y, const at::Tensor& weights, const at::Tensor& slot_row) {
  KILN_CHECK(y.dim() == 2 && weights.dim() == 2, "moe_combine: y must be [rows, C] and weights [tokens, k] (got ",
             y.sizes(), " and ", weights.sizes(), ")");
  check_slots(slot_row, weights.size(0), weights.size(1), "moe_combine");
#if KILN_WITH_CUDA
  if (moe_combine_on_kernel(y, weights) && slot_row.device() == y.device())
    return CombineFunction::apply(y, weights, slot_row);
#endif
  return moe_combine_reference(y, weights, slot_row);
}

}  // namespace kiln::kernels
