// Paged decode attention: one block per (key split, KV head, sequence), two kernels. SIMT (fp32, any
// head dim): threads form groups of TPK that each own one key at a time (VEC dims per thread), each
// with an online softmax per query head. Tensor cores (bf16, head dim 64/128): each warp scores 16
// keys per step against the whole GQA group with mma.sync. Parts merge in shared memory, key splits
// in a second kernel.
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda_mma.cuh"
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

// The block's parts merged: shared memory holds [parts, group] maxima (natural-log units), [parts,
// group] sums and [parts, group, HD] accumulators; writes the output, or this split's partials.
template <typename T, int HD>
__device__ void merge_parts(const PagedDecodeArgs& a, const float* smem, int parts, int group, int split, int splits,
                            int h, int64_t n) {
  const float* sm_max = smem;
  const float* sm_sum = sm_max + parts * group;
  const float* sm_acc = sm_sum + parts * group;
  for (int idx = threadIdx.x; idx < group * HD; idx += blockDim.x) {
    const int g = idx / HD, d = idx % HD;
    float M = -INFINITY;
    for (int k = 0; k < parts; ++k) M = fmaxf(M, sm_max[k * group + g]);
    float L = 0.f, A = 0.f;
    if (M != -INFINITY) {
      for (int k = 0; k < parts; ++k) {
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

// The cache row of sequence n's key at position j.
__device__ __forceinline__ int64_t cache_row(const PagedDecodeArgs& a, int64_t n, int64_t j) {
  const int64_t blk = j / a.block_size;
  const int64_t col = a.ring > 0 ? blk % a.ring : blk;
  return a.table[n * a.cols + col] * a.block_size + j % a.block_size;
}

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
      const int64_t off = (cache_row(a, n, j) * a.hkv + h) * HD + sub * VEC;
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
  merge_parts<T, HD>(a, smem, KG, group, split, splits, h, n);
}

// ---------------------------------------------------------------------------------------------
// bf16 on tensor cores. Each warp takes 16-key tiles of the block's range (tile w, w + 4, ...) and
// runs S = Q . K^T and O += P . V as mma.m16n8k16 with the GQA group's query heads as the 16 rows
// (zero rows past the group), so the per-key work is a share of four MMAs instead of a warp
// reduction per head. The k slots of the score MMA may map to any dims if Q and K agree: lane t
// takes 4 consecutive dims per 16-dim chunk (dims 32 s + 8 t .. + 7 for chunks 2s, 2s + 1), so both
// are read with 16-byte loads. In P . V the output column n of n-tile j is dim n * HD/8 + j: lane g
// reads its HD/8 dims of a V row contiguously and pairs two keys per register with a byte permute.
// P is rounded to bf16 for the MMA (the sums l stay fp32), as flash attention does.
constexpr int kMmaWarps = kThreads / 32;
constexpr int kMmaTile = 16;  // keys per warp step
constexpr float kLn2 = 0.69314718055994531f;

// Scores of the 16-key tile at `base` for lane (g, t): keys base + 8 i + (column) for i = 0, 1,
// lane g supplying key base + 8 i + g as B's column g (zeros from `end` on), against Q's rows.
template <int HD>
__device__ __forceinline__ void tile_scores(const PagedDecodeArgs& a, const __nv_bfloat16* kc,
                                            const uint32_t (&qa)[HD / 16][4], int64_t n, int h, int64_t base,
                                            int64_t end, int g, int t, float (&sc)[2][4]) {
  constexpr int KS = HD / 32;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t j = base + 8 * i + g;
    uint4 kv[KS];
    if (j < end) {
      const __nv_bfloat16* kp = kc + (cache_row(a, n, j) * a.hkv + h) * HD + 8 * t;
#pragma unroll
      for (int s = 0; s < KS; ++s) kv[s] = *reinterpret_cast<const uint4*>(kp + 32 * s);
    } else {
#pragma unroll
      for (int s = 0; s < KS; ++s) kv[s] = make_uint4(0, 0, 0, 0);
    }
    sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.f;
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      mma_bf16(sc[i], qa[2 * s][0], qa[2 * s][1], qa[2 * s][2], qa[2 * s][3], kv[s].x, kv[s].y);
      mma_bf16(sc[i], qa[2 * s + 1][0], qa[2 * s + 1][1], qa[2 * s + 1][2], qa[2 * s + 1][3], kv[s].z, kv[s].w);
    }
  }
}

// V rows of keys base + 2t, 2t + 1, 2t + 8, 2t + 9 (the P . V A operand's k slots), lane g's HD/8
// dims each; zeros from `end` on.
template <int HD>
__device__ __forceinline__ void load_v_tile(const PagedDecodeArgs& a, const __nv_bfloat16* vc, int64_t n, int h,
                                            int64_t base, int64_t end, int g, int t, uint32_t (&vw)[4][HD / 16]) {
  constexpr int NT = HD / 8;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const int64_t j = base + 2 * t + (kk & 1) + 8 * (kk >> 1);
    if (j < end) {
      const __nv_bfloat16* vp = vc + (cache_row(a, n, j) * a.hkv + h) * HD + NT * g;
#pragma unroll
      for (int w = 0; w < NT / 8; ++w) {
        const uint4 v = *reinterpret_cast<const uint4*>(vp + 8 * w);
        vw[kk][4 * w] = v.x, vw[kk][4 * w + 1] = v.y, vw[kk][4 * w + 2] = v.z, vw[kk][4 * w + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int w = 0; w < NT / 2; ++w) vw[kk][w] = 0u;
    }
  }
}

template <int HD>
__global__ void __launch_bounds__(kThreads) paged_decode_mma_kernel(PagedDecodeArgs a, int group, float scale_log2) {
  static_assert(HD == 64 || HD == 128, "tensor-core decode: head dim 64 or 128");
  constexpr int KS = HD / 32;  // 32-dim spans: two score k-chunks each
  constexpr int NT = HD / 8;   // P . V n-tiles; also a lane's dims per V row
  extern __shared__ float smem[];  // [warps, group] max, sum; [warps, group, HD] acc
  const int split = blockIdx.x, splits = gridDim.x, h = blockIdx.y;
  const int64_t n = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const auto* q = static_cast<const __nv_bfloat16*>(a.q);
  const auto* kc = static_cast<const __nv_bfloat16*>(a.k_cache);
  const auto* vc = static_cast<const __nv_bfloat16*>(a.v_cache);

  // Q as the A operand: rows g and g + 8 are query heads h * group + row.
  uint32_t qa[2 * KS][4];
#pragma unroll
  for (int s = 0; s < KS; ++s)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = g + 8 * r;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (row < group) v = *reinterpret_cast<const uint4*>(q + (n * a.hq + h * group + row) * HD + 32 * s + 8 * t);
      qa[2 * s][r] = v.x, qa[2 * s][2 + r] = v.y, qa[2 * s + 1][r] = v.z, qa[2 * s + 1][2 + r] = v.w;
    }

  const int64_t pos = a.positions[n];
  const int64_t lo = a.window > 0 ? max(int64_t(0), pos - a.window + 1) : 0;
  const int64_t chunk = (pos - lo + 1 + splits - 1) / splits;
  const int64_t begin = lo + split * chunk, end = min(pos + 1, begin + chunk);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // rows g, g + 8; m in log2 units
  float o[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;

  for (int64_t base = begin + int64_t(warp) * kMmaTile; base < end; base += kMmaWarps * kMmaTile) {
    float sc[2][4];
    tile_scores<HD>(a, kc, qa, n, h, base, end, g, t, sc);
    // Online softmax over the tile; key base is valid, so every row's tile maximum is finite.
    float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const bool ok = base + 8 * i + 2 * t + (c & 1) < end;
        sc[i][c] = ok ? sc[i][c] * scale_log2 : -INFINITY;
        tmax[c >> 1] = fmaxf(tmax[c >> 1], sc[i][c]);
      }
    float corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 1));
      tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 2));
      const float mn = fmaxf(m[r], tmax[r]);
      corr[r] = exp2f(m[r] - mn);
      m[r] = mn;
    }
    float p[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) p[i][c] = exp2f(sc[i][c] - m[c >> 1]);
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = l[r] * corr[r] + (p[0][2 * r] + p[0][2 * r + 1] + p[1][2 * r] + p[1][2 * r + 1]);
#pragma unroll
    for (int j = 0; j < NT; ++j) o[j][0] *= corr[0], o[j][1] *= corr[0], o[j][2] *= corr[1], o[j][3] *= corr[1];
    const uint32_t pa0 = pack_bf16x2(p[0][0], p[0][1]), pa1 = pack_bf16x2(p[0][2], p[0][3]);
    const uint32_t pa2 = pack_bf16x2(p[1][0], p[1][1]), pa3 = pack_bf16x2(p[1][2], p[1][3]);
    uint32_t vw[4][NT / 2];
    load_v_tile<HD>(a, vc, n, h, base, end, g, t, vw);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const uint32_t sel = (j & 1) ? 0x7632u : 0x5410u;  // the high or low bf16 of each word
      mma_bf16(o[j], pa0, pa1, pa2, pa3, prmt(vw[0][j / 2], vw[1][j / 2], sel), prmt(vw[2][j / 2], vw[3][j / 2], sel));
    }
  }
  // The quad's partial sums, then this warp's part into shared memory.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  float* sm_max = smem;
  float* sm_sum = sm_max + kMmaWarps * group;
  float* sm_acc = sm_sum + kMmaWarps * group;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    if (row >= group) continue;
    const int at = warp * group + row;
    if (t == 0) sm_max[at] = m[r] * kLn2, sm_sum[at] = l[r];
