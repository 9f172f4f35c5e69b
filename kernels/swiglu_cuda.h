// Raw-pointer launchers for the SwiGLU kernels (swiglu.cu): no torch headers.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::kernels {

// dtype: 0 float32, 1 bfloat16; n contiguous values. a = silu(g) * u.
cudaError_t launch_swiglu_forward(int dtype, const void* g, const void* u, void* a, int64_t n, cudaStream_t stream);
// dg = da * u * silu'(g), du = da * silu(g).
cudaError_t launch_swiglu_backward(int dtype, const void* g, const void* u, const void* da, void* dg, void* du,
                                   int64_t n, cudaStream_t stream);

}  // namespace kiln::kernels
