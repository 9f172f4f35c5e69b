// Raw-pointer launchers for the MoE row kernels (moe_rows.cu): no torch headers.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::kernels {

constexpr int kMoeRowsMaxTopK = 16;

// dtype: 0 float32, 1 bfloat16. Rows are `cols` wide and contiguous.
// expand: out[slot_row[t*k + j]] = x[t] * (w ? w[t*k + j] : 1) for t < tokens, j < k; other rows
// of out are left as they are. With y and dots: dots[t*k + j] = sum_c x[t, c] * y[slot_row[t*k + j], c].
cudaError_t launch_moe_expand(int dtype, const void* x, const float* w, const int64_t* slot_row, int64_t tokens,
                              int k, int64_t cols, void* out, const void* y, float* dots, cudaStream_t stream);
// reduce: out[t] = sum_j (w ? w[t*k + j] : 1) * y[slot_row[t*k + j]], summed in fp32 in j order.
cudaError_t launch_moe_reduce(int dtype, const void* y, const float* w, const int64_t* slot_row, int64_t tokens,
                              int k, int64_t cols, void* out, cudaStream_t stream);

}  // namespace kiln::kernels
