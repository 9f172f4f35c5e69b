// Rollout engine implementation: a coordinator of the paged KV cache (kv_cache.h), the scheduler
// (scheduler.h), the attention over the cache (cache_attention.h) and the sampler (sampler.h); it
// keeps the requests' samples (tokens, log-probs, routing), the step's order of work, and idle
// multi-turn sessions (a finished sample's tokens and KV blocks, kept for its next turn).
#include "rollout/engine.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <numeric>
#include <set>
#include <string>

#include "core/error.h"
#include "model/batch_invariant.h"
#include "model/expert_parallel.h"
#include "model/lora.h"
#include "model/nvfp4_model.h"
#include "rollout/decode_graph.h"
#include "rollout/cache_attention.h"
#include "rollout/kv_cache.h"
#include "rollout/sampler.h"
#include "rollout/scheduler.h"

namespace kiln::rollout {

const char* finish_reason_name(FinishReason r) { return r == FinishReason::kStop ? "stop" : "length"; }

Quantization parse_quantization(const std::string& name) {
  if (name == "none") return Quantization::kNone;
  if (name == "nvfp4") return Quantization::kNvfp4;
  if (name == "w4a4") return Quantization::kW4a4;
  KILN_FAIL("quantization must be none, nvfp4 or w4a4 (got '", name, "')");
}

const char* quantization_name(Quantization q) {
  return q == Quantization::kNvfp4 ? "nvfp4" : q == Quantization::kW4a4 ? "w4a4" : "none";
}

int64_t kv_cache_bytes_for(const model::ModelConfig& cfg, const EngineConfig& ec, int64_t elem, int64_t tokens) {
  const KvLayout k = KvLayout::of(cfg, ec.block_size, elem);
  return k.window_pool_blocks(ec.max_num_seqs, ec.max_model_len) * k.window_block_bytes +
         ec.max_num_seqs * ((tokens + ec.block_size - 1) / ec.block_size) * k.full_block_bytes;
}

void EngineConfig::validate() const {
  KILN_CHECK(kv_cache_bytes > 0, "rollout config: kv_cache_bytes must be positive (got ", kv_cache_bytes, ")");
  KILN_CHECK(block_size > 0, "rollout config: block_size must be positive (got ", block_size, ")");
  KILN_CHECK(max_num_seqs > 0, "rollout config: max_num_seqs must be positive (got ", max_num_seqs, ")");
  KILN_CHECK(!max_model_len || *max_model_len > 0, "rollout config: max_model_len must be positive when set (got ",
             max_model_len.value_or(0), "); leave it unset for any length");
  KILN_CHECK(max_batch_tokens > 0, "rollout config: max_batch_tokens must be positive (got ", max_batch_tokens, ")");
  KILN_CHECK(prefill_chunk > 0, "rollout config: prefill_chunk must be positive (got ", prefill_chunk, ")");
  KILN_CHECK(!share_weights || !expert_group, "rollout config: share_weights serves a whole frozen model; an expert ",
             "shard's engine (expert_group) fills its own");
  KILN_CHECK(quantization == Quantization::kNone || !bitwise(), "rollout config: numerics bitwise serves the ",
             "trainer's dense weights; quantization '", quantization_name(quantization), "' cannot be bitwise");
  KILN_CHECK(std::isfinite(expert_capacity) && expert_capacity >= 0, "rollout config: expert_capacity must be a ",
             "finite number >= 0 (got ", expert_capacity, ")");
}

struct RequestState {
  Request request;
  std::vector<Sample> samples;
  int64_t done = 0;
};

namespace {
using Named = std::vector<std::pair<std::string, at::Tensor>>;
using Item = std::function<std::pair<std::string, at::Tensor>(size_t)>;  // the i-th of a sync's tensors

EngineConfig validated(EngineConfig c) {
  c.validate();
  return c;
}
}  // namespace

struct Engine::Impl {
  model::Muse model;
  model::ModelConfig cfg;
  EngineConfig ec;
  KvCache kv;
  Scheduler sched;
  std::map<int64_t, RequestState> requests;
  int64_t next_request = 0;
  const std::vector<Work>& work;         // the current step's schedule (sched's)
  CacheAttention attention;              // the forward's attention over the cache
  bool use_graph = false;                // the current step is a graph step (set by schedule; group_step
                                         // may turn it off)
  EngineStats st;
  std::unique_ptr<DecodeGraphs> graphs;  // CUDA-graph decode steps, when available
  std::unique_ptr<model::AllToAllDispatcher> dispatcher;  // an expert shard's exchange (ec.expert_group)
  std::function<void(const StepTrace&)> trace;
  using clock = std::chrono::steady_clock;
  clock::time_point step_start;          // when the current step's planning began
  int64_t weight_version = 0;            // weight or adapter updates so far
  int64_t update_weights(size_t count, const Item& item);   // Engine::update_weights, tensors one at a time
  int64_t update_adapters(size_t count, const Item& item);
  std::map<int64_t, std::unique_ptr<Seq>> sessions;  // finished turns kept for a next one (idle)
  int64_t next_session = 0;

