// `kiln bench train --cp N` under `mpirun -np N`: a training step's forward and backward with every
// sequence's tokens split over the N ranks (parallel/context_parallel.h) against one rank's step
// on the whole batch and on 1/N of each sequence (the ideal), timed and measured in the same run.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <sys/resource.h>

#include <chrono>
#include <functional>

#include "core/comm.h"
#include "core/error.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/muse.h"
#include "parallel/context_parallel.h"
#include "parallel/parallel.h"
#include "tools/bench_util.h"

namespace kiln::tools {
namespace {

// The process's peak resident set so far, in bytes (Linux reports KiB).
double peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) * 1024.0;
}

// Peak memory of a GPU since the last mark, above what was allocated then. The CPU has no such
// count (its resident set keeps freed pages and only grows): there it is 0, and a step's memory is
// the process's peak resident set (peak_rss_bytes) of a run of its own.
struct PeakMeter {
  at::Device device;
  double base = 0;
  void mark() {
    model::reset_peak_memory(device);
    base = model::current_memory_gb(device) * 1e9;
  }
  double above_mark() const { return model::peak_memory_gb(device) * 1e9 - base; }
};

struct Step {
  double seconds = 0, peak = 0;
};

// Times `fn` (1 warm-up, 3 timed calls, the median) after measuring one call's peak above the mark.
Step measure(at::Device device, const std::function<void()>& fn) {
  PeakMeter meter{device};
  meter.mark();
  fn();
  sync(device);
  Step s;
  s.peak = meter.above_mark();
  s.seconds = time_it(device, fn, 0, 3);
  return s;
}

}  // namespace

