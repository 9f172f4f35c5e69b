// NVFP4 W4A16 GEMM on Hopper's warpgroup MMA (Nvfp4Gemm::kWgmma), dense and grouped: weight tiles
// reach shared memory by bulk copies, each warp decodes its rows to exact bf16 in registers
// (nvfp4_gemm::decode_block) as wgmma's A operand; activations, permuted to the lanes' k order, by cp.async.
#include <cuda_bf16.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda_memory.cuh"
#include "kernels/cuda_wgmma.cuh"
#include "kernels/nvfp4_cuda.h"
#include "kernels/nvfp4_gemm.cuh"
#include "kernels/nvfp4_layout.h"

namespace kiln::kernels {
// The kernel's constants and device helpers (in a named namespace: nvcc's host pass, which drops
// kernel bodies, would warn that helpers in an anonymous one are never referenced).
namespace nvfp4_wgmma {

using namespace nvfp4_gemm;  // decode_block, kSuper, epilogue_scale

// y [tokens, N] = x . W^T with W's rows on the MMA's M side (64 per warpgroup: warp w takes rows
// 16 w .. 16 w + 15, i.e. half a 32-row tile of the kernel layout) and TN tokens on its N side.
// A 256-wide K step of a 32-row tile is 4 KB of codes and 512 scale bytes, contiguous
// (nvfp4_layout); one thread brings the block's tiles of a step into shared memory with bulk copies
// counted on an mbarrier, kWRing - 1 steps ahead, so the weights' DRAM latency hides behind the
// MMAs. A lane reads its two rows' four blocks there (blocks 2t, 2t+1, 8+2t, 9+2t: 16 bytes at
// 1024 r + 16 lane and 512 further, and the rows' scale words). Block c of those is the A operand
// of k16 steps 4c .. 4c+3, whose activations are one 64-wide stage of the permuted row
// (nvfp4_layout::wgmma_source): stages of TN rows x 128 bytes, 128-byte swizzled, four deep,
// staged by cp.async. A stage's decode goes to one of two register sets, alternating, so that the
// wgmma of the stage before may still read the other.
constexpr int kWgThreads = 128;  // one warpgroup
constexpr int kWgRows = 64;      // weight rows per warpgroup
constexpr int kStageK = 64;      // K per stage: one decoded block per lane, four k16 steps
constexpr int kStages = 4;
constexpr int kWRing = 3;  // K steps of weights in shared memory: the one in use and two ahead
constexpr int kWTileCodes = nvfp4_layout::kTileUnits * 8, kWTileScales = nvfp4_layout::kTileUnits;
constexpr int kWTileBytes = kWTileCodes + kWTileScales;  // one 32-row tile's K step: codes, then scales

// Shared memory: the activation stages, then the weight ring (2 WG tiles per step), then its
// mbarriers, + room to start on 1024 bytes.
template <int TN>
__host__ __device__ constexpr int weights_at() {
  return kStages * TN * kStageK * 2;
}
template <int TN, int WG>
__host__ __device__ constexpr int barriers_at() {
  return weights_at<TN>() + kWRing * 2 * WG * kWTileBytes;
}
template <int TN, int WG>
__host__ __device__ constexpr int smem_bytes() {
  return barriers_at<TN, WG>() + 8 * kWRing + 1024;
}

// A lane's codes of two blocks of one K step (c = 0, 1 or 2, 3: one 16-byte half) for rows r0 and
// r0 + 1 of its tile's four (nvfp4_layout::block_place: row g + 8 r), and their scale words.
struct StepFrag {
  uint4 w[2];
  uint2 s;  // the scale words of rows r0 and r0 + 1: byte c is block c's
};

// Block c of both rows decoded: d[h][i] is values 2i, 2i+1 of row r0 + h's block.
template <int C>
__device__ __forceinline__ void decode_step_block(const StepFrag& f, uint32_t (&d)[2][8]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint4& v = f.w[h];
    const uint32_t w0 = (C & 1) ? v.z : v.x, w1 = (C & 1) ? v.w : v.y;
    const uint32_t sf = ((h ? f.s.y : f.s.x) >> (8 * C)) & 0xFFu;
    decode_block(w0, w1, sf, d[h]);
  }
}

}  // namespace nvfp4_wgmma

namespace {

using namespace nvfp4_wgmma;

// Permutes each 256-wide K step of x [R, K] into wgmma_source order: a thread per 8 values out.
__global__ void permute_kernel(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ xp, int64_t chunks) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= chunks) return;
  const int64_t out = 8 * i, step0 = out / kSuper * kSuper;  // K is a multiple of 256: steps never cross rows
  const int q0 = int(out - step0);
  const uint32_t* src = reinterpret_cast<const uint32_t*>(x + step0);
  uint4 v;
  v.x = __ldg(src + nvfp4_layout::wgmma_source(q0) / 2);
  v.y = __ldg(src + nvfp4_layout::wgmma_source(q0 + 2) / 2);
  v.z = __ldg(src + nvfp4_layout::wgmma_source(q0 + 4) / 2);
  v.w = __ldg(src + nvfp4_layout::wgmma_source(q0 + 6) / 2);
  *reinterpret_cast<uint4*>(xp + out) = v;
}

