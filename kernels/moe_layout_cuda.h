// Raw-pointer launcher for the MoE layout CUDA kernel: no torch headers, for moe_layout.cpp.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::kernels {

// Largest expert count the single-block kernel handles (its per-expert tables live in shared memory).
constexpr int64_t kMoeLayoutMaxExperts = 4096;

cudaError_t launch_moe_layout(const int64_t* sorted_experts, const int64_t* order, int64_t n, int64_t num_experts,
                              int64_t top_k, int64_t align, int64_t* counts, int32_t* offsets, int64_t* dest,
                              int64_t* src_token, int64_t* slot_row, cudaStream_t stream);

}  // namespace kiln::kernels
