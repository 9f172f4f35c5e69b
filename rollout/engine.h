// The rollout engine: batched generation over a paged KV cache with continuous batching, shared
// prefill for the n samples of a prompt, chunked prefill, preemption by recompute, sampling with
// per-sample seeds, log-probs and routing capture. Runs model/'s forward; never includes trainer/.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/comm.h"
#include "core/yaml_fwd.h"
#include "model/muse.h"
#include "rollout/sampler.h"  // SamplingParams

namespace kiln::rollout {

struct Request {
  std::vector<int64_t> prompt;      // token ids
  SamplingParams params;
  // Multi-turn: each sample's tokens and KV cache stay in the engine after it finishes, as a session
  // (Sample::session) that Engine::continue_session extends; Engine::end_session frees it.
  bool keep_cache = false;
};

enum class FinishReason { kStop, kLength };
const char* finish_reason_name(FinishReason r);

struct Sample {
  std::vector<int64_t> tokens;      // generated ids (a stop token, when hit, is the last); of this
                                    // turn only, for a session's later turns
  std::vector<float> logprobs;      // log-prob of each generated token under the distribution it
                                    // was sampled from (after temperature, top-k, top-p; greedy:
                                    // the raw distribution)
  FinishReason finish = FinishReason::kLength;
  at::Tensor routing;               // [prompt + generated, L, k] uint8: every token's expert ids,
                                    // as routed in the step that first computed it (the step whose
                                    // logits drew the next token); a recompute after preemption
                                    // does not overwrite it. A session's turn: every token so far,
                                    // earlier turns and observations included
  int64_t num_preemptions = 0;
  std::vector<int64_t> weight_versions;  // per generated token: Engine::weight_version() when it was
                                         // drawn (a sample may span weight updates)
  int64_t session = -1;             // Request::keep_cache: the session this sample continues as
};

struct RequestOutput {
  int64_t request_id = 0;
  std::vector<Sample> samples;      // params.n of them, in sample order
};

// The weights an engine serves: kNone (the model's dtype), kNvfp4 (W4A16: NVFP4 weights, the
// model's dtype for activations) or kW4a4 (activations quantised too: Blackwell numerics, emulated).
// Named "none", "nvfp4" and "w4a4" in recipes and on the command line.
enum class Quantization { kNone, kNvfp4, kW4a4 };
Quantization parse_quantization(const std::string& name);  // throws naming the accepted values
const char* quantization_name(Quantization q);

struct EngineConfig {
  // The budget for both KV pools, in bytes: the recipe's rollout.kv_cache_mb x 2^20. Kept in bytes
  // because the pools, kv_cache_bytes_for and the memory plan all count bytes.
  int64_t kv_cache_bytes = 64ll << 20;
  int64_t block_size = 16;              // tokens per KV block
  int64_t max_num_seqs = 64;            // running sequences at once
  // The longest sequence (prompt + generation, every turn) the window pool is sized for:
  // max_num_seqs x its ring slots rather than whole rings (rollout/kv_cache.h); unset (the
  // recipe's 0): any length. Longer ones still run, preempting others for blocks. A recipe that
  // caps prompts and is single-turn derives it.
  std::optional<int64_t> max_model_len;
  int64_t max_batch_tokens = 2048;      // tokens per engine step (decode + prefill chunks)
  int64_t prefill_chunk = 512;          // longest prefill piece of one sequence per step
  bool fused_rope_cache = true;         // graph decode: RoPE and the KV-cache write in one kernel
                                        // (false: four, as the eager path; tests compare)
  bool cuda_graphs = true;              // pure decode steps of a bf16 CUDA model replay captured
                                        // graphs (rollout/decode_graph.h); false: run eagerly
  // Under expert_group, the graph steps' fixed exchange sends each rank about expert_capacity
  // times its mean share of the slots (rollout/decode_graph.h, DecodeGraphOptions); a step that
  // overflows it is redone eagerly by every rank (EngineStats::expert_overflow_steps). 0: the worst
  // case, every slot of a rank to one rank, which never overflows but runs ranks x the rows.
  double expert_capacity = 2.0;
  bool uncaptured_graph_steps = false;  // tests: pure decode steps run the graph step's code (static
                                        // buffers, padded buckets, an expert shard's fixed-shape
                                        // exchange) without capture, on any device and dtype
                                        // (with cuda_graphs on)
  // Weights served. NVFP4 copies the model already holds (an NVFP4 checkpoint's) are served as they
  // are; the rest are quantised from the dense weights. update_weights() re-quantises.
  Quantization quantization = Quantization::kNone;
  // rollout.numerics: bitwise. The forward's batch-invariant numerics (model::Numerics) and each sampled token's log-prob computed as the trainer's forward computes
  // it, so that a trainer with the same numerics rescores every token to the same bits, whatever
  // the batch, chunking or preemption, or CUDA-graph replay (a graph step's attention is the same
  // ranged attention over its keys' cache rows). Dense weights, no top-p or top-k.
  model::Numerics numerics = model::Numerics::kStandard;
  bool bitwise() const { return numerics == model::Numerics::kBitwise; }
  // Serve the model's own weights instead of a copy (the same tensors), with a copy of the LoRA
  // adapters alone: for a frozen base, which nothing else writes (LoRA GRPO), or for weights that
  // change only between generate() calls and in place (synchronous full-parameter GRPO), it saves
  // the engine a whole copy of the model. update_weights() is refused (there is nothing to copy);
  // update_adapters() works.
  bool share_weights = false;
  const comm::Group* expert_group = nullptr;  // the model is an expert shard (model/expert_parallel.h):
                                        // generate() steps in lockstep with the group's engines
                                        // (step() is refused): graph decode steps of the group's
                                        // widest bucket with a fixed-shape exchange when every
                                        // rank only decodes, else eager steps, a rank without work
                                        // joining each exchange with one dummy token. Not owned
  void validate() const;
};

// The engine's keys of a recipe's rollout: section (rollout/engine_yaml.cpp, docs/CONFIG.md):
// kv_cache_mb in MiB, max_model_len 0 for unset, numerics standard | bitwise. The section also
// holds the trainer's weight-sync check, so the caller reads those keys and finishes the section.
void read_yaml(yaml::MapReader& m, EngineConfig& c);
void write_yaml(YAML::Emitter& e, const EngineConfig& c);

// The kv_cache_bytes that holds config.max_num_seqs whole sequences of `tokens` tokens each (no
// preemption), for `elem`-byte cache values: the window blocks the pool reserves (whole rings, or
// config.max_model_len's) and every full-attention block.
int64_t kv_cache_bytes_for(const model::ModelConfig& cfg, const EngineConfig& config, int64_t elem, int64_t tokens);

struct EngineStats {
  int64_t steps = 0;
  int64_t model_tokens = 0;          // tokens run through the model (prefill, recompute, decode)
  int64_t sampled_tokens = 0;
  int64_t preemptions = 0;
  int64_t graph_steps = 0;           // steps that replayed a CUDA graph
  int64_t graphs_captured = 0;
  int64_t expert_overflow_steps = 0;  // graph steps an expert shard's exchange overflowed, redone eagerly
  // Host wall time by phase: scheduling and planning, the model (until its outputs reach the
  // host; graph capture included), and drawing tokens.
  double schedule_seconds = 0, model_seconds = 0, sample_seconds = 0;
  // Steps that only decoded (one new token per sequence, no prefill piece): how many, their rows,
  // and their host wall time, all phases.
  int64_t decode_steps = 0, decode_rows = 0;
  double decode_seconds = 0;
  double trace_seconds = 0;          // in the trace callback (Engine::set_trace), not in the above
  // Two block pools: full-attention layers keep every position, window layers a ring of
  // ceil(W / block_size) + 1 blocks per sequence.
  int64_t full_blocks_total = 0, window_blocks_total = 0;
  int64_t full_blocks_used = 0, window_blocks_used = 0;  // now
  int64_t peak_full_blocks = 0, peak_window_blocks = 0;
  int64_t full_block_bytes = 0, window_block_bytes = 0;
  int64_t window_ring_blocks = 0;    // per sequence
};

// What one engine step computed, for tracing and tests (Engine::set_trace).
struct StepTrace {
  struct Item {
    int64_t request_id = 0;
    int64_t sample = -1;              // -1: a prompt's prefill, shared by its samples
    int64_t start = 0, n = 0;         // positions [start, start + n) computed in this step
    at::Tensor routing;               // [n, L, k] uint8: the experts this step routed them to
    // Tokens drawn from the last row's logits, as (sample, id): one for a sample, one per sample
    // for a prefilled prompt, none when the row only finished a sequence's routing.
    std::vector<std::pair<int64_t, int64_t>> drawn;
  };
  std::vector<Item> items;
};

// Where an engine gets a weight that its model holds only in part, by Muse::named_parameters (or
// model::lora_parameters) name: a ZeRO-3 placeholder broadcast from its owner, a rank's expert
// shard gathered whole for a replica. Returns the whole tensor, or an undefined one to serve
// `own` as it is. Called for every tensor in the model's order on every rank alike, so that it
// may run collectives; the engine keeps one fetched tensor at a time.
using WeightSource = std::function<at::Tensor(const std::string& name, const at::Tensor& own)>;

class Engine {
 public:
  // Takes its own copy of the model's weights; update_weights() replaces them in place. With a
  // `source`, the tensors it answers for are fetched one at a time and (NVFP4) quantised as they
  // arrive, so that a rank holding a share of the model never holds the whole of it in BF16.
  Engine(const model::Muse& model, EngineConfig config, const WeightSource& source = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates and queues a request; returns its id. Throws on empty prompts, ids >= vocab, n = 0,
  // max_tokens = 0, or a request that could never fit in the KV cache.
  int64_t add_request(const Request& request);
  // Runs one scheduling step (prefill chunks and/or one decode token per running sequence).
  // Returns the requests that finished in this step.
  std::vector<RequestOutput> step();
  bool has_unfinished() const;
  // Runs everything queued to completion; outputs in request order. `progress` (optional) is
  // called after every step with (finished samples, total samples).
  std::vector<RequestOutput> generate(const std::vector<Request>& requests,
                                      const std::function<void(int64_t, int64_t)>& progress = {});

  // Multi-turn, token in and token out: queues the next turn of a finished session (a sample of a
  // keep_cache request, or an earlier turn). `observation` (ids, at least one: an environment's
  // answer, a turn separator) is appended to the session's tokens exactly as given and prefilled
  // on top of its cached keys, without recomputing the prefix; then one sample is drawn with
  // `params` (n must be 1; max_tokens counts this turn's tokens). Returns the request id whose
  // output is the turn. Sessions hold their KV blocks while idle; when a step cannot run for lack
  // of blocks, idle sessions give theirs up and are recomputed when continued (their routing kept).
  // Throws for an unknown or running session and for bad ids or params, naming them.
  int64_t continue_session(int64_t session, const std::vector<int64_t>& observation, const SamplingParams& params);
  void end_session(int64_t session);  // frees an idle session; throws for an unknown one
  int64_t num_sessions() const;       // idle sessions held

  // Copies new weights into the engine's tensors in place (same names and shapes as
  // Muse::named_parameters()); throws naming the first mismatch. Only between steps.
  void update_weights(const std::vector<std::pair<std::string, at::Tensor>>& named);
  // The same from `from`'s named_parameters, each through `source` (see WeightSource) when given:
  // a sharded trainer's weights, fetched one tensor at a time. Returns the bytes copied.
  int64_t update_weights(const model::Muse& from, const WeightSource& source);
  // LoRA: copies adapters (model::lora_parameters names and shapes, all of them) into the engine's
  // own, which it applies unmerged on its base (dense or NVFP4). Throws naming a missing, unknown
  // or wrongly shaped adapter. Returns the bytes copied. Only between steps.
  int64_t update_adapters(const std::vector<std::pair<std::string, at::Tensor>>& named);
  int64_t update_adapters(const model::Muse& from, const WeightSource& source);  // as update_weights
  // The number of weight or adapter updates so far (0 at construction): the version each drawn
  // token records (Sample::weight_versions), so that a trainer can tell how stale a sample is.
  int64_t weight_version() const;
  const model::Muse& model() const;
  EngineStats stats() const;
  // Starts the peak block counts (EngineStats::peak_*_blocks) again from the blocks in use now, so
  // that a caller can read the peak of one batch.
  void reset_peaks();
  // Called at the end of every step with what it computed (empty function: off). Costs a copy of
  // the step's routing.
  void set_trace(std::function<void(const StepTrace&)> trace);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::rollout