#pragma unroll
    for (int j = 0; j < NT; ++j)
      sm_acc[at * HD + 2 * t * NT + j] = o[j][2 * r], sm_acc[at * HD + (2 * t + 1) * NT + j] = o[j][2 * r + 1];
  }
  __syncthreads();
  merge_parts<__nv_bfloat16, HD>(a, smem, kMmaWarps, group, split, splits, h, n);
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
  if constexpr (std::is_same_v<T, __nv_bfloat16> && (HD == 64 || HD == 128)) {
    if (a.tensor_cores) {
      const size_t smem = size_t(kMmaWarps) * size_t(group) * (2 + HD) * sizeof(float);
      paged_decode_mma_kernel<HD><<<grid, kThreads, smem, stream>>>(a, group, scale * 1.44269504088896341f);
      if (a.splits > 1) merge_splits_kernel<T><<<unsigned(a.n * a.hq), unsigned(HD), 0, stream>>>(a);
      return cudaGetLastError();
    }
  }
  if (a.tensor_cores) return cudaErrorInvalidValue;
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

bool paged_decode_tensor_cores_support(int64_t head_dim, int64_t group) {
  return (head_dim == 64 || head_dim == 128) && group >= 1 && group <= kLargestGroup;
}

cudaError_t launch_paged_decode_f32(const PagedDecodeArgs& a, cudaStream_t stream) { return launch<float>(a, stream); }
cudaError_t launch_paged_decode_bf16(const PagedDecodeArgs& a, cudaStream_t stream) {
  return launch<__nv_bfloat16>(a, stream);
}

}  // namespace kiln::kernels
