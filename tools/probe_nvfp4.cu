// Probe of the NVFP4 M = 1 dense GEMM (kiln_probe_nvfp4, CUDA builds only): times the library's
// per-tile code (nvfp4_gemm.cuh) under other schedules and loaders, and splits it into its memory
// and compute halves, against a read floor. Evidence for docs/PERFORMANCE.md, not a test.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
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

}  // namespace

int main() {
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "device query");
  std::printf("NVFP4 M = 1 dense GEMM probe: CUDA graphs of 20 calls over rotating weight copies (>= 512 MiB),\n"
              "median of 7 replays; W warps per block, S blocks (a cluster) per row tile; diff: max |y - y(W 8)|\n");
  const int64_t shapes[][2] = {{8192, 4096}, {4096, 8192}, {12288, 8192}};
  for (const auto& shape : shapes) {
    const int64_t N = shape[0], K = shape[1], code_bytes = N * K / 2, bytes = code_bytes + N * K / 16;
    const int copies = int(std::max<int64_t>(2, (int64_t(512) << 20) / bytes));
    // Random codes and finite scales (E4M3 below 0x60): the values only matter for the diff column.
    std::vector<uint8_t> host(bytes);
    uint32_t state = 1;
    for (int64_t i = 0; i < bytes; ++i) {
      state = state * 1664525u + 1013904223u;
      host[i] = uint8_t(state >> 24);
      if (i >= code_bytes) host[i] %= 0x60;
    }
    uint8_t* weights = nullptr;
    __nv_bfloat16 *x = nullptr, *y = nullptr;
    uint32_t* sink = nullptr;
    check(cudaMalloc(&weights, bytes * copies), "cudaMalloc");
    for (int c = 0; c < copies; ++c) check(cudaMemcpy(weights + c * bytes, host.data(), bytes, cudaMemcpyHostToDevice), "copy");
    std::vector<__nv_bfloat16> hx(K);
    for (int64_t k = 0; k < K; ++k) hx[k] = __float2bfloat16(float(k * 37 % 17) / 17.0f - 0.5f);
    check(cudaMalloc(&x, K * 2), "cudaMalloc");
    check(cudaMalloc(&y, N * 2), "cudaMalloc");
    check(cudaMalloc(&sink, 4), "cudaMalloc");
    check(cudaMemcpy(x, hx.data(), K * 2, cudaMemcpyHostToDevice), "copy");
    std::vector<__nv_bfloat16> ref(N), got(N);
    launch<8, 1, kLoad>(x, weights, weights + code_bytes, y, N, K, nullptr);
    check(cudaMemcpy(ref.data(), y, N * 2, cudaMemcpyDeviceToHost), "reference");

    cudaStream_t stream;
    cudaEvent_t start, stop;
    check(cudaStreamCreate(&stream), "stream");
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    double floor_us = 0;
    auto time = [&](const char* name, bool diff, auto call) {
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      call(weights, weights + code_bytes);
      check(cudaStreamSynchronize(stream), name);
      check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "capture");
      for (int i = 0; i < 20; ++i) call(weights + (i % copies) * bytes, weights + (i % copies) * bytes + code_bytes);
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
      const double t = us[3];
      if (floor_us == 0) floor_us = t;
      std::printf("  %-34s %7.2f us  %5.2f TB/s  %5.2fx read", name, t, double(bytes) / t / 1e6, t / floor_us);
      if (diff) {
        check(cudaMemcpy(got.data(), y, N * 2, cudaMemcpyDeviceToHost), name);
        float d = 0;
        for (int64_t i = 0; i < N; ++i) d = std::max(d, std::fabs(__bfloat162float(got[i]) - __bfloat162float(ref[i])));
        std::printf("  diff %.1e", d);
      }
      std::printf("\n");
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
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
    cudaStreamDestroy(stream);
    cudaFree(weights);
    cudaFree(x);
    cudaFree(y);
    cudaFree(sink);
  }
  return 0;
}
