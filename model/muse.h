// The Muse latent-MoE model (docs/MODEL.md §1), written once for trainer and rollout: weights, the
// packed variable-length forward, log-probs of targets, routing capture and routing replay.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/nvfp4.h"
#include "model/config.h"

namespace kiln::comm {
class Group;
}

namespace kiln::model {

struct LayerWeights {
  at::Tensor input_norm;      // [d]
  at::Tensor q_proj;          // [num_q_heads * head_dim, d]
  at::Tensor k_proj;          // [num_kv_heads * head_dim, d]
  at::Tensor v_proj;          // [num_kv_heads * head_dim, d]
  at::Tensor o_proj;          // [d, num_q_heads * head_dim]
  at::Tensor post_attn_norm;  // [d]
  at::Tensor pre_moe_norm;    // [d]
  at::Tensor router;          // [E, d] fp32 (fp64 in fp64 runs)
  at::Tensor router_bias;     // [E] fp32, sigmoid routers only: biases selection, not weights
  at::Tensor pooler;          // [d_l, d]
  at::Tensor expert_gate;     // [E, I, d_l]
  at::Tensor expert_up;       // [E, I, d_l]
  at::Tensor expert_down;     // [E, d_l, I]
  at::Tensor expert_norm;     // [E, d_l]
  at::Tensor unpooler;        // [d, d_l]
  at::Tensor post_moe_norm;   // [d]
  // NVFP4 copies of the quantisable linears (docs/MODEL.md §4), from an NVFP4 checkpoint or
  // model::quantize_model (model/nvfp4_model.h). A linear whose dense weight above is undefined runs
  // from here (the rollout engine's NVFP4 serving). Experts are stacked [E, ...]; they stay
  // undefined in the config's bf16_expert_layers. w4a4: they also quantise their activations
  // (Blackwell numerics, emulated); otherwise W4A16.
  struct Nvfp4 {
    kernels::Nvfp4Tensor q_proj, k_proj, v_proj, o_proj, pooler, unpooler, expert_gate, expert_up, expert_down;
    bool w4a4 = false;
  } nvfp4;
  // LoRA adapters (model/lora.h), undefined when absent: A [r, in] and B [out, r] per linear,
  // [E, r, in] and [E, out, r] for the experts; the forward adds scale * B (A x) unless
  // ForwardOptions::disable_lora.
  struct Lora {
    at::Tensor q_a, q_b, k_a, k_b, v_a, v_b, o_a, o_b, pool_a, pool_b, unpool_a, unpool_b;
    at::Tensor gate_a, gate_b, up_a, up_b, down_a, down_b;
    double scale = 0;  // alpha / r
    bool on_experts() const { return gate_a.defined() || up_a.defined() || down_a.defined(); }
    // Expert adapters run as torch grouped GEMMs on CUDA bf16 (no host sync, so CUDA graphs can
    // capture them): torch >= 2.8 and a rank whose rows are 16-byte aligned (a multiple of 8).
    bool experts_grouped() const;
  } lora;
};

struct Weights {
  at::Tensor embed;           // [V, d]
  std::vector<LayerWeights> layers;
  at::Tensor final_norm;      // [d]
  at::Tensor lm_head;         // [V, d]
};

// Many sequences packed into one token dimension.
struct PackedBatch {
  at::Tensor tokens;          // [T] int64, on the model's device
  std::vector<int64_t> cu_seqlens;  // [B + 1], cu_seqlens[0] = 0, cu_seqlens[B] = T
  // [B] position of each sequence's first token here; empty means all 0. Non-zero starts need an
  // AttentionBackend that holds the earlier positions (the rollout engine's KV cache).
  std::vector<int64_t> start_positions;
  static PackedBatch from_sequences(const std::vector<std::vector<int64_t>>& seqs, at::Device device);
  int64_t num_tokens() const { return cu_seqlens.back(); }
  int64_t num_sequences() const { return int64_t(cu_seqlens.size()) - 1; }
  int64_t start_position(int64_t s) const { return start_positions.empty() ? 0 : start_positions[s]; }
  at::Tensor positions() const;  // [T] int64: absolute position of each token in its sequence
};

// Where attention finds its keys and values. Without one, each sequence of the batch attends to
// itself (training, scoring). The rollout engine supplies one backed by its paged KV cache.
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  // q [T, Hq, hd], k and v [T, Hkv, hd]: the batch's new tokens, RoPE applied. Returns [T, Hq, hd].
  virtual at::Tensor attend(int64_t layer, bool full, const PackedBatch& batch, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v) = 0;
  // The same before RoPE (cos, sin [T, hd]), which the forward calls: a backend may rotate q and k
  // in the pass that writes its cache. This default rotates them and calls attend.
  virtual at::Tensor attend_unrotated(int64_t layer, bool full, const PackedBatch& batch, const at::Tensor& q,
                                      const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                      const at::Tensor& sin);
};

