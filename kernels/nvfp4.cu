// NVFP4 CUDA kernels: quantise (two passes: per-matrix amax, then one thread per 16-value block),
// dequantise, and the W4A16 GEMMs. The GEMM swaps A and B of mma.m16n8k16 (16 weight rows x 8
// tokens), reads each warp step's codes as one 4 KB tile and decodes them to exact bf16 in
// registers (nvfp4_layout.h), and splits K over a block's warps, reduced in a fixed order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda_convert.cuh"
#include "kernels/cuda_memory.cuh"
#include "kernels/nvfp4_cuda.h"
#include "kernels/nvfp4_layout.h"

namespace kiln::kernels {
namespace {

constexpr int kBlock = 16;  // values per E4M3 block scale

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

// 16 consecutive values of a 16-byte aligned row as floats.
template <typename T>
__device__ __forceinline__ void load16(const T* p, float (&v)[16]) {
  constexpr int kPer = 16 / int(sizeof(T));
  const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < 16 / kPer; ++i) {
    const uint4 u = __ldg(q + i);
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int j = 0; j < kPer; ++j) v[i * kPer + j] = to_float(e[j]);
  }
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
// Dequantise: one thread per 16-value block. A kernel-layout block is read from its place, its words
// put back in ModelOpt order.
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
    uint2 u = reinterpret_cast<const uint2*>(packed)[base + code_at];
    if (kernel_layout) u = make_uint2(nvfp4_layout::to_modelopt_word(u.x), nvfp4_layout::to_modelopt_word(u.y));
    T* o = out + (base + i) * kBlock;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t code = ((j < 8 ? u.x : u.y) >> (4 * (j % 8))) & 0xFu;
      o[j] = from_float<T>(e2m1_decode(code) * scale);
    }
  }
}

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

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
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

__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);  // a in the low half
  return *reinterpret_cast<const uint32_t*>(&h);
}

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
__device__ __forceinline__ int block_of(int c, int t) { return (c >> 1) * 8 + 2 * t + (c & 1); }

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

// One block's work: 32 weight rows from row0 against m_count (<= 8 NT) tokens starting at x; the
// warps split K; the partial tiles are summed in shared memory (red) in a fixed order; warp 0
// writes y (row stride N) scaled by `scale`. Ends with a barrier so red can be reused.
template <int NT, int kWarps, bool kF32, bool kAligned>
__device__ __forceinline__ void gemm_tile(const void* x, int m_count, const uint8_t* packed, const uint8_t* sfs,
                                          float scale, void* y, int64_t N, int64_t K, int64_t row0, float4* red) {
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

  float acc[2][NT][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][n][i] = 0.0f;

  const int64_t sc0 = num_super * warp / kWarps, sc1 = num_super * (warp + 1) / kWarps;
  if (tiled) {
    const int64_t tile0 = (row0 / kRowsPerBlock) * num_super;
    for (int64_t sc = sc0; sc < sc1; ++sc) {
      WFrag wf;
      load_w_tile<kAligned>(wf, packed + (tile0 + sc) * nvfp4_layout::kTileUnits * 8,
                            sfs + (tile0 + sc) * nvfp4_layout::kTileUnits, lane);
      super_product<NT, kF32>(wf, xrow, sc, t, acc);
    }
  } else {
    for (int64_t sc = sc0; sc < sc1; ++sc) {
      WFrag wf;
      load_w<kAligned>(wf, wp, sp, 8 * wstride, 8 * nb, valid, sc, t);
      super_product<NT, kF32>(wf, xrow, sc, t, acc);
    }
  }
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

  // Tree reduction over the warps: the upper half adds into the lower half, in a fixed order.
#pragma unroll
  for (int half = kWarps / 2; half >= 1; half /= 2) {
    if (warp >= half && warp < 2 * half) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int n = 0; n < NT; ++n)
          red[((warp - half) * 2 * NT + mt * NT + n) * 32 + lane] =
              make_float4(acc[mt][n][0], acc[mt][n][1], acc[mt][n][2], acc[mt][n][3]);
    }
    __syncthreads();
    if (warp < half) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const float4 v = red[(warp * 2 * NT + mt * NT + n) * 32 + lane];
          acc[mt][n][0] += v.x, acc[mt][n][1] += v.y, acc[mt][n][2] += v.z, acc[mt][n][3] += v.w;
        }
    }
    __syncthreads();
  }
  if (warp == 0) {
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
}