// Token tile `tile` of the call: with offsets (rows sorted by group, [groups + 1]) the tile-th
// TN-row tile counted across the groups in order; without, of one matrix of `rows` tokens. Past
// the last tile: begin >= end.
struct TokenTile {
  int group;
  int64_t begin, end;
};
template <int TN>
__device__ __forceinline__ TokenTile token_tile(int64_t tile, const int64_t* __restrict__ offsets, int64_t rows,
                                                int groups) {
  int64_t lo = 0, hi = rows;
  int e = 0;
  if (offsets) {
    for (; e < groups; ++e) {
      lo = offsets[e], hi = offsets[e + 1];
      const int64_t tiles = (hi - lo + TN - 1) / TN;
      if (tile < tiles) break;
      tile -= tiles;
    }
    if (e == groups) return {e, 0, 0};
  }
  const int64_t begin = lo + tile * TN;
  return {e, begin, hi - begin < TN ? hi : begin + TN};
}

// The epilogue: acc[4 j + 2 h + c] is weight row `row` + 8 h, token `tok` + 8 j + c (row: 16 warp
// + lane / 4 of the tile; tok: its first token + 2 (lane % 4)), scaled and rounded to bf16; tokens
// from tok_end on are not written.
template <int TN>
__device__ __forceinline__ void store_tile(const float (&acc)[TN / 2], float scale, __nv_bfloat16* __restrict__ y,
                                           int64_t N, int64_t row, int64_t tok, int64_t tok_end) {
#pragma unroll
  for (int j = 0; j < TN / 8; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      if (tok + 8 * j + c >= tok_end) continue;
      __nv_bfloat16* out = y + (tok + 8 * j + c) * N + row;
      out[0] = __float2bfloat16_rn(acc[4 * j + c] * scale);
      out[8] = __float2bfloat16_rn(acc[4 * j + 2 + c] * scale);
    }
}

// Queues the copy of a K stage of the token tile's activations (x: the stage's first column of
// row 0) into `xs`, swizzled for wgmma's 128-byte operand layout; rows from tok_end on read as zeros.
template <int TN, int WG>
__device__ __forceinline__ void stage_activations(unsigned char* xs, const __nv_bfloat16* __restrict__ x, int64_t tok0,
                                                  int64_t tok_end, int64_t K, int tid) {
#pragma unroll
  for (int i = 0; i < TN * 8 / (kWgThreads * WG); ++i) {  // TN rows x 8 chunks of 8 values
    const int id = tid + i * kWgThreads * WG, r = id / 8, c = id % 8;
    const bool in = tok0 + r < tok_end;
    cp_async16(xs + wgmma::swizzled(r, c), in ? x + (tok0 + r) * K + 8 * c : x, in);
  }
}

// Block (token tile, WG x 64-row tile): WG warpgroups, each on its own 64 weight rows, share each
// activation stage (WG = 2 halves the activations read from L2 per weight row). With offsets (rows
// sorted by expert, [groups + 1]), token tile b is the b-th TN-row tile counted across the experts
// in order (the grid bounds them from above); without, one matrix of `rows` tokens.
template <int TN, int WG>
__global__ void __launch_bounds__(kWgThreads * WG)
    wgmma_kernel(const __nv_bfloat16* __restrict__ xp, const int64_t* __restrict__ offsets, int64_t rows, int groups,
                 const uint8_t* __restrict__ packed, const uint8_t* __restrict__ sfs,
                 const float* __restrict__ tensor_scale, const float* __restrict__ extra,
                 __nv_bfloat16* __restrict__ y, int64_t N, int64_t K) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // device code without sm_90a: nvfp4_wgmma_fits refuses it