// Dense weights this rank holds only in part (ZeRO-3: each tensor whole on one owner rank,
// parallel/zero3.h). The forward asks for a layer's full weights just before it runs the layer, and
// again when it recomputes the layer in the backward; the tensors outside the layers (embedding,
// final norm, head) are gathered where they are read. Applied from outside the model: the model
// only calls these.
class WeightGather {
 public:
  virtual ~WeightGather() = default;
  // Layer i's full weights from this rank's `own` (whose sharded tensors may be placeholders).
  // Under a gradient, each trained tensor it gathers is a fresh leaf (requires_grad) that the
  // layer's backward fills; finish_layer then hands those gradients to their owners.
  virtual LayerWeights gather_layer(int64_t i, const LayerWeights& own) const = 0;
  virtual void finish_layer(int64_t i, const LayerWeights& gathered, const LayerWeights& own) const = 0;
  // One whole tensor, differentiable: its backward hands the gradient to the owner.
  virtual at::Tensor gather(const at::Tensor& own) const = 0;
};

// Where a layer's routed rows meet their experts, when they are spread over ranks (expert
// parallelism, model/expert_parallel.h's AllToAllDispatcher). Applied from outside the model like
// WeightGather: the MoE runs the experts this rank holds on whatever rows dispatch() hands it, and
// combine() takes their outputs back. Both are differentiable, and every rank of the dispatcher's
// group calls them for every layer.
class ExpertDispatcher {
 public:
  struct Routed {
    at::Tensor rows;                     // [n, d_l]: the rows this rank's experts run
    at::Tensor ids;                      // [n] int64: the local expert of each row, or with `spare`
                                         // the number of local experts for a row that carries no slot
                                         // (padding: it runs through no expert; its output is zero)
    bool spare = false;
    int64_t live_rows = 0;               // with `spare`: the rows expected to carry a slot (this rank's
                                         // own slot count, the group's mean share), for choices that
                                         // depend on the load; 0: every row
    std::vector<int64_t> send, recv;     // rows per rank each way
    at::Tensor order;                    // the slots sorted by the rank that holds their expert
    at::Tensor slot_rows;                // fixed-shape exchanges: each slot's row of the padded send buffer
  };
  virtual ~ExpertDispatcher() = default;
  virtual int64_t ranks() const = 0;
  // The slots `flat` [T * k] (expert ids) of rows z [T, d_l] to the ranks holding their experts,
  // `local` experts per rank.
  virtual Routed dispatch(const at::Tensor& z, const at::Tensor& flat, int64_t k, int64_t local) const = 0;
  // The outputs y [n, d_l] of dispatch()'s rows back to their slots: [T * k, d_l] in slot order.
  virtual at::Tensor combine(const at::Tensor& y, const Routed& routed) const = 0;
};

// Sums a batch's statistics over ranks that each hold part of its tokens (context parallelism,
// parallel/context_parallel.h), so that a batch-level term (the load-balance loss) is the whole
// batch's on every rank. Applied from outside like WeightGather; every rank of the group calls it
// for every layer, in the same order.
class BatchReduce {
 public:
  virtual ~BatchReduce() = default;
  // The sum over the group of t (the same shape on every rank), the same bits on every rank. Its
  // backward passes each rank's gradient to its own t unchanged: every rank computes the same term
  // from the sum, and the caller sums the parameter gradients over the group, which counts it once.
  virtual at::Tensor sum(const at::Tensor& t) const = 0;
};

