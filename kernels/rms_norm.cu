// Fused RMSNorm CUDA kernels: one block per row, fp32 sum of squares, Llama-convention rounding
// (normalised value cast to the storage dtype, then multiplied by the weight). Rows whose width is a
// multiple of 16 bytes use 16-byte loads and keep the row in registers; others take a scalar path.
// The weight is one row shared by all rows (w_stride 0), one row per row (w_stride = cols), or one
// row per segment of rows (ends: each segment's end row; the per-expert norm of the grouped MoE).
// The backward (training) recomputes the statistics, writes dx, and reduces the weight gradient
// per segment into fixed partials that the caller sums: deterministic, no atomics. With one weight
// row per row, a block per row writes dx and that row's weight gradient.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda_convert.cuh"
#include "kernels/rms_norm_cuda.h"

namespace kiln::kernels {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kMaxChunks = 16;  // 16-byte chunks per thread held in registers: rows up to 32 KiB


// y = cast(x * inv) * w, rounded twice exactly as the ATen reference does.
template <typename T>
__device__ inline T normalise(T x, T w, float inv) {
  return from_float<T>(to_float(from_float<T>(to_float(x) * inv)) * to_float(w));
}

// The weight row of `row`: row * w_stride, or, with segment ends, the segment holding the row
// (the first s with ends[s] > row; ends is sorted and short, so a binary search).
__device__ inline int64_t weight_offset(int64_t row, int64_t cols, int64_t w_stride, const int32_t* ends,
                                        int num_segments) {
  if (ends == nullptr) return row * w_stride;
  int lo = 0, hi = num_segments - 1;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (int64_t(ends[mid]) > row) hi = mid;
    else lo = mid + 1;
  }
  return int64_t(lo) * cols;
}

// Sum over the block; every thread gets the total.
__device__ inline float block_sum(float v) {
  __shared__ float warp_sums[kMaxThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < int(blockDim.x / 32) ? warp_sums[lane] : 0.f;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) warp_sums[0] = v;
  }
  __syncthreads();
  return warp_sums[0];
}

// Two sums over the block in a fixed order (lanes by shuffles, then warps in order); every thread
// gets both totals. `sums` is the caller's shared array of kMaxThreads / 32; the trailing barrier
// lets the caller reduce again with it.
__device__ inline float2 block_sum2(float a, float b, float2* sums) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, offset);
    b += __shfl_xor_sync(0xffffffffu, b, offset);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) sums[warp] = make_float2(a, b);
  __syncthreads();
  float2 tot = make_float2(0.f, 0.f);
  for (int i = 0; i < warps; ++i) {
    tot.x += sums[i].x;
    tot.y += sums[i].y;
  }
  __syncthreads();
  return tot;
}

template <typename T>
__global__ void rms_norm_scalar(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                int64_t cols, int64_t w_stride, const int32_t* __restrict__ ends,
                                int num_segments, float eps) {
  const T* row = x + blockIdx.x * cols;
  w += weight_offset(blockIdx.x, cols, w_stride, ends, num_segments);
  T* out = y + blockIdx.x * cols;
  float sum = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = to_float(row[c]);
    sum += v * v;
  }
  const float inv = rsqrtf(block_sum(sum) / float(cols) + eps);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) out[c] = normalise(row[c], w[c], inv);
}

template <typename T>
struct alignas(16) Chunk {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// Loads a row's chunks into registers (thread t takes chunks t, t + blockDim, ...) and returns the
// thread's fp32 sum of their squares, in the order both vector kernels rely on for equal bits.
template <typename T, int kChunks>
__device__ inline float load_sum_squares(const Chunk<T>* row, int64_t num_chunks, Chunk<T> (&held)[kChunks]) {
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t c = threadIdx.x + int64_t(i) * blockDim.x;
    if (c < num_chunks) {
      held[i] = row[c];
#pragma unroll
      for (int j = 0; j < Chunk<T>::kSize; ++j) {
        const float v = to_float(held[i].v[j]);
        sum += v * v;
      }
    }
  }
  return sum;
}

