// Device code of the NVFP4 W4A16 GEMMs (dense and grouped kernels in nvfp4.cu): the bit-exact
// in-register decode, the fragment loads of the tiled kernel layout, and the per-tile product with
// its fixed-order reduction over warps. A header so that benchmarks and probes can time variants.
#pragma once
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda_convert.cuh"
#include "kernels/cuda_memory.cuh"
#include "kernels/cuda_mma.cuh"
#include "kernels/nvfp4_layout.h"

namespace kiln::kernels::nvfp4_gemm {

constexpr int kBlock = 16;  // values per E4M3 block scale

// ---------------------------------------------------------------------------------------------
// W4A16 GEMM.
//
// A warp owns 32 weight rows (two m16 tiles: rows g, g+8, g+16, g+24 of lane g = lane/4) and a
// contiguous range of 256-wide K "super-chunks". In mma.m16n8k16 a lane's A and B registers cover
// the same k-slots, so any physical k per (lane, register) works if A and B agree: lane t = lane%4
// of a quad takes four whole 16-value blocks of each super-chunk (blocks 2t, 2t+1, 8+2t, 9+2t, so
// each quad's 16-byte loads are contiguous), and for block c the mma step s (0..3) uses its value
// pairs 2s (slots 2t, 2t+1) and 2s+1 (slots 2t+8, 2t+9), for the weights and the activations alike.

constexpr int kRowsPerBlock = 32;
constexpr int kSuper = 256;  // K per warp iteration
static_assert(kRowsPerBlock == nvfp4_layout::kTileRows && kSuper == nvfp4_layout::kTileBlocks * kBlock,
              "a warp step is one tile of the kernel layout");

__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// A 16-value block (two kernel-layout words, E4M3 scale sf >= 0) -> its 8 bf16x2 pairs of
// e2m1 * sf * 2^-8, exact: each pair's code bits land on bf16 exponent/mantissa positions
// (nvfp4_layout::pair_bits: e2m1 * 2^-126) and one multiply by bf16(sf * 2^118) scales them. The
// 2^-8 keeps that factor below bf16's range limit (448 * 2^118 < 2^127); the epilogue multiplies
// it back (kEpilogueUnscale), and since power-of-two scaling commutes with every rounding, the
// outputs equal those of unscaled weights bit for bit.
__device__ __forceinline__ void decode_block(uint32_t w0, uint32_t w1, uint32_t sf, uint32_t (&d)[8]) {
  // E4M3 bits shifted into an fp32's exponent and mantissa, times 2^120: sf exactly, subnormals
  // too; then times 2^118 (separately: 2^238 is not an fp32).
  const float f = __uint_as_float((sf & 0x7Fu) << 20) * 0x1p120f * 0x1p118f;
  const uint32_t c = prmt(__float_as_uint(f), 0, 0x3232);  // its bf16 (exact) in both halves
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    d[q] = mul_bf16x2(nvfp4_layout::pair_bits(w0, q), c);
    d[4 + q] = mul_bf16x2(nvfp4_layout::pair_bits(w1, q), c);
  }
}

constexpr float kEpilogueUnscale = 256.0f;  // undoes decode_block's 2^-8

// A lane's weights for one super-chunk: per row r (g + 8r) 8 words (blocks c = 0..3, two words
// each) and the 4 scale bytes.
struct WFrag {
  uint32_t w[4][8];
  uint32_t s[4];
};

// A lane's activations for one 16-value block and one token: bf16 pairs; fp32 inputs carry a
// second term lo = bf16(x - hi).
template <bool kF32>
struct XBlk {
  uint32_t hi[8];
  uint32_t lo[kF32 ? 8 : 1];
};

template <bool kF32>
__device__ __forceinline__ void load_x(XBlk<kF32>& f, const void* row, int64_t k) {
  if constexpr (!kF32) {
    if (row) {
      const uint4* p = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(row) + k);
      const uint4 a = __ldg(p), b = __ldg(p + 1);
      f.hi[0] = a.x, f.hi[1] = a.y, f.hi[2] = a.z, f.hi[3] = a.w;
      f.hi[4] = b.x, f.hi[5] = b.y, f.hi[6] = b.z, f.hi[7] = b.w;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) f.hi[i] = 0;
    }
  } else {
    float v[16];
    if (row) {
      load16(static_cast<const float*>(row) + k, v);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float h0 = __bfloat162float(__float2bfloat16_rn(v[2 * i]));
      const float h1 = __bfloat162float(__float2bfloat16_rn(v[2 * i + 1]));
      f.hi[i] = pack_bf16x2(h0, h1);
      f.lo[i] = pack_bf16x2(v[2 * i] - h0, v[2 * i + 1] - h1);  // exact differences
    }
  }
}