// How the forward orders its arithmetic (the recipe's rollout.numerics). kBitwise is batch-invariant
// (model/batch_invariant.h): every linear, norm, routing decision, attention query and log-prob is
// computed row by row by calls whose shapes do not depend on the batch (kernels/invariant.h on the
// GPU), so that the trainer and the rollout engine give the same bits for the same tokens. Dense
// weights only; the fused and grouped paths are off.
enum class Numerics { kStandard, kBitwise };
Numerics parse_numerics(const std::string& name);  // "standard" or "bitwise"; else an error naming it
const char* numerics_name(Numerics n);

// Which kernels the forward runs where they apply: CUDA in bf16, outside bitwise numerics (and the
// fused MoE not under expert parallelism or an observer: muse.cpp's fused_moe_applies). Elsewhere
// each path runs the ATen ops. Tests and benches compare the paths; the trainer picks kFused or,
// with grpo.fused_kernels off, kGroupedMm.
enum class KernelPath {
  kFused,      // varlen flash attention, the fused MoE (dispatch, grouped GEMMs with SwiGLU,
               // per-expert norm, combine), and the router and log-prob kernels: the default
  kGroupedMm,  // torch's grouped GEMM for the experts; attention, MoE and loss as the ATen
               // composition the fused kernels replace
  kLoop,       // a GEMM per expert (NVFP4 experts: grouped over sorted rows), with kFused's
               // attention, router and log-prob kernels: the grouped GEMM's reference
  kComposed,   // a GEMM per expert (NVFP4 experts as under kLoop) and ATen ops throughout
};

struct ForwardOptions {
  bool return_logits = false;   // [T, V] fp32 logits (large: avoid for big vocabularies)
  at::Tensor targets;           // [T] int64: when defined, return log p(targets[t] | tokens[<=t]);
                                // entries equal to ignore_index give 0
  int64_t ignore_index = -100;
  double temperature = 1.0;     // log-probs of targets under softmax(logits / temperature)
  at::Tensor replay_routing;    // [T, L, k] uint8: use these expert sets instead of own top-k
  int64_t logprob_chunk = 2048; // tokens per lm_head chunk when computing log-probs
  KernelPath kernel_path = KernelPath::kFused;
  // The experts through torch's grouped GEMM (kFused, kGroupedMm).
  bool grouped_mm() const { return kernel_path == KernelPath::kFused || kernel_path == KernelPath::kGroupedMm; }
  // Flash attention and the router, combine and log-prob kernels (kFused, kLoop).
  bool fused_kernels() const { return kernel_path == KernelPath::kFused || kernel_path == KernelPath::kLoop; }
  AttentionBackend* attention = nullptr;  // not owned; nullptr = self-attention within the batch
  bool skip_head = false;       // stop after the final norm: return `hidden` only (rollout samples
                                // from the rows it needs)
  bool check_inputs = true;     // range-check token and routing ids (costs device syncs)
  bool load_balance = true;     // compute load_balance_loss (the rollout engine skips it: fewer kernels)
  Numerics numerics = Numerics::kStandard;  // rollout.numerics (see Numerics)
  bool bitwise() const { return numerics == Numerics::kBitwise; }
  bool rollout = false;         // the rollout engine's forward (no gradient): on CUDA the router's
                                // softmax, top-k and weights in one kernel (kernels/moe_route.h) and
                                // expert GEMMs that stop at the last real row. The trainer's scoring
                                // leaves it off and runs the ops of its training forward, so that
                                // lp_old and the first mini-step's log-probs agree bitwise
  at::Tensor positions;         // [T] int64 on the model's device: overrides the batch's positions
                                // (CUDA-graph capture: no tensor may be built from host data)
  // Called with the input of every linear that NVFP4 quantises (layer, HF name suffix such as
  // "self_attn.q_proj" or "mlp.experts.3.down_proj", rows): activation calibration. Forces the
  // per-expert loop for the experts.
  std::function<void(int64_t, const std::string&, const at::Tensor&)> observe_linear_input;
  bool disable_lora = false;    // run the base alone (LoRA's KL reference policy)
  // Expert parallel: the weights hold this rank's num_experts / ranks() experts, and their rows
  // travel through the dispatcher (model/expert_parallel.h); null: every expert here. Not owned.
  const ExpertDispatcher* experts = nullptr;
  // With a gradient: each layer keeps only its input and expert ids and runs again in the backward
  // (its routing replayed): the activations of one layer at a time instead of all of them, for
  // about one more forward of compute. The model must outlive the backward.
  bool recompute = false;
  // Sharded dense weights (ZeRO-3), gathered layer by layer; not owned. Under a gradient the
  // layers are recomputed in the backward (as with `recompute`), so that only one layer's full
  // weights are held at a time.
  const WeightGather* gather = nullptr;
  // This rank holds part of each sequence (context parallelism): batch-level statistics (the
  // load-balance loss) are summed over the ranks through it; null: the batch is whole. Not owned.
  const BatchReduce* batch_reduce = nullptr;
};

