// MoE layout: the ATen reference (the ops the grouped-GEMM path used to run) and the binding of the
// single-block CUDA kernel in moe_layout.cu.
#include "kernels/moe_layout.h"

#include <ATen/ATen.h>

#include "core/error.h"
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/moe_layout_cuda.h"
#endif

namespace kiln::kernels {
namespace {
void check_args(const at::Tensor& sorted, const at::Tensor& order, int64_t E, int64_t k, int64_t align) {
  KILN_CHECK(sorted.dim() == 1 && sorted.scalar_type() == at::kLong && order.sizes() == sorted.sizes() &&
                 order.scalar_type() == at::kLong && order.device() == sorted.device(),
             "moe_layout: sorted_experts and order must be int64 [n] on one device (got ", sorted.sizes(), " ",
             sorted.scalar_type(), " and ", order.sizes(), " ", order.scalar_type(), ")");
  KILN_CHECK(E >= 1 && k >= 1 && align >= 1 && sorted.size(0) % k == 0, "moe_layout: num_experts=", E, ", top_k=", k,
             ", align=", align, " must be positive and n=", sorted.size(0), " a multiple of top_k");
}
}  // namespace

MoeLayout moe_layout_reference(const at::Tensor& sorted, const at::Tensor& order, int64_t E, int64_t k,
                               int64_t align) {
  check_args(sorted, order, E, k, align);
  const int64_t n = sorted.size(0);
  MoeLayout l;
  l.counts = at::zeros({E}, sorted.options()).index_add_(0, sorted, at::ones_like(sorted));
  at::Tensor padded = at::div(l.counts + (align - 1), align, "floor") * align;
  at::Tensor ends = at::cumsum(padded, 0);
  at::Tensor pad_starts = ends - padded;
  at::Tensor starts = at::cumsum(l.counts, 0) - l.counts;
  l.bound = n + E * (align - 1);
  l.offsets = ends.to(at::kInt);
  l.offsets.narrow(0, E - 1, 1).fill_(l.bound);
  at::Tensor rows = at::arange(n, sorted.options());
  l.dest = pad_starts.index_select(0, sorted) + rows - starts.index_select(0, sorted);
  l.src_token = at::div(order, k, "floor");
  l.slot_row = at::empty_like(order).scatter_(0, order, l.dest);
  return l;
}

MoeLayout moe_layout(const at::Tensor& sorted, const at::Tensor& order, int64_t E, int64_t k, int64_t align) {
#if KILN_WITH_CUDA
  if (sorted.is_cuda() && E <= kMoeLayoutMaxExperts) return moe_layout_cuda(sorted, order, E, k, align);
#endif
  return moe_layout_reference(sorted, order, E, k, align);
}

MoeLayout moe_layout_cuda(const at::Tensor& sorted, const at::Tensor& order, int64_t E, int64_t k, int64_t align) {
#if KILN_WITH_CUDA
  check_args(sorted, order, E, k, align);
  KILN_CHECK(sorted.is_cuda(), "moe_layout_cuda: inputs must be on a CUDA device (got ", sorted.device(), ")");
  KILN_CHECK(E <= kMoeLayoutMaxExperts, "moe_layout_cuda: at most ", kMoeLayoutMaxExperts, " experts (got ", E, ")");
  const c10::cuda::CUDAGuard guard(sorted.device());
  at::Tensor s = sorted.contiguous(), o = order.contiguous();
  const int64_t n = s.size(0);
  MoeLayout l;
  l.bound = n + E * (align - 1);
  l.counts = at::empty({E}, s.options());
  l.offsets = at::empty({E}, s.options().dtype(at::kInt));
  l.dest = at::empty({n}, s.options());
  l.src_token = at::empty({n}, s.options());
  l.slot_row = at::empty({n}, s.options());
  const cudaError_t err =
      launch_moe_layout(s.data_ptr<int64_t>(), o.data_ptr<int64_t>(), n, E, k, align, l.counts.data_ptr<int64_t>(),
                        l.offsets.data_ptr<int32_t>(), l.dest.data_ptr<int64_t>(), l.src_token.data_ptr<int64_t>(),
                        l.slot_row.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream());
  KILN_CHECK(err == cudaSuccess, "moe_layout_cuda: kernel launch failed: ", cudaGetErrorString(err));
  return l;
#else
  KILN_FAIL("moe_layout_cuda: this build has no CUDA kernels (KILN_WITH_CUDA=0); rebuild with KILN_CUDA=ON");
#endif
}

}  // namespace kiln::kernels
