// Raw-pointer launcher for the MoE routing CUDA kernel: no torch headers, for moe_route.cpp.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::kernels {

constexpr int64_t kMoeRouteMaxExperts = 1024;  // a warp holds a token's scores in registers
constexpr int64_t kMoeRouteMaxTopK = 64;

// logits [T, E] fp32 row-major; bias [E] or null; replay [T, k] or null. Writes ids and weights [T, k].
cudaError_t launch_moe_route(const float* logits, int64_t T, int64_t E, int64_t k, bool sigmoid, const float* bias,
                             const int64_t* replay, int64_t* ids, float* weights, cudaStream_t stream);

}  // namespace kiln::kernels
