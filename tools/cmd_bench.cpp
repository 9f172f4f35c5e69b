// `kiln bench <case>`: timings that print a ratio against a baseline measured in the same run.
// Cases: rmsnorm (CUDA kernel vs ATen ops vs a device copy), forward (muse-small forward and
// forward+backward, grouped GEMM vs per-expert loop).
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <chrono>
#include <functional>

#include "core/error.h"
#include "kernels/rms_norm.h"
#include "model/muse.h"
#include "tools/commands.h"

namespace kiln::tools {
namespace {

void sync(at::Device device) {
#if KILN_WITH_CUDA
  if (device.is_cuda()) c10::cuda::device_synchronize();
#endif
}

// Median seconds per call of `fn` over `iters` calls after `warmup` calls.
double time_it(at::Device device, const std::function<void()>& fn, int warmup = 3, int iters = 20) {
  for (int i = 0; i < warmup; ++i) fn();
  sync(device);
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    auto a = std::chrono::steady_clock::now();
    fn();
    sync(device);
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void bench_rmsnorm(at::Device device) {
  KILN_CHECK(device.is_cuda(), "bench rmsnorm: needs --device cuda (the CUDA kernel is the subject)");
  fmt::print("rmsnorm, bf16, rows x cols; bytes = read x + write y; copy = x.copy_ of the same size\n");
  fmt::print("{:>14} {:>11} {:>11} {:>11} {:>9} {:>9} {:>10}\n", "shape", "kernel us", "aten us", "copy us",
             "kern GB/s", "copy GB/s", "aten/kern");
  for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{8192, 2048}, {65536, 1024}, {16384, 8192}, {19, 4097}}) {
    auto opt = at::TensorOptions().dtype(at::kBFloat16).device(device);
    at::Tensor x = at::randn({rows, cols}, opt), w = at::rand({cols}, opt), dst = at::empty_like(x);
    const double tk = time_it(device, [&] { kernels::rms_norm_cuda(x, w, 1e-6); });
    const double ta = time_it(device, [&] { kernels::rms_norm_reference(x, w, 1e-6); });
    const double tc = time_it(device, [&] { dst.copy_(x); });
    const double bytes = 2.0 * double(x.numel()) * 2;
    fmt::print("{:>14} {:>11.1f} {:>11.1f} {:>11.1f} {:>9.0f} {:>9.0f} {:>9.2f}x\n", fmt::format("{}x{}", rows, cols),
               tk * 1e6, ta * 1e6, tc * 1e6, bytes / tk / 1e9, bytes / tc / 1e9, ta / tk);
  }
}

void bench_forward(at::Device device, const std::string& config, int64_t seqs, int64_t len) {
  const model::ModelConfig cfg = model::ModelConfig::from_yaml_file(config);
  const auto dtype = device.is_cuda() ? at::kBFloat16 : at::kFloat;
  auto t0 = std::chrono::steady_clock::now();
  model::Muse m = model::Muse::init(cfg, 0, dtype, device);
  fmt::print("forward: {} in {} on {}, {} sequences x {} tokens (init {:.1f} s)\n", cfg.name, at::toString(dtype),
             device.str(), seqs, len, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  std::vector<std::vector<int64_t>> tokens(seqs);
  at::Tensor ids = at::randint(cfg.vocab_size, {seqs * len}, at::kLong);
  for (int64_t s = 0; s < seqs; ++s) tokens[s].assign(ids.data_ptr<int64_t>() + s * len, ids.data_ptr<int64_t>() + (s + 1) * len);
  model::PackedBatch batch = model::PackedBatch::from_sequences(tokens, device);
  model::ForwardOptions opt;
  opt.targets = ids.to(device);
  const double T = double(seqs * len);
  fmt::print("{:>22} {:>12} {:>12} {:>9}\n", "", "loop tok/s", "grouped tok/s", "ratio");
  for (bool train : {false, true}) {
    m.set_requires_grad(train);
    double t[2];
    for (int g = 0; g < 2; ++g) {
      opt.use_grouped_mm = g == 1;
      t[g] = time_it(device, [&] {
        if (train) {
          m.forward(batch, opt).logprobs.sum().backward();
        } else {
          at::NoGradGuard ng;
          m.forward(batch, opt);
        }
      }, 2, 7);
    }
    fmt::print("{:>22} {:>12.0f} {:>12.0f} {:>8.2f}x\n", train ? "forward+backward" : "forward (no grad)", T / t[0],
               T / t[1], t[0] / t[1]);
  }
}

}  // namespace

Run add_bench(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "Benchmarks, each against a baseline timed in the same run");
  struct Args {
    std::string name, device = "cuda", config = "configs/muse-small.yaml";
    int64_t seqs = 8, len = 1024;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("case", a->name, "rmsnorm or forward")->required()->check(CLI::IsMember({"rmsnorm", "forward"}));
  cmd->add_option("--device", a->device, "cpu or cuda")->capture_default_str();
  cmd->add_option("--config", a->config, "Model config for the forward case")->capture_default_str();
  cmd->add_option("--seqs", a->seqs, "Sequences per batch (forward)")->capture_default_str();
  cmd->add_option("--len", a->len, "Tokens per sequence (forward)")->capture_default_str();
  return [a] {
    const at::Device device(a->device);
    if (a->name == "rmsnorm") bench_rmsnorm(device);
    else bench_forward(device, a->config, a->seqs, a->len);
  };
}

}  // namespace kiln::tools