  Impl(const model::Muse& m, EngineConfig config, const WeightSource& source)
      : model(config.share_weights ? shared_view(m) : m.clone()), cfg(m.config()), ec(validated(config)),
        kv(cfg, ec.block_size, ec.kv_cache_bytes, ec.max_num_seqs, model.dtype(), model.device(), ec.max_model_len),
        sched(kv, ec, cfg.sliding_window), work(sched.work()), attention(kv, cfg, ec.numerics) {
    KILN_CHECK(!(ec.share_weights && source), "rollout: an engine that shares its model's weights cannot fill them "
               "from a weight source (it would write into the model's own tensors)");
    if (ec.expert_group) dispatcher = std::make_unique<model::AllToAllDispatcher>(*ec.expert_group);
    if (source) fill(source);
    if (ec.quantization != Quantization::kNone) {
      // The GEMM kernels read their own sign-bit layout; the CPU reference reads ModelOpt's.
      model::quantize_model(model, /*kernel_layout=*/model.device().is_cuda(), /*drop_dense=*/true);
      for (auto& l : model.weights().layers) {
        l.nvfp4.w4a4 = ec.quantization == Quantization::kW4a4;
        // A stack's static activation scales act as one, its largest (model::nvfp4_options): an
        // expert shard knows only its own experts' scales, so it would round other activations.
        KILN_CHECK(!ec.expert_group || !l.nvfp4.w4a4 || !l.nvfp4.expert_gate.input_scale.defined(),
                   "rollout: W4A4 with static activation scales (a calibrated NVFP4 checkpoint's input_scale) ",
                   "cannot be served by expert-sharded engines, which each hold a part of a stack's scales; use ",
                   "dynamic scales (kiln quantize --no-calibrate) or parallel.rollout: replica");
      }
    }
    st.full_block_bytes = kv.layout().full_block_bytes;
    st.window_block_bytes = kv.layout().window_block_bytes;
    st.window_ring_blocks = kv.layout().ring_blocks;
    st.full_blocks_total = kv.pool(true).total();
    st.window_blocks_total = kv.pool(false).total();
    // Expert adapters read the expert counts on the host unless torch's grouped GEMM takes them
    // (Lora::experts_grouped; under bitwise numerics the invariant grouped kernel, whose rank must
    // be 8k too): no graph capture then. Nor for an expert shard's NVFP4 experts when a decode
    // step's rows (at most max_num_seqs rounded up to a bucket of 16, times top_k) can exceed 64 per
    // expert, the bound this rule was set for when the grouped GEMM's prefill path read offsets on
    // the host (kept for shards, whose exchanged rows differ; unmeasured). A whole model's experts
    // above 64 rows take the dequantised stack and torch's grouped GEMM, which captures
    // (tests/cuda/test_cuda_nvfp4_model.cpp: 82 rows per expert in graphs on an H100).
    const bool many_rows = ec.expert_group && (ec.max_num_seqs + 15) * cfg.top_k > 64 * cfg.num_experts;
    bool host_sync = false;
    for (const auto& l : model.weights().layers) {
      const bool nvfp4_experts = !l.expert_gate.defined();
      host_sync |= l.lora.on_experts() && !l.lora.experts_grouped();
      host_sync |= nvfp4_experts && many_rows;
    }
    const bool capture = DecodeGraphs::available(model, ec.expert_group, ec.numerics);
    if (ec.cuda_graphs && !host_sync && (capture || ec.uncaptured_graph_steps)) {
      DecodeGraphOptions go;
      go.fuse_rope_cache = ec.fused_rope_cache;
      go.expert_group = ec.expert_group;
      go.expert_capacity = ec.expert_capacity;
      go.capture = capture && !ec.uncaptured_graph_steps;
      go.numerics = ec.numerics;
      graphs = std::make_unique<DecodeGraphs>(model, kv.graph_pools(), ec.max_num_seqs, go);
    }
  }

  // `m`'s weights themselves with a copy of its adapters (EngineConfig::share_weights). The
  // engine's forwards run without a graph, so the shared tensors' requires_grad does not matter.
  static model::Muse shared_view(const model::Muse& m) {
    model::Muse view(m.config(), m.weights());
    model::copy_adapters(view);
    return view;
  }

