// Batch-invariant CUDA kernels (rollout.numerics: bitwise): a GEMM and a ranged attention whose
// every output row is computed by the same instructions in the same reduction order whatever the
// number of rows, their place in the batch or the grid; no split-K, no atomics, no shape heuristics.
#include <cuda_bf16.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kernels/cuda_convert.cuh"
#include "kernels/cuda_memory.cuh"
#include "kernels/cuda_mma.cuh"
#include "kernels/cuda_wgmma.cuh"
#include "kernels/invariant_cuda.h"

namespace kiln::kernels {
namespace {

// ---------------------------------------------------------------------------------------------
// bf16 GEMM y = x . w^T on tensor cores. A block computes a TM x TN tile of y (TM 64 or 128, TN 128,
// 64 or 32) over K in steps of 32 (two mma k-steps each, in order), three stages deep through
// cp.async; rows past M and columns past K are zero-filled in shared memory. Each y element is one
// accumulator that adds the mma products of K's 16-wide chunks in ascending order, whatever TM,
// TN, the pipeline depth, the fragment loads (ldmatrix) or the grid: so a row's result is its own
// for any M, and the launch may pick the tile by shape (a large one where there are rows enough to
// fill the GPU with it, narrower ones where a decode step's few rows would leave SMs idle).
constexpr int kTn = 128, kTk = 32, kGemmThreads = 256, kStages = 3;
constexpr int kPitch = kTk + 8;  // bf16 per shared row: 80 bytes keeps the ldmatrix rows conflict-free

template <int TM, int TN>
__host__ __device__ constexpr int gemm_smem_bytes() {
  return kStages * (TM + TN) * kPitch * int(sizeof(__nv_bfloat16));
}

// Four 8 x 8 bf16 matrices from shared memory: lane l gives the address of row l % 8 of matrix
// l / 8 and receives, in r[j], its (row l / 4, columns 2 (l % 4) and + 1) of matrix j: the mma
// fragment layout.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// The TM x TN tile at rows [m0, m_end) of x (at most TM), columns n0.. of w [N, K], into y [*, N].
// Eight warps as WM x WN, each a (TM / WM) x (TN / WN) sub-tile of 16-row and 8-column mma tiles;
// shared memory is the kernel's dynamic one.
template <int TM, int TN>
__device__ __forceinline__ void gemm_bf16_tile(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                               __nv_bfloat16* __restrict__ y, int64_t m0, int64_t m_end, int64_t n0,
                                               int N, int K) {
  constexpr int WN = TN == 128 ? 4 : 2, WM = 8 / WN;
  constexpr int MI = TM / WM / 16, NI = TN / WN / 8;  // the warp's 16-row and 8-column mma tiles
  static_assert(MI >= 1 && NI >= 2 && NI % 2 == 0, "a warp takes whole m16 tiles and pairs of n8 tiles");
  extern __shared__ __align__(16) unsigned char gemm_smem[];
  auto xs = reinterpret_cast<__nv_bfloat16(*)[TM][kPitch]>(gemm_smem);
  auto ws = reinterpret_cast<__nv_bfloat16(*)[TN][kPitch]>(gemm_smem + kStages * TM * kPitch * sizeof(__nv_bfloat16));
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = lane % 4;
  const int wm = (warp / WN) * (TM / WM), wn = (warp % WN) * (TN / WN);
  // ldmatrix rows: for x, matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15) as a0..a3; for w, two n-tiles
  // x (k 0-7 | 8-15) as b[ni][0..1], b[ni + 1][0..1].
  const int a_row = lane % 8 + ((lane / 8) % 2) * 8, a_col = (lane / 16) * 8;
  const int b_row = lane % 8 + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;

  auto load = [&](int stage, int k0) {
#pragma unroll
    for (int i = 0; i < TM * 4 / kGemmThreads; ++i) {  // x: TM rows x 4 chunks of 8
      const int id = tid + i * kGemmThreads, r = id / 4, c = (id % 4) * 8;
      const bool in = m0 + r < m_end && k0 + c < K;
      cp_async16(&xs[stage][r][c], in ? x + (m0 + r) * K + k0 + c : x, in);
    }
#pragma unroll
    for (int i = 0; i < (TN * 4 + kGemmThreads - 1) / kGemmThreads; ++i) {  // w: TN rows x 4 chunks
      const int id = tid + i * kGemmThreads, r = id / 4, c = (id % 4) * 8;
      if (id >= TN * 4) break;
      const bool in = n0 + r < N && k0 + c < K;
      cp_async16(&ws[stage][r][c], in ? w + (n0 + r) * K + k0 + c : w, in);
    }
    cp_async_commit();
  };

  float acc[MI][NI][4] = {};
  const int steps = (K + kTk - 1) / kTk;
  load(0, 0);
  if (steps > 1) load(1, kTk);
  for (int s = 0; s < steps; ++s) {
    const int stage = s % kStages;
    // Stage s is complete once at most the loads issued after it are pending.
    if (s + 2 < steps) {
      load((s + 2) % kStages, (s + 2) * kTk);  // into the stage read in iteration s - 1
      cp_async_wait<2>();
    } else if (s + 1 < steps) {
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTk; kk += 16) {
      uint32_t a[MI][4], b[NI][2];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) ldmatrix_x4(a[mi], &xs[stage][wm + mi * 16 + a_row][kk + a_col]);
#pragma unroll
      for (int ni = 0; ni < NI; ni += 2) {
        uint32_t r[4];
        ldmatrix_x4(r, &ws[stage][wn + ni * 8 + b_row][kk + b_col]);
        b[ni][0] = r[0], b[ni][1] = r[1], b[ni + 1][0] = r[2], b[ni + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
          mma_bf16(acc[mi][ni], a[mi][0], a[mi][1], a[mi][2], a[mi][3], b[ni][0], b[ni][1]);
    }
    __syncthreads();  // a later iteration's load overwrites the stage just read
  }
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // rows g and g + 8
        const int64_t row = m0 + wm + mi * 16 + g + h * 8, col = n0 + wn + ni * 8 + 2 * t;
        if (row >= m_end) continue;
        if (col < N) y[row * N + col] = __float2bfloat16_rn(acc[mi][ni][2 * h]);
        if (col + 1 < N) y[row * N + col + 1] = __float2bfloat16_rn(acc[mi][ni][2 * h + 1]);
      }
}

// ---------------------------------------------------------------------------------------------
// The same GEMM on Hopper's warpgroup MMA (invariant_gemm_kernel() == kInvariantWgmma). A block of
// TM / 64 warpgroups computes a TM x TN tile (TN 128, or 64 and 32 for a decode step's few rows);
// each warpgroup its 64 rows by one m64nTNk16 per 16-wide K chunk, in ascending order, into FP32
// accumulators. K steps of 64 (one 128-byte swizzled row per operand row, zero past K and past the
// matrices) are staged four deep by cp.async. A row's bits do not depend on TM, M or the grid, nor
// (the tests hold them to it) on TN; they may differ from mma.sync's, so a process uses one of
// the two for every invariant GEMM.
constexpr int kWgK = 64, kWgStages = 4;

template <int TM>
__host__ __device__ constexpr int wgmma_threads() {
  return TM / 64 * 128;
}
template <int TM, int TN>
__host__ __device__ constexpr int wgmma_stage_bytes() {
  return (TM + TN) * kWgK * int(sizeof(__nv_bfloat16));
}
template <int TM, int TN>
__host__ __device__ constexpr int wgmma_smem_bytes() {
  return kWgStages * wgmma_stage_bytes<TM, TN>() + 1024;  // + room to start on 1024 bytes
}

template <int TM, int TN>
__device__ __forceinline__ void gemm_wgmma_tile(const __nv_bfloat16* __restrict__ x,
                                                const __nv_bfloat16* __restrict__ w, __nv_bfloat16* __restrict__ y,
                                                int64_t m0, int64_t m_end, int64_t n0, int N, int K) {
  constexpr int kThreads = wgmma_threads<TM>(), kStage = wgmma_stage_bytes<TM, TN>();
  extern __shared__ __align__(16) unsigned char wgmma_smem[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(wgmma_smem));
  const uint32_t pad = (1024u - (raw & 1023u)) & 1023u;
  unsigned char* smem = wgmma_smem + pad;  // stage s: x rows [TM x 128 B], then w rows [TN x 128 B]
  const uint32_t base = raw + pad;
  const int tid = threadIdx.x, wg = tid / 128;

  auto load = [&](int stage, int k0) {
    unsigned char* xs = smem + stage * kStage;
    unsigned char* ws = xs + TM * kWgK * 2;
#pragma unroll
    for (int i = 0; i < TM * 8 / kThreads; ++i) {  // x: TM rows x 8 chunks of 8 values
      const int id = tid + i * kThreads, r = id / 8, c = id % 8;
      const bool in = m0 + r < m_end && k0 + 8 * c < K;
      cp_async16(xs + wgmma::swizzled(r, c), in ? x + (m0 + r) * K + k0 + 8 * c : x, in);
    }
#pragma unroll
    for (int i = 0; i < TN * 8 / kThreads; ++i) {  // w: TN rows x 8 chunks
      const int id = tid + i * kThreads, r = id / 8, c = id % 8;
      const bool in = n0 + r < N && k0 + 8 * c < K;
      cp_async16(ws + wgmma::swizzled(r, c), in ? w + (n0 + r) * K + k0 + 8 * c : w, in);
    }
  };

  float acc[TN / 2];
#pragma unroll
  for (int i = 0; i < TN / 2; ++i) acc[i] = 0.0f;
  // Step s's copies go into stage s % 4 two steps ahead, so while step s's products run the
  // tensor cores may still be on step s - 1's, and the copies overwrite step s - 2's operands,
  // which every warpgroup has finished with (wait<1> in the step before, then the barrier).
  const int steps = (K + kWgK - 1) / kWgK;
#pragma unroll
  for (int s = 0; s < kWgStages - 2; ++s) {  // a group per step, empty past K, so the count is fixed
    if (s < steps) load(s, s * kWgK);
    cp_async_commit();
  }
  for (int s = 0; s < steps; ++s) {
    cp_async_wait<kWgStages - 3>();  // this thread's copies of step s have landed
    wgmma::fence_shared_for_async();
    __syncthreads();  // everyone's have, and every warpgroup is done with step s - 2's products
    const int next = s + kWgStages - 2;
    if (next < steps) load(next % kWgStages, next * kWgK);
    cp_async_commit();
    const uint32_t xs = base + uint32_t((s % kWgStages) * kStage), ws = xs + uint32_t(TM * kWgK * 2);
    wgmma::pin(acc);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kWgK / 16; ++kk)  // K's 16-wide chunks in ascending order
      wgmma::mma_m64k16<TN>(acc, wgmma::desc_sw128(xs + uint32_t(wg * 64 * kWgK * 2 + 32 * kk)),
                            wgmma::desc_sw128(ws + uint32_t(32 * kk)));
    wgmma::commit();
    wgmma::wait<1>();
  }
  wgmma::wait<0>();
  wgmma::pin(acc);
  const int lane = tid % 32;
  const int64_t row0 = m0 + 64 * wg + 16 * ((tid % 128) / 32) + lane / 4;
#pragma unroll
  for (int j = 0; j < TN / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // rows row0 and row0 + 8
      const int64_t row = row0 + 8 * h, col = n0 + 8 * j + 2 * (lane % 4);
      if (row >= m_end || col >= N) continue;
      __nv_bfloat16* out = y + row * N + col;
      if (N % 2 == 0) {  // col is even: the pair is one aligned 4-byte store
        *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
      } else {
        out[0] = __float2bfloat16_rn(acc[4 * j + 2 * h]);
        if (col + 1 < N) out[1] = __float2bfloat16_rn(acc[4 * j + 2 * h + 1]);
      }
    }
}

template <int TM, bool kWgmma>
__host__ __device__ constexpr int gemm_threads() {
  return kWgmma ? wgmma_threads<TM>() : kGemmThreads;
}

// The TM x TN tile on mma.sync or on wgmma.
template <int TM, int TN, bool kWgmma>
__device__ __forceinline__ void gemm_tile(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                          __nv_bfloat16* __restrict__ y, int64_t m0, int64_t m_end, int64_t n0, int N,
                                          int K) {
  if constexpr (kWgmma) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    gemm_wgmma_tile<TM, TN>(x, w, y, m0, m_end, n0, N, K);
#else
    __trap();  // built without sm_90a: the launchers never pick it (invariant_wgmma_usable)
#endif
  } else {
    gemm_bf16_tile<TM, TN>(x, w, y, m0, m_end, n0, N, K);
  }
}