// acc[mt][n] += weights (block c of the fragment) x activations x[n], for both m16 tiles.
template <int NT, bool kF32, int C>
__device__ __forceinline__ void block_product(const WFrag& wf, const XBlk<kF32> (&x)[NT], float (&acc)[2][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    uint32_t top[8], bot[8];
    decode_block(wf.w[2 * mt][2 * C], wf.w[2 * mt][2 * C + 1], (wf.s[2 * mt] >> (8 * C)) & 0xFFu, top);
    decode_block(wf.w[2 * mt + 1][2 * C], wf.w[2 * mt + 1][2 * C + 1], (wf.s[2 * mt + 1] >> (8 * C)) & 0xFFu, bot);
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        mma_bf16(acc[mt][n], top[2 * s], bot[2 * s], top[2 * s + 1], bot[2 * s + 1], x[n].hi[2 * s], x[n].hi[2 * s + 1]);
        if constexpr (kF32)
          mma_bf16(acc[mt][n], top[2 * s], bot[2 * s], top[2 * s + 1], bot[2 * s + 1], x[n].lo[2 * s],
                   x[n].lo[2 * s + 1]);
      }
  }
}

// Block offset (in 16-value blocks within a super-chunk) of lane t's block c.
__device__ __forceinline__ int block_of(int c, int t) { return nvfp4_layout::lane_block(c, t); }

template <bool kAligned>
__device__ __forceinline__ void load_w(WFrag& f, const uint8_t* wp, const uint8_t* sp, int64_t wstride, int64_t sstride,
                                       unsigned valid, int64_t sc, int t) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const uint8_t* w = wp + r * wstride + sc * (kSuper / 2);
    const uint8_t* s = sp + r * sstride + sc * (kSuper / kBlock);
    if ((valid >> r) & 1u) {
      if constexpr (kAligned) {
        const uint4 a = ld_stream16(w + 16 * t), b = ld_stream16(w + 64 + 16 * t);
        f.w[r][0] = a.x, f.w[r][1] = a.y, f.w[r][2] = a.z, f.w[r][3] = a.w;
        f.w[r][4] = b.x, f.w[r][5] = b.y, f.w[r][6] = b.z, f.w[r][7] = b.w;
        f.s[r] = uint32_t(__ldg(reinterpret_cast<const unsigned short*>(s + 2 * t))) |
                 (uint32_t(__ldg(reinterpret_cast<const unsigned short*>(s + 8 + 2 * t))) << 16);
      } else {
        f.s[r] = 0;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int b = block_of(c, t);
          const uint2 v = ld_stream8(w + 8 * b);
          f.w[r][2 * c] = v.x, f.w[r][2 * c + 1] = v.y;
          f.s[r] |= uint32_t(__ldg(s + b)) << (8 * c);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) f.w[r][i] = 0;
      f.s[r] = 0;
    }
  }
}

// The same fragment from a whole tile (nvfp4_layout::block_place): 4 KB of codes and 512 scale
// bytes, each warp load 512 contiguous bytes. Unaligned: the codes are 8-byte aligned, the scales
// only byte-aligned (a grouped stack of odd shapes).
template <bool kAligned>
__device__ __forceinline__ void load_w_tile(WFrag& f, const uint8_t* w, const uint8_t* s, int lane) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const uint8_t* p = w + 1024 * r + 16 * lane;
    if constexpr (kAligned) {
      const uint4 a = ld_stream16(p), b = ld_stream16(p + 512);
      f.w[r][0] = a.x, f.w[r][1] = a.y, f.w[r][2] = a.z, f.w[r][3] = a.w;
      f.w[r][4] = b.x, f.w[r][5] = b.y, f.w[r][6] = b.z, f.w[r][7] = b.w;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint2 v = ld_stream8(p + (i / 2) * 512 + (i % 2) * 8);
        f.w[r][2 * i] = v.x, f.w[r][2 * i + 1] = v.y;
      }
    }
  }
  if constexpr (kAligned) {
    const uint4 v = ld_stream16(s + 16 * lane);
    f.s[0] = v.x, f.s[1] = v.y, f.s[2] = v.z, f.s[3] = v.w;
  } else {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      f.s[r] = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) f.s[r] |= uint32_t(__ldg(s + 16 * lane + 4 * r + i)) << (8 * i);
    }
  }
}

// Activations of blocks C0 .. C0+G-1 of super-chunk sc, then their products.
template <int NT, bool kF32, int C0, int G>
__device__ __forceinline__ void super_group(const WFrag& wf, const void* const (&xrow)[NT], int64_t sc, int t,
                                            float (&acc)[2][NT][4]) {
  XBlk<kF32> x[G][NT];
#pragma unroll
  for (int c = 0; c < G; ++c)
#pragma unroll
    for (int n = 0; n < NT; ++n) load_x<kF32>(x[c][n], xrow[n], sc * kSuper + block_of(C0 + c, t) * kBlock);
  block_product<NT, kF32, C0>(wf, x[0], acc);
  if constexpr (G > 1) block_product<NT, kF32, C0 + 1>(wf, x[1], acc);
  if constexpr (G > 2) {
    block_product<NT, kF32, C0 + 2>(wf, x[2], acc);
    block_product<NT, kF32, C0 + 3>(wf, x[3], acc);
  }
}

