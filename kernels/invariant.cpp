// Bindings of the batch-invariant CUDA kernels (invariant.cu) to tensors, with their checks.
#include "kernels/invariant.h"

#include <ATen/ATen.h>

#include <utility>

#include "core/error.h"
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda_binding.h"
#include "kernels/invariant_cuda.h"
#endif

namespace kiln::kernels {
namespace {

#if KILN_WITH_CUDA
// The wgmma choice where it cannot run is an error that says why, not a failed launch.
void check_gemm_choice(const char* op) {
  KILN_CHECK(invariant_gemm_kernel() != kInvariantWgmma || invariant_wgmma_usable(), op,
             ": bitwise_gemm wgmma (recipe kernels.bitwise_gemm or --bitwise-gemm) needs a compute capability 9.0 ",
             "GPU and a build for sm_90a (CMAKE_CUDA_ARCHITECTURES 90a); choose auto or mma");
}

int invariant_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kInvariantF32;
    case at::kBFloat16: return kInvariantBf16;
    default: return kInvariantF64;
  }
}
#endif

}  // namespace

std::string invariant_gemm() {
#if KILN_WITH_CUDA
  return invariant_gemm_kernel() == kInvariantWgmma ? "wgmma" : "mma";
#else
  return "mma";
#endif
}

bool invariant_wgmma_available() {
#if KILN_WITH_CUDA
  return invariant_wgmma_usable();
#else
  return false;
#endif
}

std::string set_invariant_gemm(const std::string& name) {
  KILN_CHECK(name == "auto" || name == "mma" || name == "wgmma", "bitwise_gemm: must be auto, mma or wgmma (got '",
             name, "')");
#if KILN_WITH_CUDA
  const int before = set_invariant_gemm_kernel(name == "wgmma" ? kInvariantWgmma
                                               : name == "mma" ? kInvariantMma
                                                               : kInvariantAuto);
  return before == kInvariantWgmma ? "wgmma" : before == kInvariantMma ? "mma" : "auto";
#else
  KILN_CHECK(name != "wgmma", "bitwise_gemm: wgmma needs a CUDA build (this one has mma alone)");
  static std::string setting = "auto";  // kept so that a test's restore gets back what it set
  return std::exchange(setting, name);
#endif
}

bool invariant_kernels_serve(const at::Tensor& t) {
#if KILN_WITH_CUDA
  const auto s = t.scalar_type();
  return t.is_cuda() && (s == at::kFloat || s == at::kBFloat16 || s == at::kDouble);
#else
  (void)t;
  return false;
#endif
}

at::Tensor invariant_linear_cuda(const at::Tensor& x, const at::Tensor& w) {
  KILN_CHECK(invariant_kernels_serve(x), "invariant_linear: x must be a CUDA float32, bfloat16 or float64 tensor ",
             "in a CUDA build (got ", x.scalar_type(), " on ", x.device(), ")");
  KILN_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && w.scalar_type() == x.scalar_type() &&
                 w.device() == x.device(),
             "invariant_linear: x [T, K] and w [N, K] of one dtype and device (got ", x.sizes(), " ", x.scalar_type(),
             " and ", w.sizes(), " ", w.scalar_type(), ")");
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
#if KILN_WITH_CUDA
  if (x.size(1) == 0) return y.zero_();
  const c10::cuda::CUDAGuard guard(x.device());
  // A fresh copy of a view that does not start on 16 bytes: which kernel runs (and so a row's
  // bits) then depends on the dtype and K alone, never on where a tensor starts.
  auto own = [](const at::Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t.contiguous() : t.clone(at::MemoryFormat::Contiguous);
  };
  const at::Tensor xc = own(x), wc = own(w);
  if (x.scalar_type() == at::kBFloat16) check_gemm_choice("invariant_linear");
  check_launch(launch_invariant_gemm(invariant_dtype(x), xc.data_ptr(), wc.data_ptr(), y.data_ptr(), x.size(0),
                                     w.size(0), x.size(1), c10::cuda::getCurrentCUDAStream()),
               "invariant_linear");
#endif
  return y;
}

