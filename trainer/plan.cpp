// The memory plan: per-GPU, per-node host and NVMe bytes of a GRPO job from the model's shapes, the
// recipe's choices and a layout, the check against the cluster, and the search over layouts.
#include "trainer/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <utility>

#include "core/error.h"
#include "model/lora.h"
#include "model/nvfp4_model.h"
#include "parallel/context_parallel.h"
#include "trainer/grpo.h"

namespace kiln::trainer {

bool Layout::implemented() const { return tp == 1 && dense != DenseSharding::kTensor; }

std::string Layout::describe() const {
  return fmt::format("dp {} x ep {} x tp {}{}, dense {}", dp, ep, tp, cp > 1 ? fmt::format(", cp {}", cp) : "",
                     dense_sharding_name(dense));
}

PlanJob plan_job(const GrpoConfig& g, const std::string& dtype) {
  PlanJob j;
  j.weight_bytes = dtype == "fp32" || dtype == "float32" ? 4 : dtype == "fp64" || dtype == "float64" ? 8 : 2;
  j.lora = g.lora.has_value();
  j.synchronous = !g.async;
  if (g.lora) {
    j.lora_rank = g.lora->rank;
    j.lora_targets = g.lora->targets;
  }
  j.muon = g.optim.use_muon;
  j.master_weights = g.optim.master_weights;
  j.moment_bytes = g.optim.moments == at::kBFloat16 ? 2 : 4;
  j.state_placement = optimizers::placement_name(g.optim.state);
  j.chunk_bytes = double(g.optim.chunk_bytes);
  j.micro_batch_seqs = g.micro_batch_seqs;
  j.prompts_per_step = g.prompts_per_step;
  j.samples_per_prompt = g.samples_per_prompt;
  j.mini_steps = g.mini_steps;
  // A recipe without a prompt limit is planned for prompts of 256 tokens.
  j.seq_len = g.prompt.max_prompt_tokens.value_or(256) + g.max_tokens;
  j.recompute = g.recompute;
  j.rollout_quantization = rollout::quantization_name(g.engine.quantization);
  j.rollout_sharded = g.parallel.sharded_rollout();
  j.rollout_auto = g.parallel.rollout == parallel::RolloutPlacement::kAuto;
  // What the trainer and the engine refuse on a sharded rollout today (grpo.cpp, EngineConfig).
  j.rollout_shard_allowed = !g.async && !g.environment.enabled();
  j.rollout_split = g.split_placement();
  j.kv_cache_bytes = double(g.engine.kv_cache_bytes);
  return j;
}

namespace {

// The structural count below (every tensor the fused path saves for the backward) over-counts what
// the caching allocator's peak shows. Calibrated against the peaks of muse-small GRPO steps on an
// H200 (tools/gpu_check.sh, section calibrate) with LoRA (no gradient buffers to confound the
// backward's peak) at micro-batches of 2816 and 1408 tokens: the peak grew 1.40 GiB per 1408
// tokens, 1.07 MB per token. Less the saved bf16 logits (131 KB), the embedding (16 KB) and the
// head's bf16 logit gradient (131 KB per token of a 2048-token chunk), that is 108 KB per token and
// layer against 136.7 structural (0.79), and a fixed 0.63 GiB (kBackwardWorkspace) that no token
// count explains.
constexpr double kActivationCalibration = 0.79;
constexpr double kBackwardWorkspace = 0.63 * double(1ll << 30);
constexpr int64_t kLogprobChunk = 2048;  // ForwardOptions::logprob_chunk: the head's rows per GEMM
// The optimizer step's temporaries beyond the gradients (the same calibration runs): device Muon on
// muse-small's largest stack (64 x 1024 x 1024) took 1.01 GiB, 16 bytes a parameter (the fp32
// gradient, momentum update, normalised copy, and Newton-Schulz's iterate and products); the
// streamed placements took 0.16 GiB with 64 MiB chunks, 2.5 chunks.
constexpr double kMuonTempBytes = 16.0;
constexpr double kStreamedTempChunks = 2.5;

struct Parts {
  double experts = 0, dense = 0;          // parameters
  double dense_tp = 0;                    // the dense parameters tensor parallelism splits
  double muon_dense = 0;                  // the dense parameters Muon updates
};

Parts parts_of(const model::ModelConfig& cfg, bool muon) {
  const model::ParamCounts c = model::count_parameters(cfg);
  Parts p;
  p.experts = double(c.experts);
  p.dense = double(c.total() - c.experts);
  p.dense_tp = double(c.attention + c.latent + c.embedding + c.head);
  // The default groups (optimizers/groups.h): Muon for attention, the latent projections and the
  // experts; AdamW for embedding, head, norms and the router.
  p.muon_dense = muon ? double(c.attention + c.latent) : 0;
  return p;
}

double lora_count(const model::ModelConfig& cfg, const PlanJob& job, bool experts) {
  model::LoraConfig lc;
  lc.rank = job.lora_rank;
  lc.targets.clear();
  for (const std::string& t : job.lora_targets) {
    const bool is_expert = t == "gate_proj" || t == "up_proj" || t == "down_proj";
    if (is_expert == experts) lc.targets.push_back(t);
  }
  return lc.targets.empty() ? 0.0 : double(model::lora_parameter_count(cfg, lc));
}

}  // namespace

double layer_activation_bytes_per_token(const model::ModelConfig& c, int64_t tp) {
  const double d = double(c.hidden_size), dl = double(c.latent_size), k = double(c.top_k);
  const double ffn = double(c.expert_ffn_size), q = double(c.q_size()), kv = double(c.kv_size());
  // bf16 values: the norms' inputs and outputs, the residual and the unpooler's output (6 d); q
  // and the attention output, k and v (split over tp ranks by heads); the pooled row and the
  // combined one (2 d_l); per routed slot the dispatched row, the expert's output and its normed
  // copy (3 d_l) and gate, up and their SwiGLU (3 I). fp32: the router's logits and scores (2 E).
  const double values = 6 * d + (2 * q + 2 * kv) / double(tp) + 2 * dl + k * (3 * dl + 3 * ffn);
  return kActivationCalibration * (2 * values + 8.0 * double(c.num_experts));
}

namespace {

// One plan being built by plan_placed: the job, the layout and the sizes the stages share, and the
// stages, each adding one part of the job's memory to the plan.
struct PlanBuilder {
  PlanBuilder(const model::ModelConfig& model, const PlanJob& the_job, const Cluster& the_cluster,
              const Layout& layout)
      : cfg(model), job(the_job), cluster(the_cluster), L(layout), world(the_cluster.world()),
        wb(double(the_job.weight_bytes)) {
    plan.rollout_sharded = job.rollout_sharded;
    plan.layout = L;
    plan.cluster = cluster;
  }