template <typename T, int kChunks>
__global__ void rms_norm_vector(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                int64_t cols, int64_t w_stride, const int32_t* __restrict__ ends,
                                int num_segments, float eps) {
  w += weight_offset(blockIdx.x, cols, w_stride, ends, num_segments);
  using C = Chunk<T>;
  const int64_t num_chunks = cols / C::kSize;
  const C* row = reinterpret_cast<const C*>(x + blockIdx.x * cols);
  const C* weight = reinterpret_cast<const C*>(w);
  C* out = reinterpret_cast<C*>(y + blockIdx.x * cols);
  C held[kChunks];
  const float inv = rsqrtf(block_sum(load_sum_squares<T, kChunks>(row, num_chunks, held)) / float(cols) + eps);
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t c = threadIdx.x + int64_t(i) * blockDim.x;
    if (c < num_chunks) {
      const C wc = weight[c];
      C o;
#pragma unroll
      for (int j = 0; j < C::kSize; ++j) o.v[j] = normalise(held[i].v[j], wc.v[j], inv);
      out[c] = o;
    }
  }
}

// The vector kernels' block: a thread per 32 chunks up to kMaxThreads.
inline int vector_threads(int64_t num_chunks) { return int(std::min<int64_t>(kMaxThreads, (num_chunks + 31) / 32 * 32)); }

// Calls launch_with(std::integral_constant<int, K>) for the fewest chunks per thread K (1, 2, 4, 8,
// kMaxChunks) that hold num_chunks; false when none does. Every vector kernel picks K here, so rows
// normed by different kernels are summed alike.
template <typename F>
bool with_vector_chunks(int64_t num_chunks, int threads, const F& launch_with) {
  const auto fits = [&](int k) { return num_chunks <= int64_t(k) * threads; };
  if (fits(1)) return launch_with(std::integral_constant<int, 1>()), true;
  if (fits(2)) return launch_with(std::integral_constant<int, 2>()), true;
  if (fits(4)) return launch_with(std::integral_constant<int, 4>()), true;
  if (fits(8)) return launch_with(std::integral_constant<int, 8>()), true;
  if (fits(kMaxChunks)) return launch_with(std::integral_constant<int, kMaxChunks>()), true;
  return false;
}

template <typename T>
cudaError_t launch(const T* x, const T* w, T* y, int64_t rows, int64_t cols, int64_t w_stride, const int32_t* ends,
                   int num_segments, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  constexpr int64_t kSize = Chunk<T>::kSize;
  const bool aligned = (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w) |
                        reinterpret_cast<uintptr_t>(y)) % 16 == 0;
  if (aligned && cols % kSize == 0) {
    const int64_t num_chunks = cols / kSize;
    const int threads = vector_threads(num_chunks);
    const bool launched = with_vector_chunks(num_chunks, threads, [&](auto chunks) {
      rms_norm_vector<T, decltype(chunks)::value>
          <<<dim3(unsigned(rows)), dim3(threads), 0, stream>>>(x, w, y, cols, w_stride, ends, num_segments, eps);
    });
    if (launched) return cudaGetLastError();
  }
  rms_norm_scalar<T>
      <<<dim3(unsigned(rows)), dim3(kMaxThreads), 0, stream>>>(x, w, y, cols, w_stride, ends, num_segments, eps);
  return cudaGetLastError();
}

// The sandwich norm's residual step fused with the next norm (inference): h = x + rms_norm(a, w_add)
// and hn = rms_norm(h, w_next), with rms_norm_vector's threads, chunks and sums, so that both equal
// the composition of two rms_norm launches and an add bit for bit.
template <typename T, int kChunks>
__global__ void add_rms_norm_vector(const T* __restrict__ a, const T* __restrict__ x, const T* __restrict__ w_add,
                                    const T* __restrict__ w_next, T* __restrict__ h, T* __restrict__ hn,
                                    int64_t cols, float eps) {
  using C = Chunk<T>;
  const int64_t num_chunks = cols / C::kSize, base = blockIdx.x * cols;
  const C* ar = reinterpret_cast<const C*>(a + base);
  const C* xr = reinterpret_cast<const C*>(x + base);
  C held[kChunks];
  const float inv = rsqrtf(block_sum(load_sum_squares<T, kChunks>(ar, num_chunks, held)) / float(cols) + eps);
  float sum_h = 0.f;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t c = threadIdx.x + int64_t(i) * blockDim.x;
    if (c < num_chunks) {
      const C wc = reinterpret_cast<const C*>(w_add)[c], xc = xr[c];
      C o;
#pragma unroll
      for (int j = 0; j < C::kSize; ++j) {
        // __fadd_rn: never contracted with normalise's multiply into an FMA (fp32 would then round
        // once where the composition rounds twice).
        o.v[j] = from_float<T>(__fadd_rn(to_float(xc.v[j]), to_float(normalise(held[i].v[j], wc.v[j], inv))));
        const float v = to_float(o.v[j]);
        sum_h += v * v;
      }
      held[i] = o;
      reinterpret_cast<C*>(h + base)[c] = o;
    }
  }
  __syncthreads();  // every thread has read the first total before block_sum's slots are reused
  const float inv_h = rsqrtf(block_sum(sum_h) / float(cols) + eps);
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t c = threadIdx.x + int64_t(i) * blockDim.x;
    if (c < num_chunks) {
      const C wc = reinterpret_cast<const C*>(w_next)[c];
      C o;
#pragma unroll
      for (int j = 0; j < C::kSize; ++j) o.v[j] = normalise(held[i].v[j], wc.v[j], inv_h);
      reinterpret_cast<C*>(hn + base)[c] = o;
    }
  }
}

