// `kiln bench <case>`: timings that print a ratio against a baseline measured in the same run.
// Cases: rmsnorm (CUDA kernel vs ATen ops vs a device copy), forward (forward and forward+backward,
// grouped GEMM vs per-expert loop), decode (engine decode vs full recompute vs the bytes roofline),
// rollout (the RL workload through the engine: tools/bench_rollout.cpp),
// train (one training step's forward+backward on 8192 packed tokens: tok/s, model TFLOP/s, grouped
// GEMM vs per-expert loop; with --cp under mpirun: tools/bench_cp.cpp), optim (tools/bench_optim.cpp), nvfp4 (W4A16 GEMMs vs BF16: tools/bench_nvfp4.cpp),
// attention (paged decode, tensor cores vs SIMT: tools/bench_attention.cpp),
// tokenize (kiln vs HF tokenizers' Node binding: tools/bench_tokenize.cpp).
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#if KILN_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <chrono>
#include <functional>
#include <tuple>

#include "core/error.h"
#include "kernels/rms_norm.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/muse.h"
#include "rollout/engine.h"
#include "tools/bench_util.h"
#include "tools/commands.h"
#include "tools/kernel_flags.h"

namespace kiln::tools {

void sync(at::Device device) {
#if KILN_WITH_CUDA
  if (device.is_cuda()) c10::cuda::device_synchronize();
#endif
}

double time_it(at::Device device, const std::function<void()>& fn, int warmup, int iters) {
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

double graphed_per_call(at::Device device, const std::function<void(int)>& fn, int calls) {
#if KILN_WITH_CUDA
  try {
    sync(device);
    c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
    at::cuda::CUDAGraph graph;
    {
      c10::cuda::CUDAStreamGuard guard(side);
      for (int i = 0; i < calls; ++i) fn(i);  // warm-up: lazy library state outside the capture
      side.synchronize();
      graph.capture_begin();
      for (int i = 0; i < calls; ++i) fn(i);
      graph.capture_end();
    }
    sync(device);
    constexpr int kReplays = 10;
    std::vector<double> runs;
    for (int run = 0; run < 7; ++run) {
      at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);  // timing enabled
      start.record();
      for (int r = 0; r < kReplays; ++r) graph.replay();
      stop.record();
      stop.synchronize();
      if (run >= 2) runs.push_back(double(start.elapsed_time(stop)) * 1e-3 / (kReplays * calls));  // 2 warm-ups
    }
    std::sort(runs.begin(), runs.end());
    return runs[runs.size() / 2];
  } catch (const std::exception& e) {
    fmt::print("  (graph capture failed: {}; timing eagerly)\n", std::string(e.what()).substr(0, 120));
  }
#endif
  int i = 0;
  return time_it(device, [&] { fn(i++); }, 3, 20);
}

double copy_bandwidth(at::Device device) {
  // 2 GiB on a GPU (well beyond L2); 128 MiB on the CPU.
  at::Tensor a = at::randn({int64_t(1) << (device.is_cuda() ? 30 : 26)}, at::TensorOptions().dtype(at::kBFloat16).device(device));
  at::Tensor b = at::empty_like(a);
  const double t = time_it(device, [&] { b.copy_(a); }, 3, 10);
  return 2.0 * double(a.numel()) * 2.0 / t;  // read + write
}

namespace {

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
  // The batch-invariant norms' gradient (rms_norm_backward): muse-small's attention norms (a shared
  // row, 8 x 1024 tokens) and its experts' norms over every slot (a weight row per slot).
  fmt::print("rmsnorm backward by formula, bf16, dx and dw; bytes = read x, dy (and per-row w) + write dx (and dw)\n");
  fmt::print("{:>24} {:>11} {:>11} {:>9} {:>10}\n", "shape", "kernel us", "aten us", "kern GB/s", "aten/kern");
  for (auto [rows, cols, per_row] : std::vector<std::tuple<int64_t, int64_t, bool>>{
           {8192, 2048, false}, {65536, 1024, true}, {19, 4097, true}}) {
    auto opt = at::TensorOptions().dtype(at::kBFloat16).device(device);
    at::Tensor x = at::randn({rows, cols}, opt), dy = at::randn({rows, cols}, opt);
    at::Tensor w = per_row ? at::rand({rows, cols}, opt) : at::rand({cols}, opt);
    const double tk = time_it(device, [&] { kernels::rms_norm_backward(x, w, dy, 1e-6, true, true); });
    const double ta = time_it(device, [&] { kernels::rms_norm_backward_reference(x, w, dy, 1e-6, true, true); });
    const double bytes = 2.0 * double(x.numel()) * (per_row ? 5 : 3);
    fmt::print("{:>24} {:>11.1f} {:>11.1f} {:>9.0f} {:>9.2f}x\n",
               fmt::format("{}x{} {}", rows, cols, per_row ? "per-row" : "shared"), tk * 1e6, ta * 1e6,
               bytes / tk / 1e9, ta / tk);
  }
}

}  // namespace

