// Raw-pointer launcher for the sampling CUDA kernel: no torch headers, for sampling.cpp's binding.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::kernels {

// logits [rows, V] fp32 row-major; temperature [rows] fp64; seeds [rows] (uint64 bits).
cudaError_t launch_sample_rows(const float* logits, int64_t rows, int64_t V, const double* temperature,
                               const uint64_t* seeds, int64_t* ids, float* logprobs, cudaStream_t stream);

}  // namespace kiln::kernels