template <int NT, bool kF32>
__device__ __forceinline__ void super_product(const WFrag& wf, const void* const (&xrow)[NT], int64_t sc, int t,
                                              float (&acc)[2][NT][4]) {
  // About 32 registers of activations in flight: all four blocks' at once for one n-tile of bf16.
  constexpr int G = kF32 ? (NT == 1 ? 2 : 1) : (NT == 1 ? 4 : NT == 2 ? 2 : 1);
  if constexpr (G == 4) {
    super_group<NT, kF32, 0, 4>(wf, xrow, sc, t, acc);
  } else if constexpr (G == 2) {
    super_group<NT, kF32, 0, 2>(wf, xrow, sc, t, acc);
    super_group<NT, kF32, 2, 2>(wf, xrow, sc, t, acc);
  } else {
    super_group<NT, kF32, 0, 1>(wf, xrow, sc, t, acc);
    super_group<NT, kF32, 1, 1>(wf, xrow, sc, t, acc);
    super_group<NT, kF32, 2, 1>(wf, xrow, sc, t, acc);
    super_group<NT, kF32, 3, 1>(wf, xrow, sc, t, acc);
  }
}

// A warp's share of one block's work: 32 weight rows from row0 against m_count (<= 8 NT) tokens
// starting at x, over part `part` of `parts` equal K ranges (whole super-chunks; the K tail goes to
// the last part), split again over the block's kWarps warps. Adds into acc.
template <int NT, int kWarps, bool kF32, bool kAligned>
__device__ __forceinline__ void tile_partial(const void* x, int m_count, const uint8_t* packed, const uint8_t* sfs,
                                             int64_t N, int64_t K, int64_t row0, int part, int parts,
                                             float (&acc)[2][NT][4]) {
  using T = typename std::conditional<kF32, float, __nv_bfloat16>::type;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int64_t wstride = K / 2, nb = K / kBlock, num_super = K / kSuper, nb32 = num_super * (kSuper / kBlock);
  // Row tiles of 32 whole rows are tiled (nvfp4_layout::block_place), their K tails row-major after
  // the tiles; a last partial tile is row-major as a whole.
  const bool tiled = row0 + kRowsPerBlock <= N;
  const int64_t n32 = N / kRowsPerBlock * kRowsPerBlock;
  const int64_t tail_nb = tiled ? nb - nb32 : nb, tail_b0 = tiled ? nb32 : 0;
  const int64_t tail_at = tiled ? n32 * nb32 + (row0 + g) * tail_nb : (row0 + g) * nb;  // in blocks
  const uint8_t* wp = packed + (row0 + g) * wstride;
  const uint8_t* sp = sfs + (row0 + g) * nb;
  unsigned valid = 0;
#pragma unroll
  for (int r = 0; r < 4; ++r) valid |= unsigned(row0 + g + 8 * r < N) << r;
  const void* xrow[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n)
    xrow[n] = 8 * n + g < m_count ? static_cast<const void*>(static_cast<const T*>(x) + (8 * n + g) * K) : nullptr;

  const int64_t p0 = num_super * part / parts, p1 = num_super * (part + 1) / parts;
  const int64_t sc0 = p0 + (p1 - p0) * warp / kWarps, sc1 = p0 + (p1 - p0) * (warp + 1) / kWarps;
  if (tiled) {
    constexpr int64_t kUnits = nvfp4_layout::kTileUnits;
    const uint8_t* tw = packed + (row0 / kRowsPerBlock) * num_super * kUnits * 8;
    const uint8_t* ts = sfs + (row0 / kRowsPerBlock) * num_super * kUnits;
    for (int64_t sc = sc0; sc < sc1; ++sc) {
      WFrag wf;
      load_w_tile<kAligned>(wf, tw + sc * kUnits * 8, ts + sc * kUnits, lane);
      super_product<NT, kF32>(wf, xrow, sc, t, acc);
    }
  } else {
    for (int64_t sc = sc0; sc < sc1; ++sc) {
      WFrag wf;
      load_w<kAligned>(wf, wp, sp, 8 * wstride, 8 * nb, valid, sc, t);
      super_product<NT, kF32>(wf, xrow, sc, t, acc);
    }
  }
  if (part != parts - 1) return;
  // The K tail (< 16 blocks, row-major): chunks of 4 blocks, chunk j on warp j, lane t on block 4j + t.
  const int tail = int(nb - nb32);
  for (int j = warp; 4 * j < tail; j += kWarps) {
    const int b = 4 * j + t;
    const int64_t blk = nb32 + b;
    const bool ok = b < tail;
    WFrag wf;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      if (ok && ((valid >> r) & 1u)) {
        const int64_t at = tail_at + r * 8 * tail_nb + (blk - tail_b0);
        const uint2 v = ld_stream8(packed + 8 * at);
        wf.w[r][0] = v.x, wf.w[r][1] = v.y;
        wf.s[r] = __ldg(sfs + at);
      } else {
        wf.w[r][0] = wf.w[r][1] = 0;
        wf.s[r] = 0;
      }
    }
    XBlk<kF32> xb[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) load_x<kF32>(xb[n], ok ? xrow[n] : nullptr, blk * kBlock);
    block_product<NT, kF32, 0>(wf, xb, acc);
  }
}

