// The NVFP4 GEMMs' kernel layout: a fixed permutation of the 32 bits of every word of 8 codes (and
// the bit step of its decode), the places of each 16-value block's codes and scale in a matrix, and
// the names of the dense GEMM kernels. Shared by nvfp4.cpp, the CUDA kernels and the tests; no torch.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define KILN_HOST_DEVICE __host__ __device__
#else
#define KILN_HOST_DEVICE
#endif

namespace kiln::kernels {

// Which W4A16 kernel runs: the launcher's choice by shape, or one forced (benchmarks, tests).
// kSplitK: warps (and clusters) split K, activations read from global memory, up to 32 tokens a
// pass; kStaged: bf16 activations staged in shared memory, shared by 256 weight rows, 64 tokens a
// pass (dense) or 16-32 (grouped: grouped_stack_aligned) (nvfp4_gemm.cuh);
// kWgmma: Hopper's warpgroup MMA with the decoded weights as its register operand
// (nvfp4_wgmma.cu; bf16, N a multiple of 64, K of 256, sm_90a on a 9.0 device), its launcher
// choosing 64 or 128 weight rows per block; kWgmma64 and kWgmma128 force one (128: N a multiple of 128).
// kStagedTiles (grouped only): the grouped staged kernel with its token chunks dealt to blocks as
// tiles over all experts, rather than a fixed two blocks per expert (kStaged); bitwise the same
// output. The experts' dispatch runs it above 64 rows per expert. kStagedTiles64: the same with
// 64-token chunks (eight n-tiles, one block per SM) instead of 16 or 32, forced only: each decoded
// weight tile feeds twice the tokens, yet it measured no faster at 128 rows per expert (H100).
enum class Nvfp4Gemm : int {
  kAuto = 0, kSplitK = 1, kStaged = 2, kWgmma = 3, kWgmma64 = 4, kWgmma128 = 5, kStagedTiles = 6, kStagedTiles64 = 7
};
// Whether `g` is a tiled launch of the grouped staged kernel, or any launch of it (bf16 x and
// grouped_stack_aligned stacks only).
inline bool is_staged_tiles(Nvfp4Gemm g) { return g == Nvfp4Gemm::kStagedTiles || g == Nvfp4Gemm::kStagedTiles64; }
inline bool is_grouped_staged(Nvfp4Gemm g) { return g == Nvfp4Gemm::kStaged || is_staged_tiles(g); }
// Whether `g` is one of the wgmma GEMMs, and the warpgroups per block it asks for (0: the launcher's choice).
inline bool is_wgmma(Nvfp4Gemm g) { return g == Nvfp4Gemm::kWgmma || g == Nvfp4Gemm::kWgmma64 || g == Nvfp4Gemm::kWgmma128; }
inline int wgmma_warpgroups(Nvfp4Gemm g) { return g == Nvfp4Gemm::kWgmma64 ? 1 : g == Nvfp4Gemm::kWgmma128 ? 2 : 0; }
// Whether N output rows split into blocks of `warpgroups` x 64 rows (0 and 1: any N the GEMM takes).
constexpr bool wgmma_warpgroups_fit(int64_t N, int warpgroups) { return warpgroups <= 1 || N % (64 * warpgroups) == 0; }
// Whether every expert of a stack of [N, K] starts its codes and scales on 16 bytes (given a
// 16-byte aligned stack): the grouped split-K kernel's aligned path, and what the grouped staged
// kernel's 16-byte cp.async copies need.
constexpr bool grouped_stack_aligned(int64_t N, int64_t K) { return K % 32 == 0 && N * (K / 16) % 16 == 0; }

// The wgmma GEMM's block: tokens per tile (32, 64 or 128, by the rows per group that carry work)
// and warpgroups (64 weight rows each). Unforced (warpgroups 0), two with 128-token tiles where N
// is a multiple of 128: bench nvfp4 measured them 1.0-1.4x one warpgroup there (each activation
// stage is read once for both), and mostly 0.75-0.9x with 32 and 64-token tiles, where decoding
// the weights, not reading the activations, is the cost (kiln bench nvfp4 on an H100). Host code (the launcher).
struct WgmmaBlock {
  int tokens, warpgroups;
};
constexpr WgmmaBlock wgmma_block(int64_t work_rows, int64_t groups, int64_t N, int warpgroups) {
  const int64_t per = (work_rows + groups - 1) / groups;
  const int tokens = per <= 32 ? 32 : per <= 64 ? 64 : 128;
  return {tokens, warpgroups > 0 ? warpgroups : tokens == 128 && wgmma_warpgroups_fit(N, 2) ? 2 : 1};
}

}  // namespace kiln::kernels

