// Probe of the NVFP4 W4A16 GEMMs (kiln_probe_nvfp4, CUDA builds only): the M = 1 dense GEMM's tile
// code (nvfp4_gemm.cuh) under other schedules and loaders, split into memory and compute halves,
// and the grouped (experts) kernel against other work splits. Evidence for docs/PERFORMANCE.md.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/nvfp4_gemm.cuh"

namespace {

using namespace kiln::kernels;
using namespace kiln::kernels::nvfp4_gemm;
constexpr int64_t kUnits = nvfp4_layout::kTileUnits;  // blocks per tile; codes 8 bytes each
constexpr int kStage = 4608;                           // one tile in shared memory: 4096 + 512 bytes

// Loaders. kLoad: registers, the library's loop (tile_partial); kLoadsOnly / kComputeOnly: the two
// halves of that loop; kAsync: each warp's tiles through a 2-stage cp.async pipeline in shared
// memory; kBulk: the same with one bulk copy (TMA) per tile and an mbarrier per stage.
enum Loader { kLoad, kLoadsOnly, kComputeOnly, kAsync, kBulk };

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ uint4 ld_shared16(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a) : "memory");
  return v;
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity) {
  asm volatile("{\n .reg .pred p;\n WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT;\n}" ::"r"(bar),
               "r"(parity)
               : "memory");
}

// A tile's fragment from shared memory, laid out as in global memory (lane-order 16-byte pieces).
__device__ __forceinline__ void read_stage(WFrag& f, uint32_t st, int lane) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const uint4 a = ld_shared16(st + 1024 * r + 16 * lane), b = ld_shared16(st + 1024 * r + 512 + 16 * lane);
    f.w[r][0] = a.x, f.w[r][1] = a.y, f.w[r][2] = a.z, f.w[r][3] = a.w;
    f.w[r][4] = b.x, f.w[r][5] = b.y, f.w[r][6] = b.z, f.w[r][7] = b.w;
  }
  const uint4 v = ld_shared16(st + 4096 + 16 * lane);
  f.s[0] = v.x, f.s[1] = v.y, f.s[2] = v.z, f.s[3] = v.w;
}

// Steps [s0, s1) of the tile at tw/ts (whole tiles only) with one of the probe's loaders.
template <Loader L>
__device__ __forceinline__ void warp_steps(uint32_t stage0, uint32_t bar0, const void* const (&xr)[1], const uint8_t* tw,
                                           const uint8_t* ts, int64_t s0, int64_t s1, int lane, float (&acc)[2][1][4]) {
  constexpr int kDepth = 2;
  const int t = lane % 4;
  if constexpr (L == kLoadsOnly || L == kComputeOnly) {
    uint32_t h = 0;
    for (int64_t sc = s0; sc < s1; ++sc) {
      WFrag f;
      if constexpr (L == kLoadsOnly) {
        load_w_tile<true>(f, tw + sc * kUnits * 8, ts + sc * kUnits, lane);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
#pragma unroll
          for (int i = 0; i < 8; ++i) h ^= f.w[r][i];
          h ^= f.s[r];
        }
      } else {  // fragments made in registers, different per step so nothing is hoisted
#pragma unroll
        for (int r = 0; r < 4; ++r) {
#pragma unroll
          for (int i = 0; i < 8; ++i) f.w[r][i] = uint32_t(sc) * 0x9E3779B9u ^ uint32_t(lane * 77 + r * 8 + i);
          f.s[r] = 0x30303030u;
        }
        super_product<1, false>(f, xr, sc, t, acc);
      }
    }
    acc[0][0][0] += float(h & 1u);
  } else {
    auto issue = [&](int64_t sc, uint32_t st, uint32_t bar) {
      if constexpr (L == kAsync) {
#pragma unroll
        for (int i = 0; i < 8; ++i) cp_async16(st + 512 * i + 16 * lane, tw + sc * kUnits * 8 + 512 * i + 16 * lane);
        cp_async16(st + 4096 + 16 * lane, ts + sc * kUnits + 16 * lane);
      } else if (lane == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(kStage) : "memory");
        bulk_copy(st, tw + sc * kUnits * 8, 4096, bar);
        bulk_copy(st + 4096, ts + sc * kUnits, 512, bar);
      }
    };
    if constexpr (L == kBulk) {
      if (lane == 0) {
        for (int j = 0; j < kDepth; ++j) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0 + 8 * j) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
      }
      __syncwarp();
    }
    for (int j = 0; j < kDepth; ++j) {
      if (s0 + j < s1) issue(s0 + j, stage0 + j * kStage, bar0 + 8 * j);
      if constexpr (L == kAsync) asm volatile("cp.async.commit_group;" ::: "memory");
    }
    for (int64_t i = 0; s0 + i < s1; ++i) {
      const int j = int(i % kDepth);
      if constexpr (L == kAsync) asm volatile("cp.async.wait_group %0;" ::"n"(kDepth - 1) : "memory");
      else bar_wait(bar0 + 8 * j, uint32_t((i / kDepth) & 1));
      WFrag f;
      read_stage(f, stage0 + j * kStage, lane);
      super_product<1, false>(f, xr, s0 + i, t, acc);
      __syncwarp();
      if (s0 + i + kDepth < s1) issue(s0 + i + kDepth, stage0 + j * kStage, bar0 + 8 * j);
      if constexpr (L == kAsync) asm volatile("cp.async.commit_group;" ::: "memory");
    }
  }
}

