// The next-token loss the MPI model tests compare with one rank: token sequences of varied lengths,
// each rank's contiguous share of them, and one forward (and backward) over a batch of them.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "model/muse.h"

namespace kiln::test {

using Sequences = std::vector<std::vector<int64_t>>;

// `count` sequences of byte-vocabulary ids drawn from `seed`, sequence i of length first + step * (i % 3).
inline Sequences token_sequences(uint64_t seed, int64_t count, int64_t first, int64_t step) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  Sequences out;
  for (int64_t i = 0; i < count; ++i) {
    at::Tensor t = at::randint(128, {first + step * (i % 3)}, g, at::kLong);
    out.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
  }
  return out;
}

// The targets every sequence predicts: its tokens after the first.
inline double target_count(const Sequences& seqs) {
  double n = 0;
  for (const auto& s : seqs) n += double(s.size()) - 1;
  return n;
}

// Rank `rank` of `ranks`' contiguous share of the sequences, and where its token rows start in
// the whole batch and how many there are.
struct RankShare {
  Sequences seqs;
  int64_t first_row = 0, rows = 0;
};
inline RankShare rank_share(const Sequences& seqs, int rank, int ranks) {
  const size_t b = seqs.size() * size_t(rank) / size_t(ranks), e = seqs.size() * size_t(rank + 1) / size_t(ranks);
  RankShare r;
  r.seqs.assign(seqs.begin() + long(b), seqs.begin() + long(e));
  for (size_t i = 0; i < b; ++i) r.first_row += int64_t(seqs[i].size());
  for (const auto& s : r.seqs) r.rows += int64_t(s.size());
  return r;
}

struct LossRun {
  at::Tensor logprobs, routing;
  double loss = 0;
};

// -sum log p / norm over `seqs` on m's device, with a backward when `grad` and a parameter trains;
// the tokens' log-probs and routing.
inline LossRun next_token_loss(const model::Muse& m, const Sequences& seqs, double norm, model::ForwardOptions o,
                               bool grad = true) {
  std::vector<int64_t> targets;
  for (const auto& s : seqs)
    for (size_t j = 0; j < s.size(); ++j) targets.push_back(j + 1 < s.size() ? s[j + 1] : -100);
  o.targets = at::tensor(targets, at::kLong);
  std::optional<at::NoGradGuard> no_grad;
  if (!grad) no_grad.emplace();
  model::ForwardOutput out = m.forward(model::PackedBatch::from_sequences(seqs, m.device()), o);
  at::Tensor loss = -out.logprobs.sum() / norm;
  if (loss.requires_grad()) loss.backward();
  return {out.logprobs.detach(), out.routing, loss.item<double>()};
}

}  // namespace kiln::test
