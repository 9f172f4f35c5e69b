// What the CUDA bindings (*.cpp beside the kernels) share: the dtype code their raw-pointer
// launchers take, and the check of a launch's result. CUDA builds only.
#pragma once
#include <ATen/core/Tensor.h>
#include <cuda_runtime.h>

#include "core/error.h"

namespace kiln::kernels {

// The `dtype` argument of launchers that take float32 (0) or bfloat16 (1).
inline int cuda_dtype_code(const at::Tensor& t) { return t.scalar_type() == at::kFloat ? 0 : 1; }

inline void check_launch(cudaError_t err, const char* what) {
  KILN_CHECK(err == cudaSuccess, what, ": kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace kiln::kernels
