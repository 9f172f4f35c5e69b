// Raw-pointer launcher of the stream-read kernel (stream_read.cu): no torch headers.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::kernels {

// *out (one uint32 on the device) ^= XOR of words[0 .. count). 16-byte loads from the first
// 16-byte boundary, word loads for the rest.
cudaError_t launch_xor_words(const uint32_t* words, int64_t count, uint32_t* out, cudaStream_t stream);

}  // namespace kiln::kernels
