// Supervised warm start: packed (prompt, answer, eos) sequences, loss on the answer side only.
#include "trainer/sft.h"

#include <ATen/ATen.h>
#include <torch/nn/utils/clip_grad.h>

#include "core/error.h"

namespace kiln::trainer {

void SftConfig::validate() const {
  KILN_CHECK(steps >= 0, "sft: steps must be >= 0 (got ", steps, ")");
  KILN_CHECK(batch_size > 0, "sft: batch_size must be positive (got ", batch_size, ")");
  optim.validate();
  schedule.validate();
}

struct SftTrainer::Impl {
  model::Muse& model;
  SftConfig cfg;
  CharTokenizer tok;
  DataStream stream;
  std::vector<at::Tensor> params;  // for grad-norm clipping
  std::unique_ptr<optimizers::Optimizer> opt;
  int64_t steps = 0;

  Impl(model::Muse& m, SftConfig c, CharTokenizer t, std::vector<Problem> train)
      : model(m), cfg(c), tok(std::move(t)), stream(std::move(train), c.seed) {
    cfg.validate();
    model.set_requires_grad(true);
    for (auto& [name, p] : model.named_parameters()) params.push_back(p);
    opt = std::make_unique<optimizers::Optimizer>(model.named_parameters(), cfg.optim);
  }

  SftMetrics step() {
    std::vector<std::vector<int64_t>> seqs;
    std::vector<int64_t> targets;
    for (const Problem& p : stream.next(cfg.batch_size)) {
      std::vector<int64_t> prompt = tok.encode(p.prompt), answer = tok.encode(p.answer);
      answer.push_back(tok.eos_id());
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
    const double n = std::max(mask.sum().item<double>(), 1.0);
    at::Tensor loss = -out.logprobs.sum() / n;
    opt->set_lr_factor(cfg.schedule.factor(steps + 1));
    opt->zero_grad();
    loss.backward();
    torch::nn::utils::clip_grad_norm_(params, cfg.grad_clip > 0 ? cfg.grad_clip : INFINITY);
    opt->step();
    SftMetrics m;
    m.step = ++steps;
    m.loss = loss.item<double>();
    at::Tensor right = out.logits.detach().argmax(-1).eq(o.targets).logical_and(mask);
    m.token_accuracy = right.sum().item<double>() / n;
    return m;
  }
};

SftTrainer::SftTrainer(model::Muse& model, SftConfig config, CharTokenizer tokenizer, std::vector<Problem> train)
    : impl_(std::make_unique<Impl>(model, config, std::move(tokenizer), std::move(train))) {}
SftTrainer::~SftTrainer() = default;
SftMetrics SftTrainer::step() { return impl_->step(); }

}  // namespace kiln::trainer
