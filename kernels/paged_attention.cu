// Paged decode attention: one block per (key split, KV head, sequence). Threads form groups of TPK
// that each own one key at a time (VEC dims per thread); every group keeps an online softmax for
// the GQA group's query heads, groups merge in shared memory, and splits merge in a second kernel.
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/paged_attention_cuda.h"

namespace kiln::kernels {
namespace {

constexpr int kThreads = 128;
constexpr int kLargestGroup = 16;
constexpr int64_t kMaxSmem = 48 * 1024;

template <int HD>
struct Shape {
  static constexpr int kTpk = HD / 4 < 32 ? HD / 4 : 32;  // threads per key
  static constexpr int kVec = HD / kTpk;                    // dims per thread: 4 or 8
  static constexpr int kGroups = kThreads / kTpk;           // keys in flight per block
};

__device__ inline void load4(const float* p, float* out) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
}
__device__ inline void load4(const __nv_bfloat16* p, float* out) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.y));
  out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y;
}
__device__ inline void store(float* p, float v) { *p = v; }
__device__ inline void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

template <typename T, int HD, int kMaxGroup>
__global__ void __launch_bounds__(kThreads) paged_decode_kernel(PagedDecodeArgs a, int group, float scale) {
  using S = Shape<HD>;
  constexpr int TPK = S::kTpk, VEC = S::kVec, KG = S::kGroups;
  extern __shared__ float smem[];  // [KG, group] max, [KG, group] sum, [KG, group, HD] acc
  float* sm_max = smem;
  float* sm_sum = sm_max + KG * group;
  float* sm_acc = sm_sum + KG * group;
  const int split = blockIdx.x, splits = gridDim.x, h = blockIdx.y;
  const int64_t n = blockIdx.z;
  const int sub = threadIdx.x % TPK, grp = threadIdx.x / TPK;
  const T* q = static_cast<const T*>(a.q);
  const T* kc = static_cast<const T*>(a.k_cache);
  const T* vc = static_cast<const T*>(a.v_cache);

  float qr[kMaxGroup][VEC], m[kMaxGroup], l[kMaxGroup], acc[kMaxGroup][VEC];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[g][v] = 0.f, qr[g][v] = 0.f;
    if (g < group) {
      const T* qp = q + ((n * a.hq + h * group + g) * HD + sub * VEC);
#pragma unroll
      for (int v = 0; v < VEC; v += 4) load4(qp + v, &qr[g][v]);
#pragma unroll
      for (int v = 0; v < VEC; ++v) qr[g][v] *= scale;
    }
  }
  const int64_t pos = a.positions[n];
  const int64_t lo = a.window > 0 ? max(int64_t(0), pos - a.window + 1) : 0;
  const int64_t chunk = (pos - lo + 1 + splits - 1) / splits;
  const int64_t begin = lo + split * chunk, end = min(pos + 1, begin + chunk);
  // Every lane of a warp runs the same trip count so that the shuffles stay converged.
  for (int64_t base = begin; base < end; base += KG) {
    const int64_t j = base + grp;
    const bool valid = j < end;
    float kf[VEC], vf[VEC];
    if (valid) {
      const int64_t blk = j / a.block_size;
      const int64_t col = a.ring > 0 ? blk % a.ring : blk;
      const int64_t row = a.table[n * a.cols + col] * a.block_size + j % a.block_size;
      const int64_t off = (row * a.hkv + h) * HD + sub * VEC;
#pragma unroll
      for (int v = 0; v < VEC; v += 4) load4(kc + off + v, &kf[v]), load4(vc + off + v, &vf[v]);
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) kf[v] = vf[v] = 0.f;
    }
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g >= group) break;
      float d = 0.f;
#pragma unroll
      for (int v = 0; v < VEC; ++v) d += qr[g][v] * kf[v];
#pragma unroll
      for (int o = TPK / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
      if (valid) {
        const float mn = fmaxf(m[g], d);
        const float corr = __expf(m[g] - mn), p = __expf(d - mn);
        l[g] = l[g] * corr + p;
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[g][v] = acc[g][v] * corr + p * vf[v];
        m[g] = mn;
      }
    }
  }
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g >= group) break;
    if (sub == 0) sm_max[grp * group + g] = m[g], sm_sum[grp * group + g] = l[g];
