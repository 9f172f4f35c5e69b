// Paged decode attention: the ATen reference, shape checks, and the binding of the CUDA kernel in
// paged_attention.cu (including how many key splits keep the GPU busy at small batch).
#include "kernels/paged_attention.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#if KILN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/paged_attention_cuda.h"
#endif

namespace kiln::kernels {
namespace {

void check_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& table, const at::Tensor& positions, int64_t block_size, int64_t window,
                int64_t ring) {
  KILN_CHECK(q.dim() == 3, "paged_decode_attention: q must be [N, Hq, head_dim] (got ", q.sizes(), ")");
  KILN_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == q.size(2),
             "paged_decode_attention: k_cache and v_cache must both be [rows, Hkv, ", q.size(2), "] (got ",
             k_cache.sizes(), " and ", v_cache.sizes(), ")");
  KILN_CHECK(k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0, "paged_decode_attention: Hq=", q.size(1),
             " is not a multiple of Hkv=", k_cache.size(1));
  KILN_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
             "paged_decode_attention: q, k_cache and v_cache must share a dtype (got ", q.scalar_type(), ", ",
             k_cache.scalar_type(), ", ", v_cache.scalar_type(), ")");
  const int64_t n = q.size(0);
  KILN_CHECK(table.dim() == 2 && table.size(0) == n && table.scalar_type() == at::kLong,
             "paged_decode_attention: block_table must be int64 [", n, ", cols] (got ", table.sizes(), " ",
             table.scalar_type(), ")");
  KILN_CHECK(positions.dim() == 1 && positions.size(0) == n && positions.scalar_type() == at::kLong,
             "paged_decode_attention: positions must be int64 [", n, "] (got ", positions.sizes(), " ",
             positions.scalar_type(), ")");
  KILN_CHECK(block_size > 0 && window >= 0 && ring >= 0, "paged_decode_attention: block_size=", block_size,
             " must be positive and window=", window, ", ring=", ring, " non-negative");
  KILN_CHECK(k_cache.size(0) % block_size == 0, "paged_decode_attention: cache rows (", k_cache.size(0),
             ") are not whole blocks of ", block_size);
}

}  // namespace

at::Tensor paged_decode_attention_reference(const at::Tensor& q, const at::Tensor& k_cache,
                                            const at::Tensor& v_cache, const at::Tensor& block_table,
                                            const at::Tensor& positions, int64_t block_size, int64_t window,
                                            int64_t ring) {
  check_args(q, k_cache, v_cache, block_table, positions, block_size, window, ring);
  const int64_t n = q.size(0), hq = q.size(1), hd = q.size(2), group = hq / k_cache.size(1);
  const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor pos = positions.cpu(), table = block_table.cpu();
  at::Tensor out = at::empty_like(q);
  for (int64_t s = 0; s < n; ++s) {
    const int64_t p = pos.data_ptr<int64_t>()[s];
    const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
    std::vector<int64_t> rows;
    for (int64_t j = lo; j <= p; ++j) {
      const int64_t blk = j / block_size, col = ring > 0 ? blk % ring : blk;
      KILN_CHECK(col < table.size(1), "paged_decode_attention: sequence ", s, " position ", j,
                 " needs block-table column ", col, " but the table has ", table.size(1));
      rows.push_back(table.data_ptr<int64_t>()[s * table.size(1) + col] * block_size + j % block_size);
    }
    at::Tensor idx = at::tensor(rows, at::kLong).to(q.device());
    at::Tensor k = k_cache.index_select(0, idx).to(acc).repeat_interleave(group, 1);  // [m, Hq, hd]
    at::Tensor v = v_cache.index_select(0, idx).to(acc).repeat_interleave(group, 1);
    at::Tensor scores = (q[s].to(acc).unsqueeze(0) * k).sum(-1) / std::sqrt(double(hd));  // [m, Hq]
    at::Tensor w = at::softmax(scores, 0);
    out[s].copy_((w.unsqueeze(-1) * v).sum(0));
  }
  return out;
}

