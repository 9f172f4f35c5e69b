// `kiln bench optim`: optimizer steps against baselines timed in the same run — the fused CPU AdamW
// against torch::optim::AdamW, every state placement against the all-on-device update and against
// the PCIe and disk bounds, the multi-tensor CUDA AdamW against the ATen update, torch's fused
// AdamW and the copy bandwidth, Muon batched against per-matrix, and Muon's share of a step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/optim/adamw.h>
#include <torch/version.h>
#if KILN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include <chrono>

#include "core/error.h"
#include "model/config.h"
#include "optimizers/nvme.h"
#include "optimizers/optimizer.h"
#include "tools/bench_util.h"

namespace kiln::tools {
namespace {

using optimizers::Optimizer;
using optimizers::OptimizerConfig;
using optimizers::Placement;
using Named = std::vector<std::pair<std::string, at::Tensor>>;

// A model-like parameter set of about `elems` elements: 4M-element matrices plus 64 small odd-sized
// vectors (norms, biases), with gradients.
Named synthetic_params(int64_t elems, at::ScalarType dtype, at::Device device) {
  Named ps;
  const auto opt = at::TensorOptions().dtype(dtype).device(device);
  for (int64_t i = 0; i < 64; ++i) ps.emplace_back(fmt::format("norm{}.weight", i), at::randn({4097}, opt));
  for (int64_t i = 0; int64_t(i) * (1 << 22) < elems; ++i)
    ps.emplace_back(fmt::format("layer{}.weight", i), at::randn({2048, 2048}, opt));
  for (auto& [n, p] : ps) p.mutable_grad() = at::randn_like(p);
  return ps;
}

int64_t numel(const Named& ps) {
  int64_t n = 0;
  for (auto& [name, p] : ps) n += p.numel();
  return n;
}

OptimizerConfig adamw_only(Placement where, const std::string& nvme_dir, double chunk_mb) {
  OptimizerConfig c;
  c.use_muon = false;
  c.state = where;
  c.nvme_dir = nvme_dir;
  c.chunk_bytes = int64_t(chunk_mb * double(1 << 20));
  c.adamw.weight_decay = 0.01;
  return c;
}

// 1. The fused Eigen AdamW (placement cpu_update) against libtorch's AdamW, same threads.
void cpu_adamw() {
  const at::Device cpu(at::kCPU);
  Named ours = synthetic_params(64 << 20, at::kFloat, cpu);
  std::vector<at::Tensor> theirs;
  for (auto& [n, p] : ours) {
    theirs.push_back(p.detach().clone());
    theirs.back().mutable_grad() = p.grad().clone();
  }
  Optimizer fused(ours, adamw_only(Placement::kHostCpu, "", 64));
  torch::optim::AdamW ref(theirs, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  const double t_ours = time_it(cpu, [&] { fused.step(); }, 2, 9);
  const double t_ref = time_it(cpu, [&] { ref.step(); }, 2, 9);
  const double n = double(numel(ours));
  fmt::print("AdamW on the CPU, {} threads, {:.1f}M fp32 parameters in {} tensors (28 B/param touched):\n",
             at::get_num_threads(), n / 1e6, ours.size());
  fmt::print("  kiln fused (Eigen)      {:8.1f} ms  {:6.2f} GB/s\n", t_ours * 1e3, 28 * n / t_ours / 1e9);
  fmt::print("  torch::optim::AdamW     {:8.1f} ms  {:6.2f} GB/s\n", t_ref * 1e3, 28 * n / t_ref / 1e9);
  fmt::print("  speed-up of the fused loop over torch: {:.2f}x (the bytes bound: torch's 9 passes move ~88 B/param "
             "against 28, ~3.1x, when both run at memory bandwidth)\n\n", t_ref / t_ours);
}

// Seconds to write then read `bytes` through an NvmeFile in `chunk`-byte pieces (the same calls
// the optimizer makes), as (write, read).
std::pair<double, double> disk_io(const std::string& dir, int64_t bytes, int64_t chunk) {
  optimizers::NvmeFile f(dir, "kiln-bench-io.bin", uint64_t(bytes));
  std::vector<char> buf(size_t(chunk), 1);
  // One untimed pass first: the optimizer's steps rewrite blocks already written, not fresh ones.
  for (int64_t o = 0; o < bytes; o += chunk) f.write(uint64_t(o), buf.data(), uint64_t(std::min(chunk, bytes - o)));
  auto now = [] { return std::chrono::steady_clock::now(); };
  auto a = now();
  for (int64_t o = 0; o < bytes; o += chunk) f.write(uint64_t(o), buf.data(), uint64_t(std::min(chunk, bytes - o)));
  auto b = now();
  for (int64_t o = 0; o < bytes; o += chunk) f.read(uint64_t(o), buf.data(), uint64_t(std::min(chunk, bytes - o)));
  auto c = now();
  return {std::chrono::duration<double>(b - a).count(), std::chrono::duration<double>(c - b).count()};
}

// 2. Every placement against the state on the device, and against the transfer bounds.
void placements(at::Device device, const std::string& nvme_dir, double chunk_mb) {
  const bool cuda = device.is_cuda();
  // On a GPU: bf16 parameters with fp32 masters, 12 B of state per parameter.
  const auto dtype = cuda ? at::kBFloat16 : at::kFloat;
  Named ps = synthetic_params(cuda ? (256 << 20) : (32 << 20), dtype, device);
  const double n = double(numel(ps));
  fmt::print("AdamW state placements on {}: {:.1f}M {} parameters, chunks of {} MiB\n", device.str(), n / 1e6,
             at::toString(dtype), chunk_mb);
  fmt::print("{:>12} {:>10} {:>14} {:>10}\n", "state", "ms/step", "state GB/s", "vs device");
  double t_device = 0, state_bytes = 0, t_host = 0, t_nvme = 0;
  for (Placement p : {Placement::kDevice, Placement::kHost, Placement::kHostCpu, Placement::kNvme}) {
    Optimizer o(ps, adamw_only(p, nvme_dir, chunk_mb));
    state_bytes = double(o.state_bytes());
    const double t = time_it(device, [&] { o.step(); }, 1, 5);
    if (p == Placement::kDevice) t_device = t;
    if (p == Placement::kHost) t_host = t;
    if (p == Placement::kNvme) t_nvme = t;
    fmt::print("{:>12} {:>10.1f} {:>14.2f} {:>9.2f}x\n", optimizers::placement_name(p), t * 1e3,
               state_bytes / t / 1e9, t / t_device);
  }
#if KILN_WITH_CUDA
  if (cuda) {
    // The PCIe bound of the chunked update: all state over and back, at the pinned copy bandwidth.
    at::Tensor host = at::empty({1ll << 30}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    at::Tensor dev = at::empty({1ll << 30}, at::TensorOptions().dtype(at::kByte).device(device));
    const double h2d = double(host.nbytes()) / time_it(device, [&] { dev.copy_(host, true); }, 1, 5);
    const double d2h = double(host.nbytes()) / time_it(device, [&] { host.copy_(dev, true); }, 1, 5);
    const double bound = std::max(state_bytes / h2d, state_bytes / d2h);
    fmt::print("PCIe (pinned copies): host->device {:.1f} GB/s, device->host {:.1f} GB/s; moving the state both "
               "ways takes >= {:.1f} ms; the chunked update (cpu) reaches {:.0f}% of that bound\n",
               h2d / 1e9, d2h / 1e9, bound * 1e3, 100 * bound / t_host);
  }
#endif
  const auto [tw, tr] = disk_io(nvme_dir, int64_t(state_bytes), int64_t(chunk_mb * double(1 << 20)));
  fmt::print("disk ({}): write {:.2f} GB/s, read {:.2f} GB/s; reading and writing the state once takes {:.1f} ms; "
             "the nvme step takes {:.1f} ms ({:.2f}x the I/O time)\n\n",
             nvme_dir, state_bytes / tw / 1e9, state_bytes / tr / 1e9, (tw + tr) * 1e3, t_nvme * 1e3,
             t_nvme / (tw + tr));
}

// 3. AdamW with the state on the GPU: the multi-tensor kernel against the ATen ops it replaced,
// torch's own fused AdamW (fp32 parameters: the same 28 B per parameter), and a device copy.
void device_adamw(at::Device device) {
  Named bf16 = synthetic_params(256 << 20, at::kBFloat16, device), f32 = synthetic_params(256 << 20, at::kFloat, device);
  const double n = double(numel(bf16));
  OptimizerConfig fast = adamw_only(Placement::kDevice, "", 64), slow = fast;
  slow.fused = false;
  Optimizer o_fast(bf16, fast), o_f32(f32, fast);
  const double t_fast = time_it(device, [&] { o_fast.step(); }, 2, 9);
  const double t_f32 = time_it(device, [&] { o_f32.step(); }, 2, 9);
  double t_slow = 0;
  {
    Optimizer o_slow(bf16, slow);
    t_slow = time_it(device, [&] { o_slow.step(); }, 2, 9);
  }
  at::Tensor a = at::empty({1ll << 30}, at::TensorOptions().dtype(at::kByte).device(device)), b = at::empty_like(a);
  const double copy_bw = 2.0 * double(a.nbytes()) / time_it(device, [&] { b.copy_(a); }, 2, 9);  // read + write
  const double bytes = 28 * n;  // g 2 + master 8 + moments 16 + parameter 2 (fp32: g 4 + p 8 + moments 16)
  fmt::print("AdamW with the state on {}: {:.1f}M parameters in {} tensors, 28 B/param touched; device copy "
             "(read + write) {:.0f} GB/s\n", device.str(), n / 1e6, bf16.size(), copy_bw / 1e9);
  fmt::print("{:>44} {:>9} {:>9} {:>9}\n", "", "ms/step", "GB/s", "of copy");
  auto row = [&](const char* what, double t) {
    fmt::print("{:>44} {:>9.2f} {:>9.0f} {:>8.0f}%\n", what, t * 1e3, bytes / t / 1e9, 100 * bytes / t / copy_bw);
  };
  row("kiln multi-tensor kernel, bf16 + fp32 master", t_fast);
  row("kiln multi-tensor kernel, fp32", t_f32);
  row("kiln ATen ops (before), bf16 + fp32 master", t_slow);
#if TORCH_VERSION_MAJOR >= 2
  {
    std::vector<at::Tensor> p, g, m, v, steps;
    for (auto& [name, t] : f32) {
      p.push_back(t.detach().clone());
      g.push_back(t.grad());
      m.push_back(at::zeros_like(t));
      v.push_back(at::zeros_like(t));
      steps.push_back(at::ones({}, t.options()));
    }
    const double t_torch = time_it(device, [&] {
      at::_fused_adamw_(p, g, m, v, {}, steps, 1e-3, 0.9, 0.999, 0.01, 1e-8, false, false);
    }, 2, 9);
    row("torch _fused_adamw_ (torch.optim fused), fp32", t_torch);
    fmt::print("  kiln multi-tensor / ATen ops: {:.2f}x; / torch fused (fp32 both): {:.2f}x\n\n", t_slow / t_fast,
               t_torch / t_f32);
  }
#else
  fmt::print("  kiln multi-tensor / ATen ops: {:.2f}x (torch's fused AdamW needs torch >= 2)\n\n", t_slow / t_fast);
#endif
}

// 4. Muon's orthogonalisation on a layer's expert stack: one batched call against a per-matrix loop.
void muon_batched(at::Device device, const model::ModelConfig& cfg) {
  const auto dtype = device.is_cuda() ? at::kBFloat16 : at::kFloat;
  at::Tensor g = at::randn({cfg.num_experts, cfg.expert_ffn_size, cfg.latent_size},
                           at::TensorOptions().dtype(at::kFloat).device(device));
  const double t_batched = time_it(device, [&] { optimizers::newton_schulz5(g, 5, dtype); }, 2, 7);
  const double t_loop = time_it(device, [&] {
    for (int64_t e = 0; e < g.size(0); ++e) optimizers::newton_schulz5(g[e], 5, dtype);
  }, 2, 7);
  fmt::print("Muon Newton-Schulz ({}), {} experts of {}x{} ({}): batched {:.2f} ms, per-matrix {:.2f} ms: {:.2f}x\n\n",
             cfg.name, cfg.num_experts, cfg.expert_ffn_size, cfg.latent_size, at::toString(dtype), t_batched * 1e3,
             t_loop * 1e3, t_loop / t_batched);
}

// 5. The optimizer's share of one training step (forward + backward on 8192 packed tokens).
void step_share(at::Device device, const model::ModelConfig& cfg) {
  const auto dtype = device.is_cuda() ? at::kBFloat16 : at::kFloat;
  model::Muse m = model::Muse::init(cfg, 0, dtype, device);
  m.set_requires_grad(true);
  model::ForwardOptions fo;
  const int64_t seqs = 8, len = device.is_cuda() ? 1024 : 64;
  model::PackedBatch batch = random_batch(cfg, seqs, len, device, fo);
  auto fwd_bwd = [&] {
    for (auto& [n, p] : m.named_parameters()) p.mutable_grad() = at::Tensor();
    (-m.forward(batch, fo).logprobs.mean()).backward();
  };
  const double t_model = time_it(device, fwd_bwd, 1, 5);
  Named muon, adamw;
  for (auto& np : m.named_parameters())
    (optimizers::default_uses_muon(np.first, np.second) ? muon : adamw).push_back(np);
  OptimizerConfig oc;
  Optimizer o_muon(muon, oc), o_adamw(adamw, oc);
  const double t_muon = time_it(device, [&] { o_muon.step(); }, 1, 5);
  const double t_adamw = time_it(device, [&] { o_adamw.step(); }, 1, 5);
  const double total = t_model + t_muon + t_adamw;
  fmt::print("training step of {} ({} on {}, {} tokens): forward+backward {:.1f} ms, Muon {:.1f} ms ({} tensors), "
             "AdamW {:.1f} ms ({} tensors); Muon is {:.1f}% of the step, the optimizer {:.1f}%\n",
             cfg.name, at::toString(dtype), device.str(), seqs * len, t_model * 1e3, t_muon * 1e3, muon.size(),
             t_adamw * 1e3, adamw.size(), 100 * t_muon / total, 100 * (t_muon + t_adamw) / total);
  // An RL optimizer step accumulates many micro-batches: the forward+backward time scales with the
  // micro-batches (measured above per micro-batch), the optimizer's does not.
  for (int64_t tokens : {int64_t(1) << 17, int64_t(1) << 20}) {
    const double micro = double(tokens) / double(seqs * len), t = micro * t_model + t_muon + t_adamw;
    fmt::print("  at {} tokens per optimizer step ({:.0f} micro-batches of {}): Muon {:.2f}%, the optimizer {:.2f}%\n",
               tokens, micro, seqs * len, 100 * t_muon / t, 100 * (t_muon + t_adamw) / t);
  }
}

}  // namespace

void bench_optim(at::Device device, const std::string& config, const std::string& nvme_dir, double chunk_mb) {
  const model::ModelConfig cfg = model::ModelConfig::from_yaml_file(config);
  at::manual_seed(0);
  cpu_adamw();
  placements(device, nvme_dir, chunk_mb);
  if (device.is_cuda()) device_adamw(device);
  muon_batched(device, cfg);
  step_share(device, cfg);
}

}  // namespace kiln::tools