template <int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[2][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][n][i] = 0.0f;
}

// float4s of one warp's partial tile in shared memory: [2 m-tiles][NT][32 lanes].
__host__ __device__ constexpr int partial_size(int nt) { return 2 * nt * 32; }

// acc += the lane's float4s of NT n-tiles at `from` (laid out as partial_size says).
template <int NT>
__device__ __forceinline__ void add_partial(float (&acc)[2][NT][4], const float4* from, int lane) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const float4 v = from[(mt * NT + n) * 32 + lane];
      acc[mt][n][0] += v.x, acc[mt][n][1] += v.y, acc[mt][n][2] += v.z, acc[mt][n][3] += v.w;
    }
}

template <int NT>
__device__ __forceinline__ void put_partial(const float (&acc)[2][NT][4], float4* to, int lane) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int n = 0; n < NT; ++n)
      to[(mt * NT + n) * 32 + lane] = make_float4(acc[mt][n][0], acc[mt][n][1], acc[mt][n][2], acc[mt][n][3]);
}

// float4s of shared memory sum_warps needs.
__host__ __device__ constexpr int red_size(int nt, int warps) { return (warps > 1 ? warps - 1 : 1) * partial_size(nt); }

// Warp 0's acc becomes the sum over the block's warps, in warp order: warps 1.. write their partial
// to red, one barrier, warp 0 adds them. A caller that reuses red needs another barrier first.
template <int NT, int kWarps>
__device__ __forceinline__ void sum_warps(float (&acc)[2][NT][4], float4* red) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (warp > 0) put_partial<NT>(acc, red + (warp - 1) * partial_size(NT), lane);
  __syncthreads();
  if (warp == 0)
    for (int w = 1; w < kWarps; ++w) add_partial<NT>(acc, red + (w - 1) * partial_size(NT), lane);
}

// The K parts of a tile, one block each, form a thread-block cluster: after sum_warps, warp 0 of
// each part > 0 writes its sum into part 0's shared memory, a cluster barrier, and warp 0 of part
// 0 adds them in part order, so the result does not depend on timing. Returns true in the threads
// that hold the tile's sum (warp 0 of part 0; with one part, warp 0).
template <int NT, int kParts>
__device__ __forceinline__ bool sum_parts(float (&acc)[2][NT][4], int part) {
  const int lane = int(threadIdx.x) % 32;
  const bool warp0 = threadIdx.x < 32;
  if constexpr (kParts > 1) {
    __shared__ float4 parts[(kParts - 1) * partial_size(NT)];
    cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    if (part > 0 && warp0) put_partial<NT>(acc, cluster.map_shared_rank(parts, 0) + (part - 1) * partial_size(NT), lane);
    cluster.sync();
    if (part == 0 && warp0)
      for (int p = 1; p < kParts; ++p) add_partial<NT>(acc, parts + (p - 1) * partial_size(NT), lane);
  }
  return part == 0 && warp0;
}

// Warp 0 writes the tile: y (row stride N) = acc * scale, rows row0.., tokens < m_count.
template <int NT, bool kF32>
__device__ __forceinline__ void store_tile(const float (&acc)[2][NT][4], float scale, void* y, int64_t N, int64_t row0,
                                           int m_count) {
  using T = typename std::conditional<kF32, float, __nv_bfloat16>::type;
  const int lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  T* out = static_cast<T*>(y);
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t row = row0 + 16 * mt + g + 8 * (i / 2);
        const int tok = 8 * n + 2 * t + (i % 2);
        if (row < N && tok < m_count) out[tok * N + row] = from_float<T>(acc[mt][n][i] * scale);
      }
}

