// The rollout engine's paged KV cache (kv_cache.h): pool sizing, reference-counted blocks,
// copy-on-write and the position -> cache row map.
#include "rollout/kv_cache.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "core/error.h"

namespace kiln::rollout {

KvLayout KvLayout::of(const model::ModelConfig& cfg, int64_t block_size, int64_t elem_bytes) {
  int64_t nf = 0;
  for (int64_t i = 0; i < cfg.num_layers; ++i) nf += cfg.is_full_attention(i) ? 1 : 0;
  const int64_t block = block_size * 2 * cfg.kv_size() * elem_bytes;  // K and V of one layer's block
  return {nf * block, (cfg.num_layers - nf) * block, (cfg.sliding_window + block_size - 1) / block_size + 1, block_size};
}

int64_t KvLayout::window_blocks_per_seq(std::optional<int64_t> max_model_len) const {
  return max_model_len ? std::min(ring_blocks, (*max_model_len + block_size - 1) / block_size) : ring_blocks;
}

int64_t KvLayout::window_pool_blocks(int64_t max_seqs, std::optional<int64_t> max_model_len) const {
  return window_block_bytes > 0 ? std::max(ring_blocks, max_seqs * window_blocks_per_seq(max_model_len)) : 0;
}

BlockPool::BlockPool(int64_t num_blocks) : refs_(size_t(num_blocks), 0) {
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);  // block 0 is handed out first
}

int64_t BlockPool::allocate() {
  KILN_CHECK(!free_.empty(), "rollout: KV block pool exhausted (scheduler bug: blocks were not reserved)");
  const int64_t b = free_.back();
  free_.pop_back();
  refs_[size_t(b)] = 1;
  return b;
}

void BlockPool::release(int64_t b) {
  if (--refs_[size_t(b)] == 0) free_.push_back(b);
}

KvCache::KvCache(const model::ModelConfig& cfg, int64_t block_size, int64_t cache_bytes, int64_t max_seqs,
                 at::ScalarType dtype, at::Device device, std::optional<int64_t> max_model_len)
    : B_(block_size), W_(cfg.sliding_window) {
  layout_ = KvLayout::of(cfg, B_, int64_t(c10::elementSize(dtype)));
  R_ = layout_.ring_blocks;
  int64_t nf = 0, nw = 0;
  for (int64_t i = 0; i < cfg.num_layers; ++i) group_index_.push_back(cfg.is_full_attention(i) ? nf++ : nw++);
  const int64_t win_blocks = layout_.window_pool_blocks(max_seqs, max_model_len);
  const int64_t left = cache_bytes - win_blocks * layout_.window_block_bytes;
  const int64_t full_blocks = left / layout_.full_block_bytes;
  KILN_CHECK(full_blocks >= 1, "rollout: kv_cache_bytes=", cache_bytes, " cannot hold the window rings (", win_blocks,
             " blocks of ", layout_.window_block_bytes, " bytes for max_num_seqs=", max_seqs,
             max_model_len ? " of max_model_len=" + std::to_string(*max_model_len) : std::string(),
             ") and one full-attention block of ", layout_.full_block_bytes,
             " bytes; raise kv_cache_bytes or lower max_num_seqs", max_model_len ? " or max_model_len" : "");
  full_pool_ = BlockPool(full_blocks);
  win_pool_ = BlockPool(win_blocks);
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  k_full_ = at::zeros({nf, (full_blocks + 1) * B_, cfg.num_kv_heads, cfg.head_dim}, opts);
  v_full_ = at::zeros_like(k_full_);
  k_win_ = at::zeros({nw, (win_blocks + 1) * B_, cfg.num_kv_heads, cfg.head_dim}, opts);
  v_win_ = at::zeros_like(k_win_);
}

KvPools KvCache::graph_pools() const {
  return KvPools{k_full_, v_full_, k_win_, v_win_, B_, W_, R_, full_pool_.total(), win_pool_.total(), group_index_};
}

int64_t KvCache::first_window_write(int64_t start, int64_t n) const { return std::max(start, start + n - W_); }

std::pair<int64_t, int64_t> KvCache::blocks_needed(const BlockTable& t, int64_t start, int64_t n) const {
  int64_t full = 0, win = 0;
  const int64_t first = start / B_, last = (start + n - 1) / B_;
  for (int64_t b = first; b <= last; ++b)
    if (b >= int64_t(t.full.size()) || full_pool_.shared(t.full[size_t(b)])) ++full;  // new, or a copy
  if (has_window_layers()) {
    std::vector<bool> seen(size_t(R_), false);
    for (int64_t b = first_window_write(start, n) / B_; b <= last; ++b) {
      const int64_t slot = b % R_;
      if (seen[size_t(slot)]) continue;
      seen[size_t(slot)] = true;
      if (slot >= int64_t(t.ring.size()) || t.ring[size_t(slot)] < 0 || win_pool_.shared(t.ring[size_t(slot)])) ++win;
    }
  }
  return {full, win};
}

bool KvCache::fits(const BlockTable& t, int64_t start, int64_t n) const {
  const auto [full, win] = blocks_needed(t, start, n);
  return full <= full_pool_.num_free() && win <= win_pool_.num_free();
}

void KvCache::make_writable(BlockTable& t, int64_t start, int64_t n) {
  auto own = [&](bool full, int64_t& block) {  // allocate, or copy a shared block
    BlockPool& pool = full ? full_pool_ : win_pool_;
    if (block < 0) {
      block = pool.allocate();
    } else if (pool.shared(block)) {
      const int64_t fresh = pool.allocate();
      copy_block(full, block, fresh);
      pool.release(block);
      block = fresh;
    }
  };
  const int64_t first = start / B_, last = (start + n - 1) / B_;
  for (int64_t b = first; b <= last; ++b) {
    if (b >= int64_t(t.full.size())) t.full.push_back(-1);
    own(true, t.full[size_t(b)]);
  }
  if (!has_window_layers()) return;
  if (t.ring.empty()) t.ring.assign(size_t(R_), -1);
  for (int64_t b = first_window_write(start, n) / B_; b <= last; ++b) own(false, t.ring[size_t(b % R_)]);
}

void KvCache::share(const BlockTable& t) {
  for (int64_t b : t.full) full_pool_.retain(b);
  for (int64_t b : t.ring)
    if (b >= 0) win_pool_.retain(b);
}

void KvCache::release(BlockTable& t) {
  for (int64_t b : t.full) full_pool_.release(b);
  for (int64_t b : t.ring)
    if (b >= 0) win_pool_.release(b);
  t.full.clear();
  t.ring.clear();
}

void KvCache::rows(const BlockTable& t, int64_t lo, int64_t hi, bool full, std::vector<int64_t>& out) const {
  for (int64_t p = lo; p < hi; ++p) {
    const int64_t block = full ? t.full[size_t(p / B_)] : t.ring[size_t((p / B_) % R_)];
    out.push_back(block * B_ + p % B_);
  }
}

void KvCache::copy_block(bool full, int64_t from, int64_t to) {
  for (at::Tensor* t : {full ? &k_full_ : &k_win_, full ? &v_full_ : &v_win_})
    t->narrow(1, to * B_, B_).copy_(t->narrow(1, from * B_, B_));
}

}  // namespace kiln::rollout
