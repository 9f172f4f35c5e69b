// `kiln generate`: completions of prompts sampled by the rollout engine, printed or saved as HDF5
// (tokens, log-probs, routing). `kiln mismatch`: the same sampling, each token then rescored by the
// trainer's forward (rollout routing replayed, and its own) and the train-vs-rollout gap reported.
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "core/error.h"
#include "core/files.h"
#include "core/hdf5_io.h"
#include "kernels/kernel_choice.h"
#include "model/checkpoint.h"
#include "model/lora.h"
#include "rollout/engine.h"
#include "tools/commands.h"
#include "tools/gnuplot.h"
#include "tools/kernel_flags.h"
#include "text/tokenizer.h"
#include "tools/token_ids.h"
#include "trainer/dataset.h"
#include "trainer/losses.h"
#include "trainer/recipe.h"
#include "trainer/scoring.h"

namespace kiln::tools {
namespace {

using Clock = std::chrono::steady_clock;

// One prompt before tokenization checks: where it came from (for errors) and its request.
struct Prompt {
  std::string where;  // "prompts.jsonl:3" or "--prompt #1"
  rollout::Request request;
};

// Text prompts are encoded with the model's tokenizer (--tokenizer, or the files beside the
// checkpoint), else byte by byte (the tiny models; ids outside the model's vocabulary are caught by
// check_prompt with the prompt named).
std::vector<int64_t> encode_text(const text::Tokenizer& tok, const std::string& text) {
  return tok.encode(text, /*add_special_tokens=*/true);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The sampling fields a JSONL line may override; anything else on the line (answers, metadata) is
// left for other tools.
void apply_overrides(const nlohmann::json& j, const std::string& where, rollout::SamplingParams& p) {
  auto get_int = [&](const char* key, int64_t& dst) {
    if (!j.contains(key)) return;
    KILN_CHECK(j[key].is_number_integer(), "generate: ", where, ": \"", key, "\" must be an integer (got ",
               j[key].dump(), ")");
    dst = j[key].get<int64_t>();
  };
  auto get_double = [&](const char* key, double& dst) {
    if (!j.contains(key)) return;
    KILN_CHECK(j[key].is_number(), "generate: ", where, ": \"", key, "\" must be a number (got ", j[key].dump(), ")");
    dst = j[key].get<double>();
  };
  get_int("n", p.n);
  get_int("max_tokens", p.max_tokens);
  get_int("top_k", p.top_k);
  get_double("temperature", p.temperature);
  get_double("top_p", p.top_p);
  if (j.contains("seed")) {
    KILN_CHECK(j["seed"].is_number_unsigned(), "generate: ", where, ": \"seed\" must be a non-negative integer (got ",
               j["seed"].dump(), ")");
    p.seed = j["seed"].get<uint64_t>();
  }
}

// Reads a JSONL prompts file: one object per non-blank line with "prompt_ids" or "prompt". Prompt i
// (counting all prompts so far) gets seed base_seed + i unless its line sets "seed".
void read_prompts_file(const std::string& path, const rollout::SamplingParams& defaults, uint64_t base_seed,
                       const text::Tokenizer& tok, std::vector<Prompt>& out) {
  check_input_file(path, "generate: --prompts", "give a JSONL file of prompts");
  std::ifstream in(path);
  KILN_CHECK(in.good(), "generate: cannot open --prompts file (path=", path, "); check the path");
  std::string line;
  for (int lineno = 1; std::getline(in, line); ++lineno) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(lineno);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      KILN_FAIL("generate: ", where, ": bad JSON (", e.what(), "); each line must be one JSON object");
    }
    KILN_CHECK(j.is_object(), "generate: ", where, ": expected a JSON object with \"prompt_ids\" or \"prompt\" (got ",
               j.type_name(), ")");
    const bool has_ids = j.contains("prompt_ids"), has_text = j.contains("prompt");
    KILN_CHECK(has_ids != has_text, "generate: ", where, ": ",
               has_ids ? "both \"prompt_ids\" and \"prompt\" given" : "no \"prompt_ids\" or \"prompt\" key",
               "; give exactly one of them");
    Prompt p{where, {{}, defaults}};
    p.request.params.seed = base_seed + out.size();
    if (has_ids) {
      const auto& ids = j["prompt_ids"];
      KILN_CHECK(ids.is_array(), "generate: ", where, ": \"prompt_ids\" must be an array of integers (got ",
                 ids.type_name(), ")");
      for (const auto& v : ids) {
        KILN_CHECK(v.is_number_integer(), "generate: ", where, ": \"prompt_ids\" holds ", v.dump(),
                   "; expected integers");
        p.request.prompt.push_back(v.get<int64_t>());
      }
    } else {
      KILN_CHECK(j["prompt"].is_string(), "generate: ", where, ": \"prompt\" must be a string (got ",
                 j["prompt"].type_name(), ")");
      p.request.prompt = encode_text(tok, j["prompt"].get<std::string>());
    }
    apply_overrides(j, where, p.request.params);
    out.push_back(std::move(p));
  }
}

// Checks the values the engine would reject, naming the prompt they came from.
void check_prompt(const Prompt& p, int64_t vocab_size) {
  const auto& ids = p.request.prompt;
  KILN_CHECK(!ids.empty(), "generate: ", p.where, ": empty prompt; give at least one token");
  for (size_t i = 0; i < ids.size(); ++i)
    KILN_CHECK(ids[i] >= 0 && ids[i] < vocab_size, "generate: ", p.where, ": token ", i,
               " is outside the vocabulary (id=", ids[i], ", vocab_size=", vocab_size,
               "); use ids below vocab_size, or a tokenizer that matches the model");
  const auto& s = p.request.params;
  KILN_CHECK(s.n >= 1, "generate: ", p.where, ": n must be at least 1 (n=", s.n, "); ask for one or more samples");
  KILN_CHECK(s.max_tokens >= 1, "generate: ", p.where, ": max_tokens must be at least 1 (max_tokens=", s.max_tokens,
             "); allow one or more generated tokens");
  KILN_CHECK(s.temperature >= 0, "generate: ", p.where, ": temperature must be >= 0 (temperature=", s.temperature,
             "); use 0 for greedy");
  KILN_CHECK(s.top_p > 0 && s.top_p <= 1, "generate: ", p.where, ": top_p must be in (0, 1] (top_p=", s.top_p, ")");
  KILN_CHECK(s.top_k >= 0, "generate: ", p.where, ": top_k must be >= 0 (top_k=", s.top_k, "); 0 disables it");
}

// The ids as text when they are all printable ASCII (newlines and tabs escaped); empty otherwise.
bool printable_text(const std::vector<int64_t>& ids, std::string& text) {
  text.clear();
  for (int64_t id : ids) {
    if (id == '\n') text += "\\n";
    else if (id == '\t') text += "\\t";
    else if (id == '"' || id == '\\') text += '\\', text += char(id);
    else if (id >= 32 && id < 127) text += char(id);
    else return false;
  }
  return true;
}

// Writes the samples flat, one row per sample, in request then sample order.
void write_samples(const std::string& path, const std::vector<rollout::Request>& requests,
                   const std::vector<rollout::RequestOutput>& outputs, const std::string& model,
                   const std::string& dtype, const std::function<void(hdf5::Writer&)>& extra = {}) {
  std::vector<int64_t> tokens, lengths, prompt_lengths, offsets{0}, prompt_tokens, routing_offsets{0};
  std::vector<int64_t> request_index, sample_index, finish;
  std::vector<float> logprobs;
  std::vector<at::Tensor> routing;
  for (size_t r = 0; r < outputs.size(); ++r) {
    const auto& prompt = requests[r].prompt;
    for (size_t s = 0; s < outputs[r].samples.size(); ++s) {
      const rollout::Sample& x = outputs[r].samples[s];
      const int64_t len = int64_t(x.tokens.size()), plen = int64_t(prompt.size());
      tokens.insert(tokens.end(), x.tokens.begin(), x.tokens.end());
      logprobs.insert(logprobs.end(), x.logprobs.begin(), x.logprobs.end());
      lengths.push_back(len);
      prompt_lengths.push_back(plen);
      offsets.push_back(offsets.back() + len);
      prompt_tokens.insert(prompt_tokens.end(), prompt.begin(), prompt.end());
      KILN_CHECK(x.routing.defined() && x.routing.dim() == 3 && x.routing.size(0) == plen + len,
                 "generate: sample ", s, " of request ", r, " has routing of the wrong shape (expected ", plen + len,
                 " rows); this is an engine bug");
      routing.push_back(x.routing.cpu().to(at::kByte));
      routing_offsets.push_back(routing_offsets.back() + plen + len);
      request_index.push_back(int64_t(r));
      sample_index.push_back(int64_t(s));
      finish.push_back(x.finish == rollout::FinishReason::kStop ? 0 : 1);
    }
  }
  auto longs = [](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong); };
  hdf5::Writer w(path);
  w.write("tokens", longs(tokens));
  w.write("logprobs", at::tensor(logprobs, at::kFloat));
  w.write("lengths", longs(lengths));
  w.write("prompt_lengths", longs(prompt_lengths));
  w.write("offsets", longs(offsets));
  w.write("prompt_tokens", longs(prompt_tokens));
  w.write("routing", at::cat(routing, 0));
  w.write("routing_offsets", longs(routing_offsets));
  w.write("request_index", longs(request_index));
  w.write("sample_index", longs(sample_index));
  w.write("finish_reason", longs(finish).to(at::kByte));
  w.attribute("model", model);
  w.attribute("dtype", dtype);
  w.attribute("finish_reason_codes", "0=stop,1=length");
  if (extra) extra(w);
  w.commit();
}