template <int TM, int TN, bool kWgmma>
__global__ void __launch_bounds__(gemm_threads<TM, kWgmma>())
    gemm_bf16_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                     __nv_bfloat16* __restrict__ y, int M, int N, int K) {
  const int64_t m0 = int64_t(blockIdx.x) * TM;  // row tiles on x (up to 2^31 - 1), column tiles on y
  gemm_tile<TM, TN, kWgmma>(x, w, y, m0, M, int64_t(blockIdx.y) * TN, N, K);
}

// Rows sorted by group: group e holds rows [offsets[e], offsets[e + 1]) and multiplies w[e]. Block
// row b (blockIdx.x) is the b-th TM-row tile counted across the groups in order; the grid bounds
// them from above (rows / TM + groups), so nothing is read back to the host.
template <int TM, int TN, bool kWgmma>
__global__ void __launch_bounds__(gemm_threads<TM, kWgmma>())
    gemm_bf16_grouped_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                             __nv_bfloat16* __restrict__ y, const int64_t* __restrict__ offsets, int groups, int N,
                             int K) {
  int64_t tile = blockIdx.x;
  for (int e = 0; e < groups; ++e) {
    const int64_t lo = offsets[e], hi = offsets[e + 1], tiles = (hi - lo + TM - 1) / TM;
    if (tile < tiles) {
      gemm_tile<TM, TN, kWgmma>(x, w + int64_t(e) * N * K, y, lo + tile * TM, hi, int64_t(blockIdx.y) * TN, N, K);
      return;
    }
    tile -= tiles;
  }
}