// The vector launch rms_norm's `launch` makes for these rows; false where that is the scalar path,
// so the caller composes instead.
template <typename T>
bool launch_add(const T* a, const T* x, const T* w_add, const T* w_next, T* h, T* hn, int64_t rows, int64_t cols,
                float eps, cudaStream_t stream) {
  constexpr int64_t kSize = Chunk<T>::kSize;
  uintptr_t addresses = 0;
  for (const void* p : {static_cast<const void*>(a), static_cast<const void*>(x), static_cast<const void*>(w_add),
                        static_cast<const void*>(w_next), static_cast<const void*>(h), static_cast<const void*>(hn)})
    addresses |= reinterpret_cast<uintptr_t>(p);
  if (addresses % 16 != 0 || cols % kSize != 0) return false;
  const int64_t num_chunks = cols / kSize;
  const int threads = vector_threads(num_chunks);
  return with_vector_chunks(num_chunks, threads, [&](auto chunks) {
    add_rms_norm_vector<T, decltype(chunks)::value>
        <<<dim3(unsigned(rows)), dim3(threads), 0, stream>>>(a, x, w_add, w_next, h, hn, cols, eps);
  });
}

// Backward, one row at a time per block; block (p, s) takes the rows p, p + parts, ... of segment
// s. Each thread owns the same columns in every row (kChunks chunks of kVec values), keeps its
// weight values in registers, and accumulates the weight gradient there; the block's sum goes to
// dw_part[s * parts + p]. With xhat = x * inv and g = dy * w:
//   dx = inv * (g - xhat * mean(g * xhat)),   dw = sum over rows of dy * cast(xhat)
// (the reference's weight gradient multiplies by the normalised value rounded to T).
template <typename T, int kVec, int kChunks>
__global__ void rms_norm_backward(const T* __restrict__ x, const T* __restrict__ w, const int32_t* __restrict__ ends,
                                  const T* __restrict__ dy, T* __restrict__ dx, float* __restrict__ dw_part,
                                  int64_t rows, int64_t cols, int parts, float eps) {
  __shared__ float2 sums[kMaxThreads / 32];
  const int s = blockIdx.y;
  const int64_t begin = ends == nullptr || s == 0 ? 0 : ends[s - 1];
  const int64_t end = ends == nullptr ? rows : ends[s];
  const T* wr = ends == nullptr ? w : w + int64_t(s) * cols;
  float wv[kChunks][kVec], acc[kChunks][kVec];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t c0 = (threadIdx.x + int64_t(i) * blockDim.x) * kVec;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      wv[i][j] = c0 + j < cols ? to_float(wr[c0 + j]) : 0.f;
      acc[i][j] = 0.f;
    }
  }
  for (int64_t r = begin + blockIdx.x; r < end; r += parts) {  // uniform across the block
    const T* xr = x + r * cols;
    const T* dyr = dy + r * cols;
    float xv[kChunks][kVec], gv[kChunks][kVec];
    float ss = 0.f, gx = 0.f;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int64_t c0 = (threadIdx.x + int64_t(i) * blockDim.x) * kVec;
      if (kVec > 1 && c0 < cols) {  // a whole chunk: cols is a multiple of kVec
        Chunk<T> xc = *reinterpret_cast<const Chunk<T>*>(xr + c0);
        Chunk<T> dc = *reinterpret_cast<const Chunk<T>*>(dyr + c0);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          xv[i][j] = to_float(xc.v[j]);
          gv[i][j] = to_float(dc.v[j]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          xv[i][j] = c0 + j < cols ? to_float(xr[c0 + j]) : 0.f;
          gv[i][j] = c0 + j < cols ? to_float(dyr[c0 + j]) : 0.f;
        }
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        ss += xv[i][j] * xv[i][j];
        gx += gv[i][j] * wv[i][j] * xv[i][j];
      }
    }
    const float2 tot = block_sum2(ss, gx, sums);  // its closing barrier: sums is rewritten by the next row
    const float inv = rsqrtf(tot.x / float(cols) + eps);
    const float m = inv * tot.y / float(cols);  // mean(g * xhat)
    T* dxr = dx + r * cols;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int64_t c0 = (threadIdx.x + int64_t(i) * blockDim.x) * kVec;
      Chunk<T> out;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float xhat = xv[i][j] * inv;
        out.v[j % Chunk<T>::kSize] = from_float<T>(inv * (gv[i][j] * wv[i][j] - xhat * m));
        acc[i][j] += gv[i][j] * to_float(from_float<T>(xhat));
        if (kVec == 1 && c0 + j < cols) dxr[c0 + j] = out.v[0];
      }
      if (kVec > 1 && c0 < cols) *reinterpret_cast<Chunk<T>*>(dxr + c0) = out;
    }
  }
  // The block's columns are disjoint across threads: each thread writes its own partials.
  float* part = dw_part + (int64_t(s) * parts + blockIdx.x) * cols;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t c0 = (threadIdx.x + int64_t(i) * blockDim.x) * kVec;
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      if (c0 + j < cols) part[c0 + j] = acc[i][j];
  }
}