bool invariant_grouped_linear_serves(const at::Tensor& x, const at::Tensor& w) {
  auto aligned = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  return invariant_kernels_serve(x) && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
         x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(2) && x.size(1) % 8 == 0 && x.is_contiguous() &&
         w.is_contiguous() && aligned(x) && aligned(w);
}

at::Tensor invariant_grouped_linear_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offsets) {
  KILN_CHECK(invariant_grouped_linear_serves(x, w), "invariant_grouped_linear: x [rows, K] and w [G, N, K] bf16 CUDA, ",
             "contiguous and 16-byte aligned, K % 8 == 0 (got ", x.sizes(), " ", x.scalar_type(), " and ", w.sizes(),
             " ", w.scalar_type(), ")");
  KILN_CHECK(offsets.dim() == 1 && offsets.size(0) == w.size(0) + 1 && offsets.scalar_type() == at::kLong &&
                 offsets.device() == x.device(),
             "invariant_grouped_linear: offsets must be int64 [", w.size(0) + 1, "] on ", x.device());
  at::Tensor y = at::empty({x.size(0), w.size(1)}, x.options());
#if KILN_WITH_CUDA
  const c10::cuda::CUDAGuard guard(x.device());
  check_gemm_choice("invariant_grouped_linear");
  const at::Tensor oc = offsets.contiguous();
  check_launch(launch_invariant_grouped_gemm(x.data_ptr(), w.data_ptr(), y.data_ptr(), oc.data_ptr<int64_t>(),
                                             x.size(0), w.size(0), w.size(1), w.size(2),
                                             c10::cuda::getCurrentCUDAStream()),
               "invariant_grouped_linear");
#endif
  return y;
}

at::Tensor ranged_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kf,
                                 const at::Tensor& vf, const at::Tensor& ranges, int64_t table_size) {
  KILN_CHECK(invariant_kernels_serve(q), "ranged_attention: q must be a CUDA float32, bfloat16 or float64 tensor ",
             "in a CUDA build (got ", q.scalar_type(), " on ", q.device(), ")");
  auto kv_like = [&](const at::Tensor& t) {
    return t.dim() == 3 && t.size(1) == k.size(1) && t.size(2) == q.size(2) && t.scalar_type() == q.scalar_type() &&
           t.device() == q.device();
  };
  KILN_CHECK(q.dim() == 3 && kv_like(k) && v.sizes() == k.sizes() && kv_like(v) && k.size(1) > 0 &&
                 q.size(1) % k.size(1) == 0 && q.size(2) <= 256,
             "ranged_attention: q [n, Hq, hd], k and v [m, Hkv, hd] of q's dtype and device, Hkv dividing Hq, ",
             "hd <= 256 (got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes(), ")");
  KILN_CHECK(table_size == 0 || (kv_like(kf) && vf.sizes() == kf.sizes() && kv_like(vf)),
             "ranged_attention: a table needs the second key source kf, vf [*, Hkv, hd]");
  KILN_CHECK(ranges.dim() == 1 && ranges.size(0) == 2 * q.size(0) + table_size && ranges.scalar_type() == at::kInt &&
                 ranges.device() == q.device(),
             "ranged_attention: ranges must be int32 [2 x ", q.size(0), " + ", table_size, "] on ", q.device());
  at::Tensor o = at::empty(q.sizes(), q.options());
#if KILN_WITH_CUDA
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), rc = ranges.contiguous();
  const at::Tensor kfc = table_size > 0 ? kf.contiguous() : kc, vfc = table_size > 0 ? vf.contiguous() : vc;
  const int32_t* r = rc.data_ptr<int32_t>();
  const int64_t n = q.size(0);
  check_launch(launch_ranged_attention(invariant_dtype(q), qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), kfc.data_ptr(),
                                       vfc.data_ptr(), table_size > 0 ? r + 2 * n : nullptr, r, r + n, o.data_ptr(), n,
                                       int(q.size(1)), int(k.size(1)), int(q.size(2)),
                                       c10::cuda::getCurrentCUDAStream()),
               "ranged_attention");
#endif
  return o;
}

}  // namespace kiln::kernels
