// The AdamW step over many tensors as one CUDA kernel launch (fp32 math, any mix of fp32/bf16/fp16
// storage): the optimizer's fast path on the GPU. Its reference is optimizers::adamw_update.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace kiln::kernels {

// One tensor's step: w (fp32 master or the parameter itself) updated in place from gradient g
// with moments m and v (fp32 or bf16, one dtype); p, when defined, the low-precision parameter
// that receives w rounded. All flat views of one CUDA device with the same number of elements.
struct AdamWTensors {
  at::Tensor w, g, m, v, p;
};

struct AdamWHyper {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;  // 1-based
};

// Whether adamw_fused takes `t` (a CUDA build, CUDA tensors, contiguous, supported dtypes).
bool adamw_fused_supported(const AdamWTensors& t);
// Updates every set in `ts` on the current stream, in launches of up to 40 tensors.
void adamw_fused(const std::vector<AdamWTensors>& ts, const AdamWHyper& h);

}  // namespace kiln::kernels