namespace kiln::kernels::nvfp4_layout {

// ModelOpt order: element j (0..7) in bits 4j..4j+3 as mantissa, exponent low, exponent high, sign.
// Kernel order: elements 2q and 2q+1 (q = 0..3) sit at the same places of the low and the high
// 16-bit half, magnitude (m, e0, e1) at bits mag(q)..mag(q)+2 and the sign at bit sign(q) (+16
// for element 2q+1). The places are chosen so that pair_bits below needs a rotate and a mask for
// q = 0 and 1, and a rotate (or none), a shift and two masks for q = 2 and 3.
KILN_HOST_DEVICE constexpr int mag_bit(int q) { return q == 0 ? 0 : q == 1 ? 3 : q == 2 ? 6 : 13; }
KILN_HOST_DEVICE constexpr int sign_bit(int q) { return q == 0 ? 9 : q == 1 ? 12 : q == 2 ? 10 : 11; }

// Where ModelOpt bit i (0..31) of a word goes in the kernel layout.
KILN_HOST_DEVICE constexpr int kernel_bit(int i) {
  const int j = i / 4, b = i % 4, q = j / 2, half = (j % 2) * 16;
  return (b < 3 ? mag_bit(q) + b : sign_bit(q)) + half;
}

KILN_HOST_DEVICE inline uint32_t to_kernel_word(uint32_t w) {
  uint32_t out = 0;
  for (int i = 0; i < 32; ++i) out |= ((w >> i) & 1u) << kernel_bit(i);
  return out;
}

KILN_HOST_DEVICE inline uint32_t to_modelopt_word(uint32_t w) {
  uint32_t out = 0;
  for (int i = 0; i < 32; ++i) out |= ((w >> kernel_bit(i)) & 1u) << i;
  return out;
}

KILN_HOST_DEVICE inline uint32_t rotl(uint32_t w, int k) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_l(w, w, k);  // one SHF
#else
  return (w << k) | (w >> (32 - k));  // k in 1..31
#endif
}

// Pair q of a kernel-layout word as a bf16x2 (element 2q low): sign at bit 15, the code's
// exponent and mantissa at bits 8..6, the rest zero; the same at 31 and 24..22. Read as bf16 this
// is e2m1 * 2^-126 (0.5 becomes the subnormal 2^-127), so one exact multiply by a power-of-two
// multiple of the block scale gives the weight.
KILN_HOST_DEVICE inline uint32_t pair_bits(uint32_t w, int q) {
  constexpr uint32_t kPair = 0x81C081C0u, kMag = 0x01C001C0u, kSign = 0x80008000u;
  switch (q) {
    case 0: return rotl(w, 6) & kPair;
    case 1: return rotl(w, 3) & kPair;
    case 2: return (w & kMag) | ((w << 5) & kSign);
    default: return (rotl(w, 25) & kMag) | ((w << 4) & kSign);
  }
}

// Where the blocks go. A matrix [N, K] has nb = K/16 blocks per row; the GEMM's warps read 32 rows
// x 256 K (16 blocks per row) per step. Tiles of whole steps (rows below N32 = N rounded down to 32,
// blocks below nb32 = nb rounded down to 16) come first, row tile by row tile and K step by K step,
// each 512 blocks contiguous: 4 KB of codes and 512 scale bytes, in the order a warp's lanes load
// them, so every warp load is 512 contiguous bytes. Lane 4g + t (g = 0..7, t = 0..3) holds rows
// g + 8r (r = 0..3) and, of the step's 16 blocks, 2t, 2t+1, 8+2t, 9+2t. Then the K tails of the
// first N32 rows (row-major, nb - nb32 blocks per row), then the last N - N32 rows (row-major,
// nb blocks per row). Shapes do not change: a matrix of N < 32 rows or K < 256 stays row-major.
constexpr int kTileRows = 32, kTileBlocks = 16;  // one warp step: 32 rows x 16 blocks (256 values)
constexpr int kTileUnits = kTileRows * kTileBlocks;