// Backward with one weight row per row (the experts' norms gathered for every slot), a block per
// row: dx as rms_norm_backward gives it, and each row's own weight gradient, cast(dy * cast(xhat)),
// nothing summed (the gather's backward sums it per expert). dx or dw may be null (not wanted).
template <typename T>
__global__ void rms_norm_backward_rows(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ dy,
                                       T* __restrict__ dx, T* __restrict__ dw, int64_t cols, float eps) {
  __shared__ float2 sums[kMaxThreads / 32];
  const int64_t base = int64_t(blockIdx.x) * cols;
  const T* xr = x + base;
  const T* wr = w + base;
  const T* dyr = dy + base;
  float ss = 0.f, gx = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xv = to_float(xr[c]);
    ss += xv * xv;
    gx += to_float(dyr[c]) * to_float(wr[c]) * xv;
  }
  const float2 tot = block_sum2(ss, gx, sums);
  const float inv = rsqrtf(tot.x / float(cols) + eps);
  const float m = inv * tot.y / float(cols);  // mean(g * xhat)
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xhat = to_float(xr[c]) * inv, g = to_float(dyr[c]);
    if (dx != nullptr) dx[base + c] = from_float<T>(inv * (g * to_float(wr[c]) - xhat * m));
    if (dw != nullptr) dw[base + c] = from_float<T>(g * to_float(from_float<T>(xhat)));
  }
}

template <typename T>
cudaError_t launch_backward_rows(const void* x, const void* w, const void* dy, void* dx, void* dw, int64_t rows,
                                 int64_t cols, float eps, cudaStream_t stream) {
  if (rows > int64_t(INT32_MAX)) return cudaErrorInvalidValue;
  // About four columns a thread, in whole warps, at most kMaxThreads.
  const int64_t threads = std::min<int64_t>(kMaxThreads, std::max<int64_t>(32, ((cols + 3) / 4 + 31) / 32 * 32));
  rms_norm_backward_rows<T><<<dim3(unsigned(rows)), dim3(unsigned(threads)), 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(w), static_cast<const T*>(dy), static_cast<T*>(dx),
      static_cast<T*>(dw), cols, eps);
  return cudaGetLastError();
}

template <typename T, int kVec, int kChunks>
bool try_backward(const T* x, const T* w, const int32_t* ends, int num_segments, const T* dy, T* dx, float* dw_part,
                  int64_t rows, int64_t cols, int parts, float eps, cudaStream_t stream) {
  const int64_t per_thread = int64_t(kVec) * kChunks;
  const int64_t threads = std::max<int64_t>(32, ((cols + per_thread - 1) / per_thread + 31) / 32 * 32);
  if (threads > kMaxThreads) return false;
  rms_norm_backward<T, kVec, kChunks><<<dim3(unsigned(parts), unsigned(num_segments)), dim3(unsigned(threads)), 0,
                                        stream>>>(x, w, ends, dy, dx, dw_part, rows, cols, parts, eps);
  return true;
}