// Launches `kernel` (the TM, TN, kWgmma instance) with its threads and dynamic shared memory,
// raising the kernel's limit past the default 48 KB the first time on each device (the attribute
// is per device; each instance has its own flags).
template <int TM, int TN, bool kWgmma, typename Kernel, typename... Args>
cudaError_t launch_gemm(Kernel kernel, dim3 grid, cudaStream_t stream, Args... args) {
  constexpr int bytes = kWgmma ? wgmma_smem_bytes<TM, TN>() : gemm_smem_bytes<TM, TN>();
  static std::atomic<bool> raised[kMaxDevices];
  const cudaError_t err = raise_smem_limit(kernel, bytes, raised);
  if (err != cudaSuccess) return err;
  kernel<<<grid, gemm_threads<TM, kWgmma>(), bytes, stream>>>(args...);
  return cudaGetLastError();
}

// The large tile where its blocks still fill the GPU about twice over; the bits are the same.
bool large_tile(int64_t row_tiles_128, int64_t col_tiles) { return row_tiles_128 * col_tiles >= 2 * num_sms(); }

// ---------------------------------------------------------------------------------------------
// Any dtype on CUDA cores (fp32, fp64, unaligned bf16): a block computes 32 x 32 outputs, a
// thread four rows of one column, each a fused multiply-add per k in order, accumulated in Acc.
constexpr int kSimpleTile = 32;

