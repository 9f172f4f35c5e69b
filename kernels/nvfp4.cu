// NVFP4 CUDA kernels: quantise (two passes: per-matrix amax, then one thread per 16-value block),
// dequantise, and the W4A16 GEMMs. The GEMMs swap A and B of mma.m16n8k16 (16 weight rows x 8
// tokens), read each warp step's codes as one 4 KB tile and decode them to exact bf16 in registers
// (nvfp4_layout.h); up to 16 tokens K is split over a block's warps, above that activations and
// tiles are staged in shared memory (nvfp4_gemm.cuh); clusters split K, reduced in a fixed order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda_convert.cuh"
#include "kernels/cuda_memory.cuh"
#include "kernels/nvfp4_cuda.h"
#include "kernels/nvfp4_gemm.cuh"
#include "kernels/nvfp4_layout.h"

namespace kiln::kernels {
namespace {

using namespace nvfp4_gemm;  // kBlock and the GEMM building blocks

// ---------------------------------------------------------------------------------------------
// Scalar codecs, bit-exact to the CPU reference (kernels/nvfp4.cpp). No fast math: every division
// is IEEE, and no product below is contracted into an FMA (there is no add to fuse).

// E4M3 (fn) of a >= 0 or NaN: round to nearest even, saturating at 448.
__device__ __forceinline__ uint32_t e4m3_encode_nonneg(float a) {
  if (isnan(a)) return 0x7F;
  if (a >= 448.0f) return 0x7E;
  if (a < 0x1p-6f) return uint32_t(rintf(a * 512.0f));  // subnormal step 2^-9 (exact scaling); 8 -> 2^-6
  uint32_t u = __float_as_uint(a);
  u += 0x7FFFFu + ((u >> 20) & 1u);  // round the fp32 mantissa to 3 bits, ties to even
  return ((((u >> 23) & 0xFFu) - 120u) << 3) | ((u >> 20) & 7u);
}

__device__ __forceinline__ float e4m3_decode(uint32_t b) {
  const uint32_t exp = (b >> 3) & 0xFu, man = b & 7u;
  float v;
  if (exp == 0xFu && man == 7u) v = __uint_as_float(0x7FC00000u);
  else if (exp == 0) v = float(man) * 0x1p-9f;
  else v = __uint_as_float(((exp + 120u) << 23) | (man << 20));
  return (b & 0x80u) ? -v : v;
}

// E2M1 code with the sign in bit 3: nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code.
__device__ __forceinline__ uint32_t e2m1_encode(float v) {
  const uint32_t sign = (__float_as_uint(v) >> 31) << 3;
  const float a = fabsf(v);
  if (isnan(a)) return sign | 7u;
  return sign | uint32_t((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f));
}

__device__ __forceinline__ float e2m1_decode(uint32_t c) {
  const uint32_t e = (c >> 1) & 3u, m = c & 1u;
  const float v = e == 0 ? (m ? 0.5f : 0.0f) : __uint_as_float(((e + 126u) << 23) | (m << 22));
  return (c & 8u) ? -v : v;
}

// ---------------------------------------------------------------------------------------------
// Quantise.

// Per-matrix amax as fp32 bits (non-negative floats order like their bits). NaN is skipped, as
// std::max(amax, NaN) keeps amax in the reference.
template <typename T>
__global__ void amax_kernel(const T* __restrict__ w, int64_t per_matrix, uint32_t* __restrict__ amax) {
  constexpr int kPer = 16 / int(sizeof(T));
  const uint4* p = reinterpret_cast<const uint4*>(w + blockIdx.y * per_matrix);
  const int64_t n = per_matrix / kPer;
  float m = 0.0f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 u = __ldg(p + i);
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int j = 0; j < kPer; ++j) m = fmaxf(m, fabsf(to_float(e[j])));
  }
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  __shared__ float warp_max[32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (unsigned i = 1; i < blockDim.x / 32; ++i) m = fmaxf(m, warp_max[i]);
    atomicMax(amax + blockIdx.y, __float_as_uint(m));
  }
}

