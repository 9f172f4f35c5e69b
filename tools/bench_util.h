// Timing helpers shared by the `kiln bench` cases: device sync and a median-of-N timer.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

#include "model/muse.h"

namespace kiln::tools {

// Waits for the device's queued work (a no-op on the CPU).
void sync(at::Device device);
// Median seconds per call of `fn` over `iters` calls after `warmup` calls.
double time_it(at::Device device, const std::function<void()>& fn, int warmup = 3, int iters = 20);

// Seconds per call of fn(i) (i = 0..calls-1) from a CUDA graph of `calls` calls, timed with device
// events around 10 back-to-back replays (the host's launch gap is paid once per 10 * calls calls),
// the median of 5 such runs. By host clock, eagerly, off CUDA or if capture fails.
double graphed_per_call(at::Device device, const std::function<void(int)>& fn, int calls = 20);

// Runs `fn` once under the Kineto profiler (CPU ops, and CUDA kernels on a CUDA device) and saves
// a Chrome trace to `path` (tools/profile_summary.py reads it).
void profile_to(const std::string& path, at::Device device, const std::function<void()>& fn);

// Device copy bandwidth (read + write) of a 2 GiB bf16 copy, in bytes per second.
double copy_bandwidth(at::Device device);

// `seqs` random sequences of `len` tokens packed into one batch; opt.targets gets their ids.
model::PackedBatch random_batch(const model::ModelConfig& cfg, int64_t seqs, int64_t len, at::Device device,
                                model::ForwardOptions& opt);

// `kiln bench train --cp N` under mpirun -np N (tools/bench_cp.cpp): the step split over cp ranks
// against one rank's on the whole batch and on 1/N of each sequence; cp_only: the cp step alone
// (what a memory limit on the cp ranks shows); profile: a Chrome trace of one cp step per rank.
void bench_train_cp(at::Device device, const std::string& config, int64_t seqs, int64_t tokens, int64_t cp,
                    bool cp_only, const std::string& profile);
// `kiln bench optim`: the optimizer's placements, CPU AdamW against torch::optim::AdamW, Muon.
void bench_optim(at::Device device, const std::string& config, const std::string& nvme_dir, double chunk_mb);
// `kiln bench rollout`: the RL rollout workload through the engine, BF16 and `quantization`
// (none: BF16 only). Shapes: `prompts` x `samples`, prompts of `len` tokens, `gen` new tokens each.
struct RolloutBenchShape {
  int64_t prompts = 128, samples = 8, len = 256, gen = 1024, max_seqs = 256;
  double kv_gib = 0;  // 0: room for max_seqs whole sequences (no preemption)
  bool bitwise = false;  // also the batch-invariant numerics (rollout.numerics: bitwise)
};
// `profile` (optional): a path prefix for Kineto traces of a few full-batch decode steps per weights.
void bench_rollout(at::Device device, const std::string& config, const RolloutBenchShape& shape,
                   const std::string& quantization, const std::string& profile);
// `kiln bench invariant`: the batch-invariant GEMMs on mma.sync and wgmma against cuBLAS, at a
// model's linears for `tokens` rows (a training step) and for decode steps of 64 and 512 rows.
void bench_invariant(at::Device device, const std::string& config, int64_t tokens);
// `kiln bench attention`: paged decode attention, tensor cores against SIMT (tools/bench_attention.cpp).
void bench_attention(at::Device device);
// `kiln bench nvfp4`: the W4A16 GEMMs (dense, grouped) against BF16 GEMMs and the copy bandwidth.
// only: {M, N, K} of one dense case of the table (for profilers), or empty for all; grouped: tokens
// routed to muse-small's experts, the experts' table alone at those batches.
void bench_nvfp4(at::Device device, const std::vector<int64_t>& only = {}, const std::vector<int64_t>& grouped = {});

}  // namespace kiln::tools
