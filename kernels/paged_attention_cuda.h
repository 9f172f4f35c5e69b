// Raw-pointer launcher for the paged decode-attention CUDA kernel: no torch headers.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::kernels {

struct PagedDecodeArgs {
  const void* q;             // [n, hq, head_dim]
  const void* k_cache;       // [rows, hkv, head_dim]
  const void* v_cache;
  const int64_t* table;      // [n, cols]
  int64_t cols;
  const int64_t* positions;  // [n]
  int64_t n, hq, hkv, head_dim, block_size, window, ring;
  int splits;                // key ranges per (sequence, kv head); > 1 needs the partial buffers
  bool tensor_cores;         // bf16 only: the mma.sync kernel (paged_decode_tensor_cores_support)
  float* part_max;           // [n, hq, splits]
  float* part_sum;           // [n, hq, splits]
  float* part_acc;           // [n, hq, splits, head_dim]
  void* out;                 // [n, hq, head_dim]
};

// Shared memory one block needs for this shape (0 when no kernel exists for it).
int64_t paged_decode_smem_bytes(int64_t head_dim, int64_t group);
// Whether the bf16 tensor-core kernel handles this shape (head_dim 64 or 128, group <= 16).
bool paged_decode_tensor_cores_support(int64_t head_dim, int64_t group);
cudaError_t launch_paged_decode_f32(const PagedDecodeArgs& a, cudaStream_t stream);
cudaError_t launch_paged_decode_bf16(const PagedDecodeArgs& a, cudaStream_t stream);

}  // namespace kiln::kernels
