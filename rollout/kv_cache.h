// The rollout engine's paged KV cache: two block pools (full-attention layers keep every position;
// sliding-window layers a ring of blocks per sequence), reference counts for blocks that forked
// samples share, copy-on-write, and the cache rows that hold a sequence's positions.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "model/config.h"

namespace kiln::rollout {

// Where the engine keeps K/V: two pools of blocks, each with one spare (scratch) block at the end
// that padded rows read and write.
struct KvPools {
  at::Tensor k_full, v_full;          // [n_full, (blocks + 1) * B, Hkv, hd]
  at::Tensor k_win, v_win;            // [n_window, (blocks + 1) * B, Hkv, hd]
  int64_t block_size = 0, window = 0, ring = 0;
  int64_t scratch_full = 0, scratch_win = 0;  // index of each pool's scratch block
  std::vector<int64_t> group_index;   // layer -> index within its kind (full or window)
};

// The cache's geometry for a model: bytes of one block of each pool (K and V of every
// full-attention layer, of every window layer) and the window ring's blocks per sequence,
// ceil(window / block_size) + 1: a step may write a block before the oldest one it reads leaves.
struct KvLayout {
  int64_t full_block_bytes = 0, window_block_bytes = 0, ring_blocks = 0, block_size = 0;
  static KvLayout of(const model::ModelConfig& cfg, int64_t block_size, int64_t elem_bytes);
  // Window blocks the pool reserves per sequence: the whole ring, or for sequences of at most
  // max_model_len tokens (when given) the ceil(max_model_len / block_size) ring slots they can touch.
  int64_t window_blocks_per_seq(std::optional<int64_t> max_model_len) const;
  // The window pool for max_seqs such sequences: never less than one whole ring, so that a single
  // sequence of any length fits. 0 without window layers.
  int64_t window_pool_blocks(int64_t max_seqs, std::optional<int64_t> max_model_len) const;
};

// Fixed-size blocks with reference counts: a block returns to the free list when its last holder
// releases it.
class BlockPool {
 public:
  explicit BlockPool(int64_t num_blocks = 0);
  int64_t total() const { return int64_t(refs_.size()); }
  int64_t num_free() const { return int64_t(free_.size()); }
  int64_t used() const { return total() - num_free(); }
  int64_t allocate();  // throws when none is free (the scheduler reserves before it allocates)
  void retain(int64_t b) { ++refs_[size_t(b)]; }
  void release(int64_t b);
  bool shared(int64_t b) const { return refs_[size_t(b)] > 1; }

 private:
  std::vector<int64_t> refs_;
  std::vector<int64_t> free_;
};

// One sequence's blocks: logical block b of the full-attention layers (positions [bB, (b+1)B)),
// and the window ring (position p lives in slot (p / B) % ring_blocks; -1: not yet allocated).
struct BlockTable {
  std::vector<int64_t> full;
  std::vector<int64_t> ring;
};

class KvCache {
 public:
  // Sizes the pools from `cache_bytes`: max_seqs window rings first (each cut to what a sequence
  // of max_model_len tokens touches, when given), the rest in full-attention blocks (at least one,
  // else an error that names what does not fit). Window blocks are handed out on demand either way,
  // so a longer sequence still runs; it may preempt others for ring blocks. The K/V tensors hold one
  // spare block per pool after the last: padded rows of a graph decode step write there.
  KvCache(const model::ModelConfig& cfg, int64_t block_size, int64_t cache_bytes, int64_t max_seqs,
          at::ScalarType dtype, at::Device device, std::optional<int64_t> max_model_len = std::nullopt);

  int64_t block_size() const { return B_; }
  const KvLayout& layout() const { return layout_; }
  const BlockPool& pool(bool full) const { return full ? full_pool_ : win_pool_; }
  bool has_window_layers() const { return win_pool_.total() > 0; }
  // Layer -> its index among the layers of its kind, the first dimension of keys() and values().
  int64_t group_of(int64_t layer) const { return group_index_[size_t(layer)]; }
  // [layers of the kind, (blocks + 1) * B, Hkv, head_dim]; row = block * B + position % B.
  at::Tensor& keys(bool full) { return full ? k_full_ : k_win_; }
  at::Tensor& values(bool full) { return full ? v_full_ : v_win_; }
  // The pools as the CUDA-graph decode steps read them.
  KvPools graph_pools() const;

  // The first of positions [start, start + n) that window layers keep: the last `window` of them.
  int64_t first_window_write(int64_t start, int64_t n) const;
  // Blocks (full, window) that making positions [start, start + n) writable would allocate: new
  // blocks and copies of shared ones.
  std::pair<int64_t, int64_t> blocks_needed(const BlockTable& t, int64_t start, int64_t n) const;
  bool fits(const BlockTable& t, int64_t start, int64_t n) const;
  // Gives t its own blocks for positions [start, start + n): allocates missing ones and copies
  // shared ones (copy on write). The caller checked fits().
  void make_writable(BlockTable& t, int64_t start, int64_t n);
  // A fork: `t`'s blocks get one more holder (a sample that shares its prompt's blocks).
  void share(const BlockTable& t);
  // Drops t's hold on its blocks and empties it.
  void release(BlockTable& t);
  // Appends the cache rows of positions [lo, hi) of t in the full (or window) pool to `out`.
  void rows(const BlockTable& t, int64_t lo, int64_t hi, bool full, std::vector<int64_t>& out) const;

 private:
  void copy_block(bool full, int64_t from, int64_t to);

  int64_t B_, W_, R_;
  KvLayout layout_;
  std::vector<int64_t> group_index_;
  BlockPool full_pool_, win_pool_;
  at::Tensor k_full_, v_full_, k_win_, v_win_;
};

}  // namespace kiln::rollout