  // The tensors `source` answers for, one at a time: each replaces the copy's placeholder or shard
  // in place (Tensor::set_, so every handle of the model sees it) and an NVFP4-served linear is
  // quantised at once, its dense copy released before the next tensor comes.
  void fill(const WeightSource& source) {
    at::NoGradGuard g;
    const bool quantize = ec.quantization != Quantization::kNone;
    auto named = model.named_parameters();
    const auto adapters = model::lora_parameters(model);
    named.insert(named.end(), adapters.begin(), adapters.end());
    for (auto& [name, t] : named) {
      at::Tensor w = source(name, t);
      if (w.defined()) t.set_(w.to(t.options(), /*non_blocking=*/false, /*copy=*/true).contiguous());
      KILN_CHECK(t.numel() > 0, "rollout: the model holds no weights for ", name,
                 " (a placeholder of a sharded model) and the weight source gave none");
      if (quantize) model::quantize_linear(model, name, /*kernel_layout=*/model.device().is_cuda(), /*drop_dense=*/true);
      t = at::Tensor();  // the last handle of a quantised linear's dense weights
    }
  }

  // ---- scheduling -----------------------------------------------------------------------------

  // The step's work (scheduler.h), and the plans that route its cache reads and writes.
  void schedule() {
    sched.schedule();
    use_graph = graph_step();
    if (!use_graph) attention.plan(work);  // a graph step finds its keys through block tables instead
    st.peak_full_blocks = std::max(st.peak_full_blocks, kv.pool(true).used());
    st.peak_window_blocks = std::max(st.peak_window_blocks, kv.pool(false).used());
  }

  // ---- requests and steps ---------------------------------------------------------------------

  // Checks `ids` (what: "prompt" or "observation") and `p` for a sequence that will hold `held`
  // tokens before this turn's.
  void check(const std::vector<int64_t>& ids, const char* what, const SamplingParams& p, int64_t held) const {
    KILN_CHECK(!ids.empty(), "rollout: request has an empty ", what, "; give at least one token");
    for (size_t i = 0; i < ids.size(); ++i)
      KILN_CHECK(ids[i] >= 0 && ids[i] < cfg.vocab_size, "rollout: ", what, " token ", i, " is ", ids[i],
                 ", outside [0, vocab_size=", cfg.vocab_size, ")");
    KILN_CHECK(p.n >= 1, "rollout: n must be at least 1 (got ", p.n, ")");
    KILN_CHECK(p.max_tokens >= 1, "rollout: max_tokens must be at least 1 (got ", p.max_tokens, ")");
    KILN_CHECK(p.temperature >= 0, "rollout: temperature must be >= 0 (got ", p.temperature, ")");
    KILN_CHECK(p.top_p > 0 && p.top_p <= 1, "rollout: top_p must be in (0, 1] (got ", p.top_p, ")");
    KILN_CHECK(p.top_k >= 0, "rollout: top_k must be >= 0 (got ", p.top_k, ")");
    KILN_CHECK(!ec.bitwise() || (p.top_p >= 1 && p.top_k == 0), "rollout: numerics bitwise records the ",
               "log-prob of the whole softmax, which the trainer rescores; top_p (", p.top_p, ") and top_k (", p.top_k,
               ") would sample from another distribution: leave them at 1 and 0");
    for (int64_t t : p.stop_token_ids)
      KILN_CHECK(t >= 0 && t < cfg.vocab_size, "rollout: stop token ", t, " is outside [0, vocab_size=", cfg.vocab_size, ")");
    const int64_t longest = held + int64_t(ids.size()) + p.max_tokens;
    const std::string session = held ? "session (" + std::to_string(held) + ") + " : "";
    KILN_CHECK(longest <= cfg.max_position_embeddings, "rollout: ", session, what, " (", ids.size(), ") + max_tokens (",
               p.max_tokens, ") exceeds max_position_embeddings=", cfg.max_position_embeddings);
    const int64_t blocks = (longest + ec.block_size - 1) / ec.block_size;
    KILN_CHECK(blocks <= kv.pool(true).total(), "rollout: one sample of ", longest, " tokens needs ", blocks,
               " KV blocks but the cache holds ", kv.pool(true).total(), "; raise kv_cache_bytes");
  }

  int64_t add(const Request& r) {
    const auto& p = r.params;
    check(r.prompt, "prompt", p, 0);
    const int64_t id = next_request++;
    RequestState& rs = requests[id];
    rs.request = r;
    rs.samples.resize(p.n);
    auto parent = std::make_unique<Seq>();
    parent->request = id;
    parent->tokens = r.prompt;
    parent->prompt_len = int64_t(r.prompt.size());
    parent->turn_start = parent->prompt_len;
    parent->width = p.n;
    sched.enqueue(std::move(parent));
    return id;
  }

