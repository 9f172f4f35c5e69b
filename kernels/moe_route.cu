// MoE routing kernel: one warp per token holds its E scores in registers (expert lane + 32 j),
// takes the softmax (or sigmoid) with warp reductions, picks the top k by k warp arg-maxes (ties
// to the lower id) and renormalises the chosen scores.
#include <climits>
#include <cmath>
#include <cstdint>

#include "kernels/moe_route_cuda.h"

namespace kiln::kernels {
namespace {

constexpr int kWarps = 4;

__device__ float warp_max(float v) {
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(~0u, v, o));
  return v;
}
__device__ float warp_sum(float v) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(~0u, v, o);
  return v;
}

template <int PerLane>
__global__ void __launch_bounds__(kWarps * 32)
    moe_route_kernel(const float* __restrict__ logits, int T, int E, int k, bool sigmoid, const float* __restrict__ bias,
                     const int64_t* __restrict__ replay, int64_t* __restrict__ ids, float* __restrict__ weights) {
  const int lane = int(threadIdx.x) & 31;
  const int t = int(blockIdx.x) * kWarps + int(threadIdx.x) / 32;
  if (t >= T) return;
  const float* row = logits + int64_t(t) * E;
  float score[PerLane], select[PerLane];
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < PerLane; ++j) {
    const int e = lane + 32 * j;
    score[j] = e < E ? row[e] : -INFINITY;
    m = fmaxf(m, score[j]);
  }
  if (sigmoid) {
#pragma unroll
    for (int j = 0; j < PerLane; ++j) score[j] = lane + 32 * j < E ? 1.0f / (1.0f + expf(-score[j])) : 0.0f;
  } else {
    m = warp_max(m);
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < PerLane; ++j) {
      score[j] = lane + 32 * j < E ? expf(score[j] - m) : 0.0f;
      s += score[j];
    }
    s = warp_sum(s);
#pragma unroll
    for (int j = 0; j < PerLane; ++j) score[j] = score[j] / s;
  }
#pragma unroll
  for (int j = 0; j < PerLane; ++j) {
    const int e = lane + 32 * j;
    float v = e < E ? score[j] + (bias ? bias[e] : 0.0f) : -INFINITY;
    select[j] = isnan(v) ? INFINITY : v;  // NaN ranks first, as in torch's topk; its weight stays NaN
  }
  float chosen = 0.0f;
  for (int r = 0; r < k; ++r) {
    int best;
    if (replay) {
      best = int(replay[int64_t(t) * k + r]);
    } else {
      float bv = -INFINITY;
      best = INT_MAX;
#pragma unroll
      for (int j = 0; j < PerLane; ++j) {
        const int e = lane + 32 * j;
        if (e < E && (select[j] > bv || (select[j] == bv && e < best))) bv = select[j], best = e;
      }
      for (int o = 16; o; o >>= 1) {
        const float ov = __shfl_xor_sync(~0u, bv, o);
        const int oe = __shfl_xor_sync(~0u, best, o);
        if (ov > bv || (ov == bv && oe < best)) bv = ov, best = oe;
      }
#pragma unroll
      for (int j = 0; j < PerLane; ++j)
        if (lane + 32 * j == best) select[j] = -INFINITY;  // chosen: out of the next rounds
    }
    float sc = 0.0f;
#pragma unroll
    for (int j = 0; j < PerLane; ++j)
      if (lane + 32 * j == best) sc = score[j];
    sc = __shfl_sync(~0u, sc, best & 31);
    chosen += sc;
    if (lane == (r & 31)) {
      ids[int64_t(t) * k + r] = best;
      weights[int64_t(t) * k + r] = sc;
    }
  }
  for (int r = lane; r < k; r += 32) weights[int64_t(t) * k + r] = weights[int64_t(t) * k + r] / chosen;
}

}  // namespace

cudaError_t launch_moe_route(const float* logits, int64_t T, int64_t E, int64_t k, bool sigmoid, const float* bias,
                             const int64_t* replay, int64_t* ids, float* weights, cudaStream_t stream) {
  if (E < 1 || E > kMoeRouteMaxExperts || k < 1 || k > kMoeRouteMaxTopK || k > E) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  const dim3 grid(unsigned((T + kWarps - 1) / kWarps)), block(kWarps * 32);
  const int t = int(T), e = int(E), kk = int(k);
  if (E <= 64)
    moe_route_kernel<2><<<grid, block, 0, stream>>>(logits, t, e, kk, sigmoid, bias, replay, ids, weights);
  else if (E <= 256)
    moe_route_kernel<8><<<grid, block, 0, stream>>>(logits, t, e, kk, sigmoid, bias, replay, ids, weights);
  else
    moe_route_kernel<32><<<grid, block, 0, stream>>>(logits, t, e, kk, sigmoid, bias, replay, ids, weights);
  return cudaGetLastError();
}

}  // namespace kiln::kernels