template <typename T, typename Acc>
__device__ __forceinline__ Acc to_acc(T v) {
  if constexpr (std::is_same_v<T, double>) return v;
  else return Acc(to_float(v));
}
template <typename T, typename Acc>
__device__ __forceinline__ T from_acc(Acc v) {
  if constexpr (std::is_same_v<T, double>) return v;
  else return from_float<T>(float(v));
}

template <typename T, typename Acc>
__global__ void gemm_simple_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int M, int N,
                                   int K) {
  __shared__ Acc xs[kSimpleTile][kSimpleTile + 1], ws[kSimpleTile][kSimpleTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;  // 32 x 8
  const int64_t m0 = int64_t(blockIdx.x) * kSimpleTile, n0 = int64_t(blockIdx.y) * kSimpleTile;
  Acc acc[4] = {};
  for (int k0 = 0; k0 < K; k0 += kSimpleTile) {
    for (int r = ty; r < kSimpleTile; r += 8) {
      const bool kin = k0 + tx < K;
      xs[r][tx] = kin && m0 + r < M ? to_acc<T, Acc>(x[(m0 + r) * K + k0 + tx]) : Acc(0);
      ws[r][tx] = kin && n0 + r < N ? to_acc<T, Acc>(w[(n0 + r) * K + k0 + tx]) : Acc(0);
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < kSimpleTile; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] = fma(xs[ty + 8 * i][kk], ws[tx][kk], acc[i]);
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t row = m0 + ty + 8 * i, col = n0 + tx;
    if (row < M && col < N) y[row * N + col] = from_acc<T, Acc>(acc[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// Ranged attention: a warp per (query, head) walks the query's keys one at a time in order with an
// online softmax in Acc. The score's sum over head dims is a butterfly, whose every lane ends with
// the same bits (each step adds the same two values, a + b = b + a), so the lanes agree.
constexpr int kAttnWarps = 4, kMaxPerLane = 8;  // head_dim <= 256

template <typename Acc>
__device__ __forceinline__ Acc warp_sum(Acc v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T, typename Acc>
__global__ void __launch_bounds__(kAttnWarps * 32)
    ranged_attention_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                            const T* __restrict__ kf, const T* __restrict__ vf, const int32_t* __restrict__ table,
                            const int32_t* __restrict__ begin, const int32_t* __restrict__ count, T* __restrict__ o,
                            int64_t pairs, int Hq, int Hkv, int hd, Acc scale) {
  const int lane = threadIdx.x % 32;
  const int64_t pair = int64_t(blockIdx.x) * kAttnWarps + threadIdx.x / 32;
  if (pair >= pairs) return;
  const int64_t i = pair / Hq;
  const int h = int(pair % Hq), kvh = h / (Hq / Hkv);
  Acc qv[kMaxPerLane], acc[kMaxPerLane];
#pragma unroll
  for (int p = 0; p < kMaxPerLane; ++p) {
    const int d = lane + 32 * p;
    qv[p] = d < hd ? to_acc<T, Acc>(q[(i * Hq + h) * hd + d]) : Acc(0);
    acc[p] = 0;
  }
  Acc m = -INFINITY, l = 0;
  const int64_t first = begin[i];
  for (int j = 0; j < count[i]; ++j) {
    // The key's row: of k and v, or through the table, of k/v (>= 0) or of kf/vf (-1 - entry).
    const T *kb = k, *vb = v;
    int64_t key = first + j;
    if (table) {
      const int32_t e = table[key];
      key = e >= 0 ? e : -1 - e;
      if (e < 0) kb = kf, vb = vf;
    }
    const int64_t row = (key * Hkv + kvh) * hd;
    Acc s = 0;
#pragma unroll
    for (int p = 0; p < kMaxPerLane; ++p) {
      const int d = lane + 32 * p;
      if (d < hd) s = fma(qv[p], to_acc<T, Acc>(kb[row + d]), s);
    }
    s = warp_sum(s) * scale;
    const Acc mn = s > m ? s : m;
    const Acc corr = exp(m - mn), e = exp(s - mn);
    l = l * corr + e;
#pragma unroll
    for (int p = 0; p < kMaxPerLane; ++p) {
      const int d = lane + 32 * p;
      if (d < hd) acc[p] = acc[p] * corr + e * to_acc<T, Acc>(vb[row + d]);
    }
    m = mn;
  }
#pragma unroll
  for (int p = 0; p < kMaxPerLane; ++p) {
    const int d = lane + 32 * p;
    if (d < hd) o[(i * Hq + h) * hd + d] = from_acc<T, Acc>(l > 0 ? acc[p] / l : Acc(0));
  }
}

unsigned blocks(int64_t n, int per) { return unsigned((n + per - 1) / per); }

// f(T{}, Acc{}) for a dtype code: the storage type and the accumulation type; false for a code
// that names none.
template <typename F>
bool with_dtype(int dtype, const F& f) {
  switch (dtype) {
    case kInvariantF32: return f(float{}, float{}), true;
    case kInvariantBf16: return f(__nv_bfloat16{}, float{}), true;
    case kInvariantF64: return f(double{}, double{}), true;
    default: return false;
  }
}

// The bf16 tensor-core GEMM on mma.sync or wgmma: the large tile where its blocks fill the GPU;
// where 64 x 128 tiles would not cover the SMs once (a decode step's few rows), 64 or 32 columns
// per tile instead: a row's bits are the same.
template <bool kWgmma>
cudaError_t dense_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, int m, int n, int k,
                       cudaStream_t stream) {
  const dim3 large(blocks(m, 128), blocks(n, kTn));
  if (large_tile(large.x, large.y))
    return launch_gemm<128, kTn, kWgmma>(gemm_bf16_kernel<128, kTn, kWgmma>, large, stream, x, w, y, m, n, k);
  const int64_t sms = num_sms();
  const unsigned rows = blocks(m, 64);
  if (int64_t(rows) * blocks(n, kTn) >= sms)
    return launch_gemm<64, kTn, kWgmma>(gemm_bf16_kernel<64, kTn, kWgmma>, dim3(rows, blocks(n, kTn)), stream, x, w, y,
                                        m, n, k);
  if (int64_t(rows) * blocks(n, 64) >= sms)
    return launch_gemm<64, 64, kWgmma>(gemm_bf16_kernel<64, 64, kWgmma>, dim3(rows, blocks(n, 64)), stream, x, w, y, m,
                                       n, k);
  return launch_gemm<64, 32, kWgmma>(gemm_bf16_kernel<64, 32, kWgmma>, dim3(rows, blocks(n, 32)), stream, x, w, y, m, n,
                                     k);
}

// The grouped form: the large tile where the groups average 256 rows or more (the training
// forward's experts), so that few of its rows are a group's padding.
template <bool kWgmma>
cudaError_t grouped_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, const int64_t* offsets,
                         int64_t rows, int64_t groups, int64_t N, int64_t K, cudaStream_t stream) {
  if (rows >= 256 * groups && large_tile(rows / 128, blocks(N, kTn)))
    return launch_gemm<128, kTn, kWgmma>(gemm_bf16_grouped_kernel<128, kTn, kWgmma>,
                                         dim3(unsigned(rows / 128 + groups), blocks(N, kTn)), stream, x, w, y, offsets,
                                         int(groups), int(N), int(K));
  return launch_gemm<64, kTn, kWgmma>(gemm_bf16_grouped_kernel<64, kTn, kWgmma>,
                                      dim3(unsigned(rows / 64 + groups), blocks(N, kTn)), stream, x, w, y, offsets,
                                      int(groups), int(N), int(K));
}

// The process's setting: kInvariantAuto until set_invariant_gemm_kernel.
std::atomic<int>& gemm_kind() {
  static std::atomic<int> kind{int(kInvariantAuto)};
  return kind;
}

}  // namespace

// wgmma runs on compute capability 9.0 alone, from code built for sm_90a (KILN_CUDA_SM90A); the
// answer is kept per device.
bool invariant_wgmma_usable() {
#if KILN_CUDA_SM90A
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices];  // 0 not asked, 1 no, 2 yes
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (device < kDevices && known[device].load(std::memory_order_relaxed) != 0) return known[device] == 2;
  int major = 0, minor = 0;
  const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
                  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
                  major == 9 && minor == 0;
  if (device < kDevices) known[device].store(ok ? 2 : 1, std::memory_order_relaxed);
  return ok;
#else
  return false;
#endif
}

cudaError_t launch_invariant_gemm(int dtype, const void* x, const void* w, void* y, int64_t M, int64_t N, int64_t K,
                                  cudaStream_t stream) {
  if (M == 0 || N == 0) return cudaSuccess;
  if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX || K == 0 || N > 65535LL * kSimpleTile) return cudaErrorInvalidValue;
  const int m = int(M), n = int(N), k = int(K);
  const bool aligned = ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) % 16 == 0) && K % 8 == 0;
  if (dtype == kInvariantBf16 && aligned) {
    const auto* xb = static_cast<const __nv_bfloat16*>(x);
    const auto* wb = static_cast<const __nv_bfloat16*>(w);
    auto* yb = static_cast<__nv_bfloat16*>(y);
    const int kind = invariant_gemm_kernel();
    if (kind == kInvariantWgmma)
      return invariant_wgmma_usable() ? dense_bf16<true>(xb, wb, yb, m, n, k, stream) : cudaErrorInvalidDevice;
    return kind == kInvariantMma ? dense_bf16<false>(xb, wb, yb, m, n, k, stream) : cudaErrorInvalidValue;
  }
  const dim3 grid(blocks(M, kSimpleTile), blocks(N, kSimpleTile)), block(32, 8);
  const bool known = with_dtype(dtype, [&](auto t, auto a) {
    using T = decltype(t);
    gemm_simple_kernel<T, decltype(a)><<<grid, block, 0, stream>>>(static_cast<const T*>(x), static_cast<const T*>(w),
                                                                   static_cast<T*>(y), m, n, k);
  });
  return known ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t launch_invariant_grouped_gemm(const void* x, const void* w, void* y, const int64_t* offsets, int64_t rows,
                                          int64_t groups, int64_t N, int64_t K, cudaStream_t stream) {
  if (rows == 0 || N == 0) return cudaSuccess;
  if (N > INT32_MAX || K > INT32_MAX || K == 0 || K % 8 != 0 || groups > INT32_MAX ||
      (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) % 16 != 0)
    return cudaErrorInvalidValue;
  if (rows / 64 + groups > INT32_MAX || N > 65535LL * kTn) return cudaErrorInvalidValue;
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  const auto* wb = static_cast<const __nv_bfloat16*>(w);
  auto* yb = static_cast<__nv_bfloat16*>(y);
  const int kind = invariant_gemm_kernel();
  if (kind == kInvariantWgmma)
    return invariant_wgmma_usable() ? grouped_bf16<true>(xb, wb, yb, offsets, rows, groups, N, K, stream)
                                    : cudaErrorInvalidDevice;
  return kind == kInvariantMma ? grouped_bf16<false>(xb, wb, yb, offsets, rows, groups, N, K, stream)
                               : cudaErrorInvalidValue;
}