  int64_t continue_session(int64_t session, const std::vector<int64_t>& observation, const SamplingParams& p) {
    auto it = sessions.find(session);
    KILN_CHECK(it != sessions.end(), "rollout: continue_session: no idle session ", session,
               " (unknown, ended, or its last turn is still running)");
    KILN_CHECK(p.n == 1, "rollout: continue_session: a turn draws one sample (n = 1, got ", p.n, ")");
    Seq& s = *it->second;
    check(observation, "observation", p, int64_t(s.tokens.size()));
    const int64_t id = next_request++;
    RequestState& rs = requests[id];
    rs.request.params = p;
    rs.request.keep_cache = true;
    rs.samples.resize(1);
    s.request = id;
    s.sample = 0;
    s.tokens.insert(s.tokens.end(), observation.begin(), observation.end());
    s.turn_start = int64_t(s.tokens.size());
    s.finalizing = false;
    s.logprobs.clear();
    s.versions.clear();
    s.preemptions = 0;
    sched.enqueue(std::move(it->second));
    sessions.erase(it);
    return id;
  }

  void end_session(int64_t session) {
    auto it = sessions.find(session);
    KILN_CHECK(it != sessions.end(), "rollout: end_session: no idle session ", session);
    kv.release(it->second->blocks);
    sessions.erase(it);
  }

  // Idle sessions give up their blocks (recomputed when continued, routing kept, as after a
  // preemption). Returns whether any had blocks.
  bool evict_sessions() {
    bool any = false;
    for (auto& [id, s] : sessions) {
      if (s->computed == 0) continue;
      kv.release(s->blocks);
      s->computed = 0;
      any = true;
    }
    return any;
  }

  const SamplingParams& params(const Seq& s) const { return requests.at(s.request).request.params; }
  uint64_t stream_seed(const Seq& s) const {
    return sample_stream_seed(params(s).seed, s.sample, int64_t(s.tokens.size()) - s.prompt_len);
  }