// One block's whole tile: every warp's partial over all of K, summed in warp order, written by
// warp 0. red: red_size(NT, kWarps) float4s of shared memory.
template <int NT, int kWarps, bool kF32, bool kAligned>
__device__ __forceinline__ void gemm_tile(const void* x, int m_count, const uint8_t* packed, const uint8_t* sfs,
                                          float scale, void* y, int64_t N, int64_t K, int64_t row0, float4* red) {
  float acc[2][NT][4];
  zero_acc<NT>(acc);
  tile_partial<NT, kWarps, kF32, kAligned>(x, m_count, packed, sfs, N, K, row0, 0, 1, acc);
  sum_warps<NT, kWarps>(acc, red);
  if (threadIdx.x < 32) store_tile<NT, kF32>(acc, scale, y, N, row0, m_count);
}

__device__ __forceinline__ float epilogue_scale(const float* tensor_scale, const float* extra) {
  const float s2 = *tensor_scale * kEpilogueUnscale;  // exact: a power of two
  return extra ? s2 * *extra : s2;
}

// Blocks per multiprocessor the register budget is cut for: 16 warps when n-tiles are few, 12 with
// four or more (168 registers; the grouped kernel with 32-token chunks on 4 warps measured 39.8
// against 46.7 us at 2 blocks and 41.2 at 4, spilling: kiln_probe_nvfp4 grouped, muse-small's 64
// experts at 32 rows each, on an H200).
constexpr int min_blocks(int nt, int warps) { return (nt <= 2 ? 16 : 12) / warps > 1 ? (nt <= 2 ? 16 : 12) / warps : 1; }

// Grouped: block (expert, row tile) walks its expert's rows in chunks of up to 8 kMaxNT tokens,
// each with the smallest n-tile count that covers it. Empty experts return before any load.
// kMinBlocks: the blocks per multiprocessor the registers are budgeted for.
template <int kMaxNT, int kWarps, bool kF32, bool kAligned, int kMinBlocks = min_blocks(kMaxNT, kWarps)>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    grouped_kernel(const void* __restrict__ x, const int64_t* __restrict__ offsets, const uint8_t* __restrict__ packed,
                   const uint8_t* __restrict__ sfs, const float* __restrict__ tensor_scale,
                   const float* __restrict__ extra, void* __restrict__ y, int64_t N, int64_t K) {
  using T = typename std::conditional<kF32, float, __nv_bfloat16>::type;
  __shared__ float4 red[red_size(kMaxNT, kWarps)];
  const int64_t e = blockIdx.x, begin = offsets[e], end = offsets[e + 1];
  if (end <= begin) return;
  const uint8_t* pk = packed + e * N * (K / 2);
  const uint8_t* sf = sfs + e * N * (K / kBlock);
  const float scale = epilogue_scale(tensor_scale + e, extra);
  const int64_t row0 = int64_t(blockIdx.y) * kRowsPerBlock;
  for (int64_t tok0 = begin; tok0 < end; tok0 += 8 * kMaxNT) {
    const int m_count = int(end - tok0 < 8 * kMaxNT ? end - tok0 : 8 * kMaxNT);
    const T* xc = static_cast<const T*>(x) + tok0 * K;
    T* yc = static_cast<T*>(y) + tok0 * N;
    if (m_count <= 8) {
      gemm_tile<1, kWarps, kF32, kAligned>(xc, m_count, pk, sf, scale, yc, N, K, row0, red);
    } else if (kMaxNT >= 2 && m_count <= 16) {
      gemm_tile<(kMaxNT >= 2 ? 2 : 1), kWarps, kF32, kAligned>(xc, m_count, pk, sf, scale, yc, N, K, row0, red);
    } else {
      gemm_tile<kMaxNT, kWarps, kF32, kAligned>(xc, m_count, pk, sf, scale, yc, N, K, row0, red);
    }
    if (tok0 + 8 * kMaxNT < end) __syncthreads();  // warp 0 has read red before the next chunk writes it
  }
}

// ---------------------------------------------------------------------------------------------
// Staged W4A16 GEMM (bf16 activations), for the batch sizes above decode's.
//
// The split-K kernel above gives every warp all of a chunk's tokens from global memory, so each
// 32-row tile re-reads the activations and a decoded block feeds at most 4 n-tiles. Here a block
// of kStagedWarps warps shares one chunk of 8 NT tokens and each warp owns its own 32 rows over
// the whole K range (split over a cluster of blocks for parallelism). Each K step of 256 is staged
// in shared memory by cp.async, two steps deep: the chunk's activations (NT x 4 KB), read from
// global memory a whole 512-byte token row per warp and stored in the order the lanes read them
// (every shared load one conflict-free 512-byte row), and each warp's weight tile (4.5 KB, the
// kernel layout's contiguous tile). A decoded block then feeds NT n-tiles. What limits it is L2
// bandwidth: per step a block moves 4 NT KB of activations and 36 KB of weight tiles into an SM.

