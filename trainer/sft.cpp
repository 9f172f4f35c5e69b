// Supervised warm start: packed (prompt, answer, eos) sequences, loss on the answer side only.
#include "trainer/sft.h"

#include <ATen/ATen.h>
#include <torch/types.h>  // clip_grad.h uses torch::Tensor without including it
#include <torch/nn/utils/clip_grad.h>

#include <nlohmann/json.hpp>

#include <cmath>

#include "core/error.h"
#include "text/tokenizer.h"
#include "dist/parallel.h"
#include "trainer/update_guard.h"

namespace kiln::trainer {

void SftConfig::validate() const {
  KILN_CHECK(steps >= 0, "sft: steps must be >= 0 (got ", steps, ")");
  KILN_CHECK(batch_size > 0, "sft: batch_size must be positive (got ", batch_size, ")");
  KILN_CHECK(std::isfinite(grad_clip) && grad_clip >= 0, "sft: grad_clip must be finite and >= 0 (got ", grad_clip,
             "); 0 turns clipping off");
  KILN_CHECK(stop_after_nonfinite >= 1, "sft: stop_after_nonfinite must be at least 1 (got ", stop_after_nonfinite,
             "): that many non-finite gradient norms in a row stop the run");
  optim.validate();
  schedule.validate();
  prompt.validate();
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
  DataStream stream;
  comm::Group group;
  std::vector<at::Tensor> params;  // all: clipping and the gradient all-reduce
  std::unique_ptr<dist::ZeroOne> zero;   // the optimizer, over the tensors this rank owns
  std::unique_ptr<dist::OverlappedGradReducer> reducer;  // more than one rank
  int64_t steps = 0;
  UpdateGuard guard;

  Impl(model::Muse& m, SftConfig c, std::shared_ptr<const text::Tokenizer> t, std::vector<Example> train,
       const comm::Group& g)
      : model(m), cfg(c), tok(std::move(t)), stream(prepared(std::move(train)), c.seed), group(g) {
    cfg.validate();
    guard.limit = cfg.stop_after_nonfinite;
    KILN_CHECK(cfg.batch_size >= group.size(), "sft: batch_size (", cfg.batch_size,
               ") must be at least the data-parallel ranks (", group.size(), ")");
    model.set_requires_grad(true);
    for (auto& [name, p] : model.named_parameters()) params.push_back(p);
    zero = std::make_unique<dist::ZeroOne>(model.named_parameters(), std::vector<bool>{}, group, comm::Group(), cfg.optim);
    if (group.size() > 1) reducer = std::make_unique<dist::OverlappedGradReducer>(group, params);
  }

  std::vector<Example> prepared(std::vector<Example> train) {
    KILN_CHECK(tok, "sft: no tokenizer given");
    KILN_CHECK(!tok->stop_ids().empty(), "sft: the tokenizer ", tok->name(), " has no eos/stop id to end answers with");
    prepare_prompts(train, *tok, cfg.prompt);
    return train;
  }

  SftMetrics step() {
    std::vector<std::vector<int64_t>> seqs;
    std::vector<int64_t> targets;
    // Every rank draws the same batch and takes its contiguous share.
    std::vector<Example> batch_all = stream.next(cfg.batch_size);
    const size_t R = size_t(group.size()), r = size_t(group.rank());
    for (size_t i = batch_all.size() * r / R; i < batch_all.size() * (r + 1) / R; ++i) {
      const Example& p = batch_all[i];
      const std::vector<int64_t>& prompt = p.prompt_ids;
      std::vector<int64_t> answer = tok->encode(p.label);
      answer.push_back(tok->stop_ids().front());
      std::vector<int64_t> seq = prompt;
      seq.insert(seq.end(), answer.begin(), answer.end());
      // Position j predicts token j+1; only answer tokens are targets.
      for (size_t j = 0; j < seq.size(); ++j)
        targets.push_back(j + 1 < seq.size() && j + 1 >= prompt.size() ? seq[j + 1] : -100);
      seqs.push_back(std::move(seq));
    }
    model::PackedBatch batch = model::PackedBatch::from_sequences(seqs, model.device());
    model::ForwardOptions o;
    o.targets = at::tensor(targets, at::kLong).to(model.device());
    o.return_logits = true;
    auto out = model.forward(batch, o);
    at::Tensor mask = o.targets.ne(-100);
    const double n = std::max(group.all_reduce(mask.sum().item<double>()), 1.0);  // answer tokens, all ranks
    at::Tensor loss = -out.logprobs.sum() / n;
    zero->set_lr_factor(cfg.schedule.factor(steps + 1));
    for (at::Tensor& p : params) p.mutable_grad().reset();
    if (reducer) reducer->arm();
    loss.backward();
    if (reducer) reducer->finish();
    const double norm = torch::nn::utils::clip_grad_norm_(params, cfg.grad_clip > 0 ? cfg.grad_clip : INFINITY);
    SftMetrics m;
    m.step = ++steps;
    m.skipped = !guard.admit(norm, loss.item<double>(), "sft", m.step);
    if (!m.skipped) zero->step();
    at::Tensor right = out.logits.detach().argmax(-1).eq(o.targets).logical_and(mask);
    at::Tensor sums = at::tensor({loss.item<double>(), right.sum().item<double>()}, at::kDouble);
    group.all_reduce(sums);
    m.loss = sums[0].item<double>();
    m.token_accuracy = sums[1].item<double>() / n;
    return m;
  }
};

SftTrainer::SftTrainer(model::Muse& model, SftConfig config, std::shared_ptr<const text::Tokenizer> tokenizer,
                       std::vector<Example> train, const comm::Group& group)
    : impl_(std::make_unique<Impl>(model, config, std::move(tokenizer), std::move(train), group)) {}
SftTrainer::~SftTrainer() = default;
SftMetrics SftTrainer::step() { return impl_->step(); }

}  // namespace kiln::trainer
