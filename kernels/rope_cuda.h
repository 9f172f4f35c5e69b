// Raw-pointer launchers for the RoPE CUDA kernels: no torch headers, for rope.cpp's binding.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::kernels {

// x, y [tokens, heads, head_dim]; cos, sin [tokens, head_dim]; all contiguous.
cudaError_t launch_rope_f32(const float* x, const float* cos, const float* sin, float* y, int64_t tokens,
                            int64_t heads, int64_t head_dim, cudaStream_t stream);
cudaError_t launch_rope_bf16(const void* x, const void* cos, const void* sin, void* y, int64_t tokens,
                             int64_t heads, int64_t head_dim, cudaStream_t stream);

// q [tokens, hq, hd] rotated into q_out; k [tokens, hkv, hd] rotated into k_cache[rows[t]] and v
// copied into v_cache[rows[t]] (caches [R, hkv, hd]); dtype 0 fp32, 1 bf16; all contiguous.
cudaError_t launch_rope_cache_write(int dtype, const void* q, const void* k, const void* v, const void* cos,
                                    const void* sin, const int64_t* rows, void* q_out, void* k_cache, void* v_cache,
                                    int64_t tokens, int64_t hq, int64_t hkv, int64_t head_dim, cudaStream_t stream);

}  // namespace kiln::kernels