constexpr int kStagedWarps = 8;  // = the 8 tokens of an n-tile: warp w stages token row w of each
constexpr int kStagedRows = kStagedWarps * kRowsPerBlock;                    // weight rows per block
constexpr int kTileBytes = nvfp4_layout::kTileUnits * 8 + nvfp4_layout::kTileUnits;  // codes + scales

__host__ __device__ constexpr int staged_x_bytes(int nt) { return nt * 4 * 2 * 32 * 16; }  // [n][c][half][lane] x 16 B
__host__ __device__ constexpr int staged_stage_bytes(int nt) { return staged_x_bytes(nt) + kStagedWarps * kTileBytes; }
// Two stages; part 0 of a cluster reuses them for the other parts' partial tiles.
__host__ __device__ constexpr int staged_smem_bytes(int nt, int parts) {
  return 2 * staged_stage_bytes(nt) > (parts - 1) * kStagedWarps * partial_size(nt) * 16
             ? 2 * staged_stage_bytes(nt)
             : (parts - 1) * kStagedWarps * partial_size(nt) * 16;
}

// One whole tile (kTileBytes: its codes, then its scales) into shared memory by cp.async, 16 bytes
// per lane at a time, stored as in global memory.
__device__ __forceinline__ void copy_tile(uint8_t* to, const uint8_t* codes, const uint8_t* scales, int lane) {
#pragma unroll
  for (int i = 0; i < 8; ++i) cp_async16(to + 512 * i + 16 * lane, codes + 512 * i + 16 * lane);
  cp_async16(to + 4096 + 16 * lane, scales + 16 * lane);
}

// Issues the copies of K step sc into `stage`: the activations of the chunk's m_count tokens at x
// (row stride K) and, per warp, the weight tile of rows row0 + 32 warp. Whole tiles go by cp.async;
// a partial row tile or the K tail step (both row-major in the kernel layout) is gathered block by
// block with plain loads. Everything outside the matrices is zero.
template <int NT>
__device__ __forceinline__ void stage_step(uint8_t* stage, const __nv_bfloat16* x, int m_count, const uint8_t* packed,
                                           const uint8_t* sfs, int64_t N, int64_t K, int64_t row0, int64_t sc) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  {
    // Lane l copies values 8l..8l+7 of the step: half (l % 2) of block l / 2, which is lane t's
    // block c (block_of) of every token g = warp of the n-tiles.
    const int b = lane / 2, half = lane % 2, c = ((b >> 3) << 1) | (b & 1), t = (b & 7) >> 1;
    uint8_t* dst = stage + (c * 2 + half) * 512 + 16 * (4 * warp + t);
    const int64_t k = sc * kSuper + 8 * lane;
    const __nv_bfloat16* src = x + int64_t(warp) * K + k;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const bool ok = k < K && warp + 8 * n < m_count;
      cp_async16(dst + 4096 * n, ok ? src + int64_t(8 * n) * K : x, ok);
    }
  }
  uint8_t* wt = stage + staged_x_bytes(NT) + warp * kTileBytes;
  const int64_t rows = row0 + kRowsPerBlock * warp, nb = K / kBlock, num_super = K / kSuper;
  if (rows + kRowsPerBlock <= N && sc < num_super) {
    const int64_t tile = (rows / kRowsPerBlock) * num_super + sc;
    copy_tile(wt, packed + tile * nvfp4_layout::kTileUnits * 8, sfs + tile * nvfp4_layout::kTileUnits, lane);
    return;
  }
  if (rows >= N) return;  // no rows: the warp computes nothing
  for (int u = lane; u < nvfp4_layout::kTileUnits; u += 32) {
    // Unit u of the tile (nvfp4_layout::block_place's in-tile order): row g + 8r, block 8 half + 2t + sub.
    const int r = u / 128, half = (u % 128) / 64, ln = (u % 64) / 2, sub = u % 2;
    const int64_t row = rows + ln / 4 + 8 * r, b = sc * (kSuper / kBlock) + 8 * half + 2 * (ln % 4) + sub;
    uint2 code = make_uint2(0, 0);
    uint8_t scale = 0;
    if (row < N && b < nb) {
      const int64_t at = nvfp4_layout::block_place<int64_t>(row, b, N, nb, false);  // row-major here
      code = ld_stream8(packed + 8 * at);
      scale = __ldg(sfs + at);
    }
    *reinterpret_cast<uint2*>(wt + 8 * u) = code;
    wt[4096 + 16 * ln + 4 * r + 2 * half + sub] = scale;
  }
}