// Grid: one block per (row tile, part); S parts of a tile form a cluster (as linear_kernel does).
template <int W, int S, Loader L>
__global__ void __launch_bounds__(W * 32) probe_kernel(const __nv_bfloat16* x, const uint8_t* packed, const uint8_t* sfs,
                                                       __nv_bfloat16* y, int64_t N, int64_t K) {
  extern __shared__ __align__(16) uint8_t stages[];
  __shared__ float4 red[red_size(1, W)];
  __shared__ __align__(8) uint64_t bars[W][2];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int part = int(blockIdx.x % S);
  const int64_t row0 = int64_t(blockIdx.x / S) * kRowsPerBlock;
  float acc[2][1][4];
  zero_acc<1>(acc);
  if constexpr (L == kLoad) {
    tile_partial<1, W, false, true>(x, 1, packed, sfs, N, K, row0, part, S, acc);
  } else {
    const int64_t ns = K / kSuper, tile = row0 / kRowsPerBlock;
    const int64_t p0 = ns * part / S, p1 = ns * (part + 1) / S;
    const void* xr[1] = {lane / 4 == 0 ? static_cast<const void*>(x) : nullptr};
    warp_steps<L>(uint32_t(__cvta_generic_to_shared(stages)) + warp * 2 * kStage,
                  uint32_t(__cvta_generic_to_shared(&bars[warp][0])), xr, packed + tile * ns * kUnits * 8,
                  sfs + tile * ns * kUnits, p0 + (p1 - p0) * warp / W, p0 + (p1 - p0) * (warp + 1) / W, lane, acc);
  }
  sum_warps<1, W>(acc, red);
  if (sum_parts<1, S>(acc, part)) store_tile<1, false>(acc, 1.0f, y, N, row0, 1);
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "probe_nvfp4: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

template <int W, int S, Loader L>
void launch(const __nv_bfloat16* x, const uint8_t* packed, const uint8_t* sfs, __nv_bfloat16* y, int64_t N, int64_t K,
            cudaStream_t stream) {
  const int smem = (L == kAsync || L == kBulk) ? W * 2 * kStage : 0;
  static const cudaError_t opt_in =  // once: time() makes the first call outside graph capture
      cudaFuncSetAttribute(probe_kernel<W, S, L>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  check(opt_in, "shared memory opt-in");
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(N / kRowsPerBlock * S));
  config.blockDim = dim3(W * 32);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute cluster[1];
  cluster[0].id = cudaLaunchAttributeClusterDimension;
  cluster[0].val.clusterDim.x = S;
  cluster[0].val.clusterDim.y = cluster[0].val.clusterDim.z = 1;
  config.attrs = cluster;
  config.numAttrs = S > 1 ? 1 : 0;
  cudaLaunchKernelEx(&config, probe_kernel<W, S, L>, x, packed, sfs, y, N, K);
}

__global__ void read_floor(const uint4* p, int64_t n, uint32_t* sink) {
  uint32_t h = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 v = ld_stream16(p + i);
    h ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (h == 0x9E3779B9u) *sink = h;  // keeps the loads
}

// Median microseconds per call of call(i), i = 0..19, captured as one CUDA graph (7 replays); call(-1)
// runs once outside the capture first (shared-memory opt-ins, the diff's output).
template <typename Call>
double graph_us(cudaStream_t stream, const char* name, Call call) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  call(-1);
  check(cudaStreamSynchronize(stream), name);
  check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "capture");
  for (int i = 0; i < 20; ++i) call(i);
  check(cudaStreamEndCapture(stream, &graph), name);
  check(cudaGraphInstantiate(&exec, graph, 0), name);
  check(cudaGraphLaunch(exec, stream), name);
  std::vector<float> us;
  for (int r = 0; r < 7; ++r) {
    cudaEventRecord(start, stream);
    cudaGraphLaunch(exec, stream);
    cudaEventRecord(stop, stream);
    check(cudaEventSynchronize(stop), name);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    us.push_back(ms * 1e3f / 20);
  }
  std::sort(us.begin(), us.end());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return us[3];
}