__device__ __forceinline__ float epilogue_scale(const float* tensor_scale, const float* extra) {
  const float s2 = *tensor_scale * kEpilogueUnscale;  // exact: a power of two
  return extra ? s2 * *extra : s2;
}

// Blocks per multiprocessor the register budget is cut for: 16 warps when n-tiles are few.
constexpr int min_blocks(int nt, int warps) { return (nt <= 2 ? 16 : 8) / warps > 1 ? (nt <= 2 ? 16 : 8) / warps : 1; }

template <int NT, int kWarps, bool kF32, bool kAligned>
__global__ void __launch_bounds__(kWarps * 32, min_blocks(NT, kWarps))
    linear_kernel(const void* __restrict__ x, const uint8_t* __restrict__ packed, const uint8_t* __restrict__ sfs,
                  const float* __restrict__ tensor_scale, const float* __restrict__ extra, void* __restrict__ y,
                  int64_t M, int64_t N, int64_t K) {
  using T = typename std::conditional<kF32, float, __nv_bfloat16>::type;
  __shared__ float4 red[(kWarps / 2) * 2 * NT * 32];
  const int64_t tok0 = int64_t(blockIdx.x) * 8 * NT;
  const int m_count = int(M - tok0 < 8 * NT ? M - tok0 : 8 * NT);
  gemm_tile<NT, kWarps, kF32, kAligned>(static_cast<const T*>(x) + tok0 * K, m_count, packed, sfs,
                                        epilogue_scale(tensor_scale, extra), static_cast<T*>(y) + tok0 * N, N, K,
                                        int64_t(blockIdx.y) * kRowsPerBlock, red);
}

// Grouped: block (expert, row tile) walks its expert's rows in chunks of up to 8 kMaxNT tokens,
// each with the smallest n-tile count that covers it. Empty experts return before any load.
template <int kMaxNT, int kWarps, bool kF32, bool kAligned>
__global__ void __launch_bounds__(kWarps * 32, min_blocks(kMaxNT, kWarps))
    grouped_kernel(const void* __restrict__ x, const int64_t* __restrict__ offsets, const uint8_t* __restrict__ packed,
                   const uint8_t* __restrict__ sfs, const float* __restrict__ tensor_scale,
                   const float* __restrict__ extra, void* __restrict__ y, int64_t N, int64_t K) {
  using T = typename std::conditional<kF32, float, __nv_bfloat16>::type;
  __shared__ float4 red[(kWarps / 2) * 2 * kMaxNT * 32];
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
  }
}

template <int NT, int kWarps, bool kF32>
cudaError_t launch_linear_nt(const void* x, const uint8_t* packed, const uint8_t* sfs, const float* ts,
                             const float* extra, void* y, int64_t M, int64_t N, int64_t K, cudaStream_t stream) {
  const dim3 grid(unsigned((M + 8 * NT - 1) / (8 * NT)), unsigned((N + kRowsPerBlock - 1) / kRowsPerBlock));
  if (K % 32 == 0)
    linear_kernel<NT, kWarps, kF32, true><<<grid, kWarps * 32, 0, stream>>>(x, packed, sfs, ts, extra, y, M, N, K);
  else
    linear_kernel<NT, kWarps, kF32, false><<<grid, kWarps * 32, 0, stream>>>(x, packed, sfs, ts, extra, y, M, N, K);
  return cudaGetLastError();
}

template <int kWarps, bool kF32>
cudaError_t launch_linear_w(const void* x, const uint8_t* packed, const uint8_t* sfs, const float* ts,
                            const float* extra, void* y, int64_t M, int64_t N, int64_t K, cudaStream_t stream) {
  if (M <= 8) return launch_linear_nt<1, kWarps, kF32>(x, packed, sfs, ts, extra, y, M, N, K, stream);
  if (M <= 16) return launch_linear_nt<2, kWarps, kF32>(x, packed, sfs, ts, extra, y, M, N, K, stream);
  // Four n-tiles need more than 128 registers: one block of 8 warps per multiprocessor.
  return launch_linear_nt<4, 8, kF32>(x, packed, sfs, ts, extra, y, M, N, K, stream);
}