#else
  // Block b: weight row tile b % row_tiles of token tile b / row_tiles. The row tiles of one token
  // tile run side by side, so its activations come from DRAM once and from L2 after; the token
  // tiles in flight at once are few, so are the experts whose weights they read.
  const int64_t row_tiles = N / (kWgRows * WG), row_tile = int64_t(blockIdx.x) % row_tiles;
  const TokenTile tt = token_tile<TN>(int64_t(blockIdx.x) / row_tiles, offsets, rows, groups);
  if (tt.begin >= tt.end) return;  // past the last tile: the whole block leaves
  const int e = tt.group;
  const int64_t tok0 = tt.begin, tok_end = tt.end;

  extern __shared__ __align__(16) unsigned char wg_smem[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(wg_smem));
  const uint32_t pad = (1024u - (raw & 1023u)) & 1023u;
  unsigned char* smem = wg_smem + pad;
  const uint32_t base = raw + pad;
  constexpr int kStageBytes = TN * kStageK * 2;

  const int tid = threadIdx.x, warp = (tid % kWgThreads) / 32, lane = tid % 32;
  const int64_t num_super = K / kSuper, steps = K / kStageK;
  // This warp's half tile: the block's layout tile u = 2 (warpgroup) + warp / 2 (of 2 WG, from
  // row tile first_tile), rows r0, r0 + 1 of its four.
  const int64_t row0 = (row_tile * WG + tid / kWgThreads) * kWgRows;
  const int r0 = 2 * (warp % 2), u = 2 * (tid / kWgThreads) + warp / 2;
  const int64_t first_tile = row_tile * WG * 2;
  const uint8_t* codes = packed + int64_t(e) * N * (K / 2);
  const uint8_t* scales = sfs + int64_t(e) * N * (K / kBlock);
  const uint32_t ring = base + uint32_t(weights_at<TN>()), bars = base + uint32_t(barriers_at<TN, WG>());
  constexpr uint32_t kStepBytes = 2 * WG * kWTileBytes;
  // Thread 0: K step sc's tiles into ring slot sc % kWRing. The slot last held step sc - kWRing,
  // which every thread has finished reading (a block barrier lies between).
  auto fetch_weights = [&](int64_t sc) {
    const uint32_t slot = ring + uint32_t(sc % kWRing) * kStepBytes, bar = bars + 8u * uint32_t(sc % kWRing);
    mbar_expect(bar, kStepBytes);
#pragma unroll
    for (int v = 0; v < 2 * WG; ++v) {
      const int64_t t = (first_tile + v) * num_super + sc;
      bulk_copy(slot + v * kWTileBytes, codes + t * kWTileCodes, kWTileCodes, bar);
      bulk_copy(slot + v * kWTileBytes + kWTileCodes, scales + t * kWTileScales, kWTileScales, bar);
    }
  };
  if (tid == 0) {
#pragma unroll
    for (int b = 0; b < kWRing; ++b) mbar_init(bars + 8u * b, 1);
    mbar_init_fence();
    for (int64_t sc = 0; sc < kWRing - 1 && sc < num_super; ++sc) fetch_weights(sc);
  }

  auto stage_x = [&](int stage, int64_t step) {
    stage_activations<TN, WG>(smem + stage * kStageBytes, xp + step * kStageK, tok0, tok_end, K, tid);
  };

  float acc[TN / 2];
#pragma unroll
  for (int i = 0; i < TN / 2; ++i) acc[i] = 0.0f;

#pragma unroll
  for (int s = 0; s < kStages - 2; ++s) {  // a group per stage, empty past K, so the count is fixed
    if (s < steps) stage_x(s, s);
    cp_async_commit();
  }
  StepFrag cur;
  uint32_t da[2][8], db[2][8];  // the two register sets (stages of even and odd c)
  // One stage: wait for its activations, queue the stage two ahead, read this lane's codes (a K
  // step's first stage: wait for its weights and queue those kWRing - 1 steps ahead), decode block
  // C into `d`, and issue its four k16 products; wait until the stage before's have finished
  // reading their set.
  auto run_stage = [&](int64_t step, auto c_const, uint32_t(&d)[2][8]) {
    constexpr int C = decltype(c_const)::value;
    cp_async_wait<kStages - 3>();
    wgmma::fence_shared_for_async();
    __syncthreads();  // every thread's copies landed; every warp is done with step - 2's stage
    const int64_t ahead = step + kStages - 2;
    if (ahead < steps) stage_x(int(ahead % kStages), ahead);
    cp_async_commit();
    const int64_t sc = step / 4;
    if constexpr (C == 0) {
      if (tid == 0 && sc + kWRing - 1 < num_super) fetch_weights(sc + kWRing - 1);
      mbar_wait(bars + 8u * uint32_t(sc % kWRing), uint32_t(sc / kWRing) & 1u);
    }
    if constexpr (C == 0 || C == 2) {
      const uint32_t tile = ring + uint32_t(sc % kWRing) * kStepBytes + uint32_t(u * kWTileBytes);
#pragma unroll
      for (int h = 0; h < 2; ++h) cur.w[h] = ld_shared16(tile + 1024u * (r0 + h) + 16u * lane + (C == 2 ? 512u : 0u));
      if constexpr (C == 0) cur.s = ld_shared8(tile + kWTileCodes + 16u * lane + 4u * r0);
    }
    decode_step_block<C>(cur, d);
    const uint32_t xs = base + uint32_t((step % kStages) * kStageBytes);
    wgmma::pin(acc);
    wgmma::pin(d[0]);  // the decode's writes stay before the fence (PTX: wgmma.fence orders
    wgmma::pin(d[1]);  // register writes of A fragments before the wgmma that reads them)
    wgmma::fence();
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const uint32_t a[4] = {d[0][2 * s], d[1][2 * s], d[0][2 * s + 1], d[1][2 * s + 1]};
      wgmma::mma_rs_m64k16<TN>(acc, a, wgmma::desc_sw128(xs + uint32_t(32 * s)));
    }
    wgmma::commit();
    wgmma::wait<1>();
  };
  for (int64_t sc = 0; sc < num_super; ++sc) {
    run_stage(4 * sc + 0, std::integral_constant<int, 0>{}, da);
    run_stage(4 * sc + 1, std::integral_constant<int, 1>{}, db);
    run_stage(4 * sc + 2, std::integral_constant<int, 2>{}, da);
    run_stage(4 * sc + 3, std::integral_constant<int, 3>{}, db);
  }
  wgmma::wait<0>();
  wgmma::pin(acc);

  store_tile<TN>(acc, epilogue_scale(tensor_scale + e, extra), y, N, row0 + 16 * warp + lane / 4, tok0 + 2 * (lane % 4),
                 tok_end);
