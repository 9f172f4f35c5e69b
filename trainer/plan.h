// The memory plan of a GRPO job (issue 21): what each GPU, each node's host memory and its NVMe
// hold for a model, a recipe and a cluster under a dp x ep x tp layout, cp folded over it, with the dense part
// replicated or sharded. `kiln plan` prints it and searches layouts; `kiln train` checks its own.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "parallel/parallel.h"
#include "model/config.h"

namespace kiln::trainer {

struct GrpoConfig;

struct Cluster {
  int64_t nodes = 1, gpus_per_node = 8;
  double gpu_bytes = 140.0 * (1ll << 30);   // per GPU (an H200 shows 143,771 MiB)
  double reserve_bytes = 6.0 * (1ll << 30); // per GPU: CUDA context, cuBLAS/NCCL workspaces, fragmentation
  double host_bytes = 2.0 * (1ll << 40);    // per node
  double nvme_bytes = 0;                    // per node; 0: none
  int64_t world() const { return nodes * gpus_per_node; }
};

// The dense part's sharding is the parallel layout's (parallel/parallel.h).
using parallel::DenseSharding;
using parallel::dense_sharding_name;
using parallel::parse_dense_sharding;

// dp x ep x tp is the world. ep ranks are data ranks too (each trains its own prompts), and cp
// consecutive ranks (parallel/context_parallel.h) share their micro-batches, split by tokens: the
// data shards are world / cp. cp folds over the ranks that dp and ep lay out (it divides the world
// / tp, and a cp group's ranks may hold different experts), so a rank's experts are 1/ep of them
// while its tokens are 1/cp of a micro-batch. ZeRO-1 state and ZeRO-3 shards spread over every
// rank. cp comes last so that {dp, ep, tp, dense} still reads as before.
struct Layout {
  int64_t dp = 1, ep = 1, tp = 1;
  DenseSharding dense = DenseSharding::kReplicated;
  int64_t cp = 1;
  // What kiln trains: tp 1 with the dense part replicated (ZeRO-1 state) or under ZeRO-3, any ep
  // and any cp.
  bool implemented() const;
  std::string describe() const;  // names cp only where it is above 1
};

// What the recipe decides about memory, read from its GRPO section (or set by hand in tests).
struct PlanJob {
  int64_t weight_bytes = 2;          // per parameter: 2 for bf16, 4 for fp32
  bool lora = false;
  bool synchronous = true;            // no grpo.async: a replica engine serves the trained tensors themselves
  int64_t lora_rank = 0;
  std::vector<std::string> lora_targets;
  bool muon = true;
  bool master_weights = true;
  int64_t moment_bytes = 4;          // fp32 or bf16 moments
  std::string state_placement = "device";  // device | cpu | cpu_update | nvme
  double chunk_bytes = 64.0 * (1 << 20);
  int64_t micro_batch_seqs = 64;
  int64_t prompts_per_step = 0;      // over every rank; 0: unknown (micro-batches accumulate)
  int64_t samples_per_prompt = 1;
  int64_t mini_steps = 1;            // optimizer steps per GRPO step
  int64_t seq_len = 1024;            // prompt + response tokens of one sequence
  bool recompute = false;
  std::string rollout_quantization = "none";  // none | nvfp4 | w4a4
  bool rollout_sharded = false;      // each rank serves its expert shard (else a full replica)
  // parallel.rollout: auto: make_plan takes the replica where it fits, else the shard where that
  // fits and the recipe allows it (rollout_shard_allowed: no async, no environment).
  bool rollout_auto = false;
  bool rollout_shard_allowed = true;
  // grpo.async.placement split: the engine and its KV cache live on rollout ranks of their own (one
  // per training GPU); with LoRA the engine there shares a frozen base of its own.
  bool rollout_split = false;
  double kv_cache_bytes = 64.0 * (1 << 20);
};
// seq_len: the recipe's prompt limit (256 without one) plus its max_tokens.
PlanJob plan_job(const GrpoConfig& g, const std::string& dtype);

struct PlanItem {
  std::string what;
  double bytes = 0;
};

struct Plan {
  Layout layout;
  Cluster cluster;
  std::vector<PlanItem> gpu, host, nvme;  // per GPU; per node
  std::vector<PlanItem> rollout_gpu;      // per rollout rank under job.rollout_split (then not in gpu)
  double gpu_used = 0, host_used = 0, nvme_used = 0, rollout_gpu_used = 0;
  double activations = 0;                 // per GPU at the backward's peak, cp's key-value gathers included
  double kv_left = 0;                     // per GPU (per rollout rank when split) after everything else and the reserve
  int64_t kv_tokens = 0;                  // tokens of seq_len-long sequences the left-over holds
  std::vector<std::string> problems;      // empty: it fits
  bool rollout_sharded = false;           // the rollout planned: each rank's expert shard, or a replica
  std::string rollout_choice;             // under parallel.rollout: auto, why this placement
  bool fits() const { return problems.empty(); }
  std::string report() const;             // the tables and the verdict
};

// Activation bytes per token kept for the backward by one layer (the fused CUDA path) on one of tp
// ranks, from the layer's shapes: calibrated on the H200 against muse-small GRPO steps (see plan.cpp).
double layer_activation_bytes_per_token(const model::ModelConfig& cfg, int64_t tp = 1);

// Under job.rollout_auto the plan of the placement it picks (Plan::rollout_choice says why).
Plan make_plan(const model::ModelConfig& cfg, const PlanJob& job, const Cluster& cluster, const Layout& layout);

// Every layout of the cluster's world (ep dividing the experts, tp a power of two within a node
// dividing the heads, cp a power of two that leaves every rank at least 2 tokens of a sequence,
// each dense sharding; under job.rollout_split only those the split trains: ep 1, dense
// replicated), best first: fitting before not, implemented before not; among those that fit the
// smaller cp first (cp gathers keys and values in every full layer's forward and backward, so it
// is taken only as far as memory needs it); then the most memory left per GPU.
std::vector<Plan> search_layouts(const model::ModelConfig& cfg, const PlanJob& job, const Cluster& cluster);

// "141GiB", "2 TB", "512MiB", "0": bytes. Throws naming `what` on anything else.
double parse_bytes(const std::string& text, const std::string& what);
std::string format_bytes(double bytes);

}  // namespace kiln::trainer