int invariant_gemm_kernel() {
  const int kind = gemm_kind().load(std::memory_order_relaxed);
  if (kind != kInvariantAuto) return kind;
  return invariant_wgmma_usable() ? kInvariantWgmma : kInvariantMma;  // wgmma measured faster on every shape, same bits
}

int set_invariant_gemm_kernel(int kind) {
  if (kind != kInvariantAuto && kind != kInvariantMma && kind != kInvariantWgmma)
    return gemm_kind().load(std::memory_order_relaxed);
  return gemm_kind().exchange(kind);
}

cudaError_t launch_ranged_attention(int dtype, const void* q, const void* k, const void* v, const void* kf,
                                    const void* vf, const int32_t* table, const int32_t* begin, const int32_t* count,
                                    void* o, int64_t queries, int Hq, int Hkv, int hd, cudaStream_t stream) {
  if (queries == 0) return cudaSuccess;
  if (hd < 1 || hd > 32 * kMaxPerLane || Hkv < 1 || Hq % Hkv != 0) return cudaErrorInvalidValue;
  const int64_t pairs = queries * Hq;
  const unsigned grid = blocks(pairs, kAttnWarps);
  const double scale = 1.0 / std::sqrt(double(hd));
  const bool known = with_dtype(dtype, [&](auto t, auto a) {
    using T = decltype(t);
    using Acc = decltype(a);
    ranged_attention_kernel<T, Acc><<<grid, kAttnWarps * 32, 0, stream>>>(
        static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const T*>(kf),
        static_cast<const T*>(vf), table, begin, count, static_cast<T*>(o), pairs, Hq, Hkv, hd, Acc(scale));
  });
  return known ? cudaGetLastError() : cudaErrorInvalidValue;
}

}  // namespace kiln::kernels
