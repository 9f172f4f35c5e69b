// Packed causal attention through libtorch's FlashAttention-2 entry point, detected at compile time
// (its signature has changed between torch releases) and probed once at run time.
#include "kernels/flash_varlen.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>

#include "core/error.h"
#include "core/torch_version.h"

namespace kiln::kernels {
namespace {

#if KILN_WITH_CUDA && KILN_TORCH_AT_LEAST(2, 5)
// The torch 2.5+ signature: (q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
// return_debug_mask, scale, window_size_left, window_size_right, ...). Detected through a
// dependent expression, so another signature turns the fast path off instead of breaking the build.
template <typename T, typename = void>
struct HasFlashVarlen : std::false_type {};
template <typename T>
struct HasFlashVarlen<T, std::void_t<decltype(at::_flash_attention_forward(
                             std::declval<const T&>(), std::declval<const T&>(), std::declval<const T&>(),
                             std::optional<T>(), std::optional<T>(), int64_t(), int64_t(), double(), bool(), bool(),
                             std::optional<double>(), std::optional<int64_t>(), std::optional<int64_t>()))>>
    : std::true_type {};

template <typename T>
T call_flash(const T& q, const T& k, const T& v, const T& cu_q, const T& cu_k, int64_t max_q, int64_t max_k,
             int64_t window) {
  if constexpr (HasFlashVarlen<T>::value) {
    const double scale = 1.0 / std::sqrt(double(q.size(-1)));
    // flash's left window counts the keys before the query: i - j <= left.
    const std::optional<int64_t> left = window > 0 ? std::optional<int64_t>(window - 1) : std::optional<int64_t>(-1);
    auto out = at::_flash_attention_forward(q, k, v, std::optional<T>(cu_q), std::optional<T>(cu_k), max_q, max_k,
                                            /*dropout_p=*/0.0, /*is_causal=*/true, /*return_debug_mask=*/false, scale,
                                            left, std::optional<int64_t>(0));
    return std::get<0>(out);
  } else {
    (void)q, (void)k, (void)v, (void)cu_q, (void)cu_k, (void)max_q, (void)max_k, (void)window;
    KILN_FAIL("flash_varlen_attention: this libtorch's _flash_attention_forward has another signature");
  }
}
constexpr bool kCompiledIn = HasFlashVarlen<at::Tensor>::value;
#else
constexpr bool kCompiledIn = false;
#endif

}  // namespace

at::Tensor flash_varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens, int64_t max_len, int64_t window) {
  KILN_CHECK(q.dim() == 3 && q.size(0) == k.size(0), "flash_varlen_attention: q and k must hold the same tokens (got ",
             q.sizes(), " and ", k.sizes(), ")");
  return flash_varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, window);
}

at::Tensor flash_varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t max_q, int64_t max_k,
                                  int64_t window) {
  KILN_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(2) == k.size(2) && k.size(1) > 0 &&
                 q.size(1) % k.size(1) == 0,
             "flash_varlen_attention: q [Tq, Hq, hd], k and v [Tk, Hkv, hd] with Hkv dividing Hq (got ", q.sizes(),
             ", ", k.sizes(), ", ", v.sizes(), ")");
  for (const at::Tensor* cu : {&cu_q, &cu_k})
    KILN_CHECK(cu->dim() == 1 && cu->scalar_type() == at::kInt && cu->device() == q.device() && cu->size(0) == cu_q.size(0),
               "flash_varlen_attention: cu_seqlens must be int32 [S + 1] on ", q.device(), ", the same S for queries "
               "and keys (got ", cu->sizes(), " ", cu->scalar_type(), " on ", cu->device(), ")");
#if KILN_WITH_CUDA && KILN_TORCH_AT_LEAST(2, 5)
  return call_flash<at::Tensor>(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, window);
#else
  (void)max_q, (void)max_k, (void)window;
  KILN_FAIL("flash_varlen_attention: needs a CUDA build against torch >= 2.5");
#endif
}

bool flash_varlen_available(at::Device device, at::ScalarType dtype, int64_t head_dim) {
  if (!kCompiledIn || !device.is_cuda() || (dtype != at::kBFloat16 && dtype != at::kHalf)) return false;
  if (head_dim % 8 != 0 || head_dim > 256) return false;  // FlashAttention-2's head sizes
  // One probe per process: two sequences (5 and 3 tokens), GQA, a window, forward and backward.
  static std::once_flag once;
  static bool works = false;
  std::call_once(once, [&] {
    try {
      c10::InferenceMode not_inference(false);
      at::AutoGradMode grad(true);
      auto opt = at::TensorOptions().dtype(dtype).device(device);
      at::Tensor q = at::randn({8, 4, 64}, opt).requires_grad_(true);
      at::Tensor kv = at::randn({8, 2, 64}, opt).requires_grad_(true);
      at::Tensor cu = at::tensor(std::vector<int32_t>{0, 5, 8}, at::kInt).to(device);
      flash_varlen_attention(q, kv, kv, cu, 5, 3).sum().backward();
      works = q.grad().defined() && kv.grad().defined();
    } catch (const std::exception&) {
      works = false;
    }
  });
  return works;
}

bool flash_varlen_offsets_available(at::Device device, at::ScalarType dtype, int64_t head_dim) {
  if (!flash_varlen_available(device, dtype, head_dim)) return false;
  // One probe per process: 3 queries at the end of 7 keys, full and a window of 3, against the
  // attention written out in fp32 on the same values.
  static std::once_flag once;
  static bool works = false;
  std::call_once(once, [&] {
    try {
      c10::InferenceMode not_inference(false);
      auto opt = at::TensorOptions().dtype(dtype).device(device);
      const at::Tensor q = at::randn({3, 2, 64}, opt), k = at::randn({7, 2, 64}, opt), v = at::randn({7, 2, 64}, opt);
      const at::Tensor cu_q = at::tensor(std::vector<int32_t>{0, 3}, at::kInt).to(device);
      const at::Tensor cu_k = at::tensor(std::vector<int32_t>{0, 7}, at::kInt).to(device);
      works = true;
      for (int64_t window : {0, 3}) {
        const at::Tensor out = flash_varlen_attention(q, k, v, cu_q, cu_k, 3, 7, window).to(at::kFloat);
        const at::Tensor qi = at::arange(4, 7, at::kLong).unsqueeze(1), kj = at::arange(0, 7, at::kLong).unsqueeze(0);
        at::Tensor allowed = kj.le(qi);
        if (window > 0) allowed = allowed.logical_and(kj.gt(qi - window));
        const at::Tensor scores = at::einsum("qhd,khd->hqk", {q.to(at::kFloat), k.to(at::kFloat)}) / 8.0;
        const at::Tensor p = at::softmax(scores.masked_fill(allowed.logical_not().to(device), -1e30), -1);
        const at::Tensor ref = at::einsum("hqk,khd->qhd", {p, v.to(at::kFloat)});
        works = works && (out - ref).abs().max().item<double>() < 5e-2;
      }
    } catch (const std::exception&) {
      works = false;
    }
  });
  return works;
}

}  // namespace kiln::kernels
