// Probe of programmatic dependent launch (kiln_probe_pdl, CUDA builds only): a chain of small
// memory-bound kernels (bf16 GEMVs at decode sizes, and a tiny elementwise kernel) captured in one
// CUDA graph, launched plainly, with PDL, and with PDL plus the weights loaded before the wait.
// Evidence for docs/PERFORMANCE.md: what a decode step's ~230 kernel boundaries cost and could save.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "probe_pdl: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// How a kernel meets its predecessor: kPlain (ordinary stream order), kPdl (launched early, waits
// before anything), kPdlEarly (launched early, loads its weights, then waits for its input).
enum Mode { kPlain, kPdl, kPdlEarly };
const char* mode_name(Mode m) { return m == kPlain ? "plain" : m == kPdl ? "pdl" : "pdl + weights first"; }

__device__ __forceinline__ void wait_for_input() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void let_next_start() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

__device__ __forceinline__ float dot8(uint4 w, const __nv_bfloat16* x) {
  const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&w);
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = __bfloat1622float2(w2[i]);
    acc += a.x * __bfloat162float(x[2 * i]) + a.y * __bfloat162float(x[2 * i + 1]);
  }
  return acc;
}

// y[n] = sum_k w[n, k] x[k], one warp per row, K a multiple of 256 and at most 4096.
template <Mode M>
__global__ void __launch_bounds__(128) gemv(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* x,
                                            __nv_bfloat16* y, int n, int k) {
  constexpr int kMax = 16;  // 16-byte pieces per lane: K up to 4096
  const int row = blockIdx.x * 4 + threadIdx.x / 32, lane = threadIdx.x % 32, pieces = k / 256;
  uint4 wv[kMax];
  const uint4* wr = reinterpret_cast<const uint4*>(w + int64_t(row) * k);
  if (M == kPdlEarly && row < n) {
#pragma unroll
    for (int i = 0; i < kMax; ++i)
      if (i < pieces) wv[i] = wr[i * 32 + lane];
  }
  if (M != kPlain) {
    wait_for_input();
    let_next_start();
  }
  if (row >= n) return;
  if (M != kPdlEarly) {
#pragma unroll
    for (int i = 0; i < kMax; ++i)
      if (i < pieces) wv[i] = wr[i * 32 + lane];
  }
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kMax; ++i)
    if (i < pieces) acc += dot8(wv[i], x + (i * 32 + lane) * 8);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) y[row] = __float2bfloat16(tanhf(acc * 3.4f * rsqrtf(float(k))));  // bounded, never 0
}

// y = x * 0.5 + 1 over n elements: a norm- or activation-sized kernel with next to no work.
template <Mode M>
__global__ void tiny(const __nv_bfloat16* x, __nv_bfloat16* y, int n) {
  if (M != kPlain) {
    wait_for_input();
    let_next_start();
  }
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2bfloat16(__bfloat162float(x[i]) * 0.5f + 1.f);
}

template <typename... Args>
void launch(Mode m, void (*kernel)(Args...), dim3 grid, dim3 block, cudaStream_t s, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid, cfg.blockDim = block, cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr, cfg.numAttrs = m == kPlain ? 0 : 1;
  check(cudaLaunchKernelEx(&cfg, kernel, args...), "launch");
}

// Microseconds per kernel of a graph of `count` kernels, each reading the last one's output.
template <Mode M>
double chain(bool gemv_kernel, int count, int n, const __nv_bfloat16* w, __nv_bfloat16* a, __nv_bfloat16* b,
             int layers, int64_t layer_elems, cudaStream_t s) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  check(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "capture");
  for (int i = 0; i < count; ++i) {
    __nv_bfloat16 *in = i % 2 ? b : a, *out = i % 2 ? a : b;
    if (gemv_kernel)
      launch(M, gemv<M>, dim3((n + 3) / 4), dim3(128), s, (const __nv_bfloat16*)(w + (i % layers) * layer_elems),
             (const __nv_bfloat16*)in, out, n, n);
    else
      launch(M, tiny<M>, dim3((n + 255) / 256), dim3(256), s, (const __nv_bfloat16*)in, out, n);
  }
  check(cudaStreamEndCapture(s, &graph), "end capture");
  check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  for (int i = 0; i < 3; ++i) cudaGraphLaunch(exec, s);
  const int reps = 20;
  cudaEventRecord(e0, s);
  for (int i = 0; i < reps; ++i) cudaGraphLaunch(exec, s);
  cudaEventRecord(e1, s);
  check(cudaEventSynchronize(e1), "run");
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaGraphExecDestroy(exec), cudaGraphDestroy(graph), cudaEventDestroy(e0), cudaEventDestroy(e1);
  return 1e3 * ms / reps / count;
}

}  // namespace

