// The read floor: XOR of every 32-bit word of a tensor, read once at full bandwidth. Benchmarks
// time it on the bytes a kernel must read, as the least time any kernel could take for them.
#pragma once
#include <ATen/core/Tensor.h>

namespace kiln::kernels {

// t: any contiguous tensor whose byte count is a multiple of 4 (on CUDA, starting on a 4-byte
// boundary). Returns an int32 scalar on t's device holding the XOR of its little-endian 32-bit
// words (0 for an empty tensor). CUDA tensors take the kernel (no host sync, so it can be captured
// in a CUDA graph), others the reference.
at::Tensor xor_words(const at::Tensor& t);
at::Tensor xor_words_reference(const at::Tensor& t);  // a host loop over a CPU copy
// out (an int32 scalar on t's device) ^= the XOR of t's words: one kernel and nothing else, for
// timing; xor_words is a zeroed out and this.
void xor_words_into(const at::Tensor& t, at::Tensor& out);

}  // namespace kiln::kernels
