// Raw-pointer launchers for the MoE layout CUDA kernels: no torch headers, for moe_layout.cpp.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::kernels {

// Largest expert count the single-block kernels handle (their per-expert tables live in shared memory).
constexpr int64_t kMoeLayoutMaxExperts = 4096;
// Up to this many slots (and kMoeLayoutSortExperts experts) one kernel also sorts them by expert;
// beyond, the caller sorts and launch_moe_layout_sorted places.
constexpr int64_t kMoeLayoutSortRows = 4096;
constexpr int64_t kMoeLayoutSortExperts = 1024;

// The per-expert outputs: counts [E], offsets and ends [E] (int32), segments [E + 1] (int64).
struct MoeSegmentsOut {
  int64_t* counts;
  int32_t* offsets;
  int32_t* ends;
  int64_t* segments;
};

// ids [n]: slot order. Writes the segments and order, dest, src_token, slot_row [n].
cudaError_t launch_moe_layout(const int64_t* ids, int64_t n, int64_t num_experts, int64_t top_k, int64_t align,
                              MoeSegmentsOut seg, int64_t* order, int64_t* dest, int64_t* src_token, int64_t* slot_row,
                              cudaStream_t stream);

// sorted_experts / order [n]: a stable sort of the slots' experts already made. Writes the
// segments, dest, src_token and slot_row.
cudaError_t launch_moe_layout_sorted(const int64_t* sorted_experts, const int64_t* order, int64_t n,
                                     int64_t num_experts, int64_t top_k, int64_t align, MoeSegmentsOut seg,
                                     int64_t* dest, int64_t* src_token, int64_t* slot_row, cudaStream_t stream);

}  // namespace kiln::kernels