// `copies` device copies of `bytes` random bytes: codes first, then finite E4M3 scales (below 0x60)
// from code_bytes on. The values only matter for the diff columns.
uint8_t* random_weights(int64_t code_bytes, int64_t bytes, int copies) {
  std::vector<uint8_t> host(bytes);
  uint32_t state = 1;
  for (int64_t i = 0; i < bytes; ++i) {
    state = state * 1664525u + 1013904223u;
    host[i] = uint8_t(state >> 24);
    if (i >= code_bytes) host[i] %= 0x60;
  }
  uint8_t* weights = nullptr;
  check(cudaMalloc(&weights, bytes * copies), "cudaMalloc");
  for (int c = 0; c < copies; ++c) check(cudaMemcpy(weights + c * bytes, host.data(), bytes, cudaMemcpyHostToDevice), "copy");
  return weights;
}

// ---------------------------------------------------------------------------------------------
// Grouped (experts) variants: the library's grouped_kernel (a tile's K split over a block's warps)
// at other chunk sizes and register budgets, its grouped_staged_kernel (activations staged once per
// 256-row block) at other chunk sizes and with each expert's chunks split over two blocks, and
// grouped_rows_kernel (a row tile per warp, its weight tiles kept in shared memory).

// Grouped W4A16 GEMM with a row tile per warp (bf16 or fp32 activations), a variant the library
// does not take: at 8-64 rows per expert it measured 0.87-1.0x grouped_kernel (on an H200).
// grouped_kernel splits each 32-row tile's K range over a block's warps, sums their partials in
// shared memory at a barrier, and reads the tile's weights again for every chunk of tokens. Here
// each warp owns a row tile over all of K and keeps its weight tiles in a ring of kRowsDepth stages
// of shared memory, filled by cp.async a stage ahead of the product: an expert with K up to
// 256 kRowsDepth (muse-small's 1024) loads its tiles once, all at once, and computes every token
// chunk from shared memory; longer K streams the tiles again per chunk. No barrier spans warps.
// Whole tiles only: N a multiple of 32 and K of 256, as the probe's shapes are.

