// MoE layout: the ATen reference (a stable sort and the ops the grouped-GEMM path used to run) and
// the binding of the single-block CUDA kernels in moe_layout.cu.
#include "kernels/moe_layout.h"

#include <ATen/ATen.h>

#include "core/error.h"
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda_binding.h"
#include "kernels/moe_layout_cuda.h"
#endif

namespace kiln::kernels {
namespace {
void check_args(const at::Tensor& ids, int64_t E, int64_t k, int64_t align) {
  KILN_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong,
             "moe_layout: ids must be int64 [n] (got ", ids.sizes(), " ", ids.scalar_type(), ")");
  KILN_CHECK(E >= 1 && k >= 1 && align >= 1 && ids.size(0) % k == 0, "moe_layout: num_experts=", E, ", top_k=", k,
             ", align=", align, " must be positive and n=", ids.size(0), " a multiple of top_k");
}
}  // namespace

MoeLayout moe_layout_reference(const at::Tensor& ids, int64_t E, int64_t k, int64_t align) {
  check_args(ids, E, k, align);
  const int64_t n = ids.size(0);
  auto [sorted, order] = at::sort(ids, /*stable=*/true, 0, /*descending=*/false);
  MoeLayout l;
  l.order = order;
  l.counts = at::zeros({E}, ids.options()).index_add_(0, sorted, at::ones_like(sorted));
  at::Tensor padded = at::div(l.counts + (align - 1), align, "floor") * align;
  at::Tensor ends = at::cumsum(padded, 0);
  at::Tensor pad_starts = ends - padded;
  at::Tensor starts = at::cumsum(l.counts, 0) - l.counts;
  l.bound = n + E * (align - 1);
  l.ends = ends.to(at::kInt);
  l.segments = at::cat({at::zeros({1}, ends.options()), ends});
  l.offsets = l.ends.clone();
  l.offsets.narrow(0, E - 1, 1).fill_(l.bound);
  at::Tensor rows = at::arange(n, ids.options());
  l.dest = pad_starts.index_select(0, sorted) + rows - starts.index_select(0, sorted);
  l.src_token = at::div(order, k, "floor");
  l.slot_row = at::empty_like(order).scatter_(0, order, l.dest);
  return l;
}

MoeLayout moe_layout(const at::Tensor& ids, int64_t E, int64_t k, int64_t align) {
#if KILN_WITH_CUDA
  if (ids.is_cuda() && E <= kMoeLayoutMaxExperts) return moe_layout_cuda(ids, E, k, align);
#endif
  return moe_layout_reference(ids, E, k, align);
}

MoeLayout moe_layout_cuda(const at::Tensor& ids, int64_t E, int64_t k, int64_t align) {
#if KILN_WITH_CUDA
  check_args(ids, E, k, align);
  KILN_CHECK(ids.is_cuda(), "moe_layout_cuda: ids must be on a CUDA device (got ", ids.device(), ")");
  KILN_CHECK(E <= kMoeLayoutMaxExperts, "moe_layout_cuda: at most ", kMoeLayoutMaxExperts, " experts (got ", E, ")");
  const c10::cuda::CUDAGuard guard(ids.device());
  at::Tensor s = ids.contiguous();
  const int64_t n = s.size(0);
  MoeLayout l;
  l.bound = n + E * (align - 1);
  l.counts = at::empty({E}, s.options());
  l.offsets = at::empty({E}, s.options().dtype(at::kInt));
  l.ends = at::empty({E}, s.options().dtype(at::kInt));
  l.segments = at::empty({E + 1}, s.options());
  const MoeSegmentsOut seg{l.counts.data_ptr<int64_t>(), l.offsets.data_ptr<int32_t>(), l.ends.data_ptr<int32_t>(),
                           l.segments.data_ptr<int64_t>()};
  l.dest = at::empty({n}, s.options());
  l.src_token = at::empty({n}, s.options());
  l.slot_row = at::empty({n}, s.options());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (n <= kMoeLayoutSortRows && E <= kMoeLayoutSortExperts) {  // sort and place in one kernel
    l.order = at::empty({n}, s.options());
    check_launch(launch_moe_layout(s.data_ptr<int64_t>(), n, E, k, align, seg, l.order.data_ptr<int64_t>(),
                                   l.dest.data_ptr<int64_t>(), l.src_token.data_ptr<int64_t>(),
                                   l.slot_row.data_ptr<int64_t>(), stream),
                 "moe_layout_cuda");
    return l;
  }
  auto [sorted, order] = at::sort(s, /*stable=*/true, 0, /*descending=*/false);
  l.order = order;
  check_launch(launch_moe_layout_sorted(sorted.data_ptr<int64_t>(), order.data_ptr<int64_t>(), n, E, k, align, seg,
                                        l.dest.data_ptr<int64_t>(), l.src_token.data_ptr<int64_t>(),
                                        l.slot_row.data_ptr<int64_t>(), stream),
               "moe_layout_cuda");
  return l;
#else
  (void)ids, (void)E, (void)k, (void)align;
  KILN_FAIL("moe_layout_cuda: this build has no CUDA kernels (KILN_WITH_CUDA=0); rebuild with KILN_CUDA=ON");
#endif
}

}  // namespace kiln::kernels