  // Appends one drawn token to a sample; marks it finalizing when it stops or hits max_tokens.
  void append(Seq& s, int64_t id, double lp) {
    const SamplingParams& p = params(s);
    const int64_t step = int64_t(s.tokens.size()) - s.turn_start;
    s.tokens.push_back(id);
    s.logprobs.push_back(float(lp));
    s.versions.push_back(weight_version);
    st.sampled_tokens++;
    const bool stop = std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), id) != p.stop_token_ids.end();
    if (stop || step + 1 >= p.max_tokens) {
      s.finalizing = true;
      s.finish = stop ? FinishReason::kStop : FinishReason::kLength;
    }
  }

  // A step that only decodes samples (no prefill piece, no prompt) can replay a CUDA graph.
  bool graph_step() const {
    if (!graphs || int64_t(work.size()) > ec.max_num_seqs) return false;
    return std::all_of(work.begin(), work.end(), [](const Work& w) { return w.n == 1 && w.seq->sample >= 0; });
  }

  // min_rows: the expert group's widest step (group_step).
  DecodeResult run_graph(int64_t min_rows = 0) {
    DecodeStep d;
    for (const Work& w : work) {
      const Seq& s = *w.seq;
      DecodeStep::Row r;
      r.token = s.tokens[size_t(w.start)];
      r.position = w.start;
      r.full_blocks = &s.blocks.full;
      r.ring = &s.blocks.ring;
      r.temperature = params(s).temperature;
      r.stream_seed = stream_seed(s);
      d.rows.push_back(r);
    }
    const int64_t before = graphs->num_graphs();
    DecodeResult r = graphs->run(d, min_rows);
    st.graph_steps++;
    st.graphs_captured += graphs->num_graphs() - before;
    return r;
  }

  // Under bitwise numerics each drawn token's log-prob as the trainer's forward computes it
  // (model::rowwise_token_logprobs, whose rows do not depend on each other): one call per
  // temperature over the drawn rows.
  void record_trainer_logprobs(const std::vector<std::pair<Seq*, int64_t>>& draws, const at::Tensor& logits,
                               std::vector<std::pair<int64_t, double>>& picked) {
    std::map<double, std::vector<size_t>> by_temperature;
    for (size_t i = 0; i < draws.size(); ++i) {
      const double T = params(*draws[i].first).temperature;
      by_temperature[T > 0 ? T : 1.0].push_back(i);
    }
    for (const auto& [T, which] : by_temperature) {
      std::vector<int64_t> rows, tokens;
      for (size_t i : which) {
        rows.push_back(draws[i].second);
        tokens.push_back(picked[i].first);
      }
      const at::Tensor lp = model::rowwise_token_logprobs(
          logits.index_select(0, at::tensor(rows, at::kLong).to(logits.device())), at::tensor(tokens, at::kLong), T);
      const at::Tensor host = lp.to(at::kCPU, at::kDouble);
      for (size_t j = 0; j < which.size(); ++j) picked[which[j]].second = host.data_ptr<double>()[j];
    }
  }

  // Draws the next token of each (sample, row) of `logits` (device [rows, V]) and appends it; a
  // graph step's result gives the ids it sampled on the GPU (rollout/sampler.h).
  void draw(const std::vector<std::pair<Seq*, int64_t>>& draws, const at::Tensor& logits, const DecodeResult* graph) {
    std::vector<Draw> d;
    for (const auto& [s, row] : draws) d.push_back({row, &params(*s), stream_seed(*s)});
    auto picked = graph ? draw_tokens(d, logits, graph->ids, graph->logprobs) : draw_tokens(d, logits);
    if (ec.bitwise()) record_trainer_logprobs(draws, logits, picked);
    for (size_t i = 0; i < draws.size(); ++i) append(*draws[i].first, picked[i].first, picked[i].second);
  }

  // Expert sharding: a rank with nothing to generate still joins the group's expert exchanges
  // (one per step of the busy ranks) with a one-token forward whose result is dropped.
  void idle_exchange() {
    at::NoGradGuard no_grad;
    model::ForwardOptions opt;
    opt.experts = dispatcher.get();
    opt.numerics = ec.numerics;
    opt.skip_head = true;
    opt.load_balance = false;
    model.forward(model::PackedBatch::from_sequences({{0}}, model.device()), opt);
  }

  void emit_trace(const at::Tensor& routing, const std::vector<int64_t>& cu_seqlens,
                  const std::vector<std::pair<Seq*, int64_t>>& draws, const std::vector<const Seq*>& drawn_from) {
    StepTrace t;
    for (size_t i = 0; i < work.size(); ++i) {
      const Work& w = work[i];
      StepTrace::Item item;
      item.request_id = w.seq->request;
      item.sample = w.seq->sample == -2 ? -1 : w.seq->sample;  // -2: a parent that forked now
      item.start = w.start;
      item.n = w.n;
      item.routing = routing.narrow(0, cu_seqlens[i], w.n).clone();
      for (size_t d = 0; d < draws.size(); ++d)
        if (drawn_from[d] == w.seq) item.drawn.push_back({draws[d].first->sample, draws[d].first->tokens.back()});
      t.items.push_back(std::move(item));
    }
    trace(t);
  }

  std::vector<RequestOutput> step() {
    plan();
    return run();
  }

  // A step's first half: its schedule (no work: every sequence has finished).
  void plan() {
    step_start = clock::now();
    schedule();
    if (work.empty() && !sched.idle() && evict_sessions()) schedule();
    KILN_CHECK(!work.empty() || sched.idle(), "rollout: nothing could be scheduled although ",
               sched.num_waiting() + int64_t(sched.running().size()),
               " sequences wait; the KV cache is too small for one of them");
  }

  // Expert sharding: one step of the group's engines in lockstep. Each plans its own work; a host
  // all-reduce then sets the step for all of them: none (no rank has work: returns false); a graph
  // decode step of the group's widest bucket when every rank with work only decodes (a rank
  // without work runs the bucket's rows all as padding); else eager forwards (a rank without work
  // joins each exchange with one dummy token).
  bool group_step(std::vector<RequestOutput>& finished) {
    plan();
    const bool busy = !work.empty();
    at::Tensor agree = at::tensor(std::vector<double>{busy ? 1.0 : 0.0, busy && !use_graph ? 1.0 : 0.0,
                                                      use_graph ? double(work.size()) : 0.0}, at::kDouble);
    ec.expert_group->all_reduce(agree, comm::ReduceOp::kMax);
    const double* a = agree.data_ptr<double>();
    if (a[0] == 0) return false;
    if (a[1] > 0) {
      if (use_graph) run_eagerly();  // another rank prefills: this one's decode runs eagerly too
      if (busy) finished = run();
      else idle_exchange();
    } else {
      KILN_CHECK(graphs, "rollout: the expert group's engines disagree on graph decode steps");
      if (busy) {
        finished = run(int64_t(a[2]));
      } else {
        const DecodeResult idle = graphs->run(DecodeStep{}, int64_t(a[2]));
        if (idle.may_overflow && any_rank(idle.overflowed)) idle_exchange();  // another rank redoes its step (run)
      }
    }
    return true;
  }

  // Turns the planned graph step into an eager one: its attention is planned over the cache.
  void run_eagerly() {
    use_graph = false;
    attention.plan(work);
  }

  // Whether `mine` holds on any rank of the expert group (a host all-reduce every rank joins).
  bool any_rank(bool mine) const { return ec.expert_group->all_reduce(mine ? 1.0 : 0.0, comm::ReduceOp::kMax) > 0; }

  // The step's forward, on a graph or eagerly: routing [T, L, k] on the CPU, and the graph's
  // result (its logits and draws) or the eager forward's hidden states. min_rows: as run's.
  struct Forward {
    DecodeResult graph;
    at::Tensor routing, hidden;
  };
  Forward forward(const std::vector<int64_t>& cu_seqlens, int64_t min_rows) {
    Forward f;
    if (use_graph) {
      f.graph = run_graph(min_rows);
      // A slot did not fit on some rank: every rank redoes the step.
      if (ec.expert_group && f.graph.may_overflow && any_rank(f.graph.overflowed)) {
        st.expert_overflow_steps++;
        f.graph = DecodeResult();
        run_eagerly();
      } else {
        f.routing = f.graph.routing;
        return f;
      }
    }
    model::PackedBatch batch;
    batch.cu_seqlens = cu_seqlens;
    std::vector<int64_t> flat;
    for (const Work& w : work) {
      flat.insert(flat.end(), w.seq->tokens.begin() + w.start, w.seq->tokens.begin() + w.start + w.n);
      batch.start_positions.push_back(w.start);
    }
    batch.tokens = at::tensor(flat, at::kLong).to(model.device());
    model::ForwardOptions opt;
    opt.attention = &attention;
    opt.experts = dispatcher.get();
    opt.numerics = ec.numerics;
    opt.skip_head = true;
    opt.check_inputs = false;  // ids were checked when the requests came in; skips device syncs
    opt.load_balance = false;
    opt.rollout = true;
    model::ForwardOutput out = model.forward(batch, opt);
    f.routing = out.routing.cpu().contiguous();
    f.hidden = out.hidden;
    return f;
  }

  // Keeps the routing of positions routed for the first time and counts the computed rows. Returns
  // the sequences whose next token is drawn now (complete, not finalizing) with the forward row of
  // each: its last computed row.
  std::vector<std::pair<Seq*, int64_t>> record_routing(const at::Tensor& routing, const std::vector<int64_t>& cu_seqlens) {
    const int64_t per_token = cfg.num_layers * cfg.top_k;
    std::vector<std::pair<Seq*, int64_t>> ready;
    for (size_t i = 0; i < work.size(); ++i) {
      const Work& w = work[i];
      Seq& s = *w.seq;
      // Only positions routed for the first time: a recompute after preemption can route a token
      // differently (bf16, other batch shapes), but its next token was drawn under the first.
      const int64_t from = std::max(w.start, s.routed), to = w.start + w.n;
      s.routing.resize(size_t(s.tokens.size() * per_token));
      if (to > from) {
        const uint8_t* r = routing.data_ptr<uint8_t>() + (cu_seqlens[i] + from - w.start) * per_token;
        std::copy(r, r + (to - from) * per_token, s.routing.begin() + from * per_token);
        s.routed = to;
      }
      s.computed += w.n;
      if (s.computed == int64_t(s.tokens.size()) && !s.finalizing) ready.push_back({&s, cu_seqlens[i + 1] - 1});
    }
    return ready;
  }

  // The logits of the ready rows and, per ready sequence, its row in them: the graph's own logits
  // (indexed by forward row), else the head over the eager forward's hidden states of those rows.
  at::Tensor ready_logits(const Forward& f, std::vector<std::pair<Seq*, int64_t>>& ready) {
    if (f.graph.logits.defined() || ready.empty()) return f.graph.logits;
    std::vector<int64_t> rows;
    for (auto& [s, row] : ready) {
      rows.push_back(row);
      row = int64_t(rows.size()) - 1;
    }
    return model.logits(f.hidden.index_select(0, at::tensor(rows, at::kLong).to(model.device())), ec.numerics);
  }

  // What is drawn now: a decoding sample's next token from its own row; a prefilled prompt forks
  // its n samples (sharing its blocks until they write), each drawing its first token from the
  // prompt's row. Each draw comes with the sequence whose row it read (for the trace).
  struct Draws {
    std::vector<std::pair<Seq*, int64_t>> draws;
    std::vector<const Seq*> from;
  };
  Draws fork_draws(const std::vector<std::pair<Seq*, int64_t>>& ready) {
    Draws d;
    for (const auto& [sp, row] : ready) {
      Seq& s = *sp;
      if (s.sample >= 0) {
        d.draws.push_back({&s, row});
        d.from.push_back(&s);
        continue;
      }
      const int64_t n = params(s).n;
      for (int64_t k = 0; k < n; ++k) {
        auto child = std::make_unique<Seq>(s);
        child->sample = k;
        child->width = 1;
        kv.share(child->blocks);
        d.draws.push_back({child.get(), row});
        d.from.push_back(&s);
        sched.start(std::move(child));
      }
      s.finalizing = true;  // the parent's work is done; released by retire
      s.sample = -2;
    }
    return d;
  }

  // The step's times into the stats: scheduling t0-t1 (a group's agreement included), model t1-t2,
  // sampling t2-t3; an all-decode step's whole time as a decode step.
  void account(clock::time_point t0, clock::time_point t1, clock::time_point t2, clock::time_point t3) {
    st.schedule_seconds += std::chrono::duration<double>(t1 - t0).count();
    st.model_seconds += std::chrono::duration<double>(t2 - t1).count();
    st.sample_seconds += std::chrono::duration<double>(t3 - t2).count();
    if (std::all_of(work.begin(), work.end(), [](const Work& w) { return w.n == 1; })) {
      st.decode_steps++;
      st.decode_rows += int64_t(work.size());
      st.decode_seconds += std::chrono::duration<double>(t3 - t0).count();
    }
  }

  // Retires parents that forked and samples whose last token's routing is now known: a sample's
  // output goes to its request (finished when its last sample is), and its blocks are released or,
  // for a request that keeps its cache, held by an idle session.
  void retire(std::vector<RequestOutput>& finished) {
    auto& running = sched.running();
    for (auto it = running.begin(); it != running.end();) {
      Seq& s = **it;
      const bool complete = s.computed == int64_t(s.tokens.size());
      if (s.sample != -2 && !(s.finalizing && complete)) {
        ++it;
        continue;
      }
      bool keep = false;
      if (s.sample >= 0) {
        RequestState& rs = requests.at(s.request);
        keep = rs.request.keep_cache;
        if (keep && s.session < 0) s.session = next_session++;
        Sample& out_s = rs.samples[s.sample];
        out_s.session = keep ? s.session : -1;
        out_s.tokens.assign(s.tokens.begin() + s.turn_start, s.tokens.end());
        out_s.logprobs = s.logprobs;
        out_s.finish = s.finish;
        out_s.num_preemptions = s.preemptions;
        out_s.weight_versions = s.versions;
        out_s.routing =
            at::from_blob(s.routing.data(), {int64_t(s.tokens.size()), cfg.num_layers, cfg.top_k}, at::kByte).clone();
        if (++rs.done == int64_t(rs.samples.size())) {
          finished.push_back({s.request, std::move(rs.samples)});
          requests.erase(s.request);
        }
      }
      if (keep) {
        sessions[s.session] = std::move(*it);
      } else {
        kv.release(s.blocks);
      }
      it = running.erase(it);
    }
  }

  // A step's second half: runs the planned work. min_rows: the expert group's widest graph step.
  std::vector<RequestOutput> run(int64_t min_rows = 0) {
    at::NoGradGuard no_grad;
    const auto t0 = step_start, t1 = clock::now();  // scheduling includes a group's agreement
    std::vector<RequestOutput> finished;
    if (work.empty()) return finished;
    std::vector<int64_t> cu_seqlens = {0};
    for (const Work& w : work) cu_seqlens.push_back(cu_seqlens.back() + w.n);
    const Forward f = forward(cu_seqlens, min_rows);
    const auto t2 = clock::now();  // the routing copy in forward waited for the device
    st.steps++;
    st.model_tokens += cu_seqlens.back();
    std::vector<std::pair<Seq*, int64_t>> ready = record_routing(f.routing, cu_seqlens);
    const at::Tensor logits = ready_logits(f, ready);
    const Draws d = fork_draws(ready);
    draw(d.draws, logits, f.graph.logits.defined() ? &f.graph : nullptr);
    const auto t3 = clock::now();
    if (trace) {  // outside the phases above, and timed apart so that benchmarks can take it out
      emit_trace(f.routing, cu_seqlens, d.draws, d.from);
      st.trace_seconds += std::chrono::duration<double>(clock::now() - t3).count();
    }
    account(t0, t1, t2, t3);
    retire(finished);
    return finished;
  }
};

