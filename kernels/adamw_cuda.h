// Raw-pointer launcher for the multi-tensor AdamW kernel (adamw.cu): no torch headers, for the
// binding in adamw.cpp.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::kernels {

// Storage codes of the tensors a step touches.
enum AdamWDtype : uint8_t { kAdamWF32 = 0, kAdamWBF16 = 1, kAdamWF16 = 2, kAdamWNone = 3 };

// One tensor of the step, n contiguous elements each: weights w (updated in place: the fp32
// master, or the parameter itself), gradient g, moments m and v, and p, the parameter to receive
// round(w) when w is a master (p == nullptr, p_dtype kAdamWNone otherwise).
struct AdamWSlice {
  void* w;
  const void* g;
  void* m;
  void* v;
  void* p;
  int64_t n;
  uint8_t w_dtype, g_dtype, m_dtype, p_dtype;
};

// The step's scalars as torch.optim.AdamW applies them: w *= decay; m += (1 - beta1) (g - m);
// v = beta2 v + (1 - beta2) g^2; w -= step_size m / (sqrt(v) / sqrt_bc2 + eps).
struct AdamWScalars {
  float decay, one_minus_beta1, beta2, one_minus_beta2, sqrt_bc2, eps, step_size;
};

// Updates all `count` slices in as few launches as the kernel's argument space allows (m and v
// of a slice share m_dtype).
cudaError_t launch_adamw(const AdamWSlice* slices, int count, const AdamWScalars& s, cudaStream_t stream);

}  // namespace kiln::kernels