// What `kiln mismatch` measured: the trainer's log-prob of every sampled token with the rollout's
// routing replayed and with its own, and the routing it chose itself.
struct Rescored {
  at::Tensor lp_rollout, lp_replay, lp_own;  // [response tokens] float64, in sample order
  at::Tensor lp_alone;                       // the same with R3, every sequence in a batch of its own
  at::Tensor entropy;                        // [response tokens] the trainer's entropy there (nats)
  at::Tensor position;                       // [response tokens] int64: the token's index in its response
  at::Tensor own_routing, rollout_routing;   // [response tokens, L, k] uint8
  trainer::MismatchMetrics replay, own;
  std::vector<std::string> token_where;      // "request r sample s token i: ...context [token]"
  int64_t micro_batch = 0;
};

Rescored rescore(const model::Muse& m, const std::vector<rollout::Request>& requests,
                 const std::vector<rollout::RequestOutput>& outputs, double temperature, int64_t micro_batch,
                 bool bitwise) {
  std::vector<trainer::Trajectory> trajs;
  std::vector<int64_t> pos;  // each response token's index in its response
  Rescored r;
  for (size_t q = 0; q < outputs.size(); ++q)
    for (size_t s = 0; s < outputs[q].samples.size(); ++s) {
      const rollout::Sample& x = outputs[q].samples[s];
      if (x.tokens.empty()) continue;
      trainer::Trajectory t;
      t.tokens = requests[q].prompt;
      t.prompt_len = int64_t(t.tokens.size());
      t.tokens.insert(t.tokens.end(), x.tokens.begin(), x.tokens.end());
      t.rollout_lp = x.logprobs;
      t.routing = x.routing.cpu().to(at::kByte);
      for (size_t i = 0; i < x.tokens.size(); ++i) {
        pos.push_back(int64_t(i));
        // The six ids before the token (prompt included), then the token.
        const size_t at_ = size_t(t.prompt_len) + i, from = at_ >= 6 ? at_ - 6 : 0;
        std::vector<int64_t> ctx(t.tokens.begin() + long(from), t.tokens.begin() + long(at_));
        r.token_where.push_back(fmt::format("request {} sample {} token {}: {}{} [{}]", q, s, i, from > 0 ? "... " : "",
                                            fmt::join(ctx, " "), t.tokens[at_]));
      }
      trajs.push_back(std::move(t));
    }
  KILN_CHECK(!trajs.empty(), "mismatch: no sample has a generated token; raise --max-tokens");
  const trainer::Packed whole = trainer::pack(trajs, 0, trajs.size(), at::kCPU, at::kDouble);
  model::ForwardOptions base;
  base.numerics = bitwise ? model::Numerics::kBitwise : model::Numerics::kStandard;  // --numerics bitwise: the trainer's forward as the engine's
  const trainer::Scored replay = trainer::score_trajectories(m, trajs, true, micro_batch, temperature, base);
  const trainer::Scored own = trainer::score_trajectories(m, trajs, false, micro_batch, temperature, base);
  // The batch-composition effect: each sequence scored alone against inside its micro-batch.
  const trainer::Scored alone = trainer::score_trajectories(m, trajs, true, 1, temperature, base);
  const at::Tensor entropy = trainer::token_entropies(m, trajs, micro_batch, temperature, base);
  const int64_t n = int64_t(trajs.size());
  r.replay = trainer::mismatch_metrics(replay.logprobs.cpu(), whole.rollout_lp, whole.mask, whole.seq_ids, n);
  r.own = trainer::mismatch_metrics(own.logprobs.cpu(), whole.rollout_lp, whole.mask, whole.seq_ids, n);
  // Position t predicts token t + 1: the response tokens' rows, and the routing of the token that
  // produced each prediction.
  at::Tensor rows = whole.mask.nonzero().squeeze(1);
  r.lp_rollout = whole.rollout_lp.index_select(0, rows);
  r.lp_replay = replay.logprobs.cpu().index_select(0, rows);
  r.lp_own = own.logprobs.cpu().index_select(0, rows);
  r.lp_alone = alone.logprobs.cpu().index_select(0, rows);
  r.entropy = entropy.index_select(0, rows);
  r.position = at::tensor(pos, at::kLong);
  KILN_CHECK(r.position.numel() == r.lp_rollout.numel(), "mismatch: ", r.position.numel(), " response positions for ",
             r.lp_rollout.numel(), " scored tokens");
  r.micro_batch = micro_batch;
  r.own_routing = own.routing.index_select(0, rows);
  r.rollout_routing = whole.routing.index_select(0, rows);
  return r;
}