#pragma unroll
    for (int v = 0; v < VEC; ++v) sm_acc[(grp * group + g) * HD + sub * VEC + v] = acc[g][v];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < group * HD; idx += kThreads) {
    const int g = idx / HD, d = idx % HD;
    float M = -INFINITY;
    for (int k = 0; k < KG; ++k) M = fmaxf(M, sm_max[k * group + g]);
    float L = 0.f, A = 0.f;
    if (M != -INFINITY) {
      for (int k = 0; k < KG; ++k) {
        const float w = __expf(sm_max[k * group + g] - M);
        L += sm_sum[k * group + g] * w;
        A += sm_acc[(k * group + g) * HD + d] * w;
      }
    }
    const int64_t hq = h * group + g;
    if (splits == 1) {
      store(static_cast<T*>(a.out) + (n * a.hq + hq) * HD + d, L > 0.f ? A / L : 0.f);
    } else {
      const int64_t p = (n * a.hq + hq) * splits + split;
      a.part_acc[p * HD + d] = A;
      if (d == 0) a.part_max[p] = M, a.part_sum[p] = L;
    }
  }
}

// Merges the splits of one (sequence, query head): one thread per dim.
template <typename T>
__global__ void merge_splits_kernel(PagedDecodeArgs a) {
  const int64_t nh = blockIdx.x;  // n * hq + hq
  const int splits = a.splits;
  const int64_t hd = a.head_dim;
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, a.part_max[nh * splits + s]);
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float L = 0.f, A = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float ls = a.part_sum[nh * splits + s];
      if (ls == 0.f) continue;
      const float w = __expf(a.part_max[nh * splits + s] - M);
      L += ls * w;
      A += a.part_acc[(nh * splits + s) * hd + d] * w;
    }
    store(static_cast<T*>(a.out) + nh * hd + d, L > 0.f ? A / L : 0.f);
  }
}

template <int HD>
int64_t smem_for(int64_t group) {
  return int64_t(Shape<HD>::kGroups) * group * (2 + HD) * int64_t(sizeof(float));
}

template <typename T, int HD>
cudaError_t launch_hd(const PagedDecodeArgs& a, cudaStream_t stream) {
  const int group = int(a.hq / a.hkv);
  const dim3 grid(unsigned(a.splits), unsigned(a.hkv), unsigned(a.n));
  const float scale = 1.f / sqrtf(float(HD));
  const size_t smem = size_t(smem_for<HD>(group));
  // Register arrays sized by the smallest bound on the GQA group that fits (fewer registers, more
  // blocks per SM).
  if (group <= 2) paged_decode_kernel<T, HD, 2><<<grid, kThreads, smem, stream>>>(a, group, scale);
  else if (group <= 4) paged_decode_kernel<T, HD, 4><<<grid, kThreads, smem, stream>>>(a, group, scale);
  else if (group <= 8) paged_decode_kernel<T, HD, 8><<<grid, kThreads, smem, stream>>>(a, group, scale);
  else paged_decode_kernel<T, HD, 16><<<grid, kThreads, smem, stream>>>(a, group, scale);
  if (a.splits > 1) merge_splits_kernel<T><<<unsigned(a.n * a.hq), unsigned(HD < 128 ? HD : 128), 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch(const PagedDecodeArgs& a, cudaStream_t stream) {
  if (a.n == 0) return cudaSuccess;
  if (paged_decode_smem_bytes(a.head_dim, a.hq / a.hkv) == 0) return cudaErrorInvalidValue;
  switch (a.head_dim) {
    case 16: return launch_hd<T, 16>(a, stream);
    case 32: return launch_hd<T, 32>(a, stream);
    case 64: return launch_hd<T, 64>(a, stream);
    case 128: return launch_hd<T, 128>(a, stream);
    case 256: return launch_hd<T, 256>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

int64_t paged_decode_smem_bytes(int64_t head_dim, int64_t group) {
  if (group < 1 || group > kLargestGroup) return 0;
  int64_t bytes = 0;
  switch (head_dim) {
    case 16: bytes = smem_for<16>(group); break;
    case 32: bytes = smem_for<32>(group); break;
    case 64: bytes = smem_for<64>(group); break;
    case 128: bytes = smem_for<128>(group); break;
    case 256: bytes = smem_for<256>(group); break;
    default: return 0;
  }
  return bytes <= kMaxSmem ? bytes : 0;
}

cudaError_t launch_paged_decode_f32(const PagedDecodeArgs& a, cudaStream_t stream) { return launch<float>(a, stream); }
cudaError_t launch_paged_decode_bf16(const PagedDecodeArgs& a, cudaStream_t stream) {
  return launch<__nv_bfloat16>(a, stream);
}

}  // namespace kiln::kernels
