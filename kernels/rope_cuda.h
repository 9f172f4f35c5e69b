// Raw-pointer launchers for the RoPE CUDA kernel: no torch headers, for rope.cpp's binding.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::kernels {

// x, y [tokens, heads, head_dim]; cos, sin [tokens, head_dim]; all contiguous.
cudaError_t launch_rope_f32(const float* x, const float* cos, const float* sin, float* y, int64_t tokens,
                            int64_t heads, int64_t head_dim, cudaStream_t stream);
cudaError_t launch_rope_bf16(const void* x, const void* cos, const void* sin, void* y, int64_t tokens,
                             int64_t heads, int64_t head_dim, cudaStream_t stream);

}  // namespace kiln::kernels