void print_mismatch(const Rescored& r, int64_t worst) {
  auto row = [](const char* name, const trainer::MismatchMetrics& x) {
    fmt::print("  {:<22} {:>12.3e} {:>12.3e} {:>10.3e} {:>10.3e} {:>12.3e}\n", name, x.mean_abs_seq, x.mean_abs_token,
               x.max_abs, x.k3_kl, x.frac_outside);
  };
  fmt::print("mismatch over {} response tokens, d = lp_trainer - lp_rollout:\n", r.replay.tokens);
  fmt::print("  {:<22} {:>12} {:>12} {:>10} {:>10} {:>12}\n", "", "mean|d| seq", "mean|d| tok", "max|d|", "k3 KL",
             "exp(d)!~[.5,2]");
  row("rollout routing (R3)", r.replay);
  row("own routing", r.own);
  at::Tensor d = (r.lp_replay - r.lp_rollout).abs();
  std::vector<std::string> qs;
  for (double q : {0.5, 0.9, 0.99, 0.999}) qs.push_back(fmt::format("p{:g} {:.3e}", q * 100, at::quantile(d, q).item<double>()));
  fmt::print("|d| quantiles (R3): {}\n", fmt::join(qs, ", "));
  // Per layer: the fraction of response tokens whose own top-k set differs from the rollout's.
  at::Tensor own = std::get<0>(at::sort(r.own_routing.to(at::kLong), -1));
  at::Tensor roll = std::get<0>(at::sort(r.rollout_routing.to(at::kLong), -1));
  at::Tensor differs = own.ne(roll).any(-1).to(at::kDouble);  // [tokens, L]
  std::vector<std::string> layers;
  for (int64_t l = 0; l < differs.size(1); ++l) layers.push_back(fmt::format("{:.4f}", differs.select(1, l).mean().item<double>()));
  fmt::print("own routing differs from the rollout's: {:.4f} of (token, layer) pairs; by layer {}\n",
             differs.mean().item<double>(), fmt::join(layers, " "));
  // The gap by the trainer's entropy at the token and by the token's place in its response.
  auto by = [&](const char* what, const at::Tensor& key, const std::vector<double>& edges, const char* unit) {
    std::vector<std::string> cells;
    for (size_t b = 0; b + 1 < edges.size(); ++b) {
      const at::Tensor in = key.ge(edges[b]).logical_and(key.lt(edges[b + 1]));
      const int64_t n = in.sum().item<int64_t>();
      if (n == 0) continue;
      cells.push_back(fmt::format("[{:g}, {:g}){} {:.3e} ({} tok)", edges[b], edges[b + 1], unit,
                                  d.masked_select(in).mean().item<double>(), n));
    }
    fmt::print("mean|d| (R3) by {}: {}\n", what, fmt::join(cells, ", "));
  };
  const double inf = std::numeric_limits<double>::infinity();
  by("entropy", r.entropy, {0, 0.1, 0.5, 1, 2, 4, inf}, " nats");
  by("position", r.position.to(at::kDouble), {0, 1, 4, 16, 64, 256, 1024, inf}, "");
  const at::Tensor comp = (r.lp_alone - r.lp_replay).abs();
  // The correlation is undefined when every |d| is the same (bitwise numerics: all 0).
  const double corr = d.std().item<double>() > 0 ? at::corrcoef(at::stack({d, r.entropy})).index({0, 1}).item<double>()
                                                  : std::nan("");
  fmt::print("batch composition (R3): each sequence scored alone vs in micro-batches of {}: mean|d| {:.3e}, max|d| "
             "{:.3e}; corr(|d|, entropy) {}\n",
             r.micro_batch, comp.mean().item<double>(), comp.max().item<double>(),
             std::isnan(corr) ? std::string("undefined (|d| constant)") : fmt::format("{:.3f}", corr));
  const int64_t k = std::min<int64_t>(worst, d.numel());
  if (k <= 0) return;
  at::Tensor top = std::get<1>(d.topk(k));
  fmt::print("largest |d| (R3):\n");
  for (int64_t i = 0; i < k; ++i) {
    const int64_t t = top[i].item<int64_t>();
    fmt::print("  {}: lp_rollout {:.5f}, lp_trainer {:.5f} (own routing {:.5f}), entropy {:.3f}\n",
               r.token_where[size_t(t)], r.lp_rollout[t].item<double>(), r.lp_replay[t].item<double>(),
               r.lp_own[t].item<double>(), r.entropy[t].item<double>());
  }
}