// Warps per block. Fewer than 8 K chunks: 4 (see launch_grouped_w). Otherwise 16 resident warps
// per multiprocessor either way (2 blocks of 8 or one of 16), with 16 per block when that fills the
// waves better (few row tiles, or a last wave mostly empty).
template <bool kF32>
cudaError_t launch_linear_blocks(const void* x, const uint8_t* packed, const uint8_t* sfs, const float* ts,
                                 const float* extra, void* y, int64_t M, int64_t N, int64_t K, cudaStream_t stream) {
  if (K < 8 * kSuper) return launch_linear_w<4, kF32>(x, packed, sfs, ts, extra, y, M, N, K, stream);
  const int64_t tiles = (N + kRowsPerBlock - 1) / kRowsPerBlock, sms = num_sms();
  auto efficiency = [&](int64_t slots) { return double(tiles) / double((tiles + slots - 1) / slots * slots); };
  if (efficiency(sms) > efficiency(2 * sms) + 0.01)
    return launch_linear_w<16, kF32>(x, packed, sfs, ts, extra, y, M, N, K, stream);
  return launch_linear_w<8, kF32>(x, packed, sfs, ts, extra, y, M, N, K, stream);
}

template <int kMaxNT, int kWarps, bool kF32>
cudaError_t launch_grouped_nt(const void* x, const int64_t* offsets, const uint8_t* packed, const uint8_t* sfs,
                              const float* ts, const float* extra, void* y, int64_t E, int64_t N, int64_t K,
                              cudaStream_t stream) {
  const dim3 grid(unsigned(E), unsigned((N + kRowsPerBlock - 1) / kRowsPerBlock));
  // Aligned: every expert's codes and scales start on 16 bytes (the stack's base does).
  if (K % 32 == 0 && N * (K / kBlock) % 16 == 0)
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
                                int64_t K, cudaStream_t stream) {
  if (M == 0 || N == 0) return cudaSuccess;
  if (dtype != Nvfp4DType::kFloat32 && dtype != Nvfp4DType::kBFloat16) return cudaErrorInvalidValue;
  return dtype == Nvfp4DType::kFloat32
             ? launch_linear_blocks<true>(x, packed, block_scale, tensor_scale, scale, y, M, N, K, stream)
             : launch_linear_blocks<false>(x, packed, block_scale, tensor_scale, scale, y, M, N, K, stream);
}

cudaError_t launch_nvfp4_grouped_linear(const void* x, Nvfp4DType dtype, const int64_t* offsets, const uint8_t* packed,
                                        const uint8_t* block_scale, const float* tensor_scale, const float* scale,
                                        void* y, int64_t R, int64_t E, int64_t N, int64_t K, cudaStream_t stream) {
  if (R == 0 || E == 0 || N == 0) return cudaSuccess;
  if (dtype != Nvfp4DType::kFloat32 && dtype != Nvfp4DType::kBFloat16) return cudaErrorInvalidValue;
  const bool f32 = dtype == Nvfp4DType::kFloat32;
  // Decode-sized batches (up to 16 rows per expert on average) keep the 1-2 n-tile bodies lean.
  if (R <= 16 * E)
    return f32 ? launch_grouped_w<2, true>(x, offsets, packed, block_scale, tensor_scale, scale, y, E, N, K, stream)
               : launch_grouped_w<2, false>(x, offsets, packed, block_scale, tensor_scale, scale, y, E, N, K, stream);
  return f32 ? launch_grouped_w<4, true>(x, offsets, packed, block_scale, tensor_scale, scale, y, E, N, K, stream)
             : launch_grouped_w<4, false>(x, offsets, packed, block_scale, tensor_scale, scale, y, E, N, K, stream);
}

}  // namespace kiln::kernels