// Usage: kiln_probe_pdl [kernels per graph, default 240]. Prints microseconds per kernel and the
// output's checksum per mode (the modes must agree: PDL must not change the result).
int main(int argc, char** argv) {
  const int count = argc > 1 ? std::atoi(argv[1]) : 240, layers = 48;
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  const int64_t max_n = 4096, layer_elems = max_n * max_n;
  __nv_bfloat16 *w, *a, *b;
  check(cudaMalloc(&w, layers * layer_elems * 2), "malloc w");
  check(cudaMalloc(&a, max_n * 2), "malloc a");
  check(cudaMalloc(&b, max_n * 2), "malloc b");
  {
    std::vector<__nv_bfloat16> h(layer_elems);
    for (int64_t i = 0; i < layer_elems; ++i) h[i] = __float2bfloat16(float((i * 7919) % 61) / 61.f - 0.5f);
    for (int l = 0; l < layers; ++l) check(cudaMemcpy(w + l * layer_elems, h.data(), layer_elems * 2, cudaMemcpyHostToDevice), "w");
  }
  std::printf("%d kernels per graph, weights of %d matrices cycled (bigger than L2 at n >= 1024)\n", count, layers);
  std::printf("%-22s %6s %12s %12s %22s %10s\n", "kernel", "n", "plain us", "pdl us", "pdl+weights first us", "checksums");
  for (int g = 0; g < 2; ++g)
    for (int n : {1024, 2048, 4096}) {
      if (!g && n != 1024) continue;
      double t[3];
      float sum[3];
      for (int m = 0; m < 3; ++m) {
        std::vector<__nv_bfloat16> h(max_n, __float2bfloat16(0.01f));
        check(cudaMemcpy(a, h.data(), max_n * 2, cudaMemcpyHostToDevice), "a");
        const Mode mode = Mode(m);
        const bool gv = g == 1;
        t[m] = mode == kPlain ? chain<kPlain>(gv, count, n, w, a, b, layers, layer_elems, s)
               : mode == kPdl ? chain<kPdl>(gv, count, n, w, a, b, layers, layer_elems, s)
                              : chain<kPdlEarly>(gv, count, n, w, a, b, layers, layer_elems, s);
        check(cudaMemcpy(h.data(), count % 2 ? b : a, n * 2, cudaMemcpyDeviceToHost), "y");
        sum[m] = 0;
        for (int i = 0; i < n; ++i) sum[m] += __bfloat162float(h[i]);
      }
      const bool agree = sum[0] == sum[1] && sum[0] == sum[2];
      std::printf("%-22s %6d %12.2f %12.2f %22.2f %10s\n", g ? "gemv bf16 n x n" : "tiny elementwise", n, t[0], t[1], t[2],
                  agree ? "agree" : "DIFFER");
      if (g && n >= 1024) {
        const double bytes = double(n) * n * 2;
        std::printf("%-22s %6s %12.2f %12.2f %22.2f   (TB/s of the weights)\n", "", "", bytes / t[0] / 1e6,
                    bytes / t[1] / 1e6, bytes / t[2] / 1e6);
      }
    }
  std::printf("modes: %s, %s, %s\n", mode_name(kPlain), mode_name(kPdl), mode_name(kPdlEarly));
  cudaFree(w), cudaFree(a), cudaFree(b);
  return 0;
}