// Index (in blocks: 8 bytes of codes, or one scale byte) of block b of row n; `scale` picks the
// scales' order inside a tile. I: the index type; the CUDA kernels use uint32_t within a matrix
// (64-bit division by a runtime value costs several times the 32-bit one on the GPU).
template <typename I>
KILN_HOST_DEVICE inline I block_place(I n, I b, I N, I nb, bool scale) {
  const I n32 = N / kTileRows * kTileRows, nb32 = nb / kTileBlocks * kTileBlocks;
  if (n >= n32) return n * nb + b;  // the last rows: row-major, as before
  if (b >= nb32) return n32 * nb32 + n * (nb - nb32) + (b - nb32);
  const I tile = (n / kTileRows) * (nb32 / kTileBlocks) + b / kTileBlocks;
  const int rr = int(n % kTileRows), bb = int(b % kTileBlocks);
  const int g = rr % 8, r = rr / 8, half = bb / 8, t = (bb % 8) / 2, sub = bb % 2, lane = 4 * g + t;
  // Codes: lane's 16 bytes at 1024 r + 512 half + 16 lane. Scales: lane's 16 bytes hold, per r, a
  // word whose bytes are blocks 2t, 2t+1, 8+2t, 9+2t.
  const int in_tile = scale ? 16 * lane + 4 * r + 2 * half + sub : 128 * r + 64 * half + 2 * lane + sub;
  return tile * I(kTileUnits) + I(in_tile);
}

// The inverse for the codes: the row n and block b whose codes sit at block index `place`.
template <typename I>
struct RowBlock {
  I n, b;
};
template <typename I>
KILN_HOST_DEVICE inline RowBlock<I> block_at(I place, I N, I nb) {
  const I n32 = N / kTileRows * kTileRows, nb32 = nb / kTileBlocks * kTileBlocks;
  if (place >= n32 * nb) return {place / nb, place % nb};
  if (place >= n32 * nb32) {
    const I q = place - n32 * nb32, tail = nb - nb32;
    return {q / tail, nb32 + q % tail};
  }
  const I tile = place / kTileUnits, steps = nb32 / kTileBlocks;
  const int in_tile = int(place % kTileUnits);
  const int r = in_tile / 128, half = (in_tile % 128) / 64, lane = (in_tile % 64) / 2, sub = in_tile % 2;
  return {(tile / steps) * I(kTileRows) + I(lane / 4 + 8 * r),
          (tile % steps) * I(kTileBlocks) + I(8 * half + 2 * (lane % 4) + sub)};
}

// The wgmma GEMM's activation order. A lane decodes whole 16-value blocks (lane t of a quad: blocks
// 2t, 2t+1, 8+2t, 9+2t of a 256-wide step, as above), so the 16 k-slots of one warpgroup MMA draw
// on four blocks: slots 2t, 2t+1 and 8+2t, 8+2t+1 of k16 step j = 4c + s hold values 4s .. 4s+3
// of lane t's block c. Activations are staged in that order: value q (0..255) of a step of the
// permuted row is value wgmma_source(q) of the original step, so each k16 step is 32 contiguous
// bytes of shared memory.
// Lane t's block c (0..3) of a 256-wide step: 2t, 2t+1, 8+2t, 9+2t.
KILN_HOST_DEVICE constexpr int lane_block(int c, int t) { return (c >> 1) * 8 + 2 * t + (c & 1); }
KILN_HOST_DEVICE constexpr int wgmma_source(int q) {
  const int j = q / 16, slot = q % 16, t = (slot % 8) / 2;
  return 16 * lane_block(j / 4, t) + 4 * (j % 4) + 2 * (slot / 8) + slot % 2;
}

}  // namespace kiln::kernels::nvfp4_layout
