// Bindings of the NVFP4 CUDA kernels (nvfp4.cu): check devices, dtypes and shapes, allocate the
// outputs and launch on the current stream. Builds without CUDA throw from each entry point.
#include <ATen/ATen.h>

#include <algorithm>

#include "core/error.h"
#include "kernels/nvfp4.h"
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/invariant_cuda.h"
#include "kernels/nvfp4_cuda.h"
#endif

namespace kiln::kernels {

#if KILN_WITH_CUDA
namespace {

// Contiguous and 16-byte aligned (a fresh copy when a view starts mid-allocation).
at::Tensor aligned(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

void check_on(const at::Tensor& t, const at::Device& device, const char* what, const char* name) {
  KILN_CHECK(t.is_cuda() && t.device() == device, what, ": ", name, " must be on ", device, " (got ", t.device(), ")");
}

void check_weights(const Nvfp4Tensor& w, const at::Tensor& x, const at::Tensor& scale, const char* what) {
  nvfp4_check(w, what);
  check_on(x, x.device(), what, "x");
  check_on(w.packed, x.device(), what, "the packed weights");
  KILN_CHECK(w.kernel_layout, what, ": weights must be in the kernel layout (nvfp4_to_kernel_layout)");
  KILN_CHECK(x.dim() == 2 && x.size(1) == w.cols(), what, ": x must be [M, ", w.cols(), "] for weights with K = ",
             w.cols(), " (got ", x.sizes(), ")");
  KILN_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, what,
             ": x must be bfloat16 or float32 (got ", x.scalar_type(), ")");
  if (scale.defined()) {
    check_on(scale, x.device(), what, "scale");
    KILN_CHECK(scale.numel() == 1 && scale.scalar_type() == at::kFloat, what,
               ": scale must be one fp32 value (got ", scale.sizes(), " ", scale.scalar_type(), ")");
  }
}

Nvfp4DType dtype_of(at::ScalarType t) {
  return t == at::kFloat ? Nvfp4DType::kFloat32 : t == at::kBFloat16 ? Nvfp4DType::kBFloat16 : Nvfp4DType::kFloat16;
}

// The wgmma GEMM on x [rows, K] (bf16) into y [rows, N]: x goes through a permuted scratch copy.
at::Tensor run_wgmma(const at::Tensor& xc, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& s2,
                     const at::Tensor& scale, const int64_t* offsets, int64_t groups, int64_t tile_rows, at::Tensor y,
                     Nvfp4Gemm gemm, const char* what) {
  const int64_t rows = xc.size(0), N = y.size(1), K = xc.size(1);
  at::Tensor xp = at::empty_like(xc);
  const cudaError_t err = launch_nvfp4_wgmma(xc.data_ptr(), xp.data_ptr(), offsets, rows, groups,
                                             packed.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(),
                                             s2.data_ptr<float>(), scale.defined() ? scale.data_ptr<float>() : nullptr,
                                             y.data_ptr(), tile_rows, N, K, c10::cuda::getCurrentCUDAStream(),
                                             wgmma_warpgroups(gemm));
  KILN_CHECK(err == cudaSuccess, what, ": wgmma kernel launch failed: ", cudaGetErrorString(err));
  return y;
}

void check_wgmma(const at::Tensor& x, const Nvfp4Tensor& w, Nvfp4Gemm gemm, const char* what) {
  KILN_CHECK(nvfp4_wgmma_usable(x, w), what, ": the wgmma GEMM needs bfloat16 x on a compute capability 9.0 device, ",
             "a build with sm_90a code, N a multiple of 64, K a multiple of 256 and 16-byte aligned weights (got x ",
             x.scalar_type(), ", N = ", w.rows(), ", K = ", w.cols(), ")");
  KILN_CHECK(wgmma_warpgroups_fit(w.rows(), wgmma_warpgroups(gemm)), what,
             ": the wgmma GEMM's 128-row blocks need N a multiple of 128 (got N = ", w.rows(), ")");
}

}  // namespace
#endif

Nvfp4Tensor nvfp4_quantize_cuda(const at::Tensor& w, bool kernel_layout) {
#if KILN_WITH_CUDA
  KILN_CHECK(w.is_cuda(), "nvfp4_quantize_cuda: weights must be on a CUDA device (got ", w.device(), ")");
  KILN_CHECK((w.dim() == 2 || w.dim() == 3) && w.size(-1) % kNvfp4Block == 0,
             "nvfp4_quantize_cuda: weights must be [N, K] or [E, N, K] with K a multiple of ", kNvfp4Block, " (got ",
             w.sizes(), ")");
  KILN_CHECK(at::isFloatingType(w.scalar_type()), "nvfp4_quantize_cuda: weights must be floating point (got ",
             w.scalar_type(), ")");
  const c10::cuda::CUDAGuard guard(w.device());
  // The reference quantises the fp32 value of every element: other dtypes go through fp32 first.
  const bool direct = w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16;
  at::Tensor src = aligned(direct ? w : w.to(at::kFloat));
  const int64_t E = w.dim() == 3 ? w.size(0) : 1, N = w.size(-2), K = w.size(-1);
  auto bytes = w.options().dtype(at::kByte);
  std::vector<int64_t> ps(w.sizes().begin(), w.sizes().end()), ss = ps;
  ps.back() = K / 2;
  ss.back() = K / kNvfp4Block;
  Nvfp4Tensor q;
  q.kernel_layout = kernel_layout;
  q.packed = at::empty(ps, bytes);
  q.block_scale = at::empty(ss, bytes);
  q.tensor_scale = w.dim() == 3 ? at::ones({E}, w.options().dtype(at::kFloat)) : at::ones(at::IntArrayRef{}, w.options().dtype(at::kFloat));
  if (N * K == 0) return q;  // empty matrices: tensor scale 1, nothing else to write
  at::Tensor amax = at::empty({E}, w.options().dtype(at::kInt));
  const cudaError_t err = launch_nvfp4_quantize(src.data_ptr(), dtype_of(src.scalar_type()), E, N, K, kernel_layout,
                                                q.packed.data_ptr<uint8_t>(), q.block_scale.data_ptr<uint8_t>(),
                                                q.tensor_scale.data_ptr<float>(),
                                                reinterpret_cast<uint32_t*>(amax.data_ptr<int32_t>()),
                                                c10::cuda::getCurrentCUDAStream());
  KILN_CHECK(err == cudaSuccess, "nvfp4_quantize_cuda: kernel launch failed: ", cudaGetErrorString(err));
  return q;
#else
  KILN_FAIL("nvfp4_quantize_cuda: this build has no CUDA kernels (KILN_WITH_CUDA=0); rebuild with KILN_CUDA=ON");
#endif
}

at::Tensor nvfp4_dequantize_cuda(const Nvfp4Tensor& q, at::ScalarType dtype) {
#if KILN_WITH_CUDA
  nvfp4_check(q, "nvfp4_dequantize_cuda");
  KILN_CHECK(q.packed.is_cuda(), "nvfp4_dequantize_cuda: weights must be on a CUDA device (got ", q.packed.device(), ")");
  KILN_CHECK(at::isFloatingType(dtype), "nvfp4_dequantize_cuda: the output dtype must be floating point (got ", dtype, ")");
  const c10::cuda::CUDAGuard guard(q.packed.device());
  const int64_t E = q.stacked() ? q.packed.size(0) : 1, N = q.rows(), K = q.cols();
  at::Tensor packed = aligned(q.packed), scales = q.block_scale.contiguous().view(at::kByte);
  at::Tensor s2 = q.tensor_scale.contiguous();
  const bool direct = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
  std::vector<int64_t> shape(q.packed.sizes().begin(), q.packed.sizes().end());
  shape.back() = K;
  at::Tensor out = at::empty(shape, q.packed.options().dtype(direct ? dtype : at::kFloat));
  const cudaError_t err =
      launch_nvfp4_dequantize(packed.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), s2.data_ptr<float>(), E, N, K,
                              q.kernel_layout, out.data_ptr(), dtype_of(out.scalar_type()), c10::cuda::getCurrentCUDAStream());
  KILN_CHECK(err == cudaSuccess, "nvfp4_dequantize_cuda: kernel launch failed: ", cudaGetErrorString(err));
  return direct ? out : out.to(dtype);  // the reference also rounds from fp32
#else
  KILN_FAIL("nvfp4_dequantize_cuda: this build has no CUDA kernels (KILN_WITH_CUDA=0); rebuild with KILN_CUDA=ON");
#endif
}