Engine::Engine(const model::Muse& model, EngineConfig config, const WeightSource& source)
    : impl_(std::make_unique<Impl>(model, config, source)) {}
Engine::~Engine() = default;

void Engine::reset_peaks() {
  impl_->st.peak_full_blocks = impl_->kv.pool(true).used();
  impl_->st.peak_window_blocks = impl_->kv.pool(false).used();
}

int64_t Engine::add_request(const Request& request) { return impl_->add(request); }
int64_t Engine::continue_session(int64_t session, const std::vector<int64_t>& observation,
                                 const SamplingParams& params) {
  return impl_->continue_session(session, observation, params);
}
void Engine::end_session(int64_t session) { impl_->end_session(session); }
int64_t Engine::num_sessions() const { return int64_t(impl_->sessions.size()); }
std::vector<RequestOutput> Engine::step() {
  KILN_CHECK(!impl_->ec.expert_group, "rollout: an expert shard's engine steps in lockstep with its group; call ",
             "generate(), not step()");
  return impl_->step();
}
bool Engine::has_unfinished() const { return !impl_->sched.idle(); }
const model::Muse& Engine::model() const { return impl_->model; }
void Engine::set_trace(std::function<void(const StepTrace&)> trace) { impl_->trace = std::move(trace); }

std::vector<RequestOutput> Engine::generate(const std::vector<Request>& requests,
                                            const std::function<void(int64_t, int64_t)>& progress) {
  std::map<int64_t, size_t> slot;
  int64_t total = 0, done = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    slot[add_request(requests[i])] = i;
    total += requests[i].params.n;
  }
  std::vector<RequestOutput> out(requests.size());
  const bool group = impl_->ec.expert_group != nullptr;
  for (std::vector<RequestOutput> now;; now.clear()) {
    if (group ? !impl_->group_step(now) : !has_unfinished()) break;  // under expert sharding: in lockstep
    if (!group) now = step();
    for (RequestOutput& r : now) {
      done += int64_t(r.samples.size());
      auto it = slot.find(r.request_id);
      if (it != slot.end()) out[it->second] = std::move(r);
    }
    if (progress) progress(done, total);
  }
  return out;
}

