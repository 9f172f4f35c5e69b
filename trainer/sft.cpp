// Supervised warm start: packed (prompt, answer, eos) sequences, loss on the answer side only.
#include "trainer/sft.h"

#include <ATen/ATen.h>
#include <torch/types.h>  // clip_grad.h uses torch::Tensor without including it
#include <torch/nn/utils/clip_grad.h>

#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include <cmath>

#include "core/error.h"
#include "core/yaml_util.h"
#include "parallel/context_parallel.h"
#include "parallel/parallel.h"
#include "parallel/sharded_model.h"
#include "model/expert_parallel.h"
#include "text/tokenizer.h"
#include "trainer/update_guard.h"

namespace kiln::trainer {

void SftConfig::validate() const {
  KILN_CHECK(steps >= 0, "sft: steps must be >= 0 (got ", steps, ")");
  KILN_CHECK(batch_size > 0, "sft: batch_size must be positive (got ", batch_size, ")");
  KILN_CHECK(std::isfinite(grad_clip) && grad_clip >= 0, "sft: grad_clip must be finite and >= 0 (got ", grad_clip,
             "); 0 turns clipping off");
  KILN_CHECK(stop_after_nonfinite >= 1, "sft: stop_after_nonfinite must be at least 1 (got ", stop_after_nonfinite,
             "): that many non-finite losses or gradient norms in a row stop the run");
  optim.validate();
  schedule.validate();
  prompt.validate();
}

Demonstrations parse_demonstrations(const std::string& name) {
  if (name == "label") return Demonstrations::kLabel;
  if (name == "environment") return Demonstrations::kEnvironment;
  KILN_FAIL("sft: demonstrations must be label or environment (got '", name, "')");
}

const char* demonstrations_name(Demonstrations d) {
  return d == Demonstrations::kEnvironment ? "environment" : "label";
}

void read_yaml(yaml::MapReader& s, SftConfig& c, bool environment) {
  s.get("steps", c.steps);
  s.get("batch_size", c.batch_size);
  read_yaml(s, c.optim);
  s.get("grad_clip", c.grad_clip);
  s.get("stop_after_nonfinite", c.stop_after_nonfinite);
  read_yaml(s, c.schedule);
  s.get_enum("demonstrations", c.demonstrations, parse_demonstrations, demonstrations_name);
  if (c.demonstrations == Demonstrations::kEnvironment && !environment)
    s.fail("demonstrations", "environment needs the recipe's environment: section (its workers demonstrate)");
  s.finish();
  s.check("", [&] { c.validate(); });
}

void write_yaml(YAML::Emitter& e, const SftConfig& c) {
  e << YAML::Key << "steps" << YAML::Value << c.steps;
  e << YAML::Key << "batch_size" << YAML::Value << c.batch_size;
  write_yaml(e, c.optim);
  e << YAML::Key << "grad_clip" << YAML::Value << c.grad_clip;
  e << YAML::Key << "stop_after_nonfinite" << YAML::Value << c.stop_after_nonfinite;
  write_yaml(e, c.schedule);
  e << YAML::Key << "demonstrations" << YAML::Value << demonstrations_name(c.demonstrations);
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> sft_sequence(const Example& ex, const text::Tokenizer& tok) {
  const std::vector<int64_t>& prompt = ex.prompt_ids;
  std::vector<int64_t> answer = ex.answer_ids;
  if (answer.empty()) {
    answer = tok.encode(ex.label);
    answer.push_back(tok.stop_ids().front());
  }
  std::vector<int64_t> seq = prompt;
  seq.insert(seq.end(), answer.begin(), answer.end());
  // Position j predicts token j + 1; only answer tokens are targets, less a demonstration's
  // observations.
  std::vector<int64_t> targets;
  for (size_t j = 0; j < seq.size(); ++j) {
    const bool answer_side = j + 1 < seq.size() && j + 1 >= prompt.size();
    const bool trained = answer_side && (ex.answer_trained.empty() || ex.answer_trained[j + 1 - prompt.size()] != 0);
    targets.push_back(trained ? seq[j + 1] : -100);
  }
  return {std::move(seq), std::move(targets)};
}

DemoReport add_demonstrations(std::vector<Example>& examples, Environment& env, const text::Tokenizer& tok) {
  KILN_CHECK(!tok.stop_ids().empty(), "sft: the tokenizer ", tok.name(), " has no eos/stop id to end turns with");
  const EnvironmentSpec& spec = env.spec();
  const int64_t stop = tok.stop_ids().front();
  DemoReport report;
  constexpr size_t kPerCall = 256;  // requests in flight at once
  for (size_t b = 0; b < examples.size(); b += kPerCall) {
    const size_t e = std::min(examples.size(), b + kPerCall);
    std::vector<EnvDemoRequest> asks;
    for (size_t i = b; i < e; ++i)
      asks.push_back({int64_t(i - b), examples[i].prompt_text.empty() ? examples[i].prompt : examples[i].prompt_text,
                      examples[i].label, examples[i].data_source, examples[i].metadata});
    const std::vector<EnvDemo> demos = env.demonstrate(asks);
    for (size_t i = b; i < e; ++i) {
      const EnvDemo& d = demos[i - b];
      Example& ex = examples[i];
      ex.answer_ids.clear();
      ex.answer_trained.clear();
      if (d.failed || d.turns.empty()) {
        ++(d.failed ? report.failed : report.label);
        continue;
      }
      const std::string where = str_cat("sft: the environment's demonstration of ", ex.origin);
      KILN_CHECK(int64_t(d.turns.size()) <= spec.max_turns, where, " has ", d.turns.size(),
                 " turns, more than environment.max_turns (", spec.max_turns, ")");
      for (const EnvTurn& t : d.turns) {
        std::vector<int64_t> r = tok.encode(t.response);
        r.push_back(stop);
        ex.answer_ids.insert(ex.answer_ids.end(), r.begin(), r.end());
        ex.answer_trained.insert(ex.answer_trained.end(), r.size(), 1);
        const std::vector<int64_t> o = t.observation_ids.empty() && !t.observation.empty() ? tok.encode(t.observation)
                                                                                           : t.observation_ids;
        KILN_CHECK(int64_t(o.size()) <= spec.max_observation_tokens, where, " has an observation of ", o.size(),
                   " tokens, more than environment.max_observation_tokens (", spec.max_observation_tokens, ")");
        for (int64_t id : o)
          KILN_CHECK(id >= 0 && id < tok.vocab_size(), where, " has observation id ", id, " outside the tokenizer's ",
                     tok.vocab_size(), " ids");
        ex.answer_ids.insert(ex.answer_ids.end(), o.begin(), o.end());
        ex.answer_trained.insert(ex.answer_trained.end(), o.size(), 0);
      }
      KILN_CHECK(int64_t(ex.answer_ids.size()) <= spec.max_episode_tokens, where, " is ", ex.answer_ids.size(),
                 " tokens, more than environment.max_episode_tokens (", spec.max_episode_tokens, ")");
      ++report.demonstrated;
    }
  }
  return report;
}

std::string SftMetrics::to_json() const {
  // A non-finite loss is written as null (JSON has no NaN), with skipped marking the update.
  return nlohmann::ordered_json{{"step", step}, {"loss", loss}, {"token_accuracy", token_accuracy}, {"skipped", skipped}}
      .dump();
}

struct SftTrainer::Impl {
  model::Muse& model;
  SftConfig cfg;
  std::shared_ptr<const text::Tokenizer> tok;
  DemoReport demos;  // what the environment demonstrated (sft.demonstrations: environment)
  DataStream stream;
  comm::Group group;
  comm::Group cp_group;  // parallel.cp consecutive ranks: one share of the batch, its tokens split
  parallel::ParallelConfig parallel;
  std::unique_ptr<parallel::ShardedModel> layout;  // the trained model under the layout
  std::vector<at::Tensor> params;  // all trained tensors: clipping and the gradient reduction
  std::vector<bool> is_expert;     // ep > 1: params[i] is an expert shard (not ZeRO-3's)
  std::unique_ptr<parallel::ZeroOne> zero;   // the optimizer, over the tensors this rank owns
  std::unique_ptr<parallel::OverlappedGradReducer> reducer;  // replicated over more than one rank
  int64_t steps = 0;
  UpdateGuard guard;

  Impl(model::Muse& m, SftConfig c, std::shared_ptr<const text::Tokenizer> t, std::vector<Example> train,
       const comm::Group& g, Environment* env, parallel::ParallelConfig par)
      : model(m), cfg(c), tok(std::move(t)), stream(prepared(std::move(train), env), c.seed), group(g),
        parallel(std::move(par)) {
    cfg.validate();
    guard.limit = cfg.stop_after_nonfinite;
    guard.loss_decides = true;  // the loss is reduced over the ranks before it decides (step)
    guard.hint = "lower sft.lr (or sft.grad_clip) and run kiln sft again";
    parallel.resolve(group.size(), model.config().num_experts);
    const int64_t shards = group.size() / parallel.cp;
    KILN_CHECK(cfg.batch_size >= shards, "sft: batch_size (", cfg.batch_size, ") must be at least the data shards (",
               shards, " = ranks / parallel.cp): every shard trains on a share of every batch");
    cp_group = parallel::context_group(group, parallel.cp);
    layout = std::make_unique<parallel::ShardedModel>(model, parallel, group);
    model::Muse& trained = layout->trained();
    trained.set_requires_grad(true);
    const auto named = trained.named_parameters();
    for (const auto& [name, p] : named) {
      params.push_back(p);
      is_expert.push_back(parallel.ep > 1 && model::is_expert_tensor(name));
    }
    zero = std::make_unique<parallel::ZeroOne>(named, is_expert, group, layout->expert_dp(), cfg.optim, layout->zero3());
    // A cp group's backward exchanges key and value gradients, which the overlapped reducer's
    // all-reduces must not interleave with: under cp the gradients are summed after it.
    if (!layout->sharded() && group.size() > 1 && parallel.cp == 1)
      reducer = std::make_unique<parallel::OverlappedGradReducer>(group, params);
  }

  std::vector<Example> prepared(std::vector<Example> train, Environment* env) {
    KILN_CHECK(tok, "sft: no tokenizer given");
    KILN_CHECK(!tok->stop_ids().empty(), "sft: the tokenizer ", tok->name(), " has no eos/stop id to end answers with");
    prepare_prompts(train, *tok, cfg.prompt);
    if (cfg.demonstrations == Demonstrations::kEnvironment) {
      KILN_CHECK(env, "sft: demonstrations: environment, but no environment was given to demonstrate");
      demos = add_demonstrations(train, *env, *tok);
    }
    return train;
  }

  SftMetrics step() {
    std::vector<std::vector<int64_t>> seqs;
    std::vector<int64_t> targets;
    // Every rank draws the same batch and takes its contiguous share (a cp group one share).
    std::vector<Example> batch_all = stream.next(cfg.batch_size);
    const size_t R = size_t(group.size() / parallel.cp), r = size_t(group.rank() / parallel.cp);
    for (size_t i = batch_all.size() * r / R; i < batch_all.size() * (r + 1) / R; ++i) {
      auto [seq, t] = sft_sequence(batch_all[i], *tok);
      targets.insert(targets.end(), t.begin(), t.end());
      seqs.push_back(std::move(seq));
    }
    model::Muse& trained = layout->trained();
    model::PackedBatch batch = model::PackedBatch::from_sequences(seqs, model.device());
    model::ForwardOptions o;
    layout->apply(o);  // the expert exchange, ZeRO-3's gathers
    o.targets = at::tensor(targets, at::kLong).to(model.device());
    o.return_logits = true;
    // Under cp this rank holds its pieces of the share's tokens: each token's loss on one rank.
    std::unique_ptr<parallel::ContextParallel> split;
    if (cp_group.size() > 1) {
      split = std::make_unique<parallel::ContextParallel>(cp_group, batch.cu_seqlens, model.config(), model.device());
      batch = split->local_batch(batch.tokens);
      o.targets = split->local_rows(o.targets);
      o = split->options(o);
    }
    auto out = trained.forward(batch, o);
    at::Tensor mask = o.targets.ne(-100);
    const double n = std::max(group.all_reduce(mask.sum().item<double>()), 1.0);  // answer tokens, all ranks
    at::Tensor loss = -out.logprobs.sum() / n;
    zero->set_lr_factor(cfg.schedule.factor(steps + 1));
    for (at::Tensor& p : params) p.mutable_grad().reset();
    if (reducer) reducer->arm();
    loss.backward();
    double norm = 0;
    if (layout->sharded()) {  // replicated gradients over every rank, experts' over their copies
      zero->all_reduce_grads();
      norm = parallel::clip_grads_expert_parallel(params, is_expert, layout->ep_group(), cfg.grad_clip, layout->zero3());
    } else {
      if (reducer) reducer->finish();
      else parallel::all_reduce_grads(group, params);  // under cp (a one-rank group does nothing)
      norm = torch::nn::utils::clip_grad_norm_(params, cfg.grad_clip > 0 ? cfg.grad_clip : INFINITY);
    }
    SftMetrics m;
    m.step = ++steps;
    // The loss of all ranks decides with the norm, so every rank skips alike.
    at::Tensor right = out.logits.detach().argmax(-1).eq(o.targets).logical_and(mask);
    at::Tensor sums = at::tensor({loss.item<double>(), right.sum().item<double>()}, at::kDouble);
    group.all_reduce(sums);
    m.loss = sums[0].item<double>();
    m.token_accuracy = sums[1].item<double>() / n;
    m.skipped = !guard.admit(norm, m.loss, "sft", m.step);
    if (!m.skipped) zero->step();
    return m;
  }
};

SftTrainer::SftTrainer(model::Muse& model, SftConfig config, std::shared_ptr<const text::Tokenizer> tokenizer,
                       std::vector<Example> train, const comm::Group& group, Environment* env,
                       parallel::ParallelConfig parallel)
    : impl_(std::make_unique<Impl>(model, config, std::move(tokenizer), std::move(train), group, env,
                                   std::move(parallel))) {}
void SftTrainer::sync_policy() { impl_->layout->update_policy(); }

void SftTrainer::save_model(const std::string& dir) const {
  const parallel::ShardedModel& layout = *impl_->layout;
  layout.check_finite(dir);
  layout.write_folder(dir, [&](const std::string& tmp) {
    layout.write(layout.trained(), layout.zero3(), tmp);
    const std::string tokenizer_files = text::tokenizer_dir(*impl_->tok);
    if (impl_->group.rank() == 0 && !tokenizer_files.empty()) text::copy_tokenizer_files(tokenizer_files, tmp);
  });
}
const DemoReport& SftTrainer::demonstrations() const { return impl_->demos; }
SftTrainer::~SftTrainer() = default;
SftMetrics SftTrainer::step() { return impl_->step(); }

}  // namespace kiln::trainer