// The rollout's batch-composition effect: each request generated again on its own, its samples
// drawn from the same streams (seed, sample, position), against the batched run. Tokens match until
// a draw flips; the log-probs of the tokens before that are compared.
void rollout_alone(rollout::Engine& engine, const std::vector<rollout::Request>& requests,
                   const std::vector<rollout::RequestOutput>& batched) {
  int64_t samples = 0, identical = 0, shared = 0;
  double sum = 0, worst = 0;
  for (size_t q = 0; q < requests.size(); ++q) {
    const rollout::RequestOutput one = engine.generate({requests[q]}).front();
    for (size_t s = 0; s < one.samples.size() && s < batched[q].samples.size(); ++s) {
      const rollout::Sample &x = batched[q].samples[s], &y = one.samples[s];
      ++samples;
      identical += x.tokens == y.tokens;
      for (size_t i = 0; i < std::min(x.tokens.size(), y.tokens.size()) && x.tokens[i] == y.tokens[i]; ++i) {
        const double d = std::abs(double(x.logprobs[i]) - double(y.logprobs[i]));
        sum += d, worst = std::max(worst, d), ++shared;
      }
    }
  }
  fmt::print("rollout batch composition: each prompt generated alone vs in the batch of {}: {} of {} samples the same "
             "tokens; over the {} tokens before any divergence, mean|d lp_rollout| {:.3e}, max {:.3e}\n",
             requests.size(), identical, samples, shared, shared ? sum / double(shared) : 0.0, worst);
}

// A PNG of the gap: histograms of log10 |d| with the rollout's routing and with the trainer's own,
// and |d| against the trainer's entropy at the token.
void plot_mismatch(const Rescored& r, const std::string& png) {
  const std::string dat = png + ".dat", script = png + ".gp";
  {
    std::ofstream f(dat);
    KILN_CHECK(f.good(), "mismatch: cannot write ", dat, " (for --png ", png, ")");
    const at::Tensor d3 = (r.lp_replay - r.lp_rollout).abs().contiguous(),
                     d_own = (r.lp_own - r.lp_rollout).abs().contiguous(), h = r.entropy.contiguous();
    const auto a = d3.accessor<double, 1>(), b = d_own.accessor<double, 1>(), e = h.accessor<double, 1>();
    for (int64_t i = 0; i < a.size(0); ++i) f << fmt::format("{:.6e} {:.6e} {:.6e}\n", a[i], b[i], e[i]);
  }
  {
    std::ofstream gp(script);
    // |d| = 0 (bitwise agreement) is drawn at 1e-12.
    gp << "set terminal pngcairo noenhanced size 1100,450\nset output '" << png << "'\n"
       << "set multiplot layout 1,2 title 'kiln mismatch: d = lp_trainer - lp_rollout, " << r.replay.tokens
       << " tokens'\nset grid\nbin(x) = 0.25 * floor(log10(x + 1e-12) / 0.25)\n"
       << "set xlabel 'log10 |d|'\nset ylabel 'tokens'\nset style fill transparent solid 0.5\nset boxwidth 0.25\n"
       << "plot '" << dat << "' u (bin($1)):(1) smooth frequency w boxes t 'rollout routing (R3)', "
       << "'' u (bin($2)):(1) smooth frequency w boxes t 'own routing'\n"
       << "set xlabel 'trainer entropy (nats)'\nset ylabel '|d| (R3)'\nset logscale y\n"
       << "plot '" << dat << "' u 3:($1 + 1e-12) w p pt 7 ps 0.4 t ''\nunset multiplot\n";
  }
  run_gnuplot(script, {dat}, "mismatch");
}