// A lane's fragment of a whole tile in shared memory, stored as in global memory (kTileBytes: the
// codes in lane-order 16-byte pieces, then the scales).
__device__ __forceinline__ void read_tile(WFrag& f, const uint8_t* tile, int lane) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const uint4 a = *reinterpret_cast<const uint4*>(tile + 1024 * r + 16 * lane);
    const uint4 b = *reinterpret_cast<const uint4*>(tile + 1024 * r + 512 + 16 * lane);
    f.w[r][0] = a.x, f.w[r][1] = a.y, f.w[r][2] = a.z, f.w[r][3] = a.w;
    f.w[r][4] = b.x, f.w[r][5] = b.y, f.w[r][6] = b.z, f.w[r][7] = b.w;
  }
  const uint4 v = *reinterpret_cast<const uint4*>(tile + 4096 + 16 * lane);
  f.s[0] = v.x, f.s[1] = v.y, f.s[2] = v.z, f.s[3] = v.w;
}

// The warp's 32 rows x 256 K of a staged step against the chunk's NT n-tiles: each block c decoded
// once (both m16 tiles), then every n-tile's activations of that block read from shared memory and
// the products issued k-step by k-step, so that consecutive mma are independent (ncu: with two
// warps per scheduler the kernel is bound by latency, not by the tensor pipe).
template <int NT>
__device__ __forceinline__ void staged_product(const uint8_t* stage, int warp, int lane, float (&acc)[2][NT][4]) {
  constexpr int kGroup = NT;  // all n-tiles' activations of a block at once: 8 NT registers
  WFrag wf;
  read_tile(wf, stage + staged_x_bytes(NT) + warp * kTileBytes, lane);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    uint32_t d[2][2][8];  // [m-tile][rows g / g + 8][pairs]
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        decode_block(wf.w[2 * mt + h][2 * c], wf.w[2 * mt + h][2 * c + 1], (wf.s[2 * mt + h] >> (8 * c)) & 0xFFu, d[mt][h]);
#pragma unroll
    for (int n0 = 0; n0 < NT; n0 += kGroup) {
      uint32_t xv[kGroup][8];
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        const uint8_t* xp = stage + ((n0 + j) * 4 + c) * 1024 + 16 * lane;
        const uint4 lo = *reinterpret_cast<const uint4*>(xp), hi = *reinterpret_cast<const uint4*>(xp + 512);
        xv[j][0] = lo.x, xv[j][1] = lo.y, xv[j][2] = lo.z, xv[j][3] = lo.w;
        xv[j][4] = hi.x, xv[j][5] = hi.y, xv[j][6] = hi.z, xv[j][7] = hi.w;
      }
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int j = 0; j < kGroup; ++j)
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
            mma_bf16(acc[mt][n0 + j], d[mt][0][2 * s], d[mt][1][2 * s], d[mt][0][2 * s + 1], d[mt][1][2 * s + 1],
                     xv[j][2 * s], xv[j][2 * s + 1]);
    }
  }
}



// One token chunk (m <= 8 NT rows at xc, their outputs at yc) of an expert's stack (pk, sf) through
// staged_kernel's pipeline (stage_step, staged_product), for the block's kStagedRows-row slab at
// row0. Every thread of the block calls it.
template <int NT>
__device__ __forceinline__ void grouped_staged_chunk(uint8_t* smem, const __nv_bfloat16* xc, int m, const uint8_t* pk,
                                                     const uint8_t* sf, float scale, __nv_bfloat16* yc, int64_t N,
                                                     int64_t K, int64_t row0) {
  constexpr int kStage = staged_stage_bytes(NT);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int64_t rows = row0 + kRowsPerBlock * warp, steps = (K + kSuper - 1) / kSuper;
  float acc[2][NT][4];
  zero_acc<NT>(acc);
  __syncthreads();  // every warp is done with the previous chunk's stages
  stage_step<NT>(smem, xc, m, pk, sf, N, K, row0, 0);
  cp_async_commit();
  for (int64_t sc = 0; sc < steps; ++sc) {
    // As staged_kernel: step sc has landed for everyone, and step sc - 1's stage is free.
    cp_async_wait<0>();
    __syncthreads();
    if (sc + 1 < steps) stage_step<NT>(smem + ((sc + 1) & 1) * kStage, xc, m, pk, sf, N, K, row0, sc + 1);
    cp_async_commit();
    if (rows < N) staged_product<NT>(smem + (sc & 1) * kStage, warp, lane, acc);
  }
  if (rows < N) store_tile<NT, false>(acc, scale, yc, N, rows, m);
}