bool paged_decode_attention_cuda_supports(at::ScalarType dtype, int64_t head_dim, int64_t group) {
#if KILN_WITH_CUDA
  return (dtype == at::kFloat || dtype == at::kBFloat16) && paged_decode_smem_bytes(head_dim, group) > 0;
#else
  return false;
#endif
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& positions, int64_t block_size,
                                  int64_t window, int64_t ring) {
  if (q.is_cuda() && paged_decode_attention_cuda_supports(q.scalar_type(), q.size(-1), q.size(1) / k_cache.size(1)))
    return paged_decode_attention_cuda(q, k_cache, v_cache, block_table, positions, block_size, window, ring);
  return paged_decode_attention_reference(q, k_cache, v_cache, block_table, positions, block_size, window, ring);
}

at::Tensor paged_decode_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& block_table, const at::Tensor& positions,
                                       int64_t block_size, int64_t window, int64_t ring, PagedDecodeKernel kernel) {
#if KILN_WITH_CUDA
  check_args(q, k_cache, v_cache, block_table, positions, block_size, window, ring);
  const int64_t n = q.size(0), hq = q.size(1), hkv = k_cache.size(1), hd = q.size(2);
  KILN_CHECK(paged_decode_attention_cuda_supports(q.scalar_type(), hd, hq / hkv),
             "paged_decode_attention_cuda: no kernel for dtype ", q.scalar_type(), ", head_dim ", hd,
             ", group ", hq / hkv, " (fp32/bf16, head_dim 16..256 in powers of 2, group <= 16)");
  for (const at::Tensor* t : {&k_cache, &v_cache, &block_table, &positions})
    KILN_CHECK(t->device() == q.device(), "paged_decode_attention_cuda: every input must be on ", q.device(),
               " (got one on ", t->device(), ")");
  KILN_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
             "paged_decode_attention_cuda: the caches must be contiguous (they are written in place)");
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor qc = q.contiguous(), table = block_table.contiguous(), pos = positions.contiguous();
  at::Tensor out = at::empty_like(qc);
  // Enough blocks for two waves over the SMs, but no split shorter than 64 keys of the longest
  // possible range (the positions stay on the device: no sync to learn the real lengths).
  const int64_t longest = window > 0 ? window : table.size(1) * block_size;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want = (2 * sms + n * hkv - 1) / std::max<int64_t>(1, n * hkv);
  const int splits = int(std::clamp<int64_t>(std::min(want, (longest + 63) / 64), 1, 64));
  PagedDecodeArgs a{};
  a.q = qc.data_ptr();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.table = table.data_ptr<int64_t>();
  a.cols = table.size(1);
  a.positions = pos.data_ptr<int64_t>();
  a.n = n, a.hq = hq, a.hkv = hkv, a.head_dim = hd, a.block_size = block_size, a.window = window, a.ring = ring;
  a.splits = splits;
  // The tensor-core kernel reads q and the caches 16 bytes at a time.
  const auto aligned16 = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  const bool mma_ok = q.scalar_type() == at::kBFloat16 && paged_decode_tensor_cores_support(hd, hq / hkv) &&
                      aligned16(qc) && aligned16(k_cache) && aligned16(v_cache);
  KILN_CHECK(kernel != PagedDecodeKernel::kTensorCores || mma_ok,
             "paged_decode_attention_cuda: the tensor-core kernel takes bf16, head_dim 64 or 128, group <= 16 and "
             "16-byte aligned tensors (got ", q.scalar_type(), ", head_dim ", hd, ", group ", hq / hkv, ")");
  a.tensor_cores = mma_ok && kernel != PagedDecodeKernel::kSimt;
  at::Tensor part;
  if (splits > 1) {
    part = at::empty({n * hq * splits * (hd + 2)}, qc.options().dtype(at::kFloat));
    a.part_acc = part.data_ptr<float>();
    a.part_max = a.part_acc + n * hq * splits * hd;
    a.part_sum = a.part_max + n * hq * splits;
  }
  a.out = out.data_ptr();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const cudaError_t err = q.scalar_type() == at::kFloat ? launch_paged_decode_f32(a, stream)
                                                          : launch_paged_decode_bf16(a, stream);
  KILN_CHECK(err == cudaSuccess, "paged_decode_attention_cuda: kernel launch failed: ", cudaGetErrorString(err));
  return out;
#else
  KILN_FAIL("paged_decode_attention_cuda: this build has no CUDA kernels (KILN_WITH_CUDA=0); rebuild with KILN_CUDA=ON");
#endif
}

}  // namespace kiln::kernels
