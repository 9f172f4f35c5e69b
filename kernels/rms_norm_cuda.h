// Raw-pointer launchers for the RMSNorm CUDA kernel: no torch headers, for rms_norm.cpp's binding.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::kernels {

// w_stride: 0 when every row shares the weight row, cols when each row has its own.
cudaError_t launch_rms_norm_f32(const float* x, const float* w, float* y, int64_t rows, int64_t cols,
                                int64_t w_stride, float eps, cudaStream_t stream);
// bf16 pointers passed untyped so callers need no CUDA bf16 header.
cudaError_t launch_rms_norm_bf16(const void* x, const void* w, void* y, int64_t rows, int64_t cols,
                                 int64_t w_stride, float eps, cudaStream_t stream);

}  // namespace kiln::kernels