// The flags of `generate` and `mismatch`; a --recipe fills those not given.
struct SamplingArgs {
  std::string model, tokenizer, prompts_file, out, dtype = "fp32", device = "cpu";
  std::vector<std::string> prompts, stop;
  int64_t n = 1, max_tokens = 64, top_k = 0;
  double temperature = 1.0, top_p = 1.0;
  uint64_t seed = 0;
  int64_t kv_cache_mb = 256, block_size = 16, max_num_seqs = 64, max_batch_tokens = 2048, prefill_chunk = 512;
  bool quiet = false;
  std::string quantization = "none", numerics = "standard", lora, recipe;
  bool lora_merged = false, no_cuda_graphs = false;
  int64_t max_prompts = 0;
  int64_t micro_batch_seqs = 64, worst = 5;
  std::string png;
  bool alone = false;
  KernelFlags kernels;
};

// Whether the command line gave the flag, so that a recipe's value does not replace it.
bool given(CLI::App* cmd, const char* flag) { return cmd->count(flag) > 0; }

// The flags both commands take, and with `mismatch` the rescoring's own.
void add_sampling_options(CLI::App* cmd, SamplingArgs& a, bool mismatch) {
  add_kernel_flags(cmd, a.kernels);
  cmd->add_option("--model", a.model, "Checkpoint directory (config.json + safetensors)")->required();
  cmd->add_option("--tokenizer", a.tokenizer,
                  "Tokenizer (a folder or tokenizer.json / *.tiktoken); default: the checkpoint's files, else bytes");
  cmd->add_option("--prompts", a.prompts_file, "JSONL file of prompts (see above)");
  cmd->add_option("--prompt", a.prompts, "A prompt: text, or \"ids:1,2,3\" for token ids; repeat for more");
  cmd->add_option("-n,--num-samples", a.n, "Samples per prompt")->capture_default_str();
  cmd->add_option("--max-tokens", a.max_tokens, "Generated tokens per sample, stop token included")
      ->capture_default_str();
  cmd->add_option("--temperature", a.temperature, "Sampling temperature; 0 = greedy")->capture_default_str();
  cmd->add_option("--top-p", a.top_p, "Nucleus mass kept, (0, 1]")->capture_default_str();
  cmd->add_option("--top-k", a.top_k, "Keep the k most likely tokens; 0 = all")->capture_default_str();
  cmd->add_option("--seed", a.seed, "Base seed; prompt i uses seed + i unless its line sets \"seed\"")->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--stop", a.stop, "Stop token ids (repeat or comma list, e.g. \"2,7\")");
  cmd->add_option("--out", a.out, "Save samples, log-probs and routing to this .h5/.hdf5 file");
  cmd->add_option("--dtype", a.dtype, "Compute dtype: fp32, bf16 or fp64")->capture_default_str();
  cmd->add_option("--device", a.device, "cpu or cuda")->capture_default_str();
  cmd->add_option("--kv-cache-mb", a.kv_cache_mb, "KV-cache budget in MiB")->capture_default_str();
  cmd->add_option("--block-size", a.block_size, "Tokens per KV block")->capture_default_str();
  cmd->add_option("--max-num-seqs", a.max_num_seqs, "Running sequences at once")->capture_default_str();
  cmd->add_option("--max-batch-tokens", a.max_batch_tokens, "Tokens per engine step")->capture_default_str();
  cmd->add_option("--prefill-chunk", a.prefill_chunk, "Longest prefill piece per sequence per step")
      ->capture_default_str();
  cmd->add_flag("--quiet", a.quiet, "No progress line on stderr");
  cmd->add_option("--quantization", a.quantization, "Rollout weights: none, nvfp4 (W4A16) or w4a4")
      ->check(CLI::IsMember({"none", "nvfp4", "w4a4"}))
      ->capture_default_str();
  cmd->add_option("--numerics", a.numerics,
                  "standard, or bitwise: batch-invariant numerics, under which the trainer's forward rescores every "
                  "sampled token to the same bits (slow; dense weights, no top-p or top-k)")
      ->check(CLI::IsMember({"standard", "bitwise"}))
      ->capture_default_str();
  cmd->add_option("--lora", a.lora,
                  "A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) on the model, applied "
                  "unmerged");
  cmd->add_flag("--lora-merged", a.lora_merged,
                "The rollout engine serves the --lora adapter folded into its own copy of the base weights"
                + std::string(mismatch ? " (the trainer's rescoring keeps it unmerged: the gap merging makes)" : ""));
  cmd->add_flag("--no-cuda-graphs", a.no_cuda_graphs, "Decode steps run eagerly instead of replaying CUDA graphs");
  cmd->add_option("--recipe", a.recipe,
                  "A GRPO recipe whose rollout settings (engine, samples, max tokens, temperature, top-p/k), dtype, "
                  "device and tokenizer are the defaults; without --prompt or --prompts, its held-out prompts, "
                  "rendered as training renders them. Flags given here win");
  cmd->add_option("--max-prompts", a.max_prompts, "With --recipe: at most this many of its held-out prompts (0: all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  if (mismatch) {
    cmd->add_option("--micro-batch-seqs", a.micro_batch_seqs, "Sequences per rescoring forward")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    cmd->add_option("--worst", a.worst, "Tokens with the largest gap to list")->check(CLI::NonNegativeNumber)->capture_default_str();
    cmd->add_option("--png", a.png, "Also draw the gap's histograms and |d| against entropy here (needs gnuplot)");
    cmd->add_flag("--alone", a.alone,
                  "Also generate every prompt again on its own and compare with the batched rollout (the engine's "
                  "batch-composition effect)");
  }
}