// One thread per 16-value block of matrix blockIdx.y: the reference's arithmetic, operation for
// operation. In the kernel layout thread i writes the codes at place i (nvfp4_layout::block_at says
// whose), so the stores are contiguous and the 32-byte reads of the source blocks are scattered.
// Indices within a matrix are 32-bit (the launcher checks N * K / 16 < 2^32).
template <typename T>
__global__ void quantize_kernel(const T* __restrict__ w, uint32_t N, uint32_t nb, const uint32_t* __restrict__ amax,
                                bool kernel_layout, uint8_t* __restrict__ packed, uint8_t* __restrict__ block_scale,
                                float* __restrict__ tensor_scale) {
  const uint32_t per = N * nb, e = blockIdx.y;
  const int64_t base = int64_t(e) * per;
  const float am = __uint_as_float(amax[e]);
  const float s2 = am > 0.0f ? am / (6.0f * 448.0f) : 1.0f;
  if (blockIdx.x == 0 && threadIdx.x == 0) tensor_scale[e] = s2;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t step = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; step < per; step += stride) {
    const uint32_t i = uint32_t(step);  // the loop counts in 64 bits: i + stride may pass 2^32
    uint32_t src = i, scale_at = i;
    if (kernel_layout) {
      const nvfp4_layout::RowBlock<uint32_t> rb = nvfp4_layout::block_at(i, N, nb);
      src = rb.n * nb + rb.b;
      scale_at = nvfp4_layout::block_place(rb.n, rb.b, N, nb, true);
    }
    float v[16];
    load16(w + (base + src) * kBlock, v);
    float bmax = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) bmax = fmaxf(bmax, fabsf(v[j]));
    const uint32_t sf = e4m3_encode_nonneg(bmax / (6.0f * s2));
    const float scale = e4m3_decode(sf) * s2;
    uint32_t word[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t code = scale > 0.0f ? e2m1_encode(v[j] / scale) : 0u;
      word[j / 8] |= code << (4 * (j % 8));
    }
    if (kernel_layout) word[0] = nvfp4_layout::to_kernel_word(word[0]), word[1] = nvfp4_layout::to_kernel_word(word[1]);
    block_scale[base + scale_at] = uint8_t(sf);
    reinterpret_cast<uint2*>(packed)[base + i] = make_uint2(word[0], word[1]);
  }
}