// Grouped staged W4A16 GEMM (bf16): block (expert, kStagedRows-row slab, z) runs
// grouped_staged_chunk over its expert's chunks of 8 NT tokens z, z + gridDim.z, ... (the library
// launches two, kGroupedStagedSplit in nvfp4.cu). The 8 warps' 256 weight rows share each 256-K
// step of a chunk's activations, copied once per block, where grouped_kernel's 32-row blocks each
// read them from L2 (its ncu profile: latency-bound on those reads, docs/PERFORMANCE.md). Needs
// grouped_stack_aligned; dynamic shared memory 2 staged_stage_bytes(NT).
template <int NT>
__global__ void __launch_bounds__(kStagedWarps * 32, NT <= 4 ? 2 : 1)
    grouped_staged_kernel(const __nv_bfloat16* __restrict__ x, const int64_t* __restrict__ offsets,
                          const uint8_t* __restrict__ packed, const uint8_t* __restrict__ sfs,
                          const float* __restrict__ tensor_scale, const float* __restrict__ extra,
                          __nv_bfloat16* __restrict__ y, int64_t N, int64_t K) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int64_t e = blockIdx.x, begin = offsets[e], end = offsets[e + 1];
  const int64_t row0 = int64_t(blockIdx.y) * kStagedRows;
  const uint8_t* pk = packed + e * N * (K / 2);
  const uint8_t* sf = sfs + e * N * (K / kBlock);
  const float scale = epilogue_scale(tensor_scale + e, extra);
  // The same trip count in every thread of the block.
  for (int64_t tok0 = begin + int64_t(blockIdx.z) * 8 * NT; tok0 < end; tok0 += int64_t(gridDim.z) * 8 * NT) {
    const int m = int(end - tok0 < 8 * NT ? end - tok0 : 8 * NT);
    grouped_staged_chunk<NT>(smem, x + tok0 * K, m, pk, sf, scale, y + tok0 * N, N, K, row0);
  }
}

// Tile t of a stack's token chunks, numbered expert by expert (expert e has ceil(rows_e / chunk)):
// warp 0 scans the offsets 32 experts at a time and writes the tile's expert and first row to
// found[0], found[1]; found[0] stays -1 past the last tile. The caller syncs before and after.
__device__ __forceinline__ void find_chunk_tile(const int64_t* offsets, int64_t E, int64_t chunk, long long t,
                                                long long (&found)[2]) {
  const int lane = int(threadIdx.x) % 32;
  long long before = 0;  // tiles of the experts already scanned
  for (int64_t base = 0; base < E && before <= t; base += 32) {
    const int64_t e = base + lane;
    const long long first_row = e < E ? offsets[e] : 0, n = e < E ? max(offsets[e + 1] - first_row, 0ll) : 0;
    const long long tiles = (n + chunk - 1) / chunk;
    long long upto = tiles;  // inclusive prefix sum over the lanes
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const long long v = __shfl_up_sync(0xffffffffu, upto, d);
      if (lane >= d) upto += v;
    }
    const long long mine = before + upto - tiles;  // this expert's first tile
    if (tiles > 0 && t >= mine && t < mine + tiles) {
      found[0] = e;
      found[1] = first_row + (t - mine) * chunk;
    }
    before += __shfl_sync(0xffffffffu, upto, 31);
  }
}

// The grouped staged kernel with its chunks dealt out as tiles: block (x, slab) takes tiles x,
// x + gridDim.x, ... of all experts' chunks (find_chunk_tile), so that an expert with many rows
// spreads over as many blocks as it has chunks, where grouped_staged_kernel gives every expert
// gridDim.z blocks per slab whatever its rows. Each chunk is computed as there, so the outputs are
// bitwise the same. The grid is sized from the rows on the host (the offsets stay on the device);
// the loop makes any grid correct. Needs grouped_stack_aligned; dynamic shared memory
// 2 staged_stage_bytes(NT).
template <int NT>
__global__ void __launch_bounds__(kStagedWarps * 32, NT <= 4 ? 2 : 1)
    grouped_staged_tiles_kernel(const __nv_bfloat16* __restrict__ x, const int64_t* __restrict__ offsets, int64_t E,
                                const uint8_t* __restrict__ packed, const uint8_t* __restrict__ sfs,
                                const float* __restrict__ tensor_scale, const float* __restrict__ extra,
                                __nv_bfloat16* __restrict__ y, int64_t N, int64_t K) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ long long found[2];
  const int64_t row0 = int64_t(blockIdx.y) * kStagedRows;
  for (long long t = blockIdx.x;; t += gridDim.x) {
    __syncthreads();  // everyone has read the last tile's `found`
    if (threadIdx.x == 0) found[0] = -1;
    __syncthreads();
    if (threadIdx.x < 32) find_chunk_tile(offsets, E, 8 * NT, t, found);
    __syncthreads();
    const long long e = found[0], tok0 = found[1];
    if (e < 0) return;  // the same in every thread: past the last tile
    const int64_t end = offsets[e + 1];
    const int m = int(end - tok0 < 8 * NT ? end - tok0 : 8 * NT);
    grouped_staged_chunk<NT>(smem, x + tok0 * K, m, packed + e * N * (K / 2), sfs + e * N * (K / kBlock),
                             epilogue_scale(tensor_scale + e, extra), y + tok0 * N, N, K, row0);
  }
}

}  // namespace kiln::kernels::nvfp4_gemm