namespace {

// Copies `count` named tensors (item(i), fetched one at a time) into the same-named tensors of
// `own` in place, each once and with its shape; a name `own` lacks goes to `other`, which takes it
// (true) or refuses it. Every tensor of `own` must come. Returns the bytes copied. `what` names
// the call and `noun` the tensors in errors.
int64_t copy_by_name(const char* what, const char* noun, const Named& own, size_t count, const Item& item,
                     const std::function<bool(const std::string&, const at::Tensor&)>& other) {
  at::NoGradGuard g;
  std::map<std::string, at::Tensor> by_name(own.begin(), own.end());
  std::set<std::string> seen;
  int64_t bytes = 0;
  for (size_t i = 0; i < count; ++i) {
    const auto [name, t] = item(i);
    KILN_CHECK(seen.insert(name).second, "rollout: ", what, " got ", name, " twice");
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      KILN_CHECK(other && other(name, t), "rollout: ", what, " got ", name, ", which is not one of the engine's ", noun);
    } else {
      KILN_CHECK(t.sizes() == it->second.sizes(), "rollout: ", what, " tensor ", name, " has shape ", t.sizes(),
                 ", expected ", it->second.sizes());
      it->second.copy_(t);
    }
    bytes += int64_t(t.numel()) * int64_t(t.element_size());
  }
  for (const auto& [name, t] : own)
    KILN_CHECK(seen.count(name), "rollout: ", what, " did not get ", name, " (", count, " ", noun,
               " given, the engine has ", own.size(), ")");
  return bytes;
}