constexpr int kRowsDepth = 4;  // tiles per warp in shared memory (18 KB)
__host__ __device__ constexpr int grouped_rows_smem(int warps) { return warps * kRowsDepth * kTileBytes; }

template <int NT, bool kF32>
__device__ __forceinline__ void rows_chunk(uint8_t* ring, bool resident, const uint8_t* tw, const uint8_t* ts,
                                           int64_t steps, const void* x, int m_count, float scale, void* y, int64_t N,
                                           int64_t K, int64_t row0) {
  using T = typename std::conditional<kF32, float, __nv_bfloat16>::type;
  constexpr int64_t kUnits = nvfp4_layout::kTileUnits;
  const int lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const void* xrow[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n)
    xrow[n] = 8 * n + g < m_count ? static_cast<const void*>(static_cast<const T*>(x) + (8 * n + g) * K) : nullptr;
  float acc[2][NT][4];
  zero_acc<NT>(acc);
  if (!resident)  // the ring's first stages; one commit group per stage, empty ones past the end
    for (int j = 0; j < kRowsDepth; ++j) {
      if (j < steps) copy_tile(ring + j * kTileBytes, tw + j * kUnits * 8, ts + j * kUnits, lane);
      cp_async_commit();
    }
  for (int64_t sc = 0; sc < steps; ++sc) {
    uint8_t* slot = ring + (sc % kRowsDepth) * kTileBytes;
    WFrag wf;
    if (!resident) {
      cp_async_wait<kRowsDepth - 1>();  // step sc's group has landed
      __syncwarp();
    }
    read_tile(wf, slot, lane);
    if (!resident) {
      __syncwarp();  // every lane has read the slot before it is refilled
      if (sc + kRowsDepth < steps)
        copy_tile(slot, tw + (sc + kRowsDepth) * kUnits * 8, ts + (sc + kRowsDepth) * kUnits, lane);
      cp_async_commit();
    }
    super_product<NT, kF32>(wf, xrow, sc, t, acc);
  }
  store_tile<NT, kF32>(acc, scale, y, N, row0, m_count);
}

// Block (expert, kWarps row tiles); the expert's rows in chunks of up to 8 kMaxNT tokens, each with
// the smallest n-tile count that covers it. Dynamic shared memory: grouped_rows_smem(kWarps).
// kMinBlocks: the blocks per multiprocessor the registers are budgeted for.
template <int kMaxNT, int kWarps, bool kF32, int kMinBlocks = 1>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    grouped_rows_kernel(const void* __restrict__ x, const int64_t* __restrict__ offsets,
                        const uint8_t* __restrict__ packed, const uint8_t* __restrict__ sfs,
                        const float* __restrict__ tensor_scale, const float* __restrict__ extra, void* __restrict__ y,
                        int64_t N, int64_t K) {
  using T = typename std::conditional<kF32, float, __nv_bfloat16>::type;
  extern __shared__ __align__(16) uint8_t rows_smem[];
  constexpr int64_t kUnits = nvfp4_layout::kTileUnits;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int64_t e = blockIdx.x, begin = offsets[e], end = offsets[e + 1];
  const int64_t row0 = (int64_t(blockIdx.y) * kWarps + warp) * kRowsPerBlock, steps = K / kSuper;
  if (end <= begin || row0 >= N) return;  // nothing below waits on other warps
  const uint8_t* tw = packed + e * N * (K / 2) + (row0 / kRowsPerBlock) * steps * kUnits * 8;
  const uint8_t* ts = sfs + e * N * (K / kBlock) + (row0 / kRowsPerBlock) * steps * kUnits;
  uint8_t* ring = rows_smem + warp * kRowsDepth * kTileBytes;
  const bool resident = steps <= kRowsDepth;
  if (resident) {
    for (int64_t sc = 0; sc < steps; ++sc) copy_tile(ring + sc * kTileBytes, tw + sc * kUnits * 8, ts + sc * kUnits, lane);
    cp_async_commit();
    cp_async_wait<0>();
    __syncwarp();
  }
  const float scale = epilogue_scale(tensor_scale + e, extra);
  for (int64_t tok0 = begin; tok0 < end; tok0 += 8 * kMaxNT) {
    const int m = int(end - tok0 < 8 * kMaxNT ? end - tok0 : 8 * kMaxNT);
    const T* xc = static_cast<const T*>(x) + tok0 * K;
    T* yc = static_cast<T*>(y) + tok0 * N;
    if (m <= 8) {
      rows_chunk<1, kF32>(ring, resident, tw, ts, steps, xc, m, scale, yc, N, K, row0);
    } else if (kMaxNT == 2 || m <= 16) {
      rows_chunk<(kMaxNT >= 2 ? 2 : 1), kF32>(ring, resident, tw, ts, steps, xc, m, scale, yc, N, K, row0);
    } else if (kMaxNT == 4 || m <= 32) {
      rows_chunk<(kMaxNT >= 4 ? 4 : 1), kF32>(ring, resident, tw, ts, steps, xc, m, scale, yc, N, K, row0);
    } else {
      rows_chunk<kMaxNT, kF32>(ring, resident, tw, ts, steps, xc, m, scale, yc, N, K, row0);
    }
  }
}

