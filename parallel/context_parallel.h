// Context parallelism (issue 53): a packed micro-batch's sequences split over the ranks of a cp group,
// load-balanced for causal attention, and the attention backend that exchanges keys and values
// between those ranks so that the forward and backward equal one rank's over the whole batch.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "core/comm.h"
#include "model/config.h"
#include "model/muse.h"

namespace kiln::parallel {

// A contiguous run of one sequence's tokens that one rank holds.
struct ContextPiece {
  int64_t sequence = 0;  // index in the whole batch
  int64_t start = 0;     // position of its first token in the sequence
  int64_t length = 0;    // > 0: empty chunks hold no piece
  bool last = false;     // it ends its sequence (no later query of the sequence reads its keys)
};

// The zigzag split of a packed micro-batch over N ranks: every sequence is cut into 2N contiguous
// chunks whose sizes differ by at most one, and rank r holds chunks r and 2N-1-r, so that each rank
// has one cheap chunk from the front and one dear chunk from the back of every sequence and the
// causal attention work of a full layer is even (docs/PARALLEL.md has the measured balance). The n % 2N tokens left over go one each to ranks in a rotation
// that runs on across the batch (front chunks first, then back chunks), so short sequences (fewer
// than 2N tokens, most chunks empty) are spread over the ranks instead of piling onto rank 0.
// Touching chunks of one rank (chunks N-1 and N, or chunks with empty ones between) are one piece.
// Pure bookkeeping: every rank builds the same split from the same cu_seqlens.
class ContextSplit {
 public:
  // cu_seqlens [B + 1] of the whole micro-batch (its sequences start at position 0).
  ContextSplit(std::vector<int64_t> cu_seqlens, int ranks);

  int ranks() const { return int(pieces_.size()); }
  int64_t num_tokens() const { return cu_seqlens_.back(); }
  int64_t num_sequences() const { return int64_t(cu_seqlens_.size()) - 1; }
  const std::vector<int64_t>& cu_seqlens() const { return cu_seqlens_; }
  // Rank's pieces, by sequence then position: its local token order.
  const std::vector<ContextPiece>& pieces(int rank) const { return pieces_.at(size_t(rank)); }
  int64_t num_tokens(int rank) const;
  // The whole batch's row of each of rank's tokens, in its local order [num_tokens(rank)].
  std::vector<int64_t> rows(int rank) const;
  // The (query, key) pairs rank's queries score under causal attention: for each query at position
  // p, p + 1 keys, or min(p + 1, window) with window > 0 (a sliding-window layer).
  int64_t attention_work(int rank, int64_t window = 0) const;
  // The same summed over a model's layers (full and sliding-window ones): what balance is judged by.
  int64_t attention_work(int rank, const model::ModelConfig& cfg) const;
  // Rank's tokens of the whole batch's `tokens` [T] as a batch: one sequence per piece, with its
  // start position, so that RoPE and the causal masks see the positions of the whole sequence.
  model::PackedBatch local_batch(const at::Tensor& tokens, int rank) const;
  // Rank's rows of a per-token tensor of the whole batch (targets, routing to replay, advantages).
  at::Tensor local_rows(const at::Tensor& whole, int rank) const;

 private:
  std::vector<int64_t> cu_seqlens_;
  std::vector<std::vector<ContextPiece>> pieces_;  // [rank]
};

// This rank's cp group of `group`: `cp` consecutive ranks (parallel.cp), so that the trajectories
// or batch shares of a group's ranks are consecutive too. Collective over `group`; cp 1: a
// one-rank group.
comm::Group context_group(const comm::Group& group, int64_t cp);

// The attention of this rank's pieces under a split (ForwardOptions::attention) and the sums of
// batch statistics over the cp group (ForwardOptions::batch_reduce), for Muse::forward on
// split.local_batch(...). Every rank of the group runs the same forward (and backward) together.
//
// Full-attention layers all-gather every rank's keys and values (GQA keeps them small: 2 * Hkv * hd
// values a token) and attend the local queries over their sequence's keys by absolute position. A
// ring (N - 1 passes, each overlapping with a block of attention) would hold less at once; the
// all-gather is one collective per layer and what this first version does. Window layers gather
// only the halo: the last min(W - 1, length) keys and values of every piece that does not end its
// sequence, which holds every key within the window of any later query even when chunks are shorter
// than the window (W - 1 suffices: a query at p reads keys after p - W). The gathers are
// differentiable: the backward sends each gathered row's gradient back to its owner, which adds the
// ranks' contributions in rank order, so results do not depend on timing.
class ContextParallel final : public model::AttentionBackend, public model::BatchReduce {
 public:
  // What this rank received in the forward's gathers (keys and values counted once per row), summed
  // over the layers since construction: what the halo test counts.
  struct Exchanged {
    int64_t full_rows = 0, window_rows = 0;
    int64_t full_layers = 0, window_layers = 0;
    int64_t flash_layers = 0;  // of those, attended through FlashAttention
    double seconds = 0;  // in the gathers, forward and backward, while timed (set_timed)
  };

