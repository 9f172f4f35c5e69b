// RMSNorm reference (ATen ops), the dispatch/binding for the CUDA kernels in rms_norm.cu, and the
// autograd function that runs them forward and backward in training.
#include "kernels/rms_norm.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "core/error.h"
#if KILN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/rms_norm_cuda.h"
#endif

namespace kiln::kernels {
namespace {

[[maybe_unused]] bool cuda_dtype(const at::Tensor& x) { return x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16; }

#if KILN_WITH_CUDA
// The forward kernel on x viewed as [rows, cols]: weight [cols], per-row [rows, cols], or per
// segment [S, cols] with ends [S] int32.
at::Tensor forward_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& ends, double eps) {
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor ec = ends.numel() > 0 ? ends.contiguous() : at::Tensor();
  at::Tensor y = at::empty_like(xc);
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  const bool per_row = !ec.defined() && weight.dim() == 2;
  const int64_t w_stride = per_row ? cols : 0;
  const int32_t* e = ec.defined() ? ec.data_ptr<int32_t>() : nullptr;
  const int segments = ec.defined() ? int(ec.size(0)) : 1;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t err =
      x.scalar_type() == at::kFloat
          ? launch_rms_norm_f32(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), rows, cols, w_stride,
                                e, segments, float(eps), stream)
          : launch_rms_norm_bf16(xc.data_ptr(), wc.data_ptr(), y.data_ptr(), rows, cols, w_stride, e, segments,
                                 float(eps), stream);
  KILN_CHECK(err == cudaSuccess, "rms_norm_cuda: kernel launch failed: ", cudaGetErrorString(err));
  return y;
}

// dx, and dw (undefined unless need_dw) in the weight's shape and dtype.
std::pair<at::Tensor, at::Tensor> backward_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& ends,
                                                const at::Tensor& dy, double eps, bool need_dw) {
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor xc = x.contiguous(), wc = weight.contiguous(), gc = dy.contiguous().to(x.scalar_type());
  at::Tensor ec = ends.numel() > 0 ? ends.contiguous() : at::Tensor();
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  const int segments = ec.defined() ? int(ec.size(0)) : 1;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // Blocks: about 4 per SM for one shared weight row. With segments (the experts, whose sizes follow
  // the routing) 16 per SM: a segment's rows are split finely enough that the largest ones do not
  // leave one block running alone (at 2 parts per expert the full-width layer's took 2.6 ms, 5x
  // its bytes at the copy bandwidth).
  const int64_t blocks = int64_t(segments > 1 ? 16 : 4) * sms;
  const int parts =
      int(std::max<int64_t>(1, std::min<int64_t>((blocks + segments - 1) / segments, rows / segments)));
  at::Tensor dx = at::empty_like(xc);
  at::Tensor part = at::empty({int64_t(segments) * parts, cols}, x.options().dtype(at::kFloat));
  const int32_t* e = ec.defined() ? ec.data_ptr<int32_t>() : nullptr;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t err =
      x.scalar_type() == at::kFloat
          ? launch_rms_norm_backward_f32(xc.data_ptr<float>(), wc.data_ptr<float>(), e, segments, gc.data_ptr<float>(),
                                         dx.data_ptr<float>(), part.data_ptr<float>(), rows, cols, parts, float(eps),
                                         stream)
          : launch_rms_norm_backward_bf16(xc.data_ptr(), wc.data_ptr(), e, segments, gc.data_ptr(), dx.data_ptr(),
                                          part.data_ptr<float>(), rows, cols, parts, float(eps), stream);
  KILN_CHECK(err == cudaSuccess, "rms_norm backward: kernel launch failed: ", cudaGetErrorString(err));
  at::Tensor dw;
  if (need_dw) dw = part.view({segments, parts, cols}).sum(1).to(weight.scalar_type()).view(weight.sizes());
  return {dx, dw};
}

// dx and dw of the norm with one weight row per row, [rows, cols] each (undefined where not wanted).
std::pair<at::Tensor, at::Tensor> backward_rows_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& dy,
                                                     double eps, bool need_dx, bool need_dw) {
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor xc = x.contiguous(), wc = weight.contiguous(), gc = dy.contiguous().to(x.scalar_type());
  at::Tensor dx = need_dx ? at::empty_like(xc) : at::Tensor(), dw = need_dw ? at::empty_like(wc) : at::Tensor();
  const cudaError_t err = launch_rms_norm_backward_rows(
      x.scalar_type() == at::kFloat ? 0 : 1, xc.data_ptr(), wc.data_ptr(), gc.data_ptr(),
      need_dx ? dx.data_ptr() : nullptr, need_dw ? dw.data_ptr() : nullptr, x.size(0), x.size(1), float(eps),
      c10::cuda::getCurrentCUDAStream());
  KILN_CHECK(err == cudaSuccess, "rms_norm backward (a weight row per row): kernel launch failed: ",
             cudaGetErrorString(err));
  return {dx, dw};
}