// --recipe: its settings fill every flag not given on the command line.
std::optional<trainer::Recipe> apply_recipe(SamplingArgs& a, CLI::App* cmd) {
  std::optional<trainer::Recipe> recipe;
  if (!a.recipe.empty()) {
    recipe = trainer::Recipe::from_yaml_file(a.recipe);
    const trainer::GrpoConfig& g = recipe->grpo;
    if (!given(cmd, "--num-samples")) a.n = g.samples_per_prompt;
    if (!given(cmd, "--max-tokens")) a.max_tokens = g.max_tokens;
    if (!given(cmd, "--temperature")) a.temperature = g.temperature;
    if (!given(cmd, "--top-p")) a.top_p = g.top_p;
    if (!given(cmd, "--top-k")) a.top_k = g.top_k;
    if (!given(cmd, "--dtype")) a.dtype = recipe->dtype;
    if (!given(cmd, "--device")) a.device = recipe->device;
    if (!given(cmd, "--tokenizer")) a.tokenizer = recipe->tokenizer;
  }
  return recipe;
}

// The sampling defaults the flags give. Everything that can be checked without the model is checked
// here, before the load, so a typo costs no load.
rollout::SamplingParams checked_defaults(const SamplingArgs& a, const char* what) {
  KILN_CHECK(a.out.empty() || ends_with(a.out, ".h5") || ends_with(a.out, ".hdf5"),
             "generate: --out must end in .h5 or .hdf5 (out=", a.out, ")");
  KILN_CHECK(a.kv_cache_mb > 0, "generate: --kv-cache-mb must be positive (kv_cache_mb=", a.kv_cache_mb, ")");
  KILN_CHECK(!a.lora_merged || !a.lora.empty(), what, ": --lora-merged needs the adapter, --lora DIR");
  rollout::SamplingParams defaults;
  defaults.n = a.n;
  defaults.max_tokens = a.max_tokens;
  defaults.temperature = a.temperature;
  defaults.top_p = a.top_p;
  defaults.top_k = a.top_k;
  for (const auto& s : a.stop) {
    auto ids = parse_ids(s, "generate", "--stop");
    defaults.stop_token_ids.insert(defaults.stop_token_ids.end(), ids.begin(), ids.end());
  }
  // The flags' own values are checked once here so their errors name the flag, not a prompt.
  check_prompt(Prompt{"command-line flags", {{0}, defaults}}, std::numeric_limits<int64_t>::max());
  return defaults;
}

// The prompts: the --prompt flags, then the --prompts file, else the recipe's held-out prompts.
std::vector<Prompt> gather_prompts(const SamplingArgs& a, const std::optional<trainer::Recipe>& recipe,
                                   const rollout::SamplingParams& defaults, const text::Tokenizer& tok,
                                   const char* what) {
  std::vector<Prompt> prompts;
  for (size_t i = 0; i < a.prompts.size(); ++i) {
    const std::string& text = a.prompts[i];
    const std::string where = "--prompt #" + std::to_string(i + 1);
    Prompt p{where, {{}, defaults}};
    p.request.params.seed = a.seed + i;  // so that equal prompts still differ
    p.request.prompt = text.rfind("ids:", 0) == 0 ? parse_ids(text.substr(4), "generate", where) : encode_text(tok, text);
    prompts.push_back(std::move(p));
  }
  if (!a.prompts_file.empty()) read_prompts_file(a.prompts_file, defaults, a.seed, tok, prompts);
  if (recipe && prompts.empty()) {  // the recipe's held-out prompts, rendered as its training renders them
    trainer::Dataset d = trainer::load_data(*recipe);
    trainer::prepare_prompts(d.test, tok, recipe->grpo.prompt);
    for (size_t i = 0; i < d.test.size() && (a.max_prompts == 0 || int64_t(i) < a.max_prompts); ++i) {
      Prompt p{a.recipe + " held-out " + d.test[i].origin, {d.test[i].prompt_ids, defaults}};
      p.request.params.seed = a.seed + i;
      prompts.push_back(std::move(p));
    }
    KILN_CHECK(!prompts.empty(), what, ": the recipe ", a.recipe, " has no held-out prompts to sample");
  }
  KILN_CHECK(!prompts.empty(), "generate: no prompts given; pass --prompts FILE.jsonl, --prompt TEXT or --recipe");
  return prompts;
}

