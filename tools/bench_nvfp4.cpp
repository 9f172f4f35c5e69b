// `kiln bench nvfp4`: the W4A16 GEMMs against BF16 in the same run (dense against cuBLAS, grouped
// against torch's grouped GEMM or a per-expert loop before torch 2.8), with the achieved bandwidth
// against a device copy's and the read floor (a kernel that only reads the same weight bytes).
// Each op is timed as a CUDA graph of 20 calls over enough weight copies to defeat the L2 cache.
#include <ATen/ATen.h>
#include <fmt/format.h>
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/torch_version.h"
#include "kernels/nvfp4.h"
#include "kernels/stream_read.h"
#include "tools/bench_util.h"

namespace kiln::tools {
namespace {

constexpr int kCalls = 20;                        // calls per captured graph
constexpr double kRotateBytes = 256.0 * (1 << 20);  // weight copies cover at least this (L2 is 50 MB)

int copies_for(double bytes) { return int(std::max(1.0, std::ceil(kRotateBytes / std::max(bytes, 1.0)))); }

double per_call(at::Device device, const std::function<void(int)>& fn) { return graphed_per_call(device, fn, kCalls); }

double nvfp4_bytes(int64_t matrices, int64_t N, int64_t K) { return double(matrices) * double(N) * double(K) * (0.5 + 1.0 / 16); }

// Seconds per call of the stream read (kernels::xor_words) over `bytes`, rotating copies as the
// GEMMs do: no kernel that must read these bytes can be faster.
double read_floor(at::Device device, double bytes) {
  const int n = copies_for(bytes);
  std::vector<at::Tensor> bufs;
  for (int i = 0; i < n; ++i)
    bufs.push_back(at::zeros({int64_t(bytes) / 16 * 16}, at::TensorOptions().dtype(at::kByte).device(device)));
  at::Tensor out = at::zeros({}, at::TensorOptions().dtype(at::kInt).device(device));
  return per_call(device, [&](int i) { kernels::xor_words_into(bufs[size_t(i % n)], out); });
}

// Dense: each kernel the dispatcher can pick (split-K up to 64 tokens, staged and wgmma above 16,
// and the dequantise + cuBLAS path) against cuBLAS BF16 on the same activations; "auto" is what
// kernels::nvfp4_linear runs for that shape (wgmma where it measured faster; --nvfp4-gemm wgmma:
// everywhere), and bf16/auto its speed-up over BF16.
void bench_dense(at::Device device, double bw, const std::vector<int64_t>& only) {
  fmt::print("\ndense W4A16 vs cuBLAS BF16 (at::linear); bytes = packed + scales + x + y; of copy: the auto path's\n");
  fmt::print("{:>5} {:>6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>10} {:>8} {:>10}\n", "M", "N",
             "K", "splitK us", "staged us", "wg64 us", "wg128 us", "deq+mm us", "bf16 us", "auto", "TB/s", "of copy",
             "bf16/auto", "read us", "bf16/read");
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(device);
  // The large shapes of issue 7, then muse-small's attention (q/o, k/v) and latent projections.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{8192, 4096}, {4096, 8192}, {12288, 8192}, {2048, 2048},
                                                            {512, 2048},  {1024, 2048}, {2048, 1024}};
  for (auto [N, K] : shapes) {
    if (!only.empty() && (N != only[1] || K != only[2])) continue;
    const int nq = copies_for(nvfp4_bytes(1, N, K)), nb = copies_for(2.0 * double(N) * double(K));
    std::vector<kernels::Nvfp4Tensor> qs;
    std::vector<at::Tensor> ws;
    for (int i = 0; i < std::max(nq, nb); ++i) {
      at::Tensor w = at::randn({N, K}, bf16) * 0.02;
      if (i < nq) qs.push_back(kernels::nvfp4_quantize_cuda(w, /*kernel_layout=*/true));
      if (i < nb) ws.push_back(w);
    }
    const double floor = read_floor(device, nvfp4_bytes(1, N, K));
    for (int64_t M : {1, 4, 16, 32, 64, 128, 256, 512, 1024}) {
      if (!only.empty() && M != only[0]) continue;
      at::Tensor x = at::randn({M, K}, bf16);
      auto gemm = [&](kernels::Nvfp4Gemm g) {
        return per_call(device, [&](int i) { kernels::nvfp4_linear_cuda(x, qs[size_t(i % nq)], at::Tensor(), g); });
      };
      const double nan = std::nan("");
      const double split = M <= 64 ? gemm(kernels::Nvfp4Gemm::kSplitK) : nan;
      const double staged = M > 16 ? gemm(kernels::Nvfp4Gemm::kStaged) : nan;
      // The wgmma GEMM with 64 and with 128 weight rows per block (one or two warpgroups).
      const bool wg = M > 16 && kernels::nvfp4_wgmma_usable(x, qs[0]);
      const double wg64 = wg ? gemm(kernels::Nvfp4Gemm::kWgmma64) : nan;
      const double wg128 = wg && kernels::wgmma_warpgroups_fit(N, 2) ? gemm(kernels::Nvfp4Gemm::kWgmma128) : nan;
      const double deq = M >= 64 ? per_call(device, [&](int i) {
        at::linear(x, kernels::nvfp4_dequantize_cuda(qs[size_t(i % nq)], at::kBFloat16));
      })
                                 : nan;
      const double tb = per_call(device, [&](int i) { at::linear(x, ws[size_t(i % nb)]); });
      const double ta = per_call(device, [&](int i) { kernels::nvfp4_linear(x, qs[size_t(i % nq)]); });
      const char* path = kernels::nvfp4_linear_path(x, qs[0]);
      const double bytes = nvfp4_bytes(1, N, K) + 2.0 * double(M) * double(K + N);
      fmt::print("{:>5} {:>6} {:>6} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>8} {:>8.2f} {:>7.0f}% {:>9.2f}x {:>8.1f} {:>9.2f}x\n",
                 M, N, K, split * 1e6, staged * 1e6, wg64 * 1e6, wg128 * 1e6, deq * 1e6, tb * 1e6, path, bytes / ta / 1e12,
                 100.0 * bytes / ta / bw, tb / ta, floor * 1e6, tb / floor);
    }
  }
}

// Routing of `tokens` tokens to top_k distinct experts each: rows sorted by expert. Uniform, or
// uneven: each expert's preference drawn once from N(0, 1) and a token's top_k by preference plus
// Gumbel noise (a router's softmax sampled), so that some experts get several times the mean.
std::vector<int64_t> random_counts(int64_t tokens, int64_t top_k, int64_t E, bool uneven = false) {
  at::Tensor scores = at::rand({tokens, E});
  if (uneven) scores = at::randn({1, E}) - (-scores.clamp_min(1e-12).log()).log();
  at::Tensor ids = std::get<1>(scores.topk(top_k, 1)).reshape({-1});
  at::Tensor counts = at::bincount(ids, {}, E).to(at::kLong);
  return std::vector<int64_t>(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + E);
}

void bench_grouped_case(at::Device device, double bw, const std::string& label, int64_t E, int64_t N, int64_t K,
                        int64_t tokens, int64_t top_k, bool uneven = false) {
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(device);
  const std::vector<int64_t> counts = random_counts(tokens, top_k, E, uneven);
  const std::string name =
      uneven ? fmt::format("{} uneven, max {}", label, *std::max_element(counts.begin(), counts.end())) : label;
  std::vector<int64_t> off{0}, padded_end;
  int64_t padded = 0, touched = 0;
  for (int64_t c : counts) {
    off.push_back(off.back() + c);
    padded += (c + 15) / 16 * 16;  // torch's grouped GEMM wants 16-row aligned segments
    padded_end.push_back(padded);
    touched += c > 0;
  }
  const int64_t R = off.back();
  at::Tensor offsets = at::tensor(off, at::kLong).to(device);
  const int nq = copies_for(nvfp4_bytes(E, N, K)), nb = copies_for(2.0 * double(E) * double(N) * double(K));
  std::vector<kernels::Nvfp4Tensor> qs;
  std::vector<at::Tensor> ws;
  for (int i = 0; i < std::max(nq, nb); ++i) {
    at::Tensor w = at::randn({E, N, K}, bf16) * 0.02;
    if (i < nq) qs.push_back(kernels::nvfp4_quantize_cuda(w, /*kernel_layout=*/true));
    if (i < nb) ws.push_back(w);
  }
  at::Tensor x = at::randn({R, K}, bf16);
  // The dispatcher: the fused kernels up to 192 rows per expert, torch's grouped GEMM on the
  // dequantised stack above (neither syncs with the host, so both capture).
  const double tq = per_call(device, [&](int i) { kernels::nvfp4_grouped_linear(x, qs[size_t(i % nq)], offsets); });
  double tb = 0;
  const char* baseline = "per-expert at::linear";
#if KILN_TORCH_AT_LEAST(2, 8)
  baseline = "at::_grouped_mm";
  at::Tensor xp = at::randn({std::max<int64_t>(padded, 16), K}, bf16);
  at::Tensor offs = at::tensor(padded_end, at::kLong).to(at::kInt).to(device);
  tb = per_call(device, [&](int i) { at::_grouped_mm(xp, ws[size_t(i % nb)].transpose(1, 2), offs); });
#else
  tb = per_call(device, [&](int i) {
    const at::Tensor& w = ws[size_t(i % nb)];
    for (int64_t e = 0; e < E; ++e)
      if (counts[size_t(e)] > 0) at::linear(x.narrow(0, off[size_t(e)], counts[size_t(e)]), w[e]);
  });
#endif
  const double bytes = nvfp4_bytes(touched, N, K) + 2.0 * double(R) * double(K + N);
  const double floor = read_floor(device, nvfp4_bytes(touched, N, K));
  fmt::print("{:>26} {:>4} {:>5} {:>5} {:>6} {:>5} {:>10.1f} {:>10.1f} {:>9.2f} {:>7.0f}% {:>10.2f}x {:>8.1f} {:>9.2f}x  "
             "(dispatch: {}; bf16: {})\n",
             name, E, N, K, R, touched, tq * 1e6, tb * 1e6, bytes / tq / 1e12, 100.0 * bytes / tq / bw, tb / tq,
             floor * 1e6, tb / floor, kernels::nvfp4_grouped_linear_path(x, qs[0], R), baseline);
  // The split-K and grouped staged kernels forced on the same rows (the dispatch takes split-K to
  // 16 rows per expert, the staged kernel launched per expert at 17-64 and tiled at 65-192).
  for (auto [g, label] : {std::pair{kernels::Nvfp4Gemm::kSplitK, "same, split-K"},
                          std::pair{kernels::Nvfp4Gemm::kStaged, "same, staged per expert"},
                          std::pair{kernels::Nvfp4Gemm::kStagedTiles, "same, staged tiles"},
                          std::pair{kernels::Nvfp4Gemm::kStagedTiles64, "same, tiles of 64 tokens"}}) {
    if (kernels::is_grouped_staged(g) && !kernels::grouped_stack_aligned(N, K)) continue;
    const double ts = per_call(device, [&](int i) {
      kernels::nvfp4_grouped_linear_cuda(x, qs[size_t(i % nq)], offsets, at::Tensor(), 0, g);
    });
    fmt::print("{:>26} {:>40.1f} {:>10.1f} {:>9.2f} {:>7.0f}% {:>10.2f}x  (forced)\n", label, ts * 1e6,
               tb * 1e6, bytes / ts / 1e12, 100.0 * bytes / ts / bw, tb / ts);
  }
  // The wgmma GEMM forced on the same rows, 64 and 128 weight rows per block (the dispatch takes it
  // above 16 rows per expert with --nvfp4-gemm wgmma, the launcher choosing the block).
  for (auto [g, label] : {std::pair{kernels::Nvfp4Gemm::kWgmma64, "same, wgmma 64 rows"},
                          std::pair{kernels::Nvfp4Gemm::kWgmma128, "same, wgmma 128 rows"}}) {
    if (!kernels::nvfp4_wgmma_usable(x, qs[0]) || !kernels::wgmma_warpgroups_fit(N, kernels::wgmma_warpgroups(g)))
      continue;
    const double tw = per_call(device, [&](int i) {
      kernels::nvfp4_grouped_linear_cuda(x, qs[size_t(i % nq)], offsets, at::Tensor(), 0, g);
    });
    fmt::print("{:>26} {:>40.1f} {:>10.1f} {:>9.2f} {:>7.0f}% {:>10.2f}x  (forced)\n", label, tw * 1e6, tb * 1e6,
               bytes / tw / 1e12, 100.0 * bytes / tw / bw, tb / tw);
  }
#if KILN_TORCH_AT_LEAST(2, 8)
  // The MoE layer's prefill call: rows already in the grouped GEMM's padded layout (no row moves),
  // against the same BF16 call on the same rows.
  if (kernels::nvfp4_grouped_dequantizes(qs[0], xp.size(0), xp)) {
    const double ta = per_call(device, [&](int i) { kernels::nvfp4_grouped_linear_aligned(xp, qs[size_t(i % nq)], offs); });
    fmt::print("{:>26} {:>40.1f} {:>10.1f} {:>9} {:>8} {:>10.2f}x  (rows in the MoE layer's padded layout)\n",
               "same, aligned rows", ta * 1e6, tb * 1e6, "", "", tb / ta);
  }
#endif
}

// tokens: muse-small's experts at these routed batches only (each x 8 rows), else the table's cases.
void bench_grouped(at::Device device, double bw, const std::vector<int64_t>& tokens) {
  fmt::print("\ngrouped W4A16 (MoE experts) vs BF16; bytes = touched experts' packed + scales + x + y\n");
  fmt::print("{:>26} {:>4} {:>5} {:>5} {:>6} {:>5} {:>10} {:>10} {:>9} {:>8} {:>11} {:>8} {:>10}\n", "case", "E", "N", "K",
             "rows", "used", "nvfp4 us", "bf16 us", "TB/s", "of copy", "bf16/nvfp4", "read us", "bf16/read");
  if (!tokens.empty()) {
    for (const int64_t t : tokens)
      for (bool uneven : {false, true})
        bench_grouped_case(device, bw, fmt::format("muse-small {}x8", t), 64, 1024, 1024, t, 8, uneven);
    return;
  }
  bench_grouped_case(device, bw, "muse-small decode 64x8", 64, 1024, 1024, 64, 8);
  bench_grouped_case(device, bw, "muse-small rollout 256x8", 64, 1024, 1024, 256, 8);
  bench_grouped_case(device, bw, "muse-small prefill 8192x8", 64, 1024, 1024, 8192, 8);
  bench_grouped_case(device, bw, "full-size decode 64x8", 256, 4096, 4096, 64, 8);
  bench_grouped_case(device, bw, "full-size prefill 8192x8", 256, 4096, 4096, 8192, 8);
}

}  // namespace

void bench_nvfp4(at::Device device, const std::vector<int64_t>& only, const std::vector<int64_t>& grouped) {
  KILN_CHECK(device.is_cuda(), "bench nvfp4: needs --device cuda (the CUDA kernels are the subject)");
#if KILN_WITH_CUDA
  const c10::cuda::CUDAGuard guard(device);
  at::NoGradGuard no_grad;
  at::manual_seed(0);
  const double bw = copy_bandwidth(device);
  fmt::print("nvfp4 W4A16 GEMMs, bf16 activations; device copy bandwidth {:.2f} TB/s (2 GiB bf16 copy, read + write);\n"
             "each op timed as a CUDA graph of {} calls over rotating weight copies (>= {:.0f} MiB);\n"
             "read us: a kernel that only reads the weight bytes (kernels::xor_words_into), so bf16/read bounds any kernel\n",
             bw / 1e12, kCalls, kRotateBytes / (1 << 20));
  if (grouped.empty()) bench_dense(device, bw, only);
  if (only.empty()) bench_grouped(device, bw, grouped);
#endif
}

}  // namespace kiln::tools
