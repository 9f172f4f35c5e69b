// The stream-read kernel: a grid-stride pass of 16-byte streaming loads, XOR-reduced per block and
// merged with one atomicXor per block (order-free, so the result is exact and deterministic).
#include <algorithm>
#include <cstdint>

#include "kernels/cuda_memory.cuh"
#include "kernels/stream_read_cuda.h"

namespace kiln::kernels {
namespace {

// Words [0, head) and [head + 4 vecs, count) one at a time; the 16-byte vectors in between.
__global__ void xor_words_kernel(const uint32_t* __restrict__ words, int64_t count, int64_t head, int64_t vecs,
                                 uint32_t* __restrict__ out) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x, i0 = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint4* v = reinterpret_cast<const uint4*>(words + head);
  uint32_t x = 0;
  for (int64_t i = i0; i < vecs; i += stride) {
    const uint4 u = ld_stream16(v + i);
    x ^= u.x ^ u.y ^ u.z ^ u.w;
  }
  for (int64_t i = i0; i < head; i += stride) x ^= words[i];
  for (int64_t i = head + 4 * vecs + i0; i < count; i += stride) x ^= words[i];
  for (int o = 16; o > 0; o >>= 1) x ^= __shfl_xor_sync(0xffffffffu, x, o);
  __shared__ uint32_t warp_x[32];
  if (threadIdx.x % 32 == 0) warp_x[threadIdx.x / 32] = x;
  __syncthreads();
  if (threadIdx.x == 0) {  // one atomic per block: thousands on one address would serialise in L2
    for (unsigned w = 1; w < blockDim.x / 32; ++w) x ^= warp_x[w];
    if (x != 0) atomicXor(out, x);
  }
}

}  // namespace

cudaError_t launch_xor_words(const uint32_t* words, int64_t count, uint32_t* out, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const int64_t misaligned = int64_t(reinterpret_cast<uintptr_t>(words) % 16) / 4;
  const int64_t head = std::min<int64_t>(count, misaligned ? 4 - misaligned : 0);
  const int64_t vecs = (count - head) / 4;
  constexpr int kThreads = 512;
  // Enough blocks to fill every multiprocessor (4 of 512 threads each), fewer for small inputs.
  const int64_t want = std::max<int64_t>(1, (std::max<int64_t>(vecs, count - 4 * vecs) + kThreads - 1) / kThreads);
  const unsigned grid = unsigned(std::min<int64_t>(want, int64_t(num_sms()) * 4));
  xor_words_kernel<<<grid, kThreads, 0, stream>>>(words, count, head, vecs, out);
  return cudaGetLastError();
}

}  // namespace kiln::kernels