  // The group's ranks split the whole batch (cu_seqlens, the same on every rank) by ContextSplit;
  // this rank is group.rank(). cfg gives the window and the heads. The group and this object must
  // outlive every forward and backward that use it (a recomputed layer attends again in the
  // backward). Attention runs as one padded batch per layer while its scores fit
  // max_padded_score_bytes, else piece by piece in query blocks.
  ContextParallel(const comm::Group& group, std::vector<int64_t> cu_seqlens, const model::ModelConfig& cfg,
                  at::Device device, int64_t max_padded_score_bytes = int64_t(256) << 20);

  const ContextSplit& split() const { return split_; }
  int rank() const { return rank_; }
  // This rank's batch of the whole batch's tokens [T], and its rows of a per-token tensor.
  model::PackedBatch local_batch(const at::Tensor& tokens) const { return split_.local_batch(tokens, rank_); }
  at::Tensor local_rows(const at::Tensor& whole) const { return split_.local_rows(whole, rank_); }
  // Every rank's per-token rows [num_tokens(rank), ...] back in the whole batch's order [T, ...], on
  // every rank (log-probs for a loss over whole sequences, or metrics). Differentiable: the backward
  // sends each row's gradient to its owner, which adds the ranks' in rank order, so a loss that
  // every rank computes alike over the whole batch is scaled by 1 / ranks before its backward.
  at::Tensor gather(const at::Tensor& local) const;
  // `o` with this object as its attention backend and batch reduction. On a CUDA device in bf16 or
  // fp16 with o's fused kernels on, attention runs through FlashAttention's varlen kernel (each
  // piece's queries against its keys), as the one-rank forward does; else as described above.
  model::ForwardOptions options(model::ForwardOptions o);
  const Exchanged& exchanged() const { return exchanged_; }
  // Times every gather and its backward into exchanged().seconds, the device synchronised around
  // each (for `kiln bench train --cp`: it serialises what would overlap).
  void set_timed(bool on) { timed_ = on; }

  at::Tensor attend(int64_t layer, bool full, const model::PackedBatch& batch, const at::Tensor& q,
                    const at::Tensor& k, const at::Tensor& v) override;
  at::Tensor sum(const at::Tensor& t) const override;

 private:
  // Where a layer kind's keys come from and which queries read which, built once for every layer.
  struct KindPlan {
    std::vector<int64_t> send_counts;  // [ranks] rows each rank adds to the gather
    at::Tensor send_rows;              // window layers: the local rows this rank sends (int64)
    // Per piece: its local query rows [q_begin, q_begin + q_length) at positions from q_start, and
    // the key source's rows (int64) of positions [k_start, q_start + q_length) in position order.
    std::vector<int64_t> q_begin, q_length, q_start, k_start;
    std::vector<at::Tensor> k_rows;
    model::PaddedLayout padded;  // the same problems as one padded batch
    bool use_padded = false;
    // FlashAttention's form on a CUDA device: every piece's key rows in one index, and the pieces'
    // query and key counts as int32 cu_seqlens (a piece's last query is at its last key's position).
    at::Tensor flash_k_rows, cu_q, cu_k;
    int64_t max_q = 0, max_k = 0;
  };
  KindPlan plan(bool full, at::Device device, int64_t heads, int64_t max_padded_score_bytes) const;
  at::Tensor attend_kind(const KindPlan& plan, bool full, bool flash, const at::Tensor& q, const at::Tensor& k_src,
                         const at::Tensor& v_src) const;

  const comm::Group& group_;
  int rank_ = 0;
  ContextSplit split_;
  int64_t window_ = 0;
  KindPlan full_plan_, window_plan_;
  Exchanged exchanged_;
  bool timed_ = false;
  bool fused_ = false;  // the options' fused kernels: FlashAttention where it runs
};

}  // namespace kiln::parallel
