// MoE layout kernels, one block each. Counts slots per expert with shared-memory atomics, scans the
// padded and unpadded segment starts in one warp, then places every slot in a stable order by
// expert: up to 256 experts by ranking each slot among its warp's (no sort), up to 1024 through
// cub's block radix sort (stable), and beyond, from a sort the caller made.
// Integer work only, so the result is exact and deterministic.
#include <cub/block/block_radix_sort.cuh>

#include <cstdint>

#include "kernels/moe_layout_cuda.h"

namespace kiln::kernels {
namespace {

// Exclusive prefix sums of the counts (start) and of the counts rounded up to `align` (pad_start),
// by warp 0 in steps of 32 experts, each a shuffle scan carried into the next. The caller syncs.
__device__ void scan_segments(const int* count, int* start, int* pad_start, int E, int align) {
  if (threadIdx.x >= 32) return;
  const int lane = int(threadIdx.x);
  int carry = 0, pad_carry = 0;
  for (int base = 0; base < E; base += 32) {
    const int e = base + lane;
    const int c = e < E ? count[e] : 0;
    const int p = (c + align - 1) / align * align;
    int s = c, ps = p;  // inclusive
    for (int d = 1; d < 32; d *= 2) {
      const int a = __shfl_up_sync(~0u, s, d), b = __shfl_up_sync(~0u, ps, d);
      if (lane >= d) s += a, ps += b;
    }
    if (e < E) start[e] = carry + s - c, pad_start[e] = pad_carry + ps - p;
    carry += __shfl_sync(~0u, s, 31);
    pad_carry += __shfl_sync(~0u, ps, 31);
  }
}

__device__ void write_segments(const int* count, const int* pad_start, int E, int align, int64_t bound,
                               MoeSegmentsOut seg) {
  if (threadIdx.x == 0) seg.segments[0] = 0;
  for (int e = int(threadIdx.x); e < E; e += int(blockDim.x)) {
    const int end = pad_start[e] + (count[e] + align - 1) / align * align;
    seg.counts[e] = count[e];
    seg.offsets[e] = e == E - 1 ? int32_t(bound) : int32_t(end);
    seg.ends[e] = end;
    seg.segments[e + 1] = end;
  }
}

template <int Threads, int Items>
__global__ void __launch_bounds__(Threads)
    moe_layout_sort_kernel(const int64_t* __restrict__ ids, int n, int E, int top_k, int align, MoeSegmentsOut seg,
                           int64_t* order, int64_t* dest, int64_t* src_token, int64_t* slot_row) {
  using Sort = cub::BlockRadixSort<unsigned, Threads, Items, int>;
  __shared__ typename Sort::TempStorage sort_storage;
  __shared__ int count[kMoeLayoutSortExperts], start[kMoeLayoutSortExperts], pad_start[kMoeLayoutSortExperts];
  for (int e = int(threadIdx.x); e < E; e += Threads) count[e] = 0;
  __syncthreads();
  unsigned key[Items];
  int slot[Items];
  for (int i = 0; i < Items; ++i) {  // blocked: thread t holds slots t * Items ...
    const int r = int(threadIdx.x) * Items + i;
    key[i] = r < n ? unsigned(ids[r]) : unsigned(E);  // padding sorts after every expert
    slot[i] = r;
    if (r < n) atomicAdd(&count[key[i]], 1);
  }
  __syncthreads();
  scan_segments(count, start, pad_start, E, align);
  Sort(sort_storage).Sort(key, slot, 0, 32 - __clz(E));  // bits [0, end) hold E itself
  __syncthreads();
  write_segments(count, pad_start, E, align, int64_t(n) + int64_t(E) * (align - 1), seg);
  for (int i = 0; i < Items; ++i) {
    const int p = int(threadIdx.x) * Items + i;  // sorted position (blocked again)
    if (p >= n) break;
    const int e = int(key[i]);
    const int64_t d = pad_start[e] + (p - start[e]);
    order[p] = slot[i];
    dest[p] = d;
    src_token[p] = slot[i] / top_k;
    slot_row[slot[i]] = d;
  }
}

// Up to kMatchExperts experts, a stable rank without a sort: chunks of 1024 slots (one per
// thread); a slot's rank among its expert's slots is its rank within its warp's matching lanes
// (__match_any_sync) plus the counts of the warps before it in this chunk and of earlier chunks.
constexpr int kMatchThreads = 1024, kMatchWarps = kMatchThreads / 32, kMatchExperts = 256;

__global__ void __launch_bounds__(kMatchThreads)
    moe_layout_match_kernel(const int64_t* __restrict__ ids, int n, int E, int top_k, int align, MoeSegmentsOut seg,
                            int64_t* order, int64_t* dest, int64_t* src_token, int64_t* slot_row) {
  __shared__ int count[kMatchExperts], start[kMatchExperts], pad_start[kMatchExperts], before[kMatchExperts];
  __shared__ int warp_count[kMatchWarps][kMatchExperts];  // this chunk's slots per (warp, expert), then their prefix
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  for (int e = tid; e < E; e += kMatchThreads) count[e] = 0, before[e] = 0;
  __syncthreads();
  for (int r = tid; r < n; r += kMatchThreads) atomicAdd(&count[ids[r]], 1);
  __syncthreads();
  scan_segments(count, start, pad_start, E, align);
  __syncthreads();
  write_segments(count, pad_start, E, align, int64_t(n) + int64_t(E) * (align - 1), seg);
  const unsigned below = (1u << lane) - 1u;
  for (int c0 = 0; c0 < n; c0 += kMatchThreads) {
    for (int i = tid; i < kMatchWarps * E; i += kMatchThreads) warp_count[i / E][i % E] = 0;
    __syncthreads();
    const int r = c0 + tid;
    const int e = r < n ? int(ids[r]) : -1;
    const unsigned peers = __match_any_sync(~0u, e);
    const int rank_in_warp = __popc(peers & below);
    if (e >= 0 && rank_in_warp == 0) warp_count[warp][e] = __popc(peers);
    __syncthreads();
    for (int x = tid; x < E; x += kMatchThreads) {  // prefix over warps, carried across chunks
      int run = before[x];
      for (int w = 0; w < kMatchWarps; ++w) {
        const int c = warp_count[w][x];
        warp_count[w][x] = run;
        run += c;
      }
      before[x] = run;
    }
    __syncthreads();
    if (e >= 0) {
      const int rank = warp_count[warp][e] + rank_in_warp;  // among expert e's slots, in slot order
      const int64_t p = start[e] + rank, d = pad_start[e] + rank;
      order[p] = r;
      dest[p] = d;
      src_token[p] = r / top_k;
      slot_row[r] = d;
    }
    __syncthreads();  // warp_count is zeroed again for the next chunk
  }
}

constexpr int kSortedThreads = 1024;

__global__ void __launch_bounds__(kSortedThreads)
    moe_layout_sorted_kernel(const int64_t* __restrict__ sorted, const int64_t* __restrict__ order, int64_t n, int E,
                             int64_t top_k, int align, MoeSegmentsOut seg, int64_t* dest, int64_t* src_token,
                             int64_t* slot_row) {
  __shared__ int count[kMoeLayoutMaxExperts];
  __shared__ int start[kMoeLayoutMaxExperts];      // first sorted slot of each expert
  __shared__ int pad_start[kMoeLayoutMaxExperts];  // first padded row of each expert
  for (int e = int(threadIdx.x); e < E; e += kSortedThreads) count[e] = 0;
  __syncthreads();
  for (int64_t r = threadIdx.x; r < n; r += kSortedThreads) atomicAdd(&count[sorted[r]], 1);
  __syncthreads();
  scan_segments(count, start, pad_start, E, align);
  __syncthreads();
  write_segments(count, pad_start, E, align, n + int64_t(E) * (align - 1), seg);
  for (int64_t r = threadIdx.x; r < n; r += kSortedThreads) {
    const int64_t e = sorted[r], slot = order[r];
    const int64_t d = pad_start[e] + (r - start[e]);
    dest[r] = d;
    src_token[r] = slot / top_k;
    slot_row[slot] = d;
  }
}

}  // namespace

cudaError_t launch_moe_layout(const int64_t* ids, int64_t n, int64_t num_experts, int64_t top_k, int64_t align,
                              MoeSegmentsOut seg, int64_t* order, int64_t* dest, int64_t* src_token, int64_t* slot_row,
                              cudaStream_t stream) {
  if (num_experts < 1 || num_experts > kMoeLayoutSortExperts || n > kMoeLayoutSortRows) return cudaErrorInvalidValue;
  const int N = int(n), E = int(num_experts), k = int(top_k), a = int(align);
  if (E <= kMatchExperts) {
    moe_layout_match_kernel<<<1, kMatchThreads, 0, stream>>>(ids, N, E, k, a, seg, order, dest, src_token, slot_row);
    return cudaGetLastError();
  }
  if (n <= 512)
    moe_layout_sort_kernel<128, 4><<<1, 128, 0, stream>>>(ids, N, E, k, a, seg, order, dest, src_token, slot_row);
  else
    moe_layout_sort_kernel<512, 8><<<1, 512, 0, stream>>>(ids, N, E, k, a, seg, order, dest, src_token, slot_row);
  return cudaGetLastError();
}

cudaError_t launch_moe_layout_sorted(const int64_t* sorted_experts, const int64_t* order, int64_t n,
                                     int64_t num_experts, int64_t top_k, int64_t align, MoeSegmentsOut seg,
                                     int64_t* dest, int64_t* src_token, int64_t* slot_row, cudaStream_t stream) {
  if (num_experts < 1 || num_experts > kMoeLayoutMaxExperts) return cudaErrorInvalidValue;
  moe_layout_sorted_kernel<<<1, kSortedThreads, 0, stream>>>(sorted_experts, order, n, int(num_experts), top_k,
                                                             int(align), seg, dest, src_token, slot_row);
  return cudaGetLastError();
}

}  // namespace kiln::kernels