// The engine's settings; what runs is written back into the flags, for the report.
rollout::EngineConfig engine_config(SamplingArgs& a, const std::optional<trainer::Recipe>& recipe, CLI::App* cmd) {
  // The engine: the recipe's, or the defaults; the flags given override either.
  rollout::EngineConfig ec = recipe ? recipe->grpo.engine : rollout::EngineConfig();
  auto flag = [&](const char* name) { return !recipe || given(cmd, name); };
  if (flag("--quantization")) ec.quantization = rollout::parse_quantization(a.quantization);
  if (flag("--numerics")) ec.numerics = model::parse_numerics(a.numerics);
  if (flag("--kv-cache-mb")) ec.kv_cache_bytes = a.kv_cache_mb << 20;
  if (flag("--block-size")) ec.block_size = a.block_size;
  if (flag("--max-num-seqs")) ec.max_num_seqs = a.max_num_seqs;
  if (flag("--max-batch-tokens")) ec.max_batch_tokens = a.max_batch_tokens;
  if (flag("--prefill-chunk")) ec.prefill_chunk = a.prefill_chunk;
  if (flag("--no-cuda-graphs")) ec.cuda_graphs = !a.no_cuda_graphs;
  ec.validate();
  a.quantization = rollout::quantization_name(ec.quantization);  // what runs, for the report
  a.numerics = model::numerics_name(ec.numerics);
  a.no_cuda_graphs = !ec.cuda_graphs;
  return ec;
}

// The engine's samples of the requests, with a progress line on stderr unless quiet; *elapsed: the
// seconds taken.
std::vector<rollout::RequestOutput> generate_all(rollout::Engine& engine, const std::vector<rollout::Request>& requests,
                                                bool quiet, double* elapsed) {
  const auto start = Clock::now();
  auto last_print = start;
  bool printed = false;
  auto progress = [&](int64_t done, int64_t total) {
    if (quiet) return;
    const auto now = Clock::now();
    if (done < total && now - last_print < std::chrono::milliseconds(500)) return;
    last_print = now;
    const double secs = std::chrono::duration<double>(now - start).count();
    // Samples count as done only when their whole request is, so tokens show progress within one.
    const int64_t tokens = engine.stats().sampled_tokens;
    const double rate = secs > 0 ? double(tokens) / secs : 0.0;
    std::fprintf(stderr, "\r generate: %lld/%lld samples, %lld tokens, %.1f tok/s   ", (long long)done,
                 (long long)total, (long long)tokens, rate);
    std::fflush(stderr);
    printed = true;
  };
  std::vector<rollout::RequestOutput> outputs = engine.generate(requests, progress);
  *elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  if (printed) std::fprintf(stderr, "\n");
  return outputs;
}

// `mismatch`: every sampled token rescored by the trainer's forward and the gap reported; saved and drawn
// when asked.
void report_mismatch(const SamplingArgs& a, const model::Muse& m, rollout::Engine& engine,
                     const std::vector<rollout::Request>& requests, const std::vector<rollout::RequestOutput>& outputs,
                     double temperature, bool batch_invariant, const std::string& lora_mode, int64_t num_samples,
                     const at::Device& device) {
  const Rescored r = rescore(m, requests, outputs, temperature, a.micro_batch_seqs, batch_invariant);
  const std::string lora = a.lora.empty() ? "" : fmt::format(", LoRA {} {}", a.lora, lora_mode);
  fmt::print("{} samples of {} prompts from {} (rollout weights {}{}, {} on {}, numerics {}{}), rescored by the "
             "trainer's forward\n",
             num_samples, outputs.size(), a.model, a.quantization, lora, a.dtype, device.str(), a.numerics,
             a.no_cuda_graphs ? ", no CUDA graphs" : "");
  print_mismatch(r, a.worst);
  if (a.alone) rollout_alone(engine, requests, outputs);
  if (!a.out.empty())
    write_samples(a.out, requests, outputs, a.model, a.dtype, [&](hdf5::Writer& w) {
      // Per response token, in the order of "tokens": the trainer's log-probs and its own routing.
      w.write("lp_trainer_replay", r.lp_replay.to(at::kFloat));
      w.write("lp_trainer_own", r.lp_own.to(at::kFloat));
      w.write("routing_trainer_own", r.own_routing);
      w.write("lp_trainer_alone", r.lp_alone.to(at::kFloat));
      w.write("entropy_trainer", r.entropy.to(at::kFloat));
      w.attribute("quantization", a.quantization);
      w.attribute("lora", lora_mode);
    });
  if (!a.out.empty()) fmt::print("wrote {}\n", a.out);
  if (!a.png.empty()) {
    plot_mismatch(r, a.png);
    fmt::print("wrote {}\n", a.png);
  }
}

// `generate` without --out: each sample's ids, finish reason and log-prob sum, and its text.
void print_samples(const std::vector<rollout::RequestOutput>& outputs, const text::Tokenizer& tok, bool bytes) {
  std::string text;
  for (size_t r = 0; r < outputs.size(); ++r)
    for (size_t s = 0; s < outputs[r].samples.size(); ++s) {
      const rollout::Sample& x = outputs[r].samples[s];
      double sum = 0;
      for (float lp : x.logprobs) sum += lp;
      fmt::print("request {} sample {} finish={} logprob_sum={:.4f}\n  ids: {}\n", r, s,
                 rollout::finish_reason_name(x.finish), sum, fmt::join(x.tokens, ","));
      if (!bytes) fmt::print("  text: {}\n", nlohmann::json(tok.decode(x.tokens)).dump());
      else if (printable_text(x.tokens, text)) fmt::print("  text: \"{}\"\n", text);
    }
}

}  // namespace