model::PackedBatch random_batch(const model::ModelConfig& cfg, int64_t seqs, int64_t len, at::Device device,
                                model::ForwardOptions& opt) {
  std::vector<std::vector<int64_t>> tokens(seqs);
  at::Tensor ids = at::randint(cfg.vocab_size, {seqs * len}, at::kLong);
  for (int64_t s = 0; s < seqs; ++s) tokens[s].assign(ids.data_ptr<int64_t>() + s * len, ids.data_ptr<int64_t>() + (s + 1) * len);
  opt.targets = ids.to(device);
  return model::PackedBatch::from_sequences(tokens, device);
}

namespace {

void bench_forward(at::Device device, const std::string& config, int64_t seqs, int64_t len) {
  const model::ModelConfig cfg = model::ModelConfig::from_yaml_file(config);
  const auto dtype = device.is_cuda() ? at::kBFloat16 : at::kFloat;
  auto t0 = std::chrono::steady_clock::now();
  model::Muse m = model::Muse::init(cfg, 0, dtype, device);
  fmt::print("forward: {} in {} on {}, {} sequences x {} tokens (init {:.1f} s)\n", cfg.name, at::toString(dtype),
             device.str(), seqs, len, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  model::ForwardOptions opt;
  model::PackedBatch batch = random_batch(cfg, seqs, len, device, opt);
  const double T = double(seqs * len);
  fmt::print("{:>22} {:>12} {:>12} {:>9}\n", "", "loop tok/s", "grouped tok/s", "ratio");
  for (bool train : {false, true}) {
    m.set_requires_grad(train);
    double t[2];
    for (int g = 0; g < 2; ++g) {
      opt.kernel_path = g == 1 ? model::KernelPath::kFused : model::KernelPath::kLoop;
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

// Model FLOPs of one training step (forward + backward = 3x forward) on sequences of `len` tokens:
// 2 per multiply-add of every matmul a token passes (attention projections, router, pooler and
// unpooler, its k experts, lm_head), plus causal attention scores and values over the keys each
// query sees (a window layer sees at most W).
double train_step_flops(const model::ModelConfig& c, int64_t seqs, int64_t len) {
  const model::ParamCounts p = model::count_parameters(c);
  const double matmul = double(p.attention + p.latent + p.router + p.head) +
                        double(p.experts) * double(c.top_k) / double(c.num_experts);
  double keys = 0;  // sum over layers and query positions of the keys attended
  for (int64_t l = 0; l < c.num_layers; ++l)
    for (int64_t t = 0; t < len; ++t) keys += double(c.is_full_attention(l) ? t + 1 : std::min(t + 1, c.sliding_window));
  const double forward = 2.0 * matmul * double(seqs * len) + 4.0 * double(c.q_size()) * keys * double(seqs);
  return 3.0 * forward;
}

void bench_train(at::Device device, const std::string& config, int64_t seqs, int64_t tokens,
                 const std::string& profile, bool only_fused, bool bitwise) {
  const model::ModelConfig cfg = model::ModelConfig::from_yaml_file(config);
  KILN_CHECK(seqs >= 1 && tokens % seqs == 0, "bench train: --tokens ", tokens, " must split into --seqs ", seqs,
             " equal sequences");
  const int64_t len = tokens / seqs;
  const auto dtype = device.is_cuda() ? at::kBFloat16 : at::kFloat;
  // On the GPU the weights are drawn there: a full-width layer's 13B parameters take minutes on the CPU.
  model::Muse m = device.is_cuda() ? model::Muse::init_on_device(cfg, 0, dtype, device)
                                   : model::Muse::init(cfg, 0, dtype, device);
  m.set_requires_grad(true);
  model::ForwardOptions opt;
  model::PackedBatch batch = random_batch(cfg, seqs, len, device, opt);
  const double flops = train_step_flops(cfg, seqs, len);
  fmt::print("train step: {} in {} on {}, {} sequences x {} tokens packed; forward + backward of the mean "
             "log-prob loss (optimizer excluded); {:.4g} TFLOP per step\n",
             cfg.name, at::toString(dtype), device.str(), seqs, len, flops / 1e12);
  fmt::print("{:>22} {:>12} {:>10} {:>10} {:>12}\n", "path", "tok/s", "TFLOP/s", "ms/step", "peak GB");
  // The experts as a loop of per-expert GEMMs with ATen ops (KernelPath::kComposed); torch's
  // grouped GEMM with the MoE, attention and loss as ATen ops (kGroupedMm); and the fused training
  // kernels (kFused). The grouped paths are CUDA-only: on the CPU the loop is the one path, timed once.
  using model::KernelPath;
  struct Path {
    const char* name;
    KernelPath kernels;
    bool recompute = false, bitwise = false;
  };
  std::vector<Path> paths = {{"per-expert loop", KernelPath::kComposed}};
  if (device.is_cuda()) {
    // 256 experts one GEMM at a time take seconds a step and say nothing new: the loop is left out.
    if (cfg.num_experts > 64 || only_fused) paths.clear();
    if (!only_fused) paths.push_back({"grouped, ATen ops", KernelPath::kGroupedMm});
    if (!only_fused) paths.push_back({"fused + recompute", KernelPath::kFused, true});  // the memory saving, and its cost
    paths.push_back({"grouped + fused", KernelPath::kFused});
  }
  // rollout.numerics: bitwise, the training forward and backward the trainer runs under it.
  if (bitwise) paths.push_back({"bitwise", KernelPath::kFused, false, true});
  std::vector<double> t, peak;
  auto step = [&] {
    for (auto& [n, p] : m.named_parameters()) p.mutable_grad() = at::Tensor();
    (-m.forward(batch, opt).logprobs.mean()).backward();
  };
  for (const Path& p : paths) {
    opt.kernel_path = p.kernels;
    opt.recompute = p.recompute;
    opt.numerics = p.bitwise ? model::Numerics::kBitwise : model::Numerics::kStandard;
    model::reset_peak_memory(device);
    t.push_back(time_it(device, step, 2, 7));
    peak.push_back(model::peak_memory_gb(device));
    fmt::print("{:>22} {:>12.0f} {:>10.3f} {:>10.1f} {:>12.2f}\n", p.name, double(tokens) / t.back(),
               flops / t.back() / 1e12, t.back() * 1e3, peak.back());
  }
  opt.recompute = false;
  // What the peak holds besides the weights and their gradients (both in the weights' dtype): the
  // activations kept for the backward and the kernels' workspace, per token.
  int64_t weight_bytes = 0;
  for (auto& [n, p] : m.named_parameters()) weight_bytes += p.numel() * int64_t(p.element_size());
  for (size_t i = 0; i < paths.size() && device.is_cuda(); ++i) {
    if (paths[i].kernels != KernelPath::kFused) continue;
    const double act = peak[i] * 1e9 - 2.0 * double(weight_bytes);
    fmt::print("memory ({}): weights {:.2f} GB, gradients {:.2f} GB, the rest of the peak {:.2f} GB = {:.1f} KB per "
               "token, {:.1f} KB per token and layer\n",
               paths[i].name, weight_bytes / 1e9, weight_bytes / 1e9, act / 1e9, act / double(tokens) / 1e3,
               act / double(tokens) / double(cfg.num_layers) / 1e3);
  }
  // Times by path name (the list depends on the device and the flags).
  const auto time_of = [&](const std::string& name) {
    for (size_t i = 0; i < paths.size(); ++i)
      if (name == paths[i].name) return t[i];
    return 0.0;
  };
  const double loop = time_of("per-expert loop"), aten = time_of("grouped, ATen ops"),
               recompute = time_of("fused + recompute"), fused = time_of("grouped + fused");
  if (loop > 0 && aten > 0) fmt::print("grouped / loop: {:.2f}x\n", loop / aten);
  if (aten > 0 && fused > 0) fmt::print("fused / ATen ops: {:.2f}x\n", aten / fused);
  if (recompute > 0 && fused > 0) fmt::print("recompute costs {:.2f}x the step time\n", recompute / fused);
  if (bitwise && fused > 0) fmt::print("bitwise costs {:.2f}x the step time\n", time_of("bitwise") / fused);
  if (!profile.empty()) {
    profile_to(profile, device, step);
    fmt::print("profile of one {} step: {}\n", paths.back().name, profile);
  }
}

// Bytes one decode step must read for `batch` sequences at context `ctx`: every non-expert weight,
// the experts the batch's tokens touch (expected distinct experts per layer under uniform routing),
// the lm_head, and each sequence's KV cache.
double decode_step_bytes(const model::ModelConfig& c, int64_t batch, int64_t ctx, double elem) {
  const model::ParamCounts p = model::count_parameters(c);
  const double touched = double(c.num_experts) * (1.0 - std::pow(1.0 - double(c.top_k) / double(c.num_experts), double(batch)));
  const double expert_bytes = double(p.experts) / double(c.num_experts) * touched * elem;
  const double dense = double(p.attention + p.latent + p.head + p.norms) * elem + double(p.router) * 4.0;
  const double kv = model::kv_cache_bytes_per_token(c, ctx, int64_t(elem)) * double(ctx) * double(batch);
  return dense + expert_bytes + kv;
}

void bench_decode(at::Device device, const std::string& config, int64_t prompt_len, int64_t gen,
                  const std::string& quantization) {
  const model::ModelConfig cfg = model::ModelConfig::from_yaml_file(config);
  const auto dtype = device.is_cuda() ? at::kBFloat16 : at::kFloat;
  model::Muse m = model::Muse::init(cfg, 0, dtype, device);
  const double bw = copy_bandwidth(device);
  const double elem = double(c10::elementSize(dtype));
  fmt::print("decode: {} in {} on {}{}, prompt {} tokens, {} generated per sample; copy bandwidth {:.0f} GB/s\n",
             cfg.name, at::toString(dtype), device.str(), quantization == "none" ? "" : ", weights " + quantization,
             prompt_len, gen, bw / 1e9);
  // On CUDA the engine's decode replays captured graphs; the eager engine is measured beside it.
  const bool graphs = device.is_cuda();
  fmt::print("{:>6} {:>12} {:>12} {:>14} {:>9} {:>14} {:>10}\n", "batch", "engine tok/s", "eager tok/s",
             "recompute tok/s", "ratio", "roofline tok/s", "of roofline");
  for (int64_t batch : {1, 16, 64}) {
    std::vector<rollout::Request> reqs(batch);
    for (int64_t b = 0; b < batch; ++b) {
      at::Tensor ids = at::randint(cfg.vocab_size, {prompt_len}, at::kLong);
      reqs[b].prompt.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + prompt_len);
      reqs[b].params.seed = uint64_t(b);
    }
    rollout::EngineConfig ec;
    ec.block_size = 16;
    ec.max_num_seqs = batch;
    ec.max_batch_tokens = std::max<int64_t>(4096, batch);
    ec.prefill_chunk = prompt_len;
    // Room for every sequence whole (no preemption): each window ring in full, which is more than
    // the context when the window is longer (muse-small's 2048), and two spare blocks per sequence
    // for the copy-on-write of a forked sample's last block. Sizing by kv_cache_bytes_per_token
    // instead (the context's bytes) left muse-small's batch 64 room for 44 sequences: it preempted
    // and recomputed, and decode numbers measured before that change include it.
    ec.kv_cache_bytes = rollout::kv_cache_bytes_for(cfg, ec, int64_t(elem), prompt_len + gen + 2 * ec.block_size) +
                        (int64_t(64) << 20);
    // Decode time: from the end of the last step that prefilled (every sample then has its first
    // token) to the end; prefill is excluded. A step prefilled when the engine did not count it as
    // a decode step (EngineStats::decode_steps: every row one token). Counting sampled tokens
    // instead could end it early wherever samples decode while other sequences still prefill (a
    // preempted sequence's recompute). Each engine runs once untimed (CUDA graphs are captured
    // then). Prefill time: from adding the requests to that point (prompt tokens per second).
    std::string split;  // where the graph engine's time went, for the note under the table
    double prefill_tps = 0;
    auto run = [&](rollout::Engine& engine) {
      for (auto& r : reqs) r.params.max_tokens = gen;
      rollout::EngineStats s0;
      const int64_t preempted = engine.stats().preemptions;
      sync(device);
      const auto t0 = std::chrono::steady_clock::now();
      for (const auto& r : reqs) engine.add_request(r);
      std::chrono::steady_clock::time_point a;
      int64_t first = -1;
      while (engine.has_unfinished()) {
        const int64_t decode_steps = engine.stats().decode_steps;
        engine.step();
        if (engine.stats().decode_steps == decode_steps) {  // this step prefilled: decode starts after it
          sync(device);
          a = std::chrono::steady_clock::now();
          first = engine.stats().sampled_tokens;
          s0 = engine.stats();
          prefill_tps = double(batch * prompt_len) / std::chrono::duration<double>(a - t0).count();
        }
      }
      sync(device);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
      const rollout::EngineStats s1 = engine.stats();
      const double steps = double(s1.steps - s0.steps);
      split = fmt::format("{:.0f} steps ({} graph), per step ms: schedule {:.3f}, model {:.3f}, sample {:.3f}; "
                          "{} preemptions in the run",
                          steps, s1.graph_steps - s0.graph_steps, 1e3 * (s1.schedule_seconds - s0.schedule_seconds) / steps,
                          1e3 * (s1.model_seconds - s0.model_seconds) / steps,
                          1e3 * (s1.sample_seconds - s0.sample_seconds) / steps, s1.preemptions - preempted);
      return double(engine.stats().sampled_tokens - first) / s;
    };
    auto measure = [&](bool use_graphs, const std::string& quant) {
      ec.cuda_graphs = use_graphs;
      ec.quantization = rollout::parse_quantization(quant);
      rollout::Engine engine(m, ec);
      if (device.is_cuda()) run(engine);
      return run(engine);
    };
    const double engine_tps = measure(graphs, quantization);
    const std::string engine_split = split;
    const double engine_prefill = prefill_tps;
    const double eager_tps = graphs ? measure(false, quantization) : engine_tps;
    // A quantised engine is also compared with the unquantised one on the same requests.
    const double plain_tps = quantization == "none" ? engine_tps : measure(graphs, "none");
    const double plain_prefill = quantization == "none" ? engine_prefill : prefill_tps;
    // Baseline: recompute the whole sequences for each new token (no KV cache).
    const int64_t steps = device.is_cuda() ? 3 : 1;
    std::vector<std::vector<int64_t>> seqs;
    for (auto& r : reqs) seqs.push_back(r.prompt);
    auto a = std::chrono::steady_clock::now();
    {
      at::NoGradGuard ng;
      for (int64_t s = 0; s < steps; ++s) {
        model::ForwardOptions opt;
        opt.skip_head = true;
        model::PackedBatch pb = model::PackedBatch::from_sequences(seqs, device);
        auto out = m.forward(pb, opt);
        std::vector<int64_t> last;
        for (int64_t b = 0; b < batch; ++b) last.push_back(pb.cu_seqlens[b + 1] - 1);
        at::Tensor next = m.logits(out.hidden.index_select(0, at::tensor(last, at::kLong).to(device))).argmax(-1).cpu();
        for (int64_t b = 0; b < batch; ++b) seqs[b].push_back(next[b].item<int64_t>());
      }
      sync(device);
    }
    const double recompute_tps = double(batch * steps) / std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
    const double roof_tps = double(batch) / (decode_step_bytes(cfg, batch, prompt_len + gen / 2, elem) / bw);
    fmt::print("{:>6} {:>12.1f} {:>12.1f} {:>14.1f} {:>8.1f}x {:>14.1f} {:>9.1f}%\n", batch, engine_tps, eager_tps, recompute_tps,
               engine_tps / recompute_tps, roof_tps, 100.0 * engine_tps / roof_tps);
    fmt::print("       engine decode: {}; prefill {:.0f} prompt tok/s\n", engine_split, engine_prefill);
    if (quantization != "none")
      fmt::print("       {} engine {:.1f} tok/s vs {} engine {:.1f} tok/s: {:.2f}x; prefill {:.0f} vs {:.0f} prompt tok/s: "
                 "{:.2f}x\n", quantization, engine_tps, at::toString(dtype), plain_tps, engine_tps / plain_tps,
                 engine_prefill, plain_prefill, engine_prefill / plain_prefill);
  }
}

}  // namespace

Run add_bench(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "Benchmarks, each against a baseline timed in the same run");
  struct Args {
    std::string name, device, config = "configs/muse-small.yaml", model, nvme_dir = "/tmp",
                quantization = "none";
    double chunk_mb = 64;
    int64_t seqs = 8, len = 1024, gen = 32, tokens = 8192, cp = 1;
    std::string profile;
    bool only_fused = false, bitwise = false, cp_only = false;
    RolloutBenchShape rollout;
    std::vector<int64_t> shape, grouped;
    KernelFlags kernels;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("case", a->name, "rmsnorm, forward, decode, rollout, train, optim, nvfp4, attention or invariant")
      ->required()
      ->check(CLI::IsMember({"rmsnorm", "forward", "decode", "rollout", "train", "optim", "nvfp4", "attention", "invariant"}));
  void add_bench_tokenize(CLI::App&); add_bench_tokenize(*cmd);  // the tokenize case: tools/bench_tokenize.cpp
  cmd->add_option("model", a->model, "Model config (the same as --config), e.g. kiln bench train configs/muse-small.yaml");
  cmd->add_option("--device", a->device, "cpu, cuda or cuda:N (default: cuda when there is one, else cpu)");
  cmd->add_option("--config", a->config, "Model config for the forward case")->capture_default_str();
  cmd->add_option("--seqs", a->seqs, "Sequences per batch (forward)")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--len", a->len, "Tokens per sequence (forward) or prompt length (decode)")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--gen", a->gen, "Generated tokens per sample (decode)")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--prompts", a->rollout.prompts, "Prompts (rollout)")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--samples", a->rollout.samples, "Samples per prompt (rollout)")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--max-seqs", a->rollout.max_seqs, "Sequences the engine runs at once (rollout)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--kv-gib", a->rollout.kv_gib, "KV cache GiB (rollout; default: room for --max-seqs whole sequences)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--nvme-dir", a->nvme_dir, "Directory for the NVMe state (optim)")->capture_default_str();
  cmd->add_option("--chunk-mb", a->chunk_mb, "Optimizer state chunk in MiB (optim)")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--quantization", a->quantization, "Rollout weights (decode): none, nvfp4 or w4a4")
      ->check(CLI::IsMember({"none", "nvfp4", "w4a4"}))
      ->capture_default_str();
  cmd->add_option("--tokens", a->tokens, "Packed tokens per step (train, split into --seqs sequences; invariant: rows)")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--profile", a->profile, "Save a Chrome trace of one step here (train; rollout: a path prefix, -<weights>.json added; tools/profile_summary.py)");
  auto* shape = cmd->add_option("--shape", a->shape, "M N K: one dense case of the table (nvfp4; for profilers)")->expected(3);
  cmd->add_option("--grouped", a->grouped, "TOKENS...: only the experts' table, muse-small's stack at these routed batches (nvfp4)")
      ->check(CLI::PositiveNumber)
      ->excludes(shape);
  cmd->add_flag("--bitwise", a->bitwise, "Also time the batch-invariant numerics (rollout.numerics bitwise): train, profiled last; rollout");
  cmd->add_option("--cp", a->cp, "Context-parallel ranks (train, under mpirun -np N): the step split over them against one "
                                 "rank's")->check(CLI::PositiveNumber);
  cmd->add_flag("--cp-only", a->cp_only, "With --cp: time the cp step alone, no one-rank baseline (for a memory "
                                        "limit on the cp ranks)");
  cmd->add_flag("--only-fused", a->only_fused, "Time only the grouped + fused path (train; for ncu and quick runs)");
  add_kernel_flags(cmd, a->kernels);
  return [a, cmd] {
    select_kernels(a->kernels);
    const std::string name = a->device.empty() ? (at::hasCUDA() ? "cuda" : "cpu") : a->device;
    const at::Device device = model::parse_device(name, "bench: --device");
    const std::string config = a->model.empty() ? a->config : a->model;
    if (a->name == "rmsnorm") bench_rmsnorm(device);
    else if (a->name == "decode") bench_decode(device, config, a->len, a->gen, a->quantization);
    else if (a->name == "rollout") {
      RolloutBenchShape shape = a->rollout;  // --len and --gen default to decode's 1024 / 32: given only
      if (cmd->count("--len")) shape.len = a->len;
      if (cmd->count("--gen")) shape.gen = a->gen;
      shape.bitwise = a->bitwise;
      bench_rollout(device, config, shape, a->quantization, a->profile);
    }
    else if (a->name == "train" && a->cp > 1) bench_train_cp(device, config, a->seqs, a->tokens, a->cp, a->cp_only, a->profile);
    else if (a->name == "train") bench_train(device, config, a->seqs, a->tokens, a->profile, a->only_fused, a->bitwise);
    else if (a->name == "optim") bench_optim(device, config, a->nvme_dir, a->chunk_mb);
    else if (a->name == "nvfp4") bench_nvfp4(device, a->shape, a->grouped);
    else if (a->name == "attention") bench_attention(device);
    else if (a->name == "invariant") bench_invariant(device, config, a->tokens);
    else bench_forward(device, config, a->seqs, a->len);
  };
}

}  // namespace kiln::tools
