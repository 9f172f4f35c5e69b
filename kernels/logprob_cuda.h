// Raw-pointer launchers for the token log-prob kernels (logprob.cu): no torch headers.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::kernels {

// dtype: 0 float32, 1 bfloat16. logits [rows, vocab] contiguous. Per row, with x = logits * inv_temp:
// lse = logsumexp(x) and lp = x[target] - lse (both fp32).
cudaError_t launch_token_logprob_forward(int dtype, const void* logits, const int64_t* targets, int64_t rows,
                                         int64_t vocab, float inv_temp, float* lp, float* lse, cudaStream_t stream);
// dlogits = g * inv_temp * (onehot(target) - exp(x - lse)), in the logits' dtype.
cudaError_t launch_token_logprob_backward(int dtype, const void* logits, const int64_t* targets, const float* lse,
                                          const float* g, int64_t rows, int64_t vocab, float inv_temp, void* dlogits,
                                          cudaStream_t stream);

}  // namespace kiln::kernels