// ---------------------------------------------------------------------------------------------
// Dequantise: one thread per 16-value block. A kernel-layout block is read from its place and each
// code taken from its permuted bits.
template <typename T>
__global__ void dequantize_kernel(const uint8_t* __restrict__ packed, const uint8_t* __restrict__ block_scale,
                                  const float* __restrict__ tensor_scale, uint32_t N, uint32_t nb, bool kernel_layout,
                                  T* __restrict__ out) {
  const uint32_t per = N * nb, e = blockIdx.y;
  const int64_t base = int64_t(e) * per;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t step = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; step < per; step += stride) {
    const uint32_t i = uint32_t(step);  // the loop counts in 64 bits: i + stride may pass 2^32
    uint32_t code_at = i, scale_at = i;
    if (kernel_layout) {
      const uint32_t n = i / nb, b = i % nb;
      code_at = nvfp4_layout::block_place(n, b, N, nb, false);
      scale_at = nvfp4_layout::block_place(n, b, N, nb, true);
    }
    const float scale = e4m3_decode(block_scale[base + scale_at]) * tensor_scale[e];
    const uint2 u = reinterpret_cast<const uint2*>(packed)[base + code_at];
    float v[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t word = j < 8 ? u.x : u.y;
      const int q = (j % 8) / 2, h = 16 * (j % 2);  // the kernel layout's places of element j
      const uint32_t code = kernel_layout ? ((word >> (nvfp4_layout::mag_bit(q) + h)) & 7u) |
                                                (((word >> (nvfp4_layout::sign_bit(q) + h)) & 1u) << 3)
                                          : (word >> (4 * (j % 8))) & 0xFu;
      v[j] = e2m1_decode(code) * scale;
    }
    // 16-byte stores: one 2-byte store per value left every L2 sector written 16 times in parts.
    constexpr int kVec = 16 / int(sizeof(T));
    T* o = out + (base + i) * kBlock;
#pragma unroll
    for (int p = 0; p < 16 / kVec; ++p) {
      float part[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) part[j] = v[p * kVec + j];
      store_vec<T, kVec>(o + p * kVec, part);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// W4A16 GEMM kernels and their launch choices (device code in nvfp4_gemm.cuh).

// Dense: block (token chunk, row tile, part) computes part `part` of kParts K ranges of its tile;
// with kParts > 1 the parts form a thread-block cluster and are summed in part order (sum_parts).
template <int NT, int kWarps, int kParts, bool kF32, bool kAligned>
__global__ void __launch_bounds__(kWarps * 32, min_blocks(NT, kWarps))
    linear_kernel(const void* __restrict__ x, const uint8_t* __restrict__ packed, const uint8_t* __restrict__ sfs,
                  const float* __restrict__ tensor_scale, const float* __restrict__ extra, void* __restrict__ y,
                  int64_t M, int64_t N, int64_t K) {
  using T = typename std::conditional<kF32, float, __nv_bfloat16>::type;
  __shared__ float4 red[red_size(NT, kWarps)];
  const int64_t tok0 = int64_t(blockIdx.x) * 8 * NT;
  const int m_count = int(M - tok0 < 8 * NT ? M - tok0 : 8 * NT);
  const int64_t row0 = int64_t(blockIdx.y / kParts) * kRowsPerBlock;
  const int part = int(blockIdx.y % kParts);
  const T* xc = static_cast<const T*>(x) + tok0 * K;
  T* yc = static_cast<T*>(y) + tok0 * N;
  float acc[2][NT][4];
  zero_acc<NT>(acc);
  tile_partial<NT, kWarps, kF32, kAligned>(xc, m_count, packed, sfs, N, K, row0, part, kParts, acc);
  sum_warps<NT, kWarps>(acc, red);
  if (sum_parts<NT, kParts>(acc, part)) store_tile<NT, kF32>(acc, epilogue_scale(tensor_scale, extra), yc, N, row0, m_count);
}

// The launch of a dense GEMM grid: x over chunks of `tokens` tokens, y over tiles of `rows` weight
// rows times `parts` K parts, whose parts form a thread-block cluster. Used in place (config
// points at the cluster attribute).
struct PartsLaunch {
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute cluster[1];
  PartsLaunch(int64_t M, int64_t N, int tokens, int rows, int parts, int threads, size_t smem, cudaStream_t stream) {
    config.gridDim = dim3(unsigned((M + tokens - 1) / tokens), unsigned((N + rows - 1) / rows * parts));
    config.blockDim = dim3(unsigned(threads));
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cluster[0].id = cudaLaunchAttributeClusterDimension;
    cluster[0].val.clusterDim.x = 1;
    cluster[0].val.clusterDim.y = unsigned(parts);
    cluster[0].val.clusterDim.z = 1;
    config.attrs = cluster;
    config.numAttrs = parts > 1 ? 1 : 0;
  }
  PartsLaunch(const PartsLaunch&) = delete;
};

template <int NT, int kWarps, int kParts, bool kF32, bool kAligned>
cudaError_t launch_linear_kernel(const void* x, const uint8_t* packed, const uint8_t* sfs, const float* ts,
                                 const float* extra, void* y, int64_t M, int64_t N, int64_t K, cudaStream_t stream) {
  PartsLaunch l(M, N, 8 * NT, kRowsPerBlock, kParts, kWarps * 32, 0, stream);
  return cudaLaunchKernelEx(&l.config, linear_kernel<NT, kWarps, kParts, kF32, kAligned>, x, packed, sfs, ts, extra,
                            y, M, N, K);
}

template <int NT, int kWarps, int kParts, bool kF32>
cudaError_t launch_linear_nt(const void* x, const uint8_t* packed, const uint8_t* sfs, const float* ts,
                             const float* extra, void* y, int64_t M, int64_t N, int64_t K, cudaStream_t stream) {
  if (K % 32 == 0) return launch_linear_kernel<NT, kWarps, kParts, kF32, true>(x, packed, sfs, ts, extra, y, M, N, K, stream);
  return launch_linear_kernel<NT, kWarps, kParts, kF32, false>(x, packed, sfs, ts, extra, y, M, N, K, stream);
}

template <int kWarps, int kParts, bool kF32>
cudaError_t launch_linear_w(const void* x, const uint8_t* packed, const uint8_t* sfs, const float* ts,
                            const float* extra, void* y, int64_t M, int64_t N, int64_t K, cudaStream_t stream) {
  if (M <= 8) return launch_linear_nt<1, kWarps, kParts, kF32>(x, packed, sfs, ts, extra, y, M, N, K, stream);
  if (M <= 16) return launch_linear_nt<2, kWarps, kParts, kF32>(x, packed, sfs, ts, extra, y, M, N, K, stream);
  // Four n-tiles need more than 128 registers: one block of 8 warps per multiprocessor, and no K
  // split (it measured 35.5 against 29.3 us at M = 64, (4096, 8192)).
  return launch_linear_nt<4, 8, 1, kF32>(x, packed, sfs, ts, extra, y, M, N, K, stream);
}

// Warps per block (W) and K parts per row tile (S). Fewer than 8 K steps (K < 2048): W = 4, so that
// no warp idles at the reduction barrier (see launch_grouped_w). Otherwise the aim is one wave of
// about as many warps as the multiprocessors hold (16 each), each with 2 or more K steps: the
// largest W x S in {4, 16 as 8 x 2} whose warps fit in one wave with room to spare; failing that,
// 16 resident warps per multiprocessor either way (2 blocks of 8 or one of 16), with 16 per block
// when that fills the waves better (few row tiles, or a last wave mostly empty). Measured with a
// probe on the H200 at M = 1: (12288, 8192) W 4 19.2 us, W 8 19.5, W 16 20.8; (4096, 8192) W 8 x
// S 2 7.8 us, W 16 8.3; (8192, 4096) W 8 7.6 us, W 16 9.1, W 8 x S 2 9.0.
template <bool kF32>
cudaError_t launch_linear_blocks(const void* x, const uint8_t* packed, const uint8_t* sfs, const float* ts,
                                 const float* extra, void* y, int64_t M, int64_t N, int64_t K, cudaStream_t stream) {
  if (K < 8 * kSuper) return launch_linear_w<4, 1, kF32>(x, packed, sfs, ts, extra, y, M, N, K, stream);
  const int64_t tiles = (N + kRowsPerBlock - 1) / kRowsPerBlock, sms = num_sms(), steps = K / kSuper;
  const int64_t wave = sms * 16 * 11 / 10;  // warps of one wave, with 10% to spare
  if (tiles * 4 <= wave && tiles * 8 > wave) return launch_linear_w<4, 1, kF32>(x, packed, sfs, ts, extra, y, M, N, K, stream);
  if (tiles * 16 <= wave && steps >= 32) return launch_linear_w<8, 2, kF32>(x, packed, sfs, ts, extra, y, M, N, K, stream);
  auto efficiency = [&](int64_t slots) { return double(tiles) / double((tiles + slots - 1) / slots * slots); };
  if (efficiency(sms) > efficiency(2 * sms) + 0.01)
    return launch_linear_w<16, 1, kF32>(x, packed, sfs, ts, extra, y, M, N, K, stream);
  return launch_linear_w<8, 1, kF32>(x, packed, sfs, ts, extra, y, M, N, K, stream);
}

template <int kMaxNT, int kWarps, bool kF32>
cudaError_t launch_grouped_nt(const void* x, const int64_t* offsets, const uint8_t* packed, const uint8_t* sfs,
                              const float* ts, const float* extra, void* y, int64_t E, int64_t N, int64_t K,
                              cudaStream_t stream) {
  const dim3 grid(unsigned(E), unsigned((N + kRowsPerBlock - 1) / kRowsPerBlock));
  if (grouped_stack_aligned(N, K))
    grouped_kernel<kMaxNT, kWarps, kF32, true><<<grid, kWarps * 32, 0, stream>>>(x, offsets, packed, sfs, ts, extra, y, N, K);
  else
    grouped_kernel<kMaxNT, kWarps, kF32, false><<<grid, kWarps * 32, 0, stream>>>(x, offsets, packed, sfs, ts, extra, y, N, K);
  return cudaGetLastError();
}

// The warps of a block split K in kSuper chunks: below 8 chunks (K < 2048), blocks of 4 warps, so
// that no warp idles at the reduction barrier (ncu: half the grouped decode's warps did at K = 1024).
template <int kMaxNT, bool kF32>
cudaError_t launch_grouped_w(const void* x, const int64_t* offsets, const uint8_t* packed, const uint8_t* sfs,
                             const float* ts, const float* extra, void* y, int64_t E, int64_t N, int64_t K,
                             cudaStream_t stream) {
  if (K < 8 * kSuper) return launch_grouped_nt<kMaxNT, 4, kF32>(x, offsets, packed, sfs, ts, extra, y, E, N, K, stream);
  return launch_grouped_nt<kMaxNT, 8, kF32>(x, offsets, packed, sfs, ts, extra, y, E, N, K, stream);
}

// Staged dense GEMM (bf16): block (token chunk, row block, part) computes part `part` of kParts K
// ranges for kStagedRows weight rows (32 per warp) and 8 NT tokens; the steps go through shared
// memory two deep (nvfp4_gemm.cuh). With kParts > 1 the parts form a cluster and part 0 adds the
// others' tiles in part order, so the result does not depend on timing.
template <int NT, int kParts>
__global__ void __launch_bounds__(kStagedWarps * 32)
    staged_kernel(const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ packed,
                  const uint8_t* __restrict__ sfs, const float* __restrict__ tensor_scale,
                  const float* __restrict__ extra, __nv_bfloat16* __restrict__ y, int64_t M, int64_t N, int64_t K) {
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int kStage = staged_stage_bytes(NT);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int64_t tok0 = int64_t(blockIdx.x) * 8 * NT;
  const int m_count = int(M - tok0 < 8 * NT ? M - tok0 : 8 * NT);
  const int64_t row0 = int64_t(blockIdx.y / kParts) * kStagedRows, rows = row0 + kRowsPerBlock * warp;
  const int part = int(blockIdx.y % kParts);
  const int64_t steps = (K + kSuper - 1) / kSuper, s0 = steps * part / kParts, s1 = steps * (part + 1) / kParts;
  const __nv_bfloat16* xc = x + tok0 * K;
  float acc[2][NT][4];
  zero_acc<NT>(acc);
  if (s0 < s1) stage_step<NT>(smem, xc, m_count, packed, sfs, N, K, row0, s0);
  cp_async_commit();
  for (int64_t sc = s0; sc < s1; ++sc) {
    // Step sc's copies have landed (this thread's; the barrier makes it everyone's), and every warp
    // is done with step sc - 1, whose stage the next copies refill while step sc is computed.
    cp_async_wait<0>();
    __syncthreads();
    if (sc + 1 < s1) stage_step<NT>(smem + ((sc + 1 - s0) & 1) * kStage, xc, m_count, packed, sfs, N, K, row0, sc + 1);
    cp_async_commit();
    if (rows < N) staged_product<NT>(smem + ((sc - s0) & 1) * kStage, warp, lane, acc);
  }
  if constexpr (kParts > 1) {
    cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    float4* red = reinterpret_cast<float4*>(smem);
    cluster.sync();  // every part is done with its stages: part 0's may now take the partial tiles
    if (part > 0)
      put_partial<NT>(acc, cluster.map_shared_rank(red, 0) + ((part - 1) * kStagedWarps + warp) * partial_size(NT), lane);
    cluster.sync();
    if (part > 0) return;
    for (int p = 1; p < kParts; ++p) add_partial<NT>(acc, red + ((p - 1) * kStagedWarps + warp) * partial_size(NT), lane);
  }
  if (rows < N) store_tile<NT, false>(acc, epilogue_scale(tensor_scale, extra), y + tok0 * N, N, rows, m_count);
}

template <int NT, int kParts>
cudaError_t launch_staged_kernel(const void* x, const uint8_t* packed, const uint8_t* sfs, const float* ts,
                                 const float* extra, void* y, int64_t M, int64_t N, int64_t K, cudaStream_t stream) {
  PartsLaunch l(M, N, 8 * NT, kStagedRows, kParts, kStagedWarps * 32, staged_smem_bytes(NT, kParts), stream);
  return cudaLaunchKernelEx(&l.config, staged_kernel<NT, kParts>, static_cast<const __nv_bfloat16*>(x), packed, sfs, ts,
                            extra, static_cast<__nv_bfloat16*>(y), M, N, K);
}

// Every staged kernel's shared-memory limit raised above the default 48 KB, once per process, at
// the first staged call (forced by a caller that warms up before it captures a graph).
template <int NT, int kParts>
cudaError_t allow_staged_smem() {
  return cudaFuncSetAttribute(staged_kernel<NT, kParts>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              staged_smem_bytes(NT, kParts));
}
cudaError_t prepare_staged_kernels() {
  static const cudaError_t err = [] {
    for (cudaError_t e : {allow_staged_smem<4, 1>(), allow_staged_smem<4, 2>(), allow_staged_smem<4, 4>(),
                          allow_staged_smem<8, 1>(), allow_staged_smem<8, 2>(), allow_staged_smem<8, 4>()})
      if (e != cudaSuccess) return e;
    return cudaSuccess;
  }();
  return err;
}

// Token chunks of 32 (M <= 32) or 64; K parts (1, 2 or 4) doubled while the grid stays within one
// block per multiprocessor (a block takes 104-192 KB of shared memory) and every part keeps at
// least two K steps.
template <int NT>
cudaError_t launch_staged_nt(const void* x, const uint8_t* packed, const uint8_t* sfs, const float* ts,
                             const float* extra, void* y, int64_t M, int64_t N, int64_t K, cudaStream_t stream) {
  const int64_t blocks = (M + 8 * NT - 1) / (8 * NT) * ((N + kStagedRows - 1) / kStagedRows);
  const int64_t steps = (K + kSuper - 1) / kSuper, target = int64_t(num_sms());
  int parts = 1;
  while (parts < 4 && blocks * parts * 2 <= target && steps >= 4 * parts) parts *= 2;
  if (parts == 4) return launch_staged_kernel<NT, 4>(x, packed, sfs, ts, extra, y, M, N, K, stream);
  if (parts == 2) return launch_staged_kernel<NT, 2>(x, packed, sfs, ts, extra, y, M, N, K, stream);
  return launch_staged_kernel<NT, 1>(x, packed, sfs, ts, extra, y, M, N, K, stream);
}

cudaError_t launch_staged(const void* x, const uint8_t* packed, const uint8_t* sfs, const float* ts,
                          const float* extra, void* y, int64_t M, int64_t N, int64_t K, cudaStream_t stream) {
  if (M <= 32) return launch_staged_nt<4>(x, packed, sfs, ts, extra, y, M, N, K, stream);
  return launch_staged_nt<8>(x, packed, sfs, ts, extra, y, M, N, K, stream);
}

// The grouped staged kernel: 16-token chunks at 16 rows or fewer per expert on average (forced
// only: the dispatch takes it above 16), else 32. Two blocks per expert and slab share its chunks
// (gridDim.z = kGroupedStagedSplit): an expert with more rows than one chunk runs two at once. In
// kiln_probe_nvfp4 (H100) that took 32 rows per expert from 42.4 to 37.0 us and 64 rows from 62.7
// to 54.3. Its shared-memory limit is raised once per process, at the first call: the rollout
// engine's decode graphs run each step once before capturing it (rollout/decode_graph.cpp).
constexpr unsigned kGroupedStagedSplit = 2;

template <int NT>
cudaError_t launch_grouped_staged_nt(const void* x, const int64_t* offsets, const uint8_t* packed, const uint8_t* sfs,
                                     const float* ts, const float* extra, void* y, int64_t E, int64_t N, int64_t K,
                                     cudaStream_t stream) {
  constexpr int smem = 2 * staged_stage_bytes(NT);
  static const cudaError_t opt_in =
      cudaFuncSetAttribute(grouped_staged_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (opt_in != cudaSuccess) return opt_in;
  const dim3 grid(unsigned(E), unsigned((N + kStagedRows - 1) / kStagedRows), kGroupedStagedSplit);
  grouped_staged_kernel<NT><<<grid, kStagedWarps * 32, smem, stream>>>(
      static_cast<const __nv_bfloat16*>(x), offsets, packed, sfs, ts, extra, static_cast<__nv_bfloat16*>(y), N, K);
  return cudaGetLastError();
}

// The tiled launch (Nvfp4Gemm::kStagedTiles, and kStagedTiles64 with NT = 8): a block per chunk
// tile and slab, as many tiles as R rows can fill (sum over experts of ceil(rows / chunk) <=
// (R + E (chunk - 1)) / chunk); the kernel's loop covers any more.
template <int NT>
cudaError_t launch_grouped_staged_tiles_nt(const void* x, const int64_t* offsets, const uint8_t* packed,
                                           const uint8_t* sfs, const float* ts, const float* extra, void* y, int64_t R,
                                           int64_t E, int64_t N, int64_t K, cudaStream_t stream) {
  constexpr int smem = 2 * staged_stage_bytes(NT);
  constexpr int64_t chunk = 8 * NT;
  static const cudaError_t opt_in =
      cudaFuncSetAttribute(grouped_staged_tiles_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (opt_in != cudaSuccess) return opt_in;
  const int64_t tiles = std::max<int64_t>(1, std::min<int64_t>((R + E * (chunk - 1)) / chunk, int64_t(1) << 30));
  const dim3 grid(unsigned(tiles), unsigned((N + kStagedRows - 1) / kStagedRows));
  grouped_staged_tiles_kernel<NT><<<grid, kStagedWarps * 32, smem, stream>>>(
      static_cast<const __nv_bfloat16*>(x), offsets, E, packed, sfs, ts, extra, static_cast<__nv_bfloat16*>(y), N, K);
  return cudaGetLastError();
}

// Grid of a per-block kernel over E matrices of `per` blocks each: y = the matrix, x = enough blocks
// of `threads` to cover one matrix, about 16 per multiprocessor over all (a grid-stride loop does
// the rest). Fails when a matrix's block count needs more than 32 bits or E is over the y limit.
bool matrix_grid(int64_t E, int64_t per, int threads, dim3* grid) {
  if (per >= (int64_t(1) << 32) || E > 65535) return false;
  const int64_t cap = std::max<int64_t>(1, int64_t(num_sms()) * 16 / E);
  *grid = dim3(unsigned(std::max<int64_t>(1, std::min<int64_t>((per + threads - 1) / threads, cap))), unsigned(E));
  return true;
}

}  // namespace

cudaError_t launch_nvfp4_quantize(const void* w, Nvfp4DType dtype, int64_t E, int64_t N, int64_t K, bool kernel_layout,
                                  uint8_t* packed, uint8_t* block_scale, float* tensor_scale, uint32_t* amax_ws,
                                  cudaStream_t stream) {
  if (E == 0) return cudaSuccess;
  cudaError_t err = cudaMemsetAsync(amax_ws, 0, size_t(E) * sizeof(uint32_t), stream);
  if (err != cudaSuccess) return err;
  const int64_t per_matrix = N * K, blocks = E * N * K / kBlock;
  if (blocks == 0) {  // N = 0 or K = 0: nothing to read; every tensor scale is 1
    return cudaSuccess;  // the binding fills the tensor scales for empty matrices
  }
  constexpr int kThreads = 256;
  const int64_t vecs = per_matrix / (dtype == Nvfp4DType::kFloat32 ? 4 : 8);
  const dim3 agrid(unsigned(std::max<int64_t>(1, std::min<int64_t>((vecs + kThreads - 1) / kThreads,
                                                                   std::max<int64_t>(1, 4096 / E)))),
                   unsigned(E));
  dim3 qgrid;
  if (!matrix_grid(E, N * K / kBlock, kThreads, &qgrid)) return cudaErrorInvalidValue;
  if (dtype == Nvfp4DType::kFloat32) {
    const float* p = static_cast<const float*>(w);
    amax_kernel<float><<<agrid, kThreads, 0, stream>>>(p, per_matrix, amax_ws);
    quantize_kernel<float><<<qgrid, kThreads, 0, stream>>>(p, uint32_t(N), uint32_t(K / kBlock), amax_ws, kernel_layout,
                                                           packed, block_scale, tensor_scale);
  } else if (dtype == Nvfp4DType::kBFloat16) {
    const __nv_bfloat16* p = static_cast<const __nv_bfloat16*>(w);
    amax_kernel<__nv_bfloat16><<<agrid, kThreads, 0, stream>>>(p, per_matrix, amax_ws);
    quantize_kernel<__nv_bfloat16><<<qgrid, kThreads, 0, stream>>>(p, uint32_t(N), uint32_t(K / kBlock), amax_ws,
                                                                   kernel_layout, packed, block_scale, tensor_scale);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_nvfp4_dequantize(const uint8_t* packed, const uint8_t* block_scale, const float* tensor_scale,
                                    int64_t E, int64_t N, int64_t K, bool kernel_layout, void* out, Nvfp4DType dtype,
                                    cudaStream_t stream) {
  const int64_t blocks = E * N * K / kBlock;
  if (blocks == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  dim3 grid;
  if (!matrix_grid(E, N * K / kBlock, kThreads, &grid)) return cudaErrorInvalidValue;
  const uint32_t n32 = uint32_t(N), nb = uint32_t(K / kBlock);
  switch (dtype) {
    case Nvfp4DType::kFloat32:
      dequantize_kernel<<<grid, kThreads, 0, stream>>>(packed, block_scale, tensor_scale, n32, nb, kernel_layout,
                                                       static_cast<float*>(out));
      break;
    case Nvfp4DType::kBFloat16:
      dequantize_kernel<<<grid, kThreads, 0, stream>>>(packed, block_scale, tensor_scale, n32, nb, kernel_layout,
                                                       static_cast<__nv_bfloat16*>(out));
      break;
    case Nvfp4DType::kFloat16:
      dequantize_kernel<<<grid, kThreads, 0, stream>>>(packed, block_scale, tensor_scale, n32, nb, kernel_layout,
                                                       static_cast<__half*>(out));
      break;
  }
  return cudaGetLastError();
}

cudaError_t launch_nvfp4_linear(const void* x, Nvfp4DType dtype, const uint8_t* packed, const uint8_t* block_scale,
                                const float* tensor_scale, const float* scale, void* y, int64_t M, int64_t N,
                                int64_t K, cudaStream_t stream, Nvfp4Gemm gemm) {
  if (M == 0 || N == 0) return cudaSuccess;
  if (dtype != Nvfp4DType::kFloat32 && dtype != Nvfp4DType::kBFloat16) return cudaErrorInvalidValue;
  if (is_staged_tiles(gemm)) return cudaErrorInvalidValue;  // grouped only
  // kAuto is split-K: the staged kernel stays out of the dispatch (nvfp4.cpp, kStagedMaxRows).
  if (gemm == Nvfp4Gemm::kStaged) {
    if (dtype != Nvfp4DType::kBFloat16) return cudaErrorInvalidValue;
    const cudaError_t prepared = prepare_staged_kernels();
    if (prepared != cudaSuccess) return prepared;
    return launch_staged(x, packed, block_scale, tensor_scale, scale, y, M, N, K, stream);
  }
  return dtype == Nvfp4DType::kFloat32
             ? launch_linear_blocks<true>(x, packed, block_scale, tensor_scale, scale, y, M, N, K, stream)
             : launch_linear_blocks<false>(x, packed, block_scale, tensor_scale, scale, y, M, N, K, stream);
}

cudaError_t launch_nvfp4_grouped_linear(const void* x, Nvfp4DType dtype, const int64_t* offsets, const uint8_t* packed,
                                        const uint8_t* block_scale, const float* tensor_scale, const float* scale,
                                        void* y, int64_t R, int64_t E, int64_t N, int64_t K, cudaStream_t stream,
                                        Nvfp4Gemm gemm) {
  if (R == 0 || E == 0 || N == 0) return cudaSuccess;
  if (dtype != Nvfp4DType::kFloat32 && dtype != Nvfp4DType::kBFloat16) return cudaErrorInvalidValue;
  if (gemm != Nvfp4Gemm::kAuto && gemm != Nvfp4Gemm::kSplitK && !is_grouped_staged(gemm)) return cudaErrorInvalidValue;
  const bool f32 = dtype == Nvfp4DType::kFloat32;
  if (is_grouped_staged(gemm)) {
    if (f32 || !grouped_stack_aligned(N, K)) return cudaErrorInvalidValue;
    const bool small = R <= 16 * E;
    if (gemm == Nvfp4Gemm::kStagedTiles64)
      return launch_grouped_staged_tiles_nt<8>(x, offsets, packed, block_scale, tensor_scale, scale, y, R, E, N, K, stream);
    if (gemm == Nvfp4Gemm::kStagedTiles)
      return small ? launch_grouped_staged_tiles_nt<2>(x, offsets, packed, block_scale, tensor_scale, scale, y, R, E, N, K, stream)
                   : launch_grouped_staged_tiles_nt<4>(x, offsets, packed, block_scale, tensor_scale, scale, y, R, E, N, K, stream);
    return small ? launch_grouped_staged_nt<2>(x, offsets, packed, block_scale, tensor_scale, scale, y, E, N, K, stream)
                 : launch_grouped_staged_nt<4>(x, offsets, packed, block_scale, tensor_scale, scale, y, E, N, K, stream);
  }
  // Decode-sized batches (up to 16 rows per expert on average) keep the 1-2 n-tile bodies lean.
  if (R <= 16 * E)
    return f32 ? launch_grouped_w<2, true>(x, offsets, packed, block_scale, tensor_scale, scale, y, E, N, K, stream)
               : launch_grouped_w<2, false>(x, offsets, packed, block_scale, tensor_scale, scale, y, E, N, K, stream);
  return f32 ? launch_grouped_w<4, true>(x, offsets, packed, block_scale, tensor_scale, scale, y, E, N, K, stream)
             : launch_grouped_w<4, false>(x, offsets, packed, block_scale, tensor_scale, scale, y, E, N, K, stream);
}

}  // namespace kiln::kernels
