// The stream-read reference (a host loop) and the binding of its CUDA kernel (stream_read.cu).
#include "kernels/stream_read.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#include "core/error.h"
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/stream_read_cuda.h"
#endif

namespace kiln::kernels {
namespace {

int64_t word_count(const at::Tensor& t, const char* what) {
  KILN_CHECK(t.defined() && t.is_contiguous(), what, ": the tensor must be defined and contiguous");
  const int64_t bytes = t.numel() * int64_t(t.element_size());
  KILN_CHECK(bytes % 4 == 0, what, ": the tensor must hold whole 32-bit words (got ", bytes, " bytes)");
  return bytes / 4;
}

}  // namespace

at::Tensor xor_words_reference(const at::Tensor& t) {
  const int64_t count = word_count(t, "xor_words_reference");
  at::Tensor c = t.cpu();
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  uint32_t x = 0;
  for (int64_t i = 0; i < count; ++i) {
    uint32_t w;
    std::memcpy(&w, p + 4 * i, 4);
    x ^= w;
  }
  int32_t s;
  std::memcpy(&s, &x, 4);
  return at::scalar_tensor(s, at::kInt).to(t.device());
}

void xor_words_into(const at::Tensor& t, at::Tensor& out) {
  const int64_t count = word_count(t, "xor_words");
  KILN_CHECK(out.defined() && out.numel() == 1 && out.scalar_type() == at::kInt && out.device() == t.device(),
             "xor_words: out must be one int32 on ", t.device());
#if KILN_WITH_CUDA
  if (t.is_cuda()) {
    KILN_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0,
               "xor_words: a CUDA tensor must start on a 4-byte boundary (it starts at byte offset ",
               reinterpret_cast<uintptr_t>(t.data_ptr()) % 4, ")");
    const c10::cuda::CUDAGuard guard(t.device());
    const cudaError_t err = launch_xor_words(static_cast<const uint32_t*>(t.data_ptr()), count,
                                             reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>()),
                                             c10::cuda::getCurrentCUDAStream());
    KILN_CHECK(err == cudaSuccess, "xor_words: kernel launch failed: ", cudaGetErrorString(err));
    return;
  }
#endif
  out.bitwise_xor_(xor_words_reference(t));
}

at::Tensor xor_words(const at::Tensor& t) {
  KILN_CHECK(t.defined(), "xor_words: the tensor must be defined");
  at::Tensor out = at::zeros({}, t.options().dtype(at::kInt));
  xor_words_into(t, out);
  return out;
}

}  // namespace kiln::kernels