struct ForwardOutput {
  at::Tensor logits;            // [T, V] fp32, when asked
  at::Tensor logprobs;          // [T] fp32 (fp64 in fp64 runs), when targets were given
  at::Tensor routing;           // [T, L, k] uint8: the expert sets actually used
  at::Tensor load_balance_loss; // scalar fp32: mean over layers of E * sum_i f_i * P_i (when asked)
  at::Tensor hidden;            // [T, d] after the final norm, when skip_head
};

// Weight dtypes: the compute dtype of every matrix and norm, and of the router (fp32 unless fp64).
at::ScalarType router_dtype(at::ScalarType dtype);

class Muse {
 public:
  Muse(ModelConfig cfg, Weights weights);

  // Random init: each tensor (each expert separately) from its own stream seeded by (seed, name),
  // so the result does not depend on order, device or sharding.
  static Muse init(const ModelConfig& cfg, uint64_t seed, at::ScalarType dtype, at::Device device);
  // The same shapes and scales drawn on `device` by its own generator (seeded with `seed`): seconds
  // instead of minutes for full-width benchmark configs, but not init's values.
  static Muse init_on_device(const ModelConfig& cfg, uint64_t seed, at::ScalarType dtype, at::Device device);
  // Rank `rank` of `size`'s expert shard, drawn alone: equal to shard_experts(init(...), rank, size)
  // (each expert has its own stream), without ever holding the other ranks' experts.
  static Muse init_shard(const ModelConfig& cfg, uint64_t seed, at::ScalarType dtype, at::Device device, int rank,
                         int size);
  // The same shard in which only the tensors `keep` selects (by named_parameters name) are drawn;
  // the others are zero-element placeholders (ZeRO-3's tensors owned by other ranks, parallel/zero3.h).
  // What it draws equals init_shard's, and nothing else is allocated.
  static Muse init_owned(const ModelConfig& cfg, uint64_t seed, at::ScalarType dtype, at::Device device, int rank,
                         int size, const std::function<bool(const std::string&)>& keep);
  // Every tensor's shape and dtype on the meta device, with `experts` experts per layer (-1: all):
  // what a sharding is planned from before any weight exists.
  static Muse shapes(const ModelConfig& cfg, at::ScalarType dtype, int64_t experts = -1);

  const ModelConfig& config() const { return cfg_; }
  const Weights& weights() const { return w_; }
  Weights& weights() { return w_; }
  at::ScalarType dtype() const { return w_.embed.scalar_type(); }
  at::Device device() const { return w_.embed.device(); }

  // Every parameter under its in-memory name (experts stacked: "...mlp.experts.gate_proj" [E,I,d_l]).
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  void set_requires_grad(bool on);
  // A deep copy: its own detached storage for every tensor (the rollout engine's weights, the
  // frozen reference policy of the KL term). With `keep`, only the named_parameters it selects are
  // copied and the others become zero-element placeholders (a ZeRO-3 share, parallel/zero3.h).
  Muse clone(const std::function<bool(const std::string&)>& keep = {}) const;

  ForwardOutput forward(const PackedBatch& batch, const ForwardOptions& opt = {}) const;
  // fp32 logits [rows, V] of final-normed hidden states (fp64 in fp64 runs).
  at::Tensor logits(const at::Tensor& hidden, Numerics numerics = Numerics::kStandard) const;