void bench_train_cp(at::Device device, const std::string& config, int64_t seqs, int64_t tokens, int64_t cp,
                    bool cp_only, const std::string& profile) {
  const comm::Group& world = comm::Group::world();
  device = model::rank_device(device, world.local_rank(), world.size());  // --device cuda: a GPU per rank
  KILN_CHECK(world.size() == cp, "bench train: --cp ", cp, " runs under mpirun -np ", cp, " (one rank per cp rank; got ",
             world.size(), " ranks)");
  KILN_CHECK(seqs >= 1 && tokens % seqs == 0 && tokens / seqs >= 2 * cp, "bench train: --tokens ", tokens,
             " must split into --seqs ", seqs, " equal sequences of at least 2 x cp = ", 2 * cp, " tokens");
  model::ModelConfig cfg = model::ModelConfig::from_yaml_file(config);
  const int64_t len = tokens / seqs;
  cfg.max_position_embeddings = std::max(cfg.max_position_embeddings, len);  // the bench's sequences
  const auto dtype = device.is_cuda() ? at::kBFloat16 : at::kFloat;
  model::Muse m = device.is_cuda() ? model::Muse::init_on_device(cfg, 0, dtype, device)
                                   : model::Muse::init(cfg, 0, dtype, device);
  m.set_requires_grad(true);
  std::vector<at::Tensor> params;
  for (auto& [n, p] : m.named_parameters()) params.push_back(p);
  model::ForwardOptions base;
  base.kernel_path = device.is_cuda() ? model::KernelPath::kFused : model::KernelPath::kComposed;
  at::manual_seed(0);  // the same batch on every rank
  model::ForwardOptions whole_opt = base, ideal_opt = base;
  const model::PackedBatch whole = random_batch(cfg, seqs, len, device, whole_opt);
  const model::PackedBatch ideal = random_batch(cfg, seqs, len / cp, device, ideal_opt);
  auto loss_step = [&](const model::PackedBatch& b, const model::ForwardOptions& o) {
    for (at::Tensor& p : params) p.mutable_grad() = at::Tensor();
    (-m.forward(b, o).logprobs.sum() / double(tokens)).backward();
  };
  parallel::ContextParallel split(world, whole.cu_seqlens, cfg, device);
  model::ForwardOptions cp_opt = split.options(base);
  cp_opt.targets = split.local_rows(whole_opt.targets);
  const model::PackedBatch local = split.local_batch(whole.tokens);
  double reduce_seconds = 0;
  auto cp_step = [&] {
    loss_step(local, cp_opt);
    sync(device);
    const auto t0 = std::chrono::steady_clock::now();
    parallel::all_reduce_grads(world, params);
    sync(device);
    reduce_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  if (world.rank() == 0)
    fmt::print("train step under cp {}: {} in {} on {}, {} sequence(s) x {} tokens; forward + backward of the "
               "log-prob loss and the gradient all-reduce (optimizer excluded); {} per rank\n",
               cp, cfg.name, at::toString(dtype), device.str(), seqs, len, fmt::format("{} tokens", split.split().num_tokens(world.rank())));
  // A small step first: what any step touches once is not timed.
  {
    model::ForwardOptions o = base;
    const model::PackedBatch warm = random_batch(cfg, 1, 2 * cp, device, o);
    loss_step(warm, o);
  }
  Step i, w;
  const bool baselines = !cp_only;
  if (world.rank() == 0 && baselines) i = measure(device, [&] { loss_step(ideal, ideal_opt); });  // the others wait
  world.barrier();
  const Step c = measure(device, cp_step);
  const double cp_seconds = world.all_reduce(c.seconds, comm::ReduceOp::kMax);
  const double cp_peak = world.all_reduce(c.peak, comm::ReduceOp::kMax);
  split.set_timed(true);  // the exchanges' share, timed apart (timing serialises them)
  reduce_seconds = 0;
  cp_step();
  const double exchange = world.all_reduce(split.exchanged().seconds, comm::ReduceOp::kMax);
  const double reduce = world.all_reduce(reduce_seconds, comm::ReduceOp::kMax);
  split.set_timed(false);
  if (world.rank() == 0 && baselines) w = measure(device, [&] { loss_step(whole, whole_opt); });
  world.barrier();
  if (!profile.empty()) {  // every rank steps (the gathers need them all); rank 0's trace is kept
    profile_to(world.rank() == 0 ? profile : profile + ".rank" + std::to_string(world.rank()), device, cp_step);
    if (world.rank() == 0) fmt::print("profile of one cp step (rank 0): {}\n", profile);
  }
  if (world.rank() != 0) return;
  if (!baselines) {  // what a memory limit on the cp ranks alone shows
    fmt::print("cp {}: {:.1f} ms a step, {:.0f} tok/s; exchange {:.1f} ms, gradient all-reduce {:.1f} ms; peak resident "
               "set of rank 0's process {:.2f} GiB (no one-rank baseline: --cp-only)\n",
               cp, cp_seconds * 1e3, double(tokens) / cp_seconds, exchange * 1e3, reduce * 1e3,
               peak_rss_bytes() / double(1ll << 30));
    return;
  }
  const auto gib = [](double b) { return b / double(1ll << 30); };
  const auto peak = [&](double b) { return device.is_cuda() ? fmt::format("{:.3f}", gib(b)) : std::string(); };
  fmt::print("{:>38} {:>10} {:>10} {:>14}\n", "path", "ms/step", "tok/s", device.is_cuda() ? "peak GiB" : "");
  fmt::print("{:>38} {:>10.1f} {:>10.0f} {:>14}\n", "one rank, the whole batch", w.seconds * 1e3,
             double(tokens) / w.seconds, peak(w.peak));
  fmt::print("{:>38} {:>10.1f} {:>10.0f} {:>14}\n", fmt::format("one rank, 1/{} of each sequence", cp),
             i.seconds * 1e3, double(tokens / cp) / i.seconds, peak(i.peak));
  fmt::print("{:>38} {:>10.1f} {:>10.0f} {:>14}\n", fmt::format("cp {}, each rank", cp), cp_seconds * 1e3,
             double(tokens) / cp_seconds, peak(cp_peak));
  fmt::print("cp exchange: {:.1f} ms of a step timed with the device synchronised around each gather ({:.1f}% of the "
             "step), the gradient all-reduce {:.1f} ms ({:.1f}%)\n",
             exchange * 1e3, 100 * exchange / cp_seconds, reduce * 1e3, 100 * reduce / cp_seconds);
  fmt::print("cp {} step / the ideal (one rank on 1/{} of each sequence): {:.2f}x; speedup over one rank: {:.2f}x{}\n",
             cp, cp, cp_seconds / i.seconds, w.seconds / cp_seconds,
             device.is_cuda() ? fmt::format("; peak memory {:.2f}x one rank's", cp_peak / std::max(w.peak, 1.0)) : "");
  fmt::print("peak resident set of rank 0's process: {:.2f} GiB (every run above; on the CPU run the cases apart to "
             "compare their memory)\n", gib(peak_rss_bytes()));
}

}  // namespace kiln::tools