#endif
}

template <int TN, int WG>
cudaError_t launch_tn(const __nv_bfloat16* xp, const int64_t* offsets, int64_t rows, int64_t groups,
                      const uint8_t* packed, const uint8_t* sfs, const float* ts, const float* extra,
                      __nv_bfloat16* y, int64_t N, int64_t K, cudaStream_t stream) {
  static std::atomic<bool> raised[kMaxDevices];
  const cudaError_t err = raise_smem_limit(wgmma_kernel<TN, WG>, smem_bytes<TN, WG>(), raised);
  if (err != cudaSuccess) return err;
  const int64_t tiles = (rows + TN - 1) / TN + (offsets ? groups : 0);
  const int64_t blocks = tiles * (N / (kWgRows * WG));
  if (blocks > int64_t(INT32_MAX)) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks));
  wgmma_kernel<TN, WG><<<grid, kWgThreads * WG, smem_bytes<TN, WG>(), stream>>>(xp, offsets, rows, int(groups), packed,
                                                                                sfs, ts, extra, y, N, K);
  return cudaGetLastError();
}

}  // namespace

bool nvfp4_wgmma_fits(int64_t N, int64_t K) {
#if KILN_CUDA_SM90A
  return N > 0 && N % kWgRows == 0 && K > 0 && K % kSuper == 0;
#else
  (void)N, (void)K;
  return false;
#endif
}

cudaError_t launch_nvfp4_wgmma(const void* x, void* x_permuted, const int64_t* offsets, int64_t rows, int64_t groups,
                               const uint8_t* packed, const uint8_t* block_scale, const float* tensor_scale,
                               const float* scale, void* y, int64_t tile_rows, int64_t N, int64_t K,
                               cudaStream_t stream, int warpgroups) {
  if (!nvfp4_wgmma_fits(N, K) || groups < 1 || groups > (int64_t(1) << 30) || rows < 0 || warpgroups < 0 ||
      warpgroups > 2 || !wgmma_warpgroups_fit(N, warpgroups))
    return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(packed) % 16 || reinterpret_cast<uintptr_t>(block_scale) % 16)
    return cudaErrorMisalignedAddress;  // the bulk copies' sources
  if (rows == 0) return cudaSuccess;
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  auto* xp = static_cast<__nv_bfloat16*>(x_permuted);
  const int64_t chunks = rows * K / 8;
  permute_kernel<<<unsigned((chunks + 255) / 256), 256, 0, stream>>>(xb, xp, chunks);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  auto* yb = static_cast<__nv_bfloat16*>(y);
  // Token tiles of 32, 64 or 128 by the rows a group has on average (tile_rows: the caller's count
  // of rows that carry work).
  const WgmmaBlock block = wgmma_block(tile_rows > 0 ? tile_rows : rows, groups, N, warpgroups);
  const int tn = block.tokens, wg = block.warpgroups;
  auto launch = [&](auto tn_const, auto wg_const) {
    return launch_tn<decltype(tn_const)::value, decltype(wg_const)::value>(
        xp, offsets, rows, groups, packed, block_scale, tensor_scale, scale, yb, N, K, stream);
  };
  auto with_wg = [&](auto tn_const) {
    return wg == 2 ? launch(tn_const, std::integral_constant<int, 2>{}) : launch(tn_const, std::integral_constant<int, 1>{});
  };
  if (tn == 32) return with_wg(std::integral_constant<int, 32>{});
  if (tn == 64) return with_wg(std::integral_constant<int, 64>{});
  return with_wg(std::integral_constant<int, 128>{});
}

}  // namespace kiln::kernels
