// Sampling CUDA kernel: one 1024-thread block per row. Thread t owns a contiguous slice of ids, so
// an exclusive scan of the per-thread sums gives every slice its CDF start in id order; the slice
// that holds the draw walks its ids. Sums in fp64, like the CPU reference.
#include <cstdint>

#include "kernels/sampling_cuda.h"

namespace kiln::kernels {
namespace {

constexpr int kThreads = 1024;

__device__ inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// (value, id) pairs ordered by larger value, then smaller id: the first maximum wins.
__device__ inline bool better(float a, int64_t ia, float b, int64_t ib) { return a > b || (a == b && ia < ib); }

__global__ void __launch_bounds__(kThreads) sample_rows_kernel(const float* __restrict__ logits, int64_t V,
                                                               const double* __restrict__ temperature,
                                                               const uint64_t* __restrict__ seeds,
                                                               int64_t* __restrict__ ids, float* __restrict__ logprobs) {
  __shared__ float s_val[kThreads / 32];
  __shared__ int64_t s_idx[kThreads / 32];
  __shared__ double s_sum[kThreads / 32];
  __shared__ unsigned long long s_pick;
  const int row = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const float* x = logits + int64_t(row) * V;
  const int64_t per = (V + kThreads - 1) / kThreads;
  const int64_t lo = min(V, per * tid), hi = min(V, lo + per);

  // 1. First maximum.
  float best = -INFINITY;
  int64_t best_i = V;
  for (int64_t i = lo; i < hi; ++i)
    if (better(x[i], i, best, best_i)) best = x[i], best_i = i;
  for (int off = 16; off > 0; off >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, best, off);
    const int64_t j = __shfl_xor_sync(0xffffffffu, best_i, off);
    if (better(v, j, best, best_i)) best = v, best_i = j;
  }
  if (lane == 0) s_val[warp] = best, s_idx[warp] = best_i;
  __syncthreads();
  if (warp == 0) {
    best = s_val[lane];
    best_i = s_idx[lane];
    for (int off = 16; off > 0; off >>= 1) {
      const float v = __shfl_xor_sync(0xffffffffu, best, off);
      const int64_t j = __shfl_xor_sync(0xffffffffu, best_i, off);
      if (better(v, j, best, best_i)) best = v, best_i = j;
    }
    if (lane == 0) s_val[0] = best, s_idx[0] = best_i, s_pick = (unsigned long long)V;
  }
  __syncthreads();
  const double mx = s_val[0];
  const int64_t argmax = s_idx[0];
  const double temp = temperature[row];
  __syncthreads();

  // 2. This slice's weight sum, then an inclusive scan over threads (warp shuffles, then warps).
  double local = 0;
  for (int64_t i = lo; i < hi; ++i) local += temp == 0 ? exp(double(x[i]) - mx) : exp((double(x[i]) - mx) / temp);
  double incl = local;
  for (int off = 1; off < 32; off <<= 1) {
    const double v = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += v;
  }
  if (lane == 31) s_sum[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    double w = s_sum[lane];
    for (int off = 1; off < 32; off <<= 1) {
      const double v = __shfl_up_sync(0xffffffffu, w, off);
      if (lane >= off) w += v;
    }
    s_sum[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const double z = s_sum[kThreads / 32 - 1];
  const double before = (warp > 0 ? s_sum[warp - 1] : 0.0) + incl - local;  // exclusive prefix
  if (temp == 0) {
    if (tid == 0) ids[row] = argmax, logprobs[row] = float(-log(z));
    return;
  }

  // 3. The slice whose running sum first passes u * z; the lowest such id wins.
  const double target = double(mix64(seeds[row]) >> 11) * 0x1p-53 * z;
  if (lo < hi && target < before + local) {
    double c = before;
    for (int64_t i = lo; i < hi; ++i) {
      c += exp((double(x[i]) - mx) / temp);
      if (target < c) {
        atomicMin(&s_pick, (unsigned long long)i);
        break;
      }
    }
  }
  __syncthreads();
  if (tid == 0) {
    const int64_t pick = s_pick < (unsigned long long)V ? int64_t(s_pick) : argmax;
    ids[row] = pick;
    logprobs[row] = s_pick < (unsigned long long)V ? float(log(exp((double(x[pick]) - mx) / temp) / z)) : float(-log(z));
  }
}

}  // namespace

cudaError_t launch_sample_rows(const float* logits, int64_t rows, int64_t V, const double* temperature,
                               const uint64_t* seeds, int64_t* ids, float* logprobs, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  sample_rows_kernel<<<dim3(unsigned(rows)), dim3(kThreads), 0, stream>>>(logits, V, temperature, seeds, ids, logprobs);
  return cudaGetLastError();
}

}  // namespace kiln::kernels
