// Raw-pointer launchers for the RMSNorm CUDA kernels (forward and training backward): no torch
// headers, for rms_norm.cpp's binding.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::kernels {

// Widest row the backward kernel takes (its per-thread columns live in registers).
constexpr int64_t kMaxBackwardCols = 8192;

// w_stride: 0 when every row shares the weight row, cols when each row has its own. With `ends`
// (num_segments sorted end rows, the last = rows), row r uses weight row s, the first with
// ends[s] > r, and w_stride is ignored.
cudaError_t launch_rms_norm_f32(const float* x, const float* w, float* y, int64_t rows, int64_t cols,
                                int64_t w_stride, const int32_t* ends, int num_segments, float eps,
                                cudaStream_t stream);
// bf16 pointers passed untyped so callers need no CUDA bf16 header.
cudaError_t launch_rms_norm_bf16(const void* x, const void* w, void* y, int64_t rows, int64_t cols,
                                 int64_t w_stride, const int32_t* ends, int num_segments, float eps,
                                 cudaStream_t stream);

// h = x + rms_norm(a, w_add), hn = rms_norm(h, w_next), rows x cols, one kernel (dtype 0 fp32, 1
// bf16). *launched is false (and nothing runs) where the forward would take its scalar path
// (misaligned rows or a width not a multiple of 16 bytes): the caller composes instead.
cudaError_t launch_add_rms_norm(int dtype, const void* a, const void* x, const void* w_add, const void* w_next,
                                void* h, void* hn, int64_t rows, int64_t cols, float eps, cudaStream_t stream,
                                bool* launched);

// Backward of the forward above with a shared weight row (ends == nullptr, num_segments 1) or
// segments: dx [rows, cols], and dw_part [num_segments * parts, cols] fp32, the weight gradient of
// each segment in `parts` partial sums (the caller adds them up in a fixed order). cols <= kMaxBackwardCols.
cudaError_t launch_rms_norm_backward_f32(const float* x, const float* w, const int32_t* ends, int num_segments,
                                         const float* dy, float* dx, float* dw_part, int64_t rows, int64_t cols,
                                         int parts, float eps, cudaStream_t stream);
cudaError_t launch_rms_norm_backward_bf16(const void* x, const void* w, const int32_t* ends, int num_segments,
                                          const void* dy, void* dx, float* dw_part, int64_t rows, int64_t cols,
                                          int parts, float eps, cudaStream_t stream);

// Backward with one weight row per row, w [rows, cols] (dtype 0 fp32, 1 bf16), a block per row:
// dx, and dw [rows, cols] each row's own weight gradient; a null dx or dw is not written.
cudaError_t launch_rms_norm_backward_rows(int dtype, const void* x, const void* w, const void* dy, void* dx,
                                          void* dw, int64_t rows, int64_t cols, float eps, cudaStream_t stream);

}  // namespace kiln::kernels
