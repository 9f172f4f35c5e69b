// `kiln bench attention`: paged decode attention on the GPU, the tensor-core kernel against the SIMT
// kernel in the same run, each as a fraction of the device's copy bandwidth over the bytes it must
// read (every key and value of every sequence). Shapes: muse-small's heads (2 KV heads, group 8,
// head dim 128) at decode batches from 1 to 256, bf16, a shuffled block table.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "core/error.h"
#include "kernels/paged_attention.h"
#include "tools/bench_util.h"

namespace kiln::tools {

void bench_attention(at::Device device) {
  KILN_CHECK(device.is_cuda(), "bench attention: needs --device cuda (the CUDA kernels are the subject)");
  constexpr int64_t hkv = 2, group = 8, hd = 128, block = 16;
  const double bw = copy_bandwidth(device);
  fmt::print("paged decode attention, bf16, {} KV heads x group {} x head dim {}, block {}; copy bandwidth {:.2f} TB/s\n",
             hkv, group, hd, block, bw / 1e12);
  fmt::print("{:>6} {:>8} {:>10} {:>10} {:>8} {:>12} {:>12} {:>10}\n", "seqs", "keys", "simt us", "tc us", "tc/simt",
             "simt of bw", "tc of bw", "max |diff|");
  const auto opt = at::TensorOptions().device(device);
  std::mt19937 rng(3);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 4096}, {16, 1024}, {64, 1280}, {64, 4096},
                                                           {256, 768},  {256, 2048}};
  for (auto [n, keys] : shapes) {
    const int64_t cols = (keys + block - 1) / block, blocks = n * cols;
    std::vector<int64_t> perm(static_cast<size_t>(blocks));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    at::Tensor table = at::tensor(perm, at::kLong).view({n, cols}).to(device);
    at::Tensor kc = at::randn({blocks * block, hkv, hd}, opt.dtype(at::kBFloat16));
    at::Tensor vc = at::randn({blocks * block, hkv, hd}, opt.dtype(at::kBFloat16));
    at::Tensor q = at::randn({n, hkv * group, hd}, opt.dtype(at::kBFloat16));
    at::Tensor pos = at::full({n}, keys - 1, opt.dtype(at::kLong));
    using K = kernels::PagedDecodeKernel;
    auto run = [&](K kind) { return kernels::paged_decode_attention_cuda(q, kc, vc, table, pos, block, 0, 0, kind); };
    const double diff = (run(K::kSimt).to(at::kFloat) - run(K::kTensorCores).to(at::kFloat)).abs().max().item<double>();
    const double simt = graphed_per_call(device, [&](int) { run(K::kSimt); }, 10);
    const double tc = graphed_per_call(device, [&](int) { run(K::kTensorCores); }, 10);
    const double bytes = double(n) * double(keys) * hkv * hd * 2.0 * 2.0;  // keys and values, bf16
    fmt::print("{:>6} {:>8} {:>10.1f} {:>10.1f} {:>7.2f}x {:>11.1f}% {:>11.1f}% {:>10.2e}\n", n, keys, simt * 1e6,
               tc * 1e6, simt / tc, 100.0 * bytes / simt / bw, 100.0 * bytes / tc / bw, diff);
  }
}

}  // namespace kiln::tools
