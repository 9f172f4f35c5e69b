// `kiln bench rollout`: the RL rollout workload (many prompts x samples, long generations,
// continuous batching) through the engine, BF16 and quantised: tok/s, decode step time, the
// achieved fraction of the bytes and FLOP rooflines (from each step's real batch), KV use, preemptions.
#include <ATen/ATen.h>
#include <fmt/format.h>
#if KILN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include <algorithm>
#include <chrono>
#include <set>
#include <string>

#include "model/config.h"
#include "model/muse.h"
#include "rollout/engine.h"
#include "tools/bench_util.h"

namespace kiln::tools {
namespace {

int64_t bytes_of(const at::Tensor& t) { return t.defined() ? int64_t(t.numel()) * int64_t(t.element_size()) : 0; }
int64_t bytes_of(const kernels::Nvfp4Tensor& q) { return bytes_of(q.packed) + bytes_of(q.block_scale); }

// The weight bytes a decode step reads, from the tensors the engine serves (dense or NVFP4): the
// per-step part (attention, router, pooler, unpooler, norms, lm_head) and, per layer, one expert's.
struct ServedBytes {
  double fixed = 0;
  std::vector<double> per_expert;  // [layer]
};
ServedBytes served_bytes(const model::Muse& m) {
  ServedBytes b;
  const auto& w = m.weights();
  b.fixed = double(bytes_of(w.final_norm) + bytes_of(w.lm_head));
  for (const auto& l : w.layers) {
    for (const at::Tensor* t : {&l.input_norm, &l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.post_attn_norm,
                                &l.pre_moe_norm, &l.router, &l.router_bias, &l.pooler, &l.unpooler, &l.post_moe_norm})
      b.fixed += double(bytes_of(*t));
    const auto& q = l.nvfp4;
    for (const kernels::Nvfp4Tensor* t : {&q.q_proj, &q.k_proj, &q.v_proj, &q.o_proj, &q.pooler, &q.unpooler})
      b.fixed += double(bytes_of(*t));
    const double experts = double(bytes_of(l.expert_gate) + bytes_of(l.expert_up) + bytes_of(l.expert_down) +
                                  bytes_of(l.expert_norm) + bytes_of(q.expert_gate) + bytes_of(q.expert_up) +
                                  bytes_of(q.expert_down));
    b.per_expert.push_back(experts / double(m.config().num_experts));
  }
  return b;
}

// Dense BF16 tensor-core peak of the device, when known (0: unknown).
double peak_flops(at::Device device) {
#if KILN_WITH_CUDA
  if (device.is_cuda()) {
    const std::string name = at::cuda::getDeviceProperties(device.index() < 0 ? 0 : device.index())->name;
    if (name.find("H100") != std::string::npos || name.find("H200") != std::string::npos) return 989e12;  // SXM
  }
#endif
  (void)device;
  return 0;
}

// What the decode steps of one run read and computed, summed from the engine's step traces.
struct DecodeWork {
  double bytes = 0, flops = 0;
};

struct RunResult {
  double wall = 0, tok_per_s = 0;
  rollout::EngineStats stats;
  DecodeWork work;
};

RunResult run_workload(const model::Muse& m, const rollout::EngineConfig& ec, const std::vector<rollout::Request>& reqs,
                       at::Device device) {
  rollout::Engine engine(m, ec);
  const model::ModelConfig& c = m.config();
  // Warm-up, untimed: one engine-full of short samples captures the decode graphs of every batch bucket.
  {
    std::vector<rollout::Request> warm(reqs.begin(), reqs.begin() + std::min<size_t>(reqs.size(), size_t(std::max<int64_t>(
                                                                           1, ec.max_num_seqs / reqs[0].params.n))));
    for (auto& r : warm) r.params.max_tokens = std::min<int64_t>(r.params.max_tokens, 32);
    engine.generate(warm);
  }
  const ServedBytes served = served_bytes(engine.model());
  const model::ParamCounts p = model::count_parameters(c);
  const double matmul = double(p.attention + p.latent + p.router + p.head) +
                        double(p.experts) * double(c.top_k) / double(c.num_experts);
  const double kv_token_layer = 2.0 * double(c.kv_size()) * double(c10::elementSize(m.dtype()));
  DecodeWork work;
  engine.set_trace([&](const rollout::StepTrace& t) {
    if (!std::all_of(t.items.begin(), t.items.end(), [](const auto& it) { return it.n == 1; })) return;
    double bytes = served.fixed, flops = 0;
    for (int64_t l = 0; l < c.num_layers; ++l) {
      std::set<int> experts;
      for (const auto& it : t.items) {
        const uint8_t* r = it.routing.data_ptr<uint8_t>() + l * c.top_k;
        experts.insert(r, r + c.top_k);
      }
      bytes += served.per_expert[size_t(l)] * double(experts.size());
      for (const auto& it : t.items) {
        const double keys = double(c.is_full_attention(l) ? it.start + 1 : std::min(it.start + 1, c.sliding_window));
        bytes += kv_token_layer * keys;
        flops += 4.0 * double(c.q_size()) * keys;
      }
    }
    flops += 2.0 * matmul * double(t.items.size());
    work.bytes += bytes;
    work.flops += flops;
  });
  const rollout::EngineStats s0 = engine.stats();
  sync(device);
  const auto a = std::chrono::steady_clock::now();
  engine.generate(reqs);
  sync(device);
  RunResult r;
  rollout::EngineStats s = engine.stats();
  // The trace that counts the bytes and FLOPs is the benchmark's, not the engine's: its time is
  // taken out of the wall time (the decode phases never include it).
  r.wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count() - (s.trace_seconds - s0.trace_seconds);
  // The timed run's own counters (the warm-up's subtracted; peaks are over both).
  s.steps -= s0.steps, s.model_tokens -= s0.model_tokens, s.sampled_tokens -= s0.sampled_tokens;
  s.preemptions -= s0.preemptions, s.graph_steps -= s0.graph_steps, s.graphs_captured -= s0.graphs_captured;
  s.decode_steps -= s0.decode_steps, s.decode_rows -= s0.decode_rows, s.decode_seconds -= s0.decode_seconds;
  s.schedule_seconds -= s0.schedule_seconds, s.model_seconds -= s0.model_seconds, s.sample_seconds -= s0.sample_seconds;
  r.stats = s;
  r.work = work;
  r.tok_per_s = double(s.sampled_tokens) / r.wall;
  return r;
}

// A Kineto trace of `steps` decode steps at full batch (after every sequence's prefill), to `path`.
void profile_decode(const model::Muse& m, const rollout::EngineConfig& ec, const std::vector<rollout::Request>& reqs,
                    at::Device device, const std::string& path, int steps) {
  rollout::Engine engine(m, ec);
  const size_t fill = std::min<size_t>(reqs.size(), size_t(std::max<int64_t>(1, ec.max_num_seqs / reqs[0].params.n)));
  for (size_t i = 0; i < fill; ++i) engine.add_request(reqs[i]);
  for (int i = 0; i < 40 && engine.has_unfinished(); ++i) engine.step();  // prefill, graph capture
  profile_to(path, device, [&] {
    for (int i = 0; i < steps && engine.has_unfinished(); ++i) engine.step();
  });
}

}  // namespace

void bench_rollout(at::Device device, const std::string& config, const RolloutBenchShape& shape,
                   const std::string& quantization, const std::string& profile) {
  const model::ModelConfig cfg = model::ModelConfig::from_yaml_file(config);
  const auto dtype = device.is_cuda() ? at::kBFloat16 : at::kFloat;
  model::Muse m = model::Muse::init(cfg, 0, dtype, device);
  const double bw = copy_bandwidth(device), peak = peak_flops(device);
  std::vector<rollout::Request> reqs(size_t(shape.prompts));
  for (int64_t i = 0; i < shape.prompts; ++i) {
    at::Tensor ids = at::randint(cfg.vocab_size, {shape.len}, at::kLong);
    reqs[size_t(i)].prompt.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + shape.len);
    reqs[size_t(i)].params.n = shape.samples;
    reqs[size_t(i)].params.max_tokens = shape.gen;  // no stop tokens: every sample runs to gen
    reqs[size_t(i)].params.seed = uint64_t(i);
  }
  rollout::EngineConfig ec;
  ec.block_size = 16;
  ec.max_num_seqs = shape.max_seqs;
  ec.max_batch_tokens = std::max<int64_t>(8192, shape.max_seqs);
  ec.prefill_chunk = 2048;
  const int64_t elem = int64_t(c10::elementSize(dtype)), seq = shape.len + shape.gen;
  ec.max_model_len = seq;  // every sequence's length is known: the window rings are cut to it
  ec.kv_cache_bytes = shape.kv_gib > 0 ? int64_t(shape.kv_gib * double(int64_t(1) << 30))
                                       : rollout::kv_cache_bytes_for(cfg, ec, elem, seq) + (int64_t(64) << 20);
  fmt::print("rollout: {} in {} on {}, {} prompts x {} samples, prompt {} tokens, {} new tokens each (no stop), at most {} "
             "sequences, KV cache {:.3g} GiB; copy bandwidth {:.0f} GB/s{}\n",
             cfg.name, at::toString(dtype), device.str(), shape.prompts, shape.samples, shape.len, shape.gen,
             shape.max_seqs, double(ec.kv_cache_bytes) / double(int64_t(1) << 30), bw / 1e9,
             peak > 0 ? fmt::format(", dense bf16 peak {:.0f} TFLOP/s", peak / 1e12) : std::string());
  fmt::print("{:>8} {:>10} {:>9} {:>12} {:>9} {:>10} {:>9} {:>9} {:>9} {:>8} {:>7} {:>8}\n", "weights", "tok/s", "wall s",
             "decode tok/s", "step ms", "rows/step", "of bytes", "of FLOPs", "KV peak", "preempt", "steps", "graph");
  std::vector<std::string> quants = {"none"};
  if (quantization != "none") quants.push_back(quantization);
  if (shape.bitwise) quants.push_back("bitwise");  // BF16 weights, batch-invariant numerics
  double base = 0;
  for (const std::string& q : quants) {
    ec.numerics = q == "bitwise" ? model::Numerics::kBitwise : model::Numerics::kStandard;
    ec.quantization = rollout::parse_quantization(ec.bitwise() ? "none" : q);
    const RunResult r = run_workload(m, ec, reqs, device);
    const rollout::EngineStats& s = r.stats;
    const double dsec = std::max(s.decode_seconds, 1e-12);
    const double kv_peak = double(s.peak_full_blocks * s.full_block_bytes + s.peak_window_blocks * s.window_block_bytes) /
                           double(ec.kv_cache_bytes);
    fmt::print("{:>8} {:>10.0f} {:>9.2f} {:>12.0f} {:>9.3f} {:>10.1f} {:>8.1f}% {:>8.2f}% {:>8.1f}% {:>8} {:>7} {:>8}\n",
               q == "none" ? at::toString(dtype) : q.c_str(), r.tok_per_s, r.wall, double(s.decode_rows) / dsec,
               1e3 * dsec / double(std::max<int64_t>(s.decode_steps, 1)),
               double(s.decode_rows) / double(std::max<int64_t>(s.decode_steps, 1)), 100.0 * r.work.bytes / dsec / bw,
               peak > 0 ? 100.0 * r.work.flops / dsec / peak : 0.0, 100.0 * kv_peak, s.preemptions, s.steps,
               s.graph_steps);
    fmt::print("         per step ms: schedule {:.3f}, model {:.3f}, sample {:.3f}; {} decode steps, {} with prefill; "
               "{} graphs captured in the timed run\n",
               1e3 * s.schedule_seconds / double(s.steps), 1e3 * s.model_seconds / double(s.steps),
               1e3 * s.sample_seconds / double(s.steps), s.decode_steps, s.steps - s.decode_steps, s.graphs_captured);
    if (q == "none") base = r.tok_per_s;
    else fmt::print("         {} / {}: {:.2f}x tok/s\n", q, at::toString(dtype), r.tok_per_s / base);
    if (!profile.empty()) {
      const std::string path = profile + "-" + q + ".json";
      profile_decode(m, ec, reqs, device, path, 5);
      fmt::print("         profile of 5 decode steps at {} rows: {}\n", std::min(shape.max_seqs, shape.prompts * shape.samples), path);
    }
  }
}

}  // namespace kiln::tools