// Forward and backward through the CUDA kernels; ends empty for a shared weight row (autograd
// functions take no undefined tensors).
struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& ends, double eps) {
    ctx->save_for_backward({x, weight, ends});
    ctx->saved_data["eps"] = eps;
    return forward_cuda(x, weight, ends, eps);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw] = backward_cuda(saved[0], saved[1], saved[2], grads[0], ctx->saved_data["eps"].toDouble(),
                                  ctx->needs_input_grad(1));
    return {dx, dw, at::Tensor(), at::Tensor()};
  }
};
#endif

[[maybe_unused]] at::Tensor no_segments(const at::Tensor& x) { return at::empty({0}, x.options().dtype(at::kInt)); }

// The fused path takes 2-D-or-more CUDA float/bf16 rows no wider than the backward kernel allows,
// with the weight in x's dtype.
[[maybe_unused]] bool train_kernel_applies(const at::Tensor& x, const at::Tensor& weight) {
#if KILN_WITH_CUDA
  return x.is_cuda() && weight.is_cuda() && cuda_dtype(x) && x.scalar_type() == weight.scalar_type() &&
         x.dim() >= 1 && x.numel() > 0 && x.size(-1) <= kMaxBackwardCols;
#else
  (void)x, (void)weight;
  return false;
#endif
}

}  // namespace

at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor xf = x.to(acc);
  at::Tensor y = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return y.to(x.scalar_type()) * weight;
}

std::pair<at::Tensor, at::Tensor> rms_norm_backward_reference(const at::Tensor& x, const at::Tensor& weight,
                                                              const at::Tensor& dy, double eps, bool need_dx,
                                                              bool need_dw) {
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor xf = x.to(acc);
  const at::Tensor r = at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  const at::Tensor xhat = xf * r;
  at::Tensor dx, dw;
  if (need_dx) {
    const at::Tensor u = (dy * weight).to(acc);  // the gradient at cast(xhat), widened as the cast's backward does
    dx = (r * (u - xhat * (u * xhat).mean(-1, /*keepdim=*/true))).to(x.scalar_type());
  }
  if (need_dw) {
    dw = dy * xhat.to(x.scalar_type());
    if (weight.dim() == 1) dw = dw.reshape({-1, weight.size(0)}).sum(0);
  }
  return {dx, dw};
}

std::pair<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& dy,
                                                    double eps, bool need_dx, bool need_dw) {
  KILN_CHECK(x.dim() == 2 && dy.sizes() == x.sizes() &&
                 ((weight.dim() == 1 && weight.size(0) == x.size(1)) || weight.sizes() == x.sizes()),
             "rms_norm_backward: x and dy [rows, n], weight [n] or [rows, n] (got x ", x.sizes(), ", dy ", dy.sizes(),
             ", weight ", weight.sizes(), ")");
  KILN_CHECK(dy.device() == x.device() && weight.device() == x.device(), "rms_norm_backward: x, weight and dy must ",
             "be on one device (got ", x.device(), ", ", weight.device(), ", ", dy.device(), ")");
#if KILN_WITH_CUDA
  // A gradient of this gradient (create_graph) needs the differentiable reference.
  const bool differentiable =
      at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad() || dy.requires_grad());
  if (train_kernel_applies(x, weight) && !differentiable && (need_dx || need_dw)) {
    if (weight.dim() == 2) return backward_rows_cuda(x, weight, dy, eps, need_dx, need_dw);
    auto [dx, dw] = backward_cuda(x, weight, no_segments(x), dy, eps, need_dw);
    return {need_dx ? dx : at::Tensor(), dw};
  }
#endif
  return rms_norm_backward_reference(x, weight, dy, eps, need_dx, need_dw);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
#if KILN_WITH_CUDA
  const bool needs_grad = at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad());
  const bool per_row = weight.dim() == 2 && x.dim() == 2 && weight.sizes() == x.sizes();
  if (x.is_cuda() && !needs_grad && cuda_dtype(x) && (weight.dim() == 1 || per_row) && x.numel() > 0)
    return rms_norm_cuda(x, weight, eps);
  if (needs_grad && weight.dim() == 1 && weight.size(0) == x.size(-1) && train_kernel_applies(x, weight))
    return RmsNormFunction::apply(x, weight, no_segments(x), eps);
#endif
  return rms_norm_reference(x, weight, eps);
}

std::pair<at::Tensor, at::Tensor> add_rms_norm_reference(const at::Tensor& a, const at::Tensor& x,
                                                         const at::Tensor& w_add, const at::Tensor& w_next,
                                                         double eps) {
  at::Tensor h = x + rms_norm(a, w_add, eps);
  return {h, rms_norm(h, w_next, eps)};
}