at::Tensor nvfp4_linear_cuda(const at::Tensor& x, const Nvfp4Tensor& w, const at::Tensor& scale, Nvfp4Gemm gemm) {
#if KILN_WITH_CUDA
  KILN_CHECK(x.is_cuda(), "nvfp4_linear_cuda: x must be on a CUDA device (got ", x.device(), ")");
  check_weights(w, x, scale, "nvfp4_linear_cuda");
  KILN_CHECK(gemm != Nvfp4Gemm::kStaged || x.scalar_type() == at::kBFloat16,
             "nvfp4_linear_cuda: the staged kernel takes bfloat16 x (got ", x.scalar_type(), ")");
  KILN_CHECK(!is_staged_tiles(gemm), "nvfp4_linear_cuda: kStagedTiles and kStagedTiles64 are for expert stacks only");
  KILN_CHECK(!w.stacked(), "nvfp4_linear_cuda: weights must be one matrix [N, K/2] (got a stack ", w.packed.sizes(),
             "); use nvfp4_grouped_linear_cuda");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t M = x.size(0), N = w.rows(), K = w.cols();
  at::Tensor xc = aligned(x), packed = aligned(w.packed), scales = aligned(w.block_scale.view(at::kByte));
  at::Tensor s2 = w.tensor_scale.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  if (is_wgmma(gemm)) {
    check_wgmma(x, w, gemm, "nvfp4_linear_cuda");
    return run_wgmma(xc, packed, scales, s2, scale, nullptr, 1, M, y, gemm, "nvfp4_linear_cuda");
  }
  const cudaError_t err = launch_nvfp4_linear(xc.data_ptr(), dtype_of(x.scalar_type()), packed.data_ptr<uint8_t>(),
                                              scales.data_ptr<uint8_t>(), s2.data_ptr<float>(),
                                              scale.defined() ? scale.data_ptr<float>() : nullptr, y.data_ptr(), M, N,
                                              K, c10::cuda::getCurrentCUDAStream(), gemm);
  KILN_CHECK(err == cudaSuccess, "nvfp4_linear_cuda: kernel launch failed: ", cudaGetErrorString(err));
  return y;
#else
  KILN_FAIL("nvfp4_linear_cuda: this build has no CUDA kernels (KILN_WITH_CUDA=0); rebuild with KILN_CUDA=ON");
#endif
}

