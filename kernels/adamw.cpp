// The binding of the multi-tensor AdamW kernel (adamw.cu): checks, dtype codes and the scalars.
#include "kernels/adamw.h"

#include <ATen/ATen.h>

#include <cmath>

#include "core/error.h"
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/adamw_cuda.h"
#include "kernels/cuda_binding.h"
#endif

namespace kiln::kernels {
namespace {

#if KILN_WITH_CUDA
uint8_t code(const at::Tensor& t) {
  if (!t.defined()) return kAdamWNone;
  switch (t.scalar_type()) {
    case at::kFloat: return kAdamWF32;
    case at::kBFloat16: return kAdamWBF16;
    case at::kHalf: return kAdamWF16;
    default: return kAdamWNone;
  }
}
#endif

}  // namespace

bool adamw_fused_supported(const AdamWTensors& t) {
#if KILN_WITH_CUDA
  if (!t.w.defined() || !t.g.defined() || !t.m.defined() || !t.v.defined()) return false;
  const int64_t n = t.w.numel();
  for (const at::Tensor* x : {&t.w, &t.g, &t.m, &t.v, &t.p}) {
    if (!x->defined()) continue;
    if (!x->is_cuda() || x->device() != t.w.device() || !x->is_contiguous() || x->numel() != n ||
        code(*x) == kAdamWNone)
      return false;
  }
  return t.m.scalar_type() == t.v.scalar_type() && t.m.scalar_type() != at::kHalf &&
         (!t.p.defined() || t.w.scalar_type() == at::kFloat);
#else
  (void)t;
  return false;
#endif
}

void adamw_fused(const std::vector<AdamWTensors>& ts, const AdamWHyper& h) {
  if (ts.empty()) return;
#if KILN_WITH_CUDA
  std::vector<AdamWSlice> slices;
  slices.reserve(ts.size());
  for (const AdamWTensors& t : ts) {
    KILN_CHECK(adamw_fused_supported(t), "adamw_fused: unsupported tensors (w ", t.w.sizes(), " ", t.w.scalar_type(),
               " on ", t.w.device(), ", g ", t.g.scalar_type(), ", moments ", t.m.scalar_type(),
               "): needs contiguous CUDA tensors of one size, fp32/bf16/fp16 weights and gradients, fp32 or bf16 "
               "moments, and an fp32 master when p is given");
    KILN_CHECK(t.w.device() == ts.front().w.device(), "adamw_fused: tensors on ", t.w.device(), " and ",
               ts.front().w.device());
    slices.push_back({t.w.data_ptr(), t.g.data_ptr(), t.m.data_ptr(), t.v.data_ptr(),
                      t.p.defined() ? t.p.data_ptr() : nullptr, t.w.numel(), code(t.w), code(t.g), code(t.m),
                      code(t.p)});
  }
  const double bc1 = 1 - std::pow(h.beta1, double(h.step)), bc2 = 1 - std::pow(h.beta2, double(h.step));
  // The scalars as ATen hands them to its fp32 kernels: each rounded once to float.
  const AdamWScalars s{float(1 - h.lr * h.weight_decay), float(1 - h.beta1), float(h.beta2), float(1 - h.beta2),
                       float(std::sqrt(bc2)), float(h.eps), float(h.lr / bc1)};
  const c10::cuda::CUDAGuard guard(ts.front().w.device());
  check_launch(launch_adamw(slices.data(), int(slices.size()), s, c10::cuda::getCurrentCUDAStream()), "adamw_fused");
#else
  (void)h;
  KILN_FAIL("adamw_fused: this build has no CUDA");
#endif
}

}  // namespace kiln::kernels