// The library's grouped staged kernel, each expert's chunks over kSplit blocks per slab.
template <int NT, int kSplit>
void launch_grouped_staged(const __nv_bfloat16* x, const int64_t* offsets, const uint8_t* packed, const uint8_t* sfs,
                           const float* ts, __nv_bfloat16* y, int64_t E, int64_t N, int64_t K, cudaStream_t stream) {
  constexpr int smem = 2 * staged_stage_bytes(NT);
  static const cudaError_t opt_in =
      cudaFuncSetAttribute(grouped_staged_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  check(opt_in, "shared memory opt-in");
  const dim3 grid(unsigned(E), unsigned((N + kStagedRows - 1) / kStagedRows), unsigned(kSplit));
  grouped_staged_kernel<NT>
      <<<grid, kStagedWarps * 32, smem, stream>>>(x, offsets, packed, sfs, ts, nullptr, y, N, K);
}

template <int kMaxNT, int W, int kMinBlocks = 1>
void launch_grouped_rows(const __nv_bfloat16* x, const int64_t* offsets, const uint8_t* packed, const uint8_t* sfs,
                         const float* ts, __nv_bfloat16* y, int64_t E, int64_t N, int64_t K, cudaStream_t stream) {
  static const cudaError_t opt_in = cudaFuncSetAttribute(
      grouped_rows_kernel<kMaxNT, W, false, kMinBlocks>, cudaFuncAttributeMaxDynamicSharedMemorySize,
      grouped_rows_smem(W));
  check(opt_in, "shared memory opt-in");
  const dim3 grid(unsigned(E), unsigned((N + W * kRowsPerBlock - 1) / (W * kRowsPerBlock)));
  grouped_rows_kernel<kMaxNT, W, false, kMinBlocks>
      <<<grid, W * 32, grouped_rows_smem(W), stream>>>(x, offsets, packed, sfs, ts, nullptr, y, N, K);
}

template <int kMaxNT, int W, int kMinBlocks = min_blocks(kMaxNT, W)>
void launch_library_grouped(const __nv_bfloat16* x, const int64_t* offsets, const uint8_t* packed, const uint8_t* sfs,
                            const float* ts, __nv_bfloat16* y, int64_t E, int64_t N, int64_t K, cudaStream_t stream) {
  const dim3 grid(unsigned(E), unsigned(N / kRowsPerBlock));
  grouped_kernel<kMaxNT, W, false, true, kMinBlocks>
      <<<grid, W * 32, 0, stream>>>(x, offsets, packed, sfs, ts, nullptr, y, N, K);
}

template <typename Kernel>
int registers(Kernel k) {
  cudaFuncAttributes a{};
  check(cudaFuncGetAttributes(&a, k), "attributes");
  return a.numRegs;
}

void probe_dense(int sms, cudaStream_t stream) {
  std::printf("NVFP4 M = 1 dense GEMM probe: CUDA graphs of 20 calls over rotating weight copies (>= 512 MiB),\n"
              "median of 7 replays; W warps per block, S blocks (a cluster) per row tile; diff: max |y - y(W 8)|\n");
  const int64_t shapes[][2] = {{8192, 4096}, {4096, 8192}, {12288, 8192}};
  for (const auto& shape : shapes) {
    const int64_t N = shape[0], K = shape[1], code_bytes = N * K / 2, bytes = code_bytes + N * K / 16;
    const int copies = int(std::max<int64_t>(2, (int64_t(512) << 20) / bytes));
    uint8_t* weights = random_weights(code_bytes, bytes, copies);
    __nv_bfloat16 *x = nullptr, *y = nullptr;
    uint32_t* sink = nullptr;
    std::vector<__nv_bfloat16> hx(K);
    for (int64_t k = 0; k < K; ++k) hx[k] = __float2bfloat16(float(k * 37 % 17) / 17.0f - 0.5f);
    check(cudaMalloc(&x, K * 2), "cudaMalloc");
    check(cudaMalloc(&y, N * 2), "cudaMalloc");
    check(cudaMalloc(&sink, 4), "cudaMalloc");
    check(cudaMemcpy(x, hx.data(), K * 2, cudaMemcpyHostToDevice), "copy");
    std::vector<__nv_bfloat16> ref(N), got(N);
    launch<8, 1, kLoad>(x, weights, weights + code_bytes, y, N, K, nullptr);
    check(cudaMemcpy(ref.data(), y, N * 2, cudaMemcpyDeviceToHost), "reference");

    double floor_us = 0;
    auto time = [&](const char* name, bool diff, auto call) {
      const double t = graph_us(stream, name, [&](int i) {
        const uint8_t* w = weights + (i < 0 ? 0 : (i % copies) * bytes);
        call(w, w + code_bytes);
      });
      if (floor_us == 0) floor_us = t;
      std::printf("  %-34s %7.2f us  %5.2f TB/s  %5.2fx read", name, t, double(bytes) / t / 1e6, t / floor_us);
      if (diff) {
        check(cudaMemcpy(got.data(), y, N * 2, cudaMemcpyDeviceToHost), name);
        float d = 0;
        for (int64_t i = 0; i < N; ++i) d = std::max(d, std::fabs(__bfloat162float(got[i]) - __bfloat162float(ref[i])));
        std::printf("  diff %.1e", d);
      }
      std::printf("\n");
    };
    std::printf("\n(N, K) = (%lld, %lld): %.1f MB per call\n", (long long)N, (long long)K, double(bytes) / 1e6);
    time("read floor (grid-stride)", false, [&](const uint8_t* p, const uint8_t*) {
      read_floor<<<sms * 8, 256, 0, stream>>>(reinterpret_cast<const uint4*>(p), bytes / 16, sink);
    });
#define PROBE(W, S, L, DIFF) \
  time(#L " W " #W " S " #S, DIFF, [&](const uint8_t* p, const uint8_t* s) { launch<W, S, L>(x, p, s, y, N, K, stream); })
    PROBE(4, 1, kLoad, true);
    PROBE(8, 1, kLoad, true);
    PROBE(16, 1, kLoad, true);
    PROBE(8, 2, kLoad, true);
    PROBE(8, 1, kLoadsOnly, false);
    PROBE(8, 1, kComputeOnly, false);
    PROBE(4, 1, kComputeOnly, false);
    PROBE(8, 1, kAsync, true);
    PROBE(4, 1, kAsync, true);
    PROBE(8, 1, kBulk, true);
    PROBE(4, 1, kBulk, true);
#undef PROBE
    check(cudaGetLastError(), "probe kernels");
    cudaFree(weights);
    cudaFree(x);
    cudaFree(y);
    cudaFree(sink);
  }
}

// Top-k routing of `tokens` tokens over E experts (distinct experts per token, a fixed LCG), as
// per-expert row counts.
std::vector<int64_t> routed_counts(int64_t tokens, int top_k, int64_t E) {
  std::vector<int64_t> counts(E, 0);
  uint32_t state = 7;
  for (int64_t i = 0; i < tokens; ++i) {
    std::vector<int64_t> picked;
    while (int(picked.size()) < top_k) {
      state = state * 1664525u + 1013904223u;
      const int64_t e = int64_t(state >> 8) % E;
      if (std::find(picked.begin(), picked.end(), e) == picked.end()) picked.push_back(e);
    }
    for (int64_t e : picked) ++counts[e];
  }
  return counts;
}

// tokens: the routed batch sizes to run (each x 8 rows).
void probe_grouped(cudaStream_t stream, const std::vector<int64_t>& batches) {
  std::printf("\nNVFP4 grouped (experts) W4A16 probe, muse-small's expert matrices (64 x 1024 x 1024), bf16,\n"
              "rows routed top-8; diff: max |y - y(library)| over all rows; regs: registers per thread\n");
  const int64_t E = 64, N = 1024, K = 1024, per = N * K / 2 + N * K / kBlock, code_bytes = E * N * K / 2;
  const int64_t bytes = E * per;
  const int copies = int(std::max<int64_t>(2, (int64_t(512) << 20) / bytes));
  uint8_t* weights = random_weights(code_bytes, bytes, copies);
  float* ts = nullptr;
  std::vector<float> ones(E, 1.0f);
  check(cudaMalloc(&ts, E * 4), "cudaMalloc");
  check(cudaMemcpy(ts, ones.data(), E * 4, cudaMemcpyHostToDevice), "copy");
  for (const int64_t tokens : batches) {
    const std::vector<int64_t> counts = routed_counts(tokens, 8, E);
    std::vector<int64_t> off{0};
    for (int64_t c : counts) off.push_back(off.back() + c);
    const int64_t R = off.back();
    int64_t* offsets = nullptr;
    __nv_bfloat16 *x = nullptr, *y = nullptr;
    check(cudaMalloc(&offsets, (E + 1) * 8), "cudaMalloc");
    check(cudaMemcpy(offsets, off.data(), (E + 1) * 8, cudaMemcpyHostToDevice), "copy");
    std::vector<__nv_bfloat16> hx(R * K);
    for (int64_t i = 0; i < R * K; ++i) hx[i] = __float2bfloat16(float(i * 37 % 17) / 17.0f - 0.5f);
    check(cudaMalloc(&x, R * K * 2), "cudaMalloc");
    check(cudaMalloc(&y, R * N * 2), "cudaMalloc");
    check(cudaMemcpy(x, hx.data(), R * K * 2, cudaMemcpyHostToDevice), "copy");
    std::vector<__nv_bfloat16> ref, got(R * N);
    const double moved = double(bytes) + 2.0 * double(R) * double(K + N);
    std::printf("\n%lld tokens x 8: %lld rows, %.1f per expert (max %lld); %.1f MB per call\n", (long long)tokens,
                (long long)R, double(R) / double(E), (long long)*std::max_element(counts.begin(), counts.end()),
                moved / 1e6);
    auto time = [&](const char* name, int regs, auto launch) {
      const double t = graph_us(stream, name, [&](int i) {
        const uint8_t* w = weights + (i < 0 ? 0 : (i % copies) * bytes);
        launch(x, offsets, w, w + code_bytes, ts, y, E, N, K, stream);
      });
      check(cudaMemcpy(got.data(), y, R * N * 2, cudaMemcpyDeviceToHost), name);
      if (ref.empty()) ref = got;
      float d = 0;
      for (int64_t i = 0; i < R * N; ++i) d = std::max(d, std::fabs(__bfloat162float(got[i]) - __bfloat162float(ref[i])));
      std::printf("  %-30s %7.2f us  %5.2f TB/s  regs %3d  diff %.1e\n", name, t, moved / t / 1e6, regs, d);
    };
    time("library kMaxNT 2, W 4", registers(grouped_kernel<2, 4, false, true>), launch_library_grouped<2, 4>);
    time("library kMaxNT 4, W 4 (3 blocks)", registers(grouped_kernel<4, 4, false, true>), launch_library_grouped<4, 4>);
    time("library kMaxNT 4, W 4, 2 blocks", registers(grouped_kernel<4, 4, false, true, 2>),
         launch_library_grouped<4, 4, 2>);
    time("library kMaxNT 4, W 4, 4 blocks", registers(grouped_kernel<4, 4, false, true, 4>),
         launch_library_grouped<4, 4, 4>);
    time("library kMaxNT 8, W 4, 2 blocks", registers(grouped_kernel<8, 4, false, true, 2>),
         launch_library_grouped<8, 4, 2>);
    time("staged, 16-token chunks", registers(grouped_staged_kernel<2>), launch_grouped_staged<2, 1>);
    time("staged, 32-token chunks", registers(grouped_staged_kernel<4>), launch_grouped_staged<4, 1>);
    time("staged, 32-token, 2 blocks per slab", registers(grouped_staged_kernel<4>), launch_grouped_staged<4, 2>);
    time("staged, 64-token chunks", registers(grouped_staged_kernel<8>), launch_grouped_staged<8, 1>);
    time("rows kMaxNT 2, W 4", registers(grouped_rows_kernel<2, 4, false>), launch_grouped_rows<2, 4>);
    time("rows kMaxNT 4, W 4", registers(grouped_rows_kernel<4, 4, false>), launch_grouped_rows<4, 4>);
    time("rows kMaxNT 4, W 2", registers(grouped_rows_kernel<4, 2, false>), launch_grouped_rows<4, 2>);
    time("rows kMaxNT 8, W 4", registers(grouped_rows_kernel<8, 4, false>), launch_grouped_rows<8, 4>);
    time("rows kMaxNT 4, W 4, 3 blocks", registers(grouped_rows_kernel<4, 4, false, 3>),
         launch_grouped_rows<4, 4, 3>);
    time("rows kMaxNT 4, W 2, 6 blocks", registers(grouped_rows_kernel<4, 2, false, 6>),
         launch_grouped_rows<4, 2, 6>);
    time("rows kMaxNT 2, W 2, 8 blocks", registers(grouped_rows_kernel<2, 2, false, 8>),
         launch_grouped_rows<2, 2, 8>);
    check(cudaGetLastError(), "grouped probe kernels");
    cudaFree(offsets);
    cudaFree(x);
    cudaFree(y);
  }
  cudaFree(ts);
  cudaFree(weights);
}

}  // namespace

// kiln_probe_nvfp4 [dense|grouped [tokens]]: one section, or both; grouped at one batch of
// `tokens` tokens (for a profiler) or at 64, 256, 512 and 1024 (8 to 128 rows per expert: 1024 is
// the rollout with every sample in flight, where the dispatch now dequantises the stack).
int main(int argc, char** argv) {
  const std::string only = argc > 1 ? argv[1] : "";
  const std::vector<int64_t> batches = argc > 2 ? std::vector<int64_t>{std::atoll(argv[2])} : std::vector<int64_t>{64, 256, 512, 1024};
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "device query");
  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "stream");
  if (only.empty() || only == "dense") probe_dense(sms, stream);
  if (only.empty() || only == "grouped") probe_grouped(stream, batches);
  cudaStreamDestroy(stream);
  return 0;
}