at::Tensor nvfp4_grouped_linear_cuda(const at::Tensor& x, const Nvfp4Tensor& w, const at::Tensor& offsets,
                                     const at::Tensor& scale, int64_t live_rows, Nvfp4Gemm gemm) {
#if KILN_WITH_CUDA
  KILN_CHECK(x.is_cuda(), "nvfp4_grouped_linear_cuda: x must be on a CUDA device (got ", x.device(), ")");
  check_weights(w, x, scale, "nvfp4_grouped_linear_cuda");
  KILN_CHECK(w.stacked(), "nvfp4_grouped_linear_cuda: weights must be a stack [E, N, K/2] (got ", w.packed.sizes(), ")");
  const int64_t E = w.packed.size(0), R = x.size(0), N = w.rows(), K = w.cols();
  KILN_CHECK(offsets.defined() && offsets.dim() == 1 && offsets.size(0) == E + 1 &&
                 offsets.scalar_type() == at::kLong,
             "nvfp4_grouped_linear_cuda: offsets must be int64 [", E + 1, "] (got ",
             offsets.defined() ? offsets.sizes() : at::IntArrayRef{}, " ",
             offsets.defined() ? offsets.scalar_type() : at::ScalarType::Undefined, ")");
  check_on(offsets, x.device(), "nvfp4_grouped_linear_cuda", "offsets");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor xc = aligned(x), packed = aligned(w.packed), scales = aligned(w.block_scale.view(at::kByte));
  at::Tensor s2 = w.tensor_scale.contiguous(), off = offsets.contiguous();
  at::Tensor y = at::empty({R, N}, x.options());
  if (R == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const int64_t tile_rows = live_rows > 0 ? std::min(live_rows, R) : R;
  if (is_wgmma(gemm)) {
    check_wgmma(x, w, gemm, "nvfp4_grouped_linear_cuda");
    return run_wgmma(xc, packed, scales, s2, scale, off.data_ptr<int64_t>(), E, tile_rows, y, gemm,
                     "nvfp4_grouped_linear_cuda");
  }
  KILN_CHECK(!is_grouped_staged(gemm) || x.scalar_type() == at::kBFloat16,
             "nvfp4_grouped_linear_cuda: the staged kernel takes bfloat16 x (got ", x.scalar_type(), ")");
  KILN_CHECK(!is_grouped_staged(gemm) || grouped_stack_aligned(N, K),
             "nvfp4_grouped_linear_cuda: the staged kernel needs every expert's codes and scales on 16 bytes: K a "
             "multiple of 32 and N * K / 16 of 16 (got N = ", N, ", K = ", K, ")");
  const cudaError_t err = launch_nvfp4_grouped_linear(
      xc.data_ptr(), dtype_of(x.scalar_type()), off.data_ptr<int64_t>(), packed.data_ptr<uint8_t>(),
      scales.data_ptr<uint8_t>(), s2.data_ptr<float>(), scale.defined() ? scale.data_ptr<float>() : nullptr,
      y.data_ptr(), tile_rows, E, N, K, c10::cuda::getCurrentCUDAStream(), gemm);
  KILN_CHECK(err == cudaSuccess, "nvfp4_grouped_linear_cuda: kernel launch failed: ", cudaGetErrorString(err));
  return y;
#else
  KILN_FAIL("nvfp4_grouped_linear_cuda: this build has no CUDA kernels (KILN_WITH_CUDA=0); rebuild with KILN_CUDA=ON");
#endif
}

bool nvfp4_wgmma_usable(const at::Tensor& x, const Nvfp4Tensor& w) {
#if KILN_WITH_CUDA
  if (!x.is_cuda() || x.scalar_type() != at::kBFloat16 || !w.packed.defined() || !w.kernel_layout ||
      !nvfp4_wgmma_fits(w.rows(), w.cols()))
    return false;
  // The kernel's bulk copies read codes and scales from 16-byte aligned addresses.
  if (reinterpret_cast<uintptr_t>(w.packed.data_ptr()) % 16 ||
      reinterpret_cast<uintptr_t>(w.block_scale.data_ptr()) % 16)
    return false;
  const c10::cuda::CUDAGuard guard(x.device());  // the device x is on, not the current one
  return invariant_wgmma_usable();
#else
  (void)x, (void)w;
  return false;
#endif
}

}  // namespace kiln::kernels
