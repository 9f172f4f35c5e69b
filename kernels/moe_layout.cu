// MoE layout kernel: one block. Counts slots per expert with shared-memory atomics, scans the
// padded and unpadded segment starts, then places every sorted slot. Integer work only, so the
// result is exact and deterministic.
#include <cstdint>

#include "kernels/moe_layout_cuda.h"

namespace kiln::kernels {
namespace {

constexpr int kThreads = 1024;

__global__ void __launch_bounds__(kThreads) moe_layout_kernel(const int64_t* __restrict__ sorted,
                                                              const int64_t* __restrict__ order, int64_t n, int E,
                                                              int64_t top_k, int64_t align, int64_t* counts,
                                                              int32_t* offsets, int64_t* dest, int64_t* src_token,
                                                              int64_t* slot_row) {
  __shared__ int count[kMoeLayoutMaxExperts];
  __shared__ int start[kMoeLayoutMaxExperts];      // first sorted slot of each expert
  __shared__ int pad_start[kMoeLayoutMaxExperts];  // first padded row of each expert
  for (int e = threadIdx.x; e < E; e += kThreads) count[e] = 0;
  __syncthreads();
  for (int64_t r = threadIdx.x; r < n; r += kThreads) atomicAdd(&count[sorted[r]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int s = 0, p = 0;
    for (int e = 0; e < E; ++e) {
      start[e] = s;
      pad_start[e] = p;
      s += count[e];
      p += int((count[e] + align - 1) / align * align);
    }
  }
  __syncthreads();
  const int64_t bound = n + int64_t(E) * (align - 1);
  for (int e = threadIdx.x; e < E; e += kThreads) {
    counts[e] = count[e];
    offsets[e] = e == E - 1 ? int32_t(bound) : int32_t(pad_start[e] + (count[e] + align - 1) / align * align);
  }
  for (int64_t r = threadIdx.x; r < n; r += kThreads) {
    const int64_t e = sorted[r], slot = order[r];
    const int64_t d = pad_start[e] + (r - start[e]);
    dest[r] = d;
    src_token[r] = slot / top_k;
    slot_row[slot] = d;
  }
}

}  // namespace

cudaError_t launch_moe_layout(const int64_t* sorted_experts, const int64_t* order, int64_t n, int64_t num_experts,
                              int64_t top_k, int64_t align, int64_t* counts, int32_t* offsets, int64_t* dest,
                              int64_t* src_token, int64_t* slot_row, cudaStream_t stream) {
  if (num_experts < 1 || num_experts > kMoeLayoutMaxExperts) return cudaErrorInvalidValue;
  moe_layout_kernel<<<1, kThreads, 0, stream>>>(sorted_experts, order, n, int(num_experts), top_k, align, counts,
                                                offsets, dest, src_token, slot_row);
  return cudaGetLastError();
}

}  // namespace kiln::kernels
