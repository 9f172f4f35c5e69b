// Raw-pointer launchers for the NVFP4 CUDA kernels (nvfp4.cu): quantise, dequantise and the W4A16
// GEMMs (dense and grouped). No torch headers; nvfp4_cuda.cpp is the binding. No launcher syncs
// with the host, so each can be captured in a CUDA graph.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/nvfp4_layout.h"

namespace kiln::kernels {

// Element types of the untyped pointers below.
enum class Nvfp4DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// w [E, N, K] (E = 1 for one matrix), kFloat32 or kBFloat16, contiguous, 16-byte aligned; K a
// multiple of 16. Writes packed [E, N, K/2] (ModelOpt order, or the GEMMs' kernel layout),
// block_scale [E, N, K/16] (E4M3 bits), tensor_scale [E] fp32. amax_ws: E uint32 of device scratch
// (zeroed here, then the per-matrix amax). Quantise and dequantise need N * K / 16 < 2^32 and
// E <= 65535 (else cudaErrorInvalidValue).
cudaError_t launch_nvfp4_quantize(const void* w, Nvfp4DType dtype, int64_t E, int64_t N, int64_t K, bool kernel_layout,
                                  uint8_t* packed, uint8_t* block_scale, float* tensor_scale, uint32_t* amax_ws,
                                  cudaStream_t stream);

// ModelOpt (or, with kernel_layout, the kernel's) layout -> out [E, N, K] in `dtype` (any of the
// three): e2m1 * (e4m3(sf) * s2) in fp32.
cudaError_t launch_nvfp4_dequantize(const uint8_t* packed, const uint8_t* block_scale, const float* tensor_scale,
                                    int64_t E, int64_t N, int64_t K, bool kernel_layout, void* out, Nvfp4DType dtype,
                                    cudaStream_t stream);

// y [M, N] = (x [M, K] . (e2m1 * sf)^T) * s2 * (*scale), FP32 accumulation, y in x's dtype
// (kFloat32 or kBFloat16; fp32 x runs as two bf16 terms hi + lo). packed [N, K/2] in the kernel
// layout (nvfp4.h), block_scale [N, K/16], tensor_scale [1]; scale: one fp32 on the device or null.
// All contiguous; x, y, packed and block_scale 16-byte aligned. K a multiple of 16, M >= 0, N >= 1.
// gemm: kAuto picks by shape; kStaged needs bf16 x (else cudaErrorInvalidValue).
cudaError_t launch_nvfp4_linear(const void* x, Nvfp4DType dtype, const uint8_t* packed, const uint8_t* block_scale,
                                const float* tensor_scale, const float* scale, void* y, int64_t M, int64_t N,
                                int64_t K, cudaStream_t stream, Nvfp4Gemm gemm = Nvfp4Gemm::kAuto);

// Grouped: x [R, K] sorted by expert, offsets [E + 1] int64 on the device (offsets[0] = 0,
// offsets[E] = R); packed [E, N, K/2] kernel layout, block_scale [E, N, K/16], tensor_scale [E];
// y [R, N]. The offsets are read on the device only. R picks the tiles: the caller may pass the rows
// that carry work where x also holds spare rows (the offsets, not R, bound what is computed).
// gemm: kAuto and kSplitK run the split-K kernel; kStaged, kStagedTiles and kStagedTiles64 the
// staged one (bf16 x and grouped_stack_aligned, else cudaErrorInvalidValue); the wgmma GEMM has
// its own launcher below.
cudaError_t launch_nvfp4_grouped_linear(const void* x, Nvfp4DType dtype, const int64_t* offsets, const uint8_t* packed,
                                        const uint8_t* block_scale, const float* tensor_scale, const float* scale,
                                        void* y, int64_t R, int64_t E, int64_t N, int64_t K, cudaStream_t stream,
                                        Nvfp4Gemm gemm = Nvfp4Gemm::kAuto);

// The wgmma W4A16 GEMM (nvfp4_wgmma.cu, Nvfp4Gemm::kWgmma), dense (offsets null: one matrix of
// `rows` tokens, groups 1) or grouped like launch_nvfp4_grouped_linear: x [rows, K] bf16, y [rows,
// N] bf16; x_permuted: rows x K bf16 of scratch (16-byte aligned) for x in the kernel's k order.
// tile_rows: the rows that carry work (0: all), which pick the token tile. Needs nvfp4_wgmma_fits
// (a build with sm_90a code, N a multiple of 64, K of 256) and a compute capability 9.0 device.
// warpgroups: 1 (64 weight rows per block), 2 (128, sharing each activation stage; N a multiple of
// 128) or 0 (nvfp4_layout.h's wgmma_block chooses).
bool nvfp4_wgmma_fits(int64_t N, int64_t K);
cudaError_t launch_nvfp4_wgmma(const void* x, void* x_permuted, const int64_t* offsets, int64_t rows, int64_t groups,
                               const uint8_t* packed, const uint8_t* block_scale, const float* tensor_scale,
                               const float* scale, void* y, int64_t tile_rows, int64_t N, int64_t K,
                               cudaStream_t stream, int warpgroups = 0);

}  // namespace kiln::kernels