// `generate`, or with `mismatch` set `kiln mismatch`: the same sampling, then the rescoring.
Run add_sampling_command(CLI::App& app, bool mismatch) {
  const char* prompts_help =
      "Prompts file (JSONL): one object per line with \"prompt_ids\": [ints] or \"prompt\": \"text\" (encoded by the\n"
      "model's tokenizer, or byte by byte for models without one); optional \"n\", \"max_tokens\", \"temperature\", \"top_p\", \"top_k\", \"seed\" override\n"
      "the flags; other keys are ignored. Prompt i's seed defaults to --seed + i.";
  auto* cmd = app.add_subcommand(
      mismatch ? "mismatch" : "generate",
      (mismatch ? std::string("Sample with the rollout engine, then rescore every sampled token with the trainer's forward\n"
                              "(rollout routing replayed, and the model's own) and report the train-vs-rollout log-prob gap.\n"
                              "No weight changes.\n")
                : std::string("Sample completions of prompts with the rollout engine; print them or save them as HDF5.\n")) +
          prompts_help);
  auto a = std::make_shared<SamplingArgs>();
  add_sampling_options(cmd, *a, mismatch);
  const char* what = mismatch ? "mismatch" : "generate";
  return [a, cmd, mismatch, what] {
    std::optional<trainer::Recipe> recipe = apply_recipe(*a, cmd);
    kernels::KernelChoice kernel_choice = recipe ? recipe->kernels : kernels::KernelChoice{};
    select_kernels(a->kernels, kernel_choice);
    rollout::SamplingParams defaults = checked_defaults(*a, what);
    // A tokenizer with files: its stop ids end samples unless --stop says otherwise.
    std::shared_ptr<const text::Tokenizer> tok;
    if (!a->tokenizer.empty()) tok = text::load_tokenizer(a->tokenizer);
    else if (text::has_tokenizer_files(a->model)) tok = text::load_tokenizer(a->model);
    const bool bytes = !tok;
    if (bytes) tok = text::make_byte_tokenizer(256);
    if (!bytes && a->stop.empty()) defaults.stop_token_ids = tok->stop_ids();
    std::vector<Prompt> prompts = gather_prompts(*a, recipe, defaults, *tok, what);

    at::NoGradGuard no_grad;
    const at::Device device = model::parse_device(a->device, "generate: --device");
    model::Muse m = model::load_checkpoint(a->model, model::parse_dtype(a->dtype), device);
    if (!a->lora.empty()) model::load_peft_adapter(m, a->lora);
    std::vector<rollout::Request> requests;
    for (const Prompt& p : prompts) {
      check_prompt(p, m.config().vocab_size);
      requests.push_back(p.request);
    }

    if (mismatch)
      for (const Prompt& p : prompts) {
        const rollout::SamplingParams& sp = p.request.params;
        KILN_CHECK(sp.temperature == defaults.temperature && sp.top_p == 1.0 && sp.top_k == 0, what, ": ", p.where,
                   " samples at temperature ", sp.temperature, ", top_p ", sp.top_p, ", top_k ", sp.top_k,
                   "; the rescoring uses one distribution: give the temperature with --temperature and leave top_p 1 "
                   "and top_k 0 (a truncated distribution is not the trainer's)");
      }
    const rollout::EngineConfig ec = engine_config(*a, recipe, cmd);
    // The engine serves the model itself, or with --lora-merged a view whose adapted weights are
    // merged copies (m keeps its base and adapters for the rescoring); the engine holds its own
    // copy, so the view goes once it is built.
    rollout::Engine engine = [&] {
      if (!a->lora_merged) return rollout::Engine(m, ec);
      model::Muse merged(m.config(), m.weights());
      model::merge_lora(merged);
      return rollout::Engine(merged, ec);
    }();

    double secs = 0;
    const std::vector<rollout::RequestOutput> outputs = generate_all(engine, requests, a->quiet, &secs);

    const std::string lora_mode = a->lora.empty() ? "none" : a->lora_merged ? "merged" : "unmerged";
    int64_t num_tokens = 0, num_samples = 0;
    for (const auto& r : outputs)
      for (const auto& s : r.samples) num_tokens += int64_t(s.tokens.size()), ++num_samples;
    if (mismatch) {
      report_mismatch(*a, m, engine, requests, outputs, defaults.temperature > 0 ? defaults.temperature : 1.0,
                      ec.bitwise(), lora_mode, num_samples, device);
      return;
    }
    if (!a->out.empty()) {
      write_samples(a->out, requests, outputs, a->model, a->dtype, [&](hdf5::Writer& w) { w.attribute("lora", lora_mode); });
    } else {
      print_samples(outputs, *tok, bytes);
    }
    fmt::print("generated {} tokens in {} samples ({} prompts) in {:.2f} s, {:.1f} tok/s{}\n", num_tokens, num_samples,
               outputs.size(), secs, secs > 0 ? double(num_tokens) / secs : 0.0,
               a->out.empty() ? "" : fmt::format("; wrote {}", a->out));
  };
}

Run add_generate(CLI::App& app) { return add_sampling_command(app, /*mismatch=*/false); }
Run add_mismatch(CLI::App& app) { return add_sampling_command(app, /*mismatch=*/true); }

}  // namespace kiln::tools
