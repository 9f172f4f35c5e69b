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

at::Tensor rope_cache_write_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                                      at::Tensor& v_cache, const at::Tensor& rows) {
  k_cache.index_copy_(0, rows, apply_rope(k, cos, sin));
  v_cache.index_copy_(0, rows, v);
  return apply_rope(q, cos, sin);
}

at::Tensor rope_cache_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                            const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& rows) {
  KILN_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                 q.size(2) == k.size(2) && q.size(2) % 2 == 0 && k_cache.dim() == 3 &&
                 k_cache.sizes() == v_cache.sizes() && k_cache.size(1) == k.size(1) && k_cache.size(2) == k.size(2) &&
                 rows.dim() == 1 && rows.size(0) == q.size(0) && rows.scalar_type() == at::kLong,
             "rope_cache_write: q [T, Hq, hd], k and v [T, Hkv, hd], caches [R, Hkv, hd] and rows int64 [T] (got q ",
             q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), ", caches ", k_cache.sizes(), " and ", v_cache.sizes(),
             ", rows ", rows.sizes(), " ", rows.scalar_type(), ")");
#if KILN_WITH_CUDA
  const auto dtype = q.scalar_type();
  const bool fits = q.is_cuda() && (dtype == at::kFloat || dtype == at::kBFloat16) && k.scalar_type() == dtype &&
                    v.scalar_type() == dtype && cos.scalar_type() == dtype && sin.scalar_type() == dtype &&
                    k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype && k_cache.is_contiguous() &&
                    v_cache.is_contiguous() && cos.dim() == 2 && cos.size(0) == q.size(0) && cos.size(1) == q.size(2) &&
                    sin.sizes() == cos.sizes();
  if (fits) {
    const c10::cuda::CUDAGuard guard(q.device());
    at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), c = cos.contiguous(), s = sin.contiguous();
    at::Tensor r = rows.contiguous();
    at::Tensor out = at::empty_like(qc);
    const cudaError_t err = launch_rope_cache_write(
        dtype == at::kFloat ? 0 : 1, qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), c.data_ptr(), s.data_ptr(),
        r.data_ptr<int64_t>(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), q.size(0), q.size(1), k.size(1),
        q.size(2), c10::cuda::getCurrentCUDAStream());
    KILN_CHECK(err == cudaSuccess, "rope_cache_write: kernel launch failed: ", cudaGetErrorString(err));
    return out;
  }
#endif
  return rope_cache_write_reference(q, k, v, cos, sin, k_cache, v_cache, rows);
}

}  // namespace kiln::kernels