// named[i], or what `source` (when given) fetches for it.
Item items_of(const Named& named, const WeightSource& source = {}) {
  return [&named, &source](size_t i) {
    at::Tensor w = source ? source(named[i].first, named[i].second) : at::Tensor();
    return std::make_pair(named[i].first, w.defined() ? w : named[i].second);
  };
}

}  // namespace

void Engine::update_weights(const Named& named) { impl_->update_weights(named.size(), items_of(named)); }

int64_t Engine::update_weights(const model::Muse& from, const WeightSource& source) {
  const Named named = from.named_parameters();
  return impl_->update_weights(named.size(), items_of(named, source));
}

int64_t Engine::update_adapters(const Named& named) { return impl_->update_adapters(named.size(), items_of(named)); }

int64_t Engine::update_adapters(const model::Muse& from, const WeightSource& source) {
  const Named named = model::lora_parameters(from);
  return impl_->update_adapters(named.size(), items_of(named, source));
}

int64_t Engine::Impl::update_weights(size_t count, const Item& item) {
  KILN_CHECK(!ec.share_weights, "rollout: update_weights on an engine that shares its model's weights "
             "(share_weights: a frozen base); it takes update_adapters only");
  // A linear served from NVFP4 has no dense tensor: it is re-quantised from the trainer's weights.
  const int64_t bytes = copy_by_name("update_weights", "tensors", model.named_parameters(), count, item,
                                     [&](const std::string& name, const at::Tensor& t) { return model::requantize(model, name, t); });
  weight_version++;
  return bytes;
}

int64_t Engine::Impl::update_adapters(size_t count, const Item& item) {
  const Named own = model::lora_parameters(model);
  KILN_CHECK(!own.empty(), "rollout: update_adapters: the engine's model has no LoRA adapters");
  const int64_t bytes = copy_by_name("update_adapters", "adapters", own, count, item, {});
  weight_version++;
  return bytes;
}

int64_t Engine::weight_version() const { return impl_->weight_version; }

EngineStats Engine::stats() const {
  EngineStats s = impl_->st;
  s.preemptions = impl_->sched.preemptions();
  s.full_blocks_used = impl_->kv.pool(true).used();
  s.window_blocks_used = impl_->kv.pool(false).used();
  return s;
}

}  // namespace kiln::rollout