template <typename T>
cudaError_t launch_backward(const T* x, const T* w, const int32_t* ends, int num_segments, const T* dy, T* dx,
                            float* dw_part, int64_t rows, int64_t cols, int parts, float eps, cudaStream_t stream) {
  if (cols > kMaxBackwardCols) return cudaErrorInvalidValue;
  constexpr int kSize = Chunk<T>::kSize;
  const bool aligned = (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w) |
                        reinterpret_cast<uintptr_t>(dy) | reinterpret_cast<uintptr_t>(dx)) % 16 == 0;
  if (aligned && cols % kSize == 0) {
    if (try_backward<T, kSize, 1>(x, w, ends, num_segments, dy, dx, dw_part, rows, cols, parts, eps, stream) ||
        try_backward<T, kSize, 2>(x, w, ends, num_segments, dy, dx, dw_part, rows, cols, parts, eps, stream) ||
        try_backward<T, kSize, 4>(x, w, ends, num_segments, dy, dx, dw_part, rows, cols, parts, eps, stream))
      return cudaGetLastError();
  }
  if (try_backward<T, 1, 4>(x, w, ends, num_segments, dy, dx, dw_part, rows, cols, parts, eps, stream) ||
      try_backward<T, 1, 16>(x, w, ends, num_segments, dy, dx, dw_part, rows, cols, parts, eps, stream) ||
      try_backward<T, 1, 32>(x, w, ends, num_segments, dy, dx, dw_part, rows, cols, parts, eps, stream))
    return cudaGetLastError();
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_rms_norm_f32(const float* x, const float* w, float* y, int64_t rows, int64_t cols,
                                int64_t w_stride, const int32_t* ends, int num_segments, float eps,
                                cudaStream_t stream) {
  return launch(x, w, y, rows, cols, w_stride, ends, num_segments, eps, stream);
}

cudaError_t launch_rms_norm_bf16(const void* x, const void* w, void* y, int64_t rows, int64_t cols,
                                 int64_t w_stride, const int32_t* ends, int num_segments, float eps,
                                 cudaStream_t stream) {
  return launch(static_cast<const __nv_bfloat16*>(x), static_cast<const __nv_bfloat16*>(w),
                static_cast<__nv_bfloat16*>(y), rows, cols, w_stride, ends, num_segments, eps, stream);
}

cudaError_t launch_add_rms_norm(int dtype, const void* a, const void* x, const void* w_add, const void* w_next,
                                void* h, void* hn, int64_t rows, int64_t cols, float eps, cudaStream_t stream,
                                bool* launched) {
  *launched = rows == 0;
  if (rows == 0) return cudaSuccess;
  if (dtype == 0) {
    *launched = launch_add(static_cast<const float*>(a), static_cast<const float*>(x), static_cast<const float*>(w_add),
                           static_cast<const float*>(w_next), static_cast<float*>(h), static_cast<float*>(hn), rows,
                           cols, eps, stream);
  } else {
    using B = __nv_bfloat16;
    *launched = launch_add(static_cast<const B*>(a), static_cast<const B*>(x), static_cast<const B*>(w_add),
                           static_cast<const B*>(w_next), static_cast<B*>(h), static_cast<B*>(hn), rows, cols, eps,
                           stream);
  }
  return cudaGetLastError();
}

cudaError_t launch_rms_norm_backward_f32(const float* x, const float* w, const int32_t* ends, int num_segments,
                                         const float* dy, float* dx, float* dw_part, int64_t rows, int64_t cols,
                                         int parts, float eps, cudaStream_t stream) {
  return launch_backward(x, w, ends, num_segments, dy, dx, dw_part, rows, cols, parts, eps, stream);
}

cudaError_t launch_rms_norm_backward_bf16(const void* x, const void* w, const int32_t* ends, int num_segments,
                                          const void* dy, void* dx, float* dw_part, int64_t rows, int64_t cols,
                                          int parts, float eps, cudaStream_t stream) {
  using B = __nv_bfloat16;
  return launch_backward(static_cast<const B*>(x), static_cast<const B*>(w), ends, num_segments,
                         static_cast<const B*>(dy), static_cast<B*>(dx), dw_part, rows, cols, parts, eps, stream);
}

cudaError_t launch_rms_norm_backward_rows(int dtype, const void* x, const void* w, const void* dy, void* dx,
                                          void* dw, int64_t rows, int64_t cols, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return dtype == 0 ? launch_backward_rows<float>(x, w, dy, dx, dw, rows, cols, eps, stream)
                    : launch_backward_rows<__nv_bfloat16>(x, w, dy, dx, dw, rows, cols, eps, stream);
}

}  // namespace kiln::kernels