  const model::ModelConfig& cfg;
  const PlanJob& job;
  const Cluster& cluster;
  const Layout& L;
  const int64_t world;
  const double wb;  // bytes per weight
  Plan plan;
  // Set by sizes(), once the layout is known to fit.
  Parts p;
  double ep = 0, tp = 0, W = 0;
  double dense_held = 0;
  // Set by weights(): what trains, the whole model or with LoRA the adapters.
  double trained_experts = 0, trained_dense = 0, trained_muon_dense = 0;
  bool on_gpu = false;  // the optimizer state, set by optimizer_state()

  void gpu(const std::string& what, double b) {
    if (b > 0) plan.gpu.push_back({what, b});
  }
  void host(const std::string& what, double b) {
    if (b > 0) plan.host.push_back({what, b});
  }
  // What the rollout engine holds: on the training GPU, or on a rollout rank of its own.
  void served(const std::string& what, double b) {
    if (b > 0) (job.rollout_split ? plan.rollout_gpu : plan.gpu).push_back({what, b});
  }

  void check_layout();
  void sizes();
  double cp_gather(double micro_seqs, std::string& what) const;
  void weights();
  void optimizer_state();
  void training_peak();
  void rollout_weights();
  void totals();
};

// The layout against the cluster and the model: its GPU count, and the experts and heads it splits.
void PlanBuilder::check_layout() {
  // ep folds into the ranks that cp splits tokens over (a cp group's ranks may hold different
  // experts), so cp is not a factor of dp x ep x tp: it only has to divide the ranks.
  if (L.dp * L.ep * L.tp != world)
    plan.problems.push_back(
        fmt::format("the layout's dp x ep x tp = {} is not the cluster's {} GPUs", L.dp * L.ep * L.tp, world));
  if (L.cp >= 1 && (world / std::max<int64_t>(1, L.tp)) % L.cp != 0)
    plan.problems.push_back(fmt::format("cp {} does not divide the cluster's {} GPUs / tp", L.cp, world));
  if (L.cp < 1)
    plan.problems.push_back(fmt::format("cp {} must be at least 1", L.cp));
  else if (L.cp > 1 && job.seq_len < 2 * L.cp)  // the zigzag split cuts each sequence into 2 cp chunks
    plan.problems.push_back(fmt::format("cp {} cuts each {}-token sequence into {} chunks: it needs sequences of at "
                                        "least 2 x cp = {} tokens",
                                        L.cp, job.seq_len, 2 * L.cp, 2 * L.cp));
  if (cfg.num_experts % L.ep != 0)
    plan.problems.push_back(fmt::format("ep {} does not divide the {} experts", L.ep, cfg.num_experts));
  if (L.tp > cluster.gpus_per_node || cfg.num_kv_heads % L.tp != 0 || cfg.num_q_heads % L.tp != 0)
    plan.problems.push_back(fmt::format("tp {} must divide the {} query and {} key-value heads and fit in a node of {}",
                                        L.tp, cfg.num_q_heads, cfg.num_kv_heads, cluster.gpus_per_node));
  if ((L.tp > 1) != (L.dense == DenseSharding::kTensor))
    plan.problems.push_back("tp > 1 goes with dense sharding tp, and tp 1 with replicated or zero3");
}

void PlanBuilder::sizes() {
  p = parts_of(cfg, job.muon);
  ep = double(L.ep);
  tp = double(L.tp);
  W = double(world);
  // The share of the dense part one rank holds: whole, its tp slice (the router and norms stay
  // whole), or 1/world under ZeRO-3.
  dense_held = L.dense == DenseSharding::kZero3  ? p.dense / W
               : L.dense == DenseSharding::kTensor ? p.dense_tp / tp + (p.dense - p.dense_tp)
                                                   : p.dense;
}

void PlanBuilder::weights() {
  // Trained model: weights, gradients.
  gpu("expert weights (1/ep of every layer's experts)", p.experts / ep * wb);
  gpu(fmt::format("dense weights ({})", dense_sharding_name(L.dense)), dense_held * wb);
  if (L.dense == DenseSharding::kZero3)
    gpu("two layers' dense weights gathered (ZeRO-3 prefetch)", 2 * p.dense / double(cfg.num_layers) * wb);
  trained_experts = p.experts;
  trained_dense = p.dense;
  trained_muon_dense = p.muon_dense;
  if (job.lora) {
    trained_experts = lora_count(cfg, job, true);
    trained_dense = lora_count(cfg, job, false);
    trained_muon_dense = 0;  // adapters train with AdamW, as PEFT trains them (optimizers/groups.cpp)
    gpu("LoRA adapters on the experts (1/ep)", trained_experts / ep * wb);
    gpu("LoRA adapters on the dense part", trained_dense * wb);
  }
  // Gradients are sharded like the weights they belong to.
  gpu(job.lora ? "gradients (adapters)" : "gradients",
      (trained_experts / ep + (job.lora ? trained_dense : dense_held)) * wb);
}

void PlanBuilder::optimizer_state() {
  // Optimizer state: ZeRO-1 splits every tensor's state over the ranks holding a copy of it, so
  // each rank keeps 1/world of it. Masters for low-precision weights, then the moments.
  const double trained = trained_experts + trained_dense;
  const double master = job.master_weights && job.weight_bytes < 4 ? 4.0 * trained : 0.0;
  const double muon_params = (job.muon && !job.lora ? trained_experts : 0.0) + trained_muon_dense;
  const double moments = double(job.moment_bytes) * (muon_params + 2.0 * (trained - muon_params));
  const double state = (master + moments) / W;
  on_gpu = job.state_placement == "device";
  if (on_gpu) {
    gpu("optimizer state (ZeRO-1: masters and moments, 1/world)", state);
  } else {
    if (job.state_placement != "cpu_update") gpu("optimizer chunk buffers (2, streamed)", 2 * job.chunk_bytes);
    if (job.state_placement == "nvme") {
      plan.nvme.push_back({"optimizer state of the node's ranks", state * double(cluster.gpus_per_node)});
      host("optimizer staging buffers (2 per rank, pinned)", 2 * job.chunk_bytes * double(cluster.gpus_per_node));
    } else {
      host("optimizer state of the node's ranks (pinned)", state * double(cluster.gpus_per_node));
    }
  }
}

void PlanBuilder::training_peak() {
  // The training step's peak beyond what stays: the backward's (activations, and the gradients as
  // they fill) or the optimizer step's (the gradients and its temporaries), whichever is higher.
  // A micro-batch holds at most what one data shard (the ranks of a cp group) trains in one
  // mini-step. The trainer gives each shard a contiguous block of the step's prompts and each
  // mini-step a contiguous range of its sequences, so a shard trains at most the smaller of its
  // block and a mini-step's range.
  const int64_t shards = std::max<int64_t>(1, world / L.cp);
  const int64_t seqs = job.prompts_per_step * job.samples_per_prompt;
  const int64_t per_rank =
      job.prompts_per_step > 0
          ? std::max<int64_t>(1, std::min((job.prompts_per_step + shards - 1) / shards * job.samples_per_prompt,
                                          (seqs + job.mini_steps - 1) / std::max<int64_t>(1, job.mini_steps)))
          : job.micro_batch_seqs;
  const int64_t micro_seqs = std::min(job.micro_batch_seqs, per_rank);
  const bool accumulates = job.prompts_per_step <= 0 || per_rank > job.micro_batch_seqs;
  const double tokens = double(micro_seqs) * double(job.seq_len);
  // Everything per token stays on the rank that holds the token: under cp a rank holds its share of
  // the micro-batch (the zigzag split's shares differ by at most one token).
  const double local = std::ceil(tokens / double(L.cp));
  const double layer = layer_activation_bytes_per_token(cfg, L.tp);
  const double logits = 2.0 * double(cfg.vocab_size) / tp;  // bf16, saved by kernels::token_logprobs
  // Every layer's activations and the head's; the logit gradient of one chunk; the fixed workspace.
  const double head = local * (logits + 8.0 * double(cfg.hidden_size)) +
                      std::min(local, double(kLogprobChunk)) * logits + kBackwardWorkspace;
  const double stored = local * double(cfg.num_layers) * layer + head;
  // Recomputed: every layer's input and one layer's activations.
  const double recomputed = local * (double(cfg.num_layers) * double(cfg.hidden_size) * wb + layer) + head;
  const double acts = job.recompute ? recomputed : stored;
  const double grads = (trained_experts / ep + (job.lora ? trained_dense : dense_held)) * wb;
  // With one micro-batch the gradients fill as the layers' activations free; with more, the later
  // backwards run beside all of them. The one-micro-batch floor, the activations over the layers,
  // is the measured fit (planned 0.44 GiB over the gradients, measured 0.47: the fixed workspace
  // and the head's tensors are gone by the backward's end).
  const double backward = accumulates ? acts : std::max(acts - grads, acts / double(cfg.num_layers));
  const double biggest_muon = std::max({double(cfg.num_experts) / ep * double(cfg.expert_ffn_size) * double(cfg.latent_size),
                                        double(cfg.q_size()) * double(cfg.hidden_size) / tp,
                                        double(cfg.latent_size) * double(cfg.hidden_size) / tp});
  const double optimizer = !on_gpu ? (job.state_placement == "cpu_update" ? 0.0 : kStreamedTempChunks * job.chunk_bytes)
                           : job.muon && !job.lora ? kMuonTempBytes * biggest_muon
                                                   : 0.0;
  std::string gather_what;
  const double gather = cp_gather(double(micro_seqs), gather_what);
  plan.activations = backward + gather;
  const std::string recompute_note =
      job.recompute ? "layers recomputed" : fmt::format("recompute: {}", format_bytes(recomputed));
  const std::string cp_note = L.cp > 1 ? fmt::format(", cp {}: {} per rank", L.cp, int64_t(local)) : "";
  if (plan.activations >= optimizer) {
    gpu(fmt::format("activations at the backward's peak, micro-batches of {} tokens{}{} ({}; {} in all)",
                    int64_t(tokens), cp_note, accumulates ? "" : ", beside the gradients as they fill", recompute_note,
                    format_bytes(acts)),
        backward);
    gpu(gather_what, gather);
  } else {
    gpu(fmt::format("the optimizer step's temporaries (the training peak; activations {}, {})",
                    format_bytes(plan.activations), recompute_note),
        optimizer);
  }
}

// Context parallelism's keys and values beyond the per-token activations (none at cp 1). A full
// layer all-gathers the whole micro-batch's keys and values; a window layer only the halo, the last
// min(W - 1, length) rows of every piece that does not end its sequence (parallel/context_parallel.h).
// With recompute a layer's gather lives while the layer runs, in the forward and again in the
// backward, where the gradient of the gathered rows (as large) goes back to their owners: one full
// layer's gather twice, the largest of any layer (a halo is never more than the whole micro-batch).
// Without recompute the attention keeps every layer's gather for the backward, and the layer being
// differentiated adds its gradient.
double PlanBuilder::cp_gather(double micro_seqs, std::string& what) const {
  if (L.cp == 1) return 0;
  const double tokens = micro_seqs * double(job.seq_len);
  const double row = 2.0 * double(cfg.kv_size()) / tp * wb;  // one token's key and value
  if (job.recompute) {
    what = "cp K/V gather (one full layer: the whole micro-batch's keys and values, and their gradient)";
    return 2 * tokens * row;
  }
  // One window layer's halo rows: the split of a micro-batch of seq_len-long sequences.
  std::vector<int64_t> cu_seqlens(size_t(micro_seqs) + 1, 0);
  for (size_t i = 1; i < cu_seqlens.size(); ++i) cu_seqlens[i] = cu_seqlens[i - 1] + job.seq_len;
  const parallel::ContextSplit split(std::move(cu_seqlens), int(L.cp));
  const int64_t halo = std::max<int64_t>(cfg.sliding_window - 1, 0);
  int64_t halo_rows = 0;
  for (int r = 0; r < split.ranks(); ++r)
    for (const parallel::ContextPiece& c : split.pieces(r))
      if (!c.last) halo_rows += std::min(halo, c.length);
  const int64_t full = cfg.num_full_layers(), window = cfg.num_window_layers();
  what = fmt::format("cp K/V gathers kept for the backward ({} full layers' whole micro-batch, {} window layers' "
                     "halos of {} rows, one layer's gradient)",
                     full, window, halo_rows);
  return (double(full) * tokens + double(window) * double(halo_rows) + tokens) * row;
}

void PlanBuilder::rollout_weights() {
  // The rollout engine's weights: its own copy of what it serves (rollout::Engine clones the model,
  // so that an async step never changes a batch's weights under it), except where it shares them.
  // A sharded engine serves 1/ep of the experts (and the tp slice of the dense part); a replica all
  // of them.
  const double dense_served = p.dense_tp / tp + (p.dense - p.dense_tp);
  const double expert_served = job.rollout_sharded ? 1.0 / ep : 1.0;
  const char* where = job.rollout_sharded ? "shard" : "replica";
  if (job.rollout_split && job.lora)  // the frozen base the engine shares, and the engine's adapters
    served("the frozen base and its LoRA adapters", (p.experts + p.dense + trained_experts + trained_dense) * wb);
  if (job.rollout_quantization != "none") {
    // NVFP4 codes and scales for the quantised linears, BF16 copies of the rest (the router FP32,
    // counted at BF16 here: a million parameters per layer at most).
    const model::Nvfp4Footprint nv = model::nvfp4_footprint(cfg, job.rollout_quantization == "nvfp4");
    const double kept_bytes = double(nv.kept_params) * wb, quantized_bytes = double(nv.bytes) - kept_bytes;
    // The quantised experts (those of bf16_expert_layers stay BF16) as a share of the quantised
    // parameters; the rest are the dense linears.
    const double n_bf16 = double(cfg.bf16_expert_layers.size()), n_layers = double(cfg.num_layers);
    const double q_experts = p.experts * (n_layers - n_bf16) / n_layers, kept_experts = p.experts - q_experts;
    const double expert_share = std::min(1.0, q_experts / std::max(1.0, double(nv.quantized_params)));
    const double quantized = quantized_bytes * (expert_share * expert_served + (1 - expert_share) / tp);
    const double kept = kept_experts * expert_served * wb + (kept_bytes - kept_experts * wb);
    served(fmt::format("rollout {} weights ({}): codes and scales", job.rollout_quantization, where), quantized);
    served(fmt::format("rollout weights kept at their width ({}: embedding, head, norms, router)", where), kept);
  } else if (!((job.lora || (job.synchronous && !job.rollout_split)) && L.ep == 1 &&
                 L.dense == DenseSharding::kReplicated)) {
    // (A replica at ep 1 serves the trainer's own tensors, EngineConfig::share_weights: LoRA's
    // frozen base, and a synchronous full-parameter job's weights.)
    served(fmt::format("rollout weights (bf16 {})", where), (p.experts * expert_served + dense_served) * wb);
  } else if (job.lora && !job.rollout_split) {  // the engine's own copy of the adapters
    served("rollout LoRA adapters (the engine's copy)", (trained_experts + trained_dense) * wb);
  }
}

// The totals, and the checks against the cluster: the training GPU, the KV cache, host memory, NVMe.
void PlanBuilder::totals() {
  for (const PlanItem& i : plan.gpu) plan.gpu_used += i.bytes;
  for (const PlanItem& i : plan.host) plan.host_used += i.bytes;
  for (const PlanItem& i : plan.nvme) plan.nvme_used += i.bytes;
  for (const PlanItem& i : plan.rollout_gpu) plan.rollout_gpu_used += i.bytes;
  if (job.rollout_split && plan.gpu_used + cluster.reserve_bytes > cluster.gpu_bytes)
    plan.problems.push_back(fmt::format("training GPU: needs {} + {} reserve, has {} (short by {})",
                                        format_bytes(plan.gpu_used), format_bytes(cluster.reserve_bytes),
                                        format_bytes(cluster.gpu_bytes),
                                        format_bytes(plan.gpu_used + cluster.reserve_bytes - cluster.gpu_bytes)));
  // The KV cache takes what is left where the engine is.
  plan.kv_left = cluster.gpu_bytes - cluster.reserve_bytes - (job.rollout_split ? plan.rollout_gpu_used : plan.gpu_used);
  const double kv_token = model::kv_cache_bytes_per_token(cfg, std::max<int64_t>(1, job.seq_len)) /
                          (cfg.num_kv_heads % L.tp == 0 ? tp : 1.0);
  plan.kv_tokens = plan.kv_left > 0 ? int64_t(plan.kv_left / kv_token) : 0;
  if (plan.kv_left < job.kv_cache_bytes)
    plan.problems.push_back(fmt::format(
        "{}: needs {} + the KV cache's {} + {} reserve, has {} (short by {})",
        job.rollout_split ? "rollout rank's GPU" : "GPU", format_bytes(job.rollout_split ? plan.rollout_gpu_used : plan.gpu_used),
        format_bytes(job.kv_cache_bytes), format_bytes(cluster.reserve_bytes), format_bytes(cluster.gpu_bytes),
        format_bytes(job.kv_cache_bytes - plan.kv_left)));
  if (plan.host_used > cluster.host_bytes)
    plan.problems.push_back(fmt::format("host memory: needs {} per node, has {} (short by {})",
                                        format_bytes(plan.host_used), format_bytes(cluster.host_bytes),
                                        format_bytes(plan.host_used - cluster.host_bytes)));
  if (plan.nvme_used > cluster.nvme_bytes)
    plan.problems.push_back(fmt::format("NVMe: needs {} per node, has {} (short by {})", format_bytes(plan.nvme_used),
                                        format_bytes(cluster.nvme_bytes),
                                        format_bytes(plan.nvme_used - cluster.nvme_bytes)));
}

// The plan with the rollout placed as job.rollout_sharded says.
Plan plan_placed(const model::ModelConfig& cfg, const PlanJob& job, const Cluster& cluster, const Layout& L) {
  PlanBuilder b(cfg, job, cluster, L);
  b.check_layout();
  if (!b.plan.problems.empty()) return std::move(b.plan);
  b.sizes();
  b.weights();
  b.optimizer_state();
  b.training_peak();
  b.rollout_weights();
  b.totals();
  return std::move(b.plan);
}

}  // namespace

Plan make_plan(const model::ModelConfig& cfg, const PlanJob& job, const Cluster& cluster, const Layout& L) {
  if (!job.rollout_auto) return plan_placed(cfg, job, cluster, L);
  PlanJob placed = job;
  placed.rollout_sharded = false;
  Plan replica = plan_placed(cfg, placed, cluster, L);
  if (replica.fits() || L.ep == 1 || !job.rollout_shard_allowed) {
    replica.rollout_choice = replica.fits()  ? "auto: a replica fits"
                             : L.ep == 1     ? "auto: a replica (ep 1 has no expert shards)"
                                             : "auto: a replica (async rollouts and environments need one)";
    return replica;
  }
  placed.rollout_sharded = true;
  Plan shard = plan_placed(cfg, placed, cluster, L);
  if (!shard.fits()) {
    replica.rollout_choice = "auto: a replica; the expert-sharded rollout does not fit either";
    return replica;
  }
  shard.rollout_choice = fmt::format("auto: sharded, since a replica does not fit ({} of {} per GPU)",
                                     format_bytes(replica.gpu_used), format_bytes(cluster.gpu_bytes));
  return shard;
}

std::string Plan::report() const {
  std::string s = fmt::format("layout: {} on {} node(s) x {} GPUs{}\n", layout.describe(), cluster.nodes,
                              cluster.gpus_per_node, layout.implemented() ? "" : " (not implemented yet)");
  if (!rollout_choice.empty()) s += fmt::format("rollout: {}\n", rollout_choice);
  auto table = [&](const char* title, const std::vector<PlanItem>& items, double used, double cap) {
    if (items.empty()) return;
    s += fmt::format("{}\n", title);
    for (const PlanItem& i : items) s += fmt::format("  {:>12}  {}\n", format_bytes(i.bytes), i.what);
    s += fmt::format("  {:>12}  total, of {}\n", format_bytes(used), format_bytes(cap));
  };
  table("per GPU", gpu, gpu_used, cluster.gpu_bytes);
  table("per rollout rank (grpo.async.placement split), one more GPU per training GPU", rollout_gpu, rollout_gpu_used,
        cluster.gpu_bytes);
  if (!gpu.empty())
    s += fmt::format("  {:>12}  left for the KV cache after a {} reserve: {} tokens\n", format_bytes(kv_left),
                     format_bytes(cluster.reserve_bytes), kv_tokens);
  table("per node, host memory", host, host_used, cluster.host_bytes);
  table("per node, NVMe", nvme, nvme_used, cluster.nvme_bytes);
  if (fits()) {
    s += "fits\n";
  } else {
    s += "does not fit:\n";
    for (const std::string& p : problems) s += "  " + p + "\n";
  }
  return s;
}

std::vector<Plan> search_layouts(const model::ModelConfig& cfg, const PlanJob& job, const Cluster& cluster) {
  std::vector<Plan> plans;
  const int64_t world = cluster.world();
  for (int64_t ep = 1; ep <= std::min(world, cfg.num_experts); ++ep) {
    if (cfg.num_experts % ep != 0 || world % ep != 0) continue;
    for (int64_t tp = 1; tp <= cluster.gpus_per_node; tp *= 2) {
      if ((world / ep) % tp != 0) continue;
      // cp ranks need at least 2 tokens of every sequence (the zigzag split's 2 cp chunks).
      for (int64_t cp = 1; cp <= world / tp && (cp == 1 || job.seq_len >= 2 * cp); cp *= 2) {
        if ((world / tp) % cp != 0) continue;
        for (DenseSharding d : {DenseSharding::kReplicated, DenseSharding::kZero3, DenseSharding::kTensor}) {
          if ((tp > 1) != (d == DenseSharding::kTensor)) continue;
          // The split placement sends whole weights from each trainer: ep 1, the dense part replicated.
          if (job.rollout_split && (ep > 1 || d != DenseSharding::kReplicated)) continue;
          Plan p = make_plan(cfg, job, cluster, {world / ep / tp, ep, tp, d, cp});
          if (p.problems.empty() || p.gpu_used > 0) plans.push_back(std::move(p));
        }
      }
    }
  }
  std::stable_sort(plans.begin(), plans.end(), [](const Plan& a, const Plan& b) {
    if (a.fits() != b.fits()) return a.fits();
    if (a.layout.implemented() != b.layout.implemented()) return a.layout.implemented();
    if (a.fits() && a.layout.cp != b.layout.cp) return a.layout.cp < b.layout.cp;
    return a.kv_left > b.kv_left;
  });
  return plans;
}

double parse_bytes(const std::string& text, const std::string& what) {
  size_t i = 0;
  double v = 0;
  try {
    v = std::stod(text, &i);
  } catch (const std::exception&) {
    KILN_FAIL(what, ": '", text, "' is not a size; expected a number with a unit such as 141GiB, 2TB or 512MiB");
  }
  std::string unit;
  for (; i < text.size(); ++i)
    if (!std::isspace(static_cast<unsigned char>(text[i]))) unit += char(std::tolower(static_cast<unsigned char>(text[i])));
  const std::pair<const char*, double> units[] = {{"", 1},           {"b", 1},
                                                  {"kb", 1e3},       {"mb", 1e6},
                                                  {"gb", 1e9},       {"tb", 1e12},
                                                  {"kib", 1024.0},   {"mib", 1048576.0},
                                                  {"gib", 1073741824.0}, {"tib", 1099511627776.0}};
  for (const auto& [name, scale] : units)
    if (unit == name) {
      KILN_CHECK(std::isfinite(v) && v >= 0, what, ": '", text, "' must be a non-negative size");
      return v * scale;
    }
  KILN_FAIL(what, ": unknown unit '", unit, "' in '", text, "'; expected B, KB, MB, GB, TB, KiB, MiB, GiB or TiB");
}

std::string format_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  const bool neg = b < 0;
  b = std::fabs(b);
  while (b >= 1024 && u < 5) b /= 1024, ++u;
  return fmt::format("{}{:.2f} {}", neg ? "-" : "", b, units[u]);
}

}  // namespace kiln::trainer
