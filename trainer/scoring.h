// Sampled responses laid out for the trainer's forward (Trajectory, pack) and their log-probs
// under a model, with the rollout's routing replayed or the model's own (score_trajectories):
// what GRPO's lp_old and `kiln mismatch` compute.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/comm.h"
#include "model/muse.h"
#include "parallel/context_parallel.h"

namespace kiln::trainer {

// One sampled response, laid out for training.
struct Trajectory {
  std::vector<int64_t> tokens;      // prompt + response
  int64_t prompt_len = 0;
  std::vector<float> rollout_lp;    // per response token (0 for an observation's)
  std::vector<uint8_t> sampled;     // per response token: 1 drawn by the policy, 0 appended by an
                                    // environment (no loss, no mismatch); empty: all drawn
  at::Tensor routing;               // [tokens, L, k] uint8 from the rollout
  double reward = 0;                // the (shaped) reward its advantage came from
  double advantage = 0;
  bool in_loss = true;              // false: scored (lp_old, mismatch) but no loss (grpo.mask_truncated)
};

// A packed micro-batch of trajectories. Position t predicts token t+1; positions that predict a
// token the policy drew carry mask 1 (observations an environment appended carry 0).
struct Packed {
  model::PackedBatch batch;
  at::Tensor targets, mask, seq_ids, rollout_lp, advantages, routing;
  at::Tensor loss_mask;             // mask, zero on trajectories that are not in the loss
  int64_t num_seqs = 0;
};

// Trajectories [begin, end) packed on `device`; mask, rollout_lp and advantages in `dtype`.
Packed pack(const std::vector<Trajectory>& trajs, size_t begin, size_t end, at::Device device, at::ScalarType dtype);

// The forward of a packed micro-batch whose tokens are split over the ranks of `context` (a cp
// group, parallel/context_parallel.h; null or one rank: the whole batch here). Every rank of the
// group runs it together on the same micro-batch; the log-probs and routing come back in the whole
// batch's order on every rank, the log-probs differentiable. `split` holds the exchange that the
// backward (and a recomputed layer) needs: keep it until the backward is done.
struct SplitForward {
  std::unique_ptr<parallel::ContextParallel> split;
  model::ForwardOutput out;
};
SplitForward forward_split(const model::Muse& model, const Packed& p, model::ForwardOptions o,
                           const comm::Group* context);

struct Scored {
  at::Tensor logprobs;  // [T] float64, every position of the packed trajectories (0 where no target)
  at::Tensor routing;   // [T, L, k] uint8 on the CPU: the routing the forward used
};

// Log-probs of every target of `trajs` under `model` at `temperature`, in micro-batches of
// `micro_batch_seqs` trajectories, with the rollout's routing replayed or the model's own. `base`
// carries the other forward options (the expert group, disable_lora); `context` splits each
// micro-batch's tokens over a cp group (forward_split). No gradient.
Scored score_trajectories(const model::Muse& model, const std::vector<Trajectory>& trajs, bool replay,
                          int64_t micro_batch_seqs, double temperature, const model::ForwardOptions& base,
                          const comm::Group* context = nullptr);

// The entropy (nats) of the model's next-token distribution at `temperature` at every position of
// the packed trajectories, [T] float64, with the rollout's routing replayed; the lm_head runs over
// 1024 rows at a time, so no [T, V] tensor is built. No gradient.
at::Tensor token_entropies(const model::Muse& model, const std::vector<Trajectory>& trajs, int64_t micro_batch_seqs,
                           double temperature, const model::ForwardOptions& base);

}  // namespace kiln::trainer
