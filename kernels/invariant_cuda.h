// Raw-pointer launchers for the batch-invariant kernels (invariant.cu): no torch headers.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::kernels {

enum InvariantDtype { kInvariantF32 = 0, kInvariantBf16 = 1, kInvariantF64 = 2 };

// Which instructions the bf16 tensor-core GEMMs below use: mma.sync, or Hopper's wgmma (compute
// capability 9.0 and code for sm_90a; elsewhere its launches fail). Each gives every row bits that
// do not depend on the batch; on the H200 the two gave the same bits on every shape `kiln bench
// invariant` tried, but nothing guarantees it, so a process uses one for all of its invariant
// GEMMs. kInvariantAuto (the default) is wgmma where it runs, else mma. invariant_gemm_kernel gives
// the instructions the next launch uses (never auto); the setter (recipe kernels.bitwise_gemm,
// flag --bitwise-gemm, tests, benchmarks) returns the previous setting; another kind changes nothing.
enum InvariantGemmKernel { kInvariantAuto = -1, kInvariantMma = 0, kInvariantWgmma = 1 };
int invariant_gemm_kernel();
int set_invariant_gemm_kernel(int kind);
// Whether wgmma runs here: the current device has compute capability 9.0 and this build has code
// for sm_90a.
bool invariant_wgmma_usable();

// y [M, N] = x [M, K] . w [N, K]^T, all contiguous; bf16 on tensor cores when x and w are 16-byte
// aligned and K % 8 == 0, else on CUDA cores. Each row's result does not depend on M.
cudaError_t launch_invariant_gemm(int dtype, const void* x, const void* w, void* y, int64_t M, int64_t N, int64_t K,
                                  cudaStream_t stream);
// y [rows, N]: rows sorted by group, group e = rows [offsets[e], offsets[e + 1]) (int64 on the
// device) times w[e] ([groups, N, K]); bf16, x and w 16-byte aligned, K % 8 == 0. Each row gets the
// bits launch_invariant_gemm gives it with w[e]. No host sync.
cudaError_t launch_invariant_grouped_gemm(const void* x, const void* w, void* y, const int64_t* offsets, int64_t rows,
                                          int64_t groups, int64_t N, int64_t K, cudaStream_t stream);
// o [queries, Hq, hd]: query i of q [queries, Hq, hd] over entries [begin[i], begin[i] + count[i])
// of a key list, softmax(q k^T / sqrt(hd)) v with the keys in order. Entry r is row r of k, v
// [*, Hkv, hd] when table is null; else row table[r] of k, v if >= 0, row -1 - table[r] of kf, vf
// if < 0. int32 ranges and table on the device.
cudaError_t launch_ranged_attention(int dtype, const void* q, const void* k, const void* v, const void* kf,
                                    const void* vf, const int32_t* table, const int32_t* begin, const int32_t* count,
                                    void* o, int64_t queries, int Hq, int Hkv, int hd, cudaStream_t stream);

}  // namespace kiln::kernels