std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& a, const at::Tensor& x, const at::Tensor& w_add,
                                               const at::Tensor& w_next, double eps) {
#if KILN_WITH_CUDA
  const bool needs_grad = at::GradMode::is_enabled() && (a.requires_grad() || x.requires_grad() ||
                                                          w_add.requires_grad() || w_next.requires_grad());
  const bool fits = a.is_cuda() && cuda_dtype(a) && a.dim() == 2 && x.sizes() == a.sizes() &&
                    x.scalar_type() == a.scalar_type() && w_add.dim() == 1 && w_add.size(0) == a.size(1) &&
                    w_next.sizes() == w_add.sizes() && w_add.scalar_type() == a.scalar_type() &&
                    w_next.scalar_type() == a.scalar_type() && x.device() == a.device() &&
                    w_add.device() == a.device() && w_next.device() == a.device();
  if (fits && !needs_grad) {
    const c10::cuda::CUDAGuard guard(a.device());
    at::Tensor ac = a.contiguous(), xc = x.contiguous(), wa = w_add.contiguous(), wn = w_next.contiguous();
    at::Tensor h = at::empty_like(ac), hn = at::empty_like(ac);
    bool launched = false;
    const cudaError_t err =
        launch_add_rms_norm(a.scalar_type() == at::kFloat ? 0 : 1, ac.data_ptr(), xc.data_ptr(), wa.data_ptr(),
                            wn.data_ptr(), h.data_ptr(), hn.data_ptr(), ac.size(0), ac.size(1), float(eps),
                            c10::cuda::getCurrentCUDAStream(), &launched);
    KILN_CHECK(err == cudaSuccess, "add_rms_norm: kernel launch failed: ", cudaGetErrorString(err));
    if (launched) return {h, hn};
  }
#endif
  return add_rms_norm_reference(a, x, w_add, w_next, eps);
}

at::Tensor segment_rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& ends,
                                      double eps) {
  at::Tensor rows = at::arange(x.size(0), x.options().dtype(at::kLong));
  at::Tensor segment = at::searchsorted(ends.to(at::kLong), rows, /*out_int32=*/false, /*right=*/true);
  return rms_norm_reference(x, weight.index_select(0, segment), eps);
}

at::Tensor segment_rms_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& ends, double eps) {
  KILN_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(1) == x.size(1) && ends.dim() == 1 &&
                 ends.size(0) == weight.size(0) && ends.scalar_type() == at::kInt && ends.device() == x.device(),
             "segment_rms_norm: x [rows, n], weight [S, n] and ends [S] int32 on x's device (got x ", x.sizes(),
             ", weight ", weight.sizes(), ", ends ", ends.sizes(), " ", ends.scalar_type(), ")");
#if KILN_WITH_CUDA
  if (train_kernel_applies(x, weight)) return RmsNormFunction::apply(x, weight, ends, eps);
#endif
  return segment_rms_norm_reference(x, weight, ends, eps);
}

at::Tensor rms_norm_train_cuda(const at::Tensor& x, const at::Tensor& weight, double eps) {
#if KILN_WITH_CUDA
  KILN_CHECK(train_kernel_applies(x, weight) && weight.dim() == 1 && weight.size(0) == x.size(-1),
             "rms_norm_train_cuda: x [..., n] and weight [n], CUDA float32 or bfloat16 of one dtype, n <= ",
             kMaxBackwardCols, " (got x ", x.sizes(), " ", x.scalar_type(), " on ", x.device(), ", weight ",
             weight.sizes(), " ", weight.scalar_type(), ")");
  return RmsNormFunction::apply(x, weight, no_segments(x), eps);
#else
  (void)x, (void)weight, (void)eps;
  KILN_FAIL("rms_norm_train_cuda: this build has no CUDA kernels (KILN_WITH_CUDA=0); rebuild with KILN_CUDA=ON");
#endif
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
                              w_stride, nullptr, 1, float(eps), stream);
  } else {
    KILN_CHECK(x.scalar_type() == at::kBFloat16, "rms_norm_cuda: only float32 and bfloat16 (got ",
               x.scalar_type(), ")");
    err = launch_rms_norm_bf16(xc.data_ptr(), wc.data_ptr(), y.data_ptr(), rows, cols, w_stride, nullptr, 1,
                               float(eps), stream);
  }
  KILN_CHECK(err == cudaSuccess, "rms_norm_cuda: kernel launch failed: ", cudaGetErrorString(err));
  return y;
#else
  KILN_FAIL("rms_norm_cuda: this build has no CUDA kernels (KILN_WITH_CUDA=0); rebuild with KILN_CUDA=ON");
#endif
}

}  // namespace kiln::kernels