 private:
  ModelConfig cfg_;
  Weights w_;
};

// Building blocks, exposed for the rollout engine and for tests.
// RMSNorm, Llama convention: normalise in fp32 (fp64 for fp64 inputs), cast back, times weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// cos and sin tables [T, head_dim] (fp32, fp64 for fp64) for the given positions.
std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& positions, int64_t head_dim,
                                              double theta, at::ScalarType dtype);
// Causal attention of one sequence: q [H, n, hd] at positions q_start.., k/v [H, m, hd] at positions
// k_start.. (KV heads already repeated for GQA; keys must reach q_start + n - 1). A window layer
// (full=false) lets the query at position i see keys at positions i-W < j <= i. Returns [H, n, hd].
at::Tensor sequence_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool full,
                              int64_t window, int64_t q_start = 0, int64_t k_start = 0);
// FlashAttention of pieces whose queries come after earlier keys (context parallelism's): q
// [Tq, Hq, hd] at cu_q, k and v [Tk, Hkv, hd] at cu_k (int32 on q's device), each piece's last query
// at its last key's position (kernels/flash_varlen.h). Whether it runs for this device, dtype and
// head dim (compiled in, and its one-time probe agreed with the reference), and the call.
bool piece_flash_available(at::Device device, at::ScalarType dtype, int64_t head_dim);
at::Tensor piece_flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
                                 const at::Tensor& cu_k, int64_t max_q, int64_t max_k, int64_t window);
// Causal attention of packed sequences (cu_seqlens [S + 1]), q [T, Hq, hd], k and v [T, Hkv, hd]
// -> [T, Hq, hd], by the standard forward's numerics: varlen flash where it runs, else one padded
// batch for many sequences, else one sequence at a time. window <= 0: full. Differentiable.
at::Tensor packed_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const std::vector<int64_t>& cu_seqlens, int64_t window);
// One layer's load-balance term E * sum_i f_i * P_i: f_i the share of the T * top_k slots routed to
// expert i (counts [E]), P_i its mean router score (scores [T, E]). With `reduce` the counts, score
// sums and T are the group's (a batch split over ranks); without, the ops the forward always ran.
at::Tensor load_balance_term(const at::Tensor& counts, const at::Tensor& scores, int64_t top_k,
                             const BatchReduce* reduce);
// [Hkv, n, hd] -> [Hq, n, hd]: query head h reads KV head h / group.
at::Tensor expand_kv_heads(const at::Tensor& x, int64_t group);

// Many small attention problems run as one padded batch (one set of kernels instead of a loop).
// Problem b has queries at rows q_rows[b] of a query source and keys at rows k_rows[b] of a key
// source, with absolute positions; the same layout serves every layer of one kind.
struct PaddedLayout {
  int64_t num_problems = 0, max_queries = 0, max_keys = 0;
  at::Tensor q_index;    // [B * Lq] int64 rows of the query source (pads read row 0)
  at::Tensor q_pos;      // [B, Lq] int64 absolute positions, -1 = pad
  at::Tensor k_index;    // [B * Lk] int64 rows of the key source
  at::Tensor k_pos;      // [B, Lk] int64, -1 = pad
  at::Tensor out_index;  // [queries] position in [B * Lq] of each real query, in listed order
  static PaddedLayout build(const std::vector<std::vector<int64_t>>& q_rows,
                            const std::vector<std::vector<int64_t>>& q_positions,
                            const std::vector<std::vector<int64_t>>& k_rows,
                            const std::vector<std::vector<int64_t>>& k_positions, at::Device device);
  // Bytes of fp32 attention scores for `heads` heads: callers fall back to a loop when too many.
  int64_t score_bytes(int64_t heads) const { return num_problems * heads * max_queries * max_keys * 4; }
};
// q_src [*, Hq, hd], k_src and v_src [*, Hkv, hd]. Returns [queries, Hq, hd] in listed order.
at::Tensor padded_attention(const PaddedLayout& layout, const at::Tensor& q_src, const at::Tensor& k_src,
                            const at::Tensor& v_src, bool full, int64_t window);
// x [T, H, head_dim] rotated by rotate-half RoPE (HF convention).
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace kiln::model
