// The BPE model over bytes: a word (the raw bytes of one pre-token) -> ids, merging by the ranks
// of HF merges (pair -> rank) or of tiktoken tokens (the rank of the merged bytes), with a bounded,
// thread-safe per-word cache.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <queue>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kiln::text {

// One symbol of a word being merged: a token id covering word bytes [start, start + length).
struct BpeSymbol {
  int32_t id;
  uint32_t start, length;
};

// What merging two neighbours gives: `rank` orders the merges (lower first; < 0: none), `id` is the
// merged token.
struct BpeMerge {
  int32_t rank = -1;
  int32_t id = -1;
};

// An open-addressing map (id_a, id_b) -> merge, the hot lookup of HF-style merging.
class PairRanks {
 public:
  void reserve(size_t num_pairs);
  // Later inserts of the same pair win (HF builds its merge map the same way).
  void insert(int32_t a, int32_t b, BpeMerge merge);
  BpeMerge find(int32_t a, int32_t b) const;
  size_t size() const { return size_; }

 private:
  struct Slot {
    uint64_t key = kEmpty;
    BpeMerge merge;
  };
  static constexpr uint64_t kEmpty = ~uint64_t(0);
  std::vector<Slot> slots_;
  size_t size_ = 0;
};

// Merges `symbols` in place: repeatedly the neighbour pair with the lowest rank, the leftmost on
// ties, until no pair merges (HF's BPE::merge_word and tiktoken's byte_pair_merge agree on this
// order). `pair(left, right)` returns the merge of two neighbours. A word of many symbols goes
// through a heap, a short one through a scan; both give the same result (tested).
template <typename PairFn>
void merge_symbols(std::vector<BpeSymbol>& symbols, const PairFn& pair);
template <typename PairFn>
void merge_symbols_scan(std::vector<BpeSymbol>& symbols, const PairFn& pair);
template <typename PairFn>
void merge_symbols_heap(std::vector<BpeSymbol>& symbols, const PairFn& pair);

class BpeModel {
 public:
  enum class Merging { kPairRanks, kTokenRanks };

  // HF-style: `token_bytes[id]` are the bytes of token `id` ("" for ids that a byte-level word can
  // never reach: gaps, added tokens, tokens outside the byte alphabet); merges are (a, b, merged)
  // in rank order. unk_id >= 0 stands for bytes without a token (fused when fuse_unk); otherwise
  // such bytes are dropped, as HF does.
  static std::unique_ptr<BpeModel> with_merges(std::vector<std::string> token_bytes,
                                               const std::vector<std::array<int32_t, 3>>& merges, bool ignore_merges,
                                               int32_t unk_id, bool fuse_unk);
  // tiktoken-style: the id of a token is its rank; every single byte must be a token.
  static std::unique_ptr<BpeModel> with_token_ranks(std::vector<std::string> token_bytes);

  // Appends the ids of one word (the raw bytes of a pre-token).
  void encode_word(std::string_view word, std::vector<int64_t>& out) const;
  // The same without the cache (for tests).
  void encode_word_uncached(std::string_view word, std::vector<int64_t>& out) const;
  // The id of a token with exactly these bytes, if a word can reach it.
  std::optional<int32_t> find(std::string_view bytes) const;

 private:
  BpeModel() = default;
  void index_tokens();

  Merging merging_ = Merging::kPairRanks;
  bool ignore_merges_ = false;  // a word that is itself a token becomes that token
  int32_t unk_id_ = -1;
  bool fuse_unk_ = false;
  std::vector<std::string> token_bytes_;
  std::unordered_map<std::string_view, int32_t> ids_;  // views into token_bytes_
  int32_t byte_ids_[256];
  PairRanks pairs_;

  // Bounded cache word -> ids, in shards so threads rarely wait on each other: an open-addressing
  // table over two arenas (key bytes, ids), so a lookup is a hash, one probe run and a memcmp. A
  // full shard is cleared: cheap, and a tokenizer's working set of words refills it quickly.
  struct Slot {
    uint64_t hash = 0;  // 0: empty
    uint32_t key_offset = 0, key_length = 0, ids_offset = 0, ids_length = 0;
  };
  struct Shard {
    std::mutex mutex;
    std::vector<Slot> slots;
    size_t used = 0;
    std::string keys;
    std::vector<int32_t> ids;
  };
  static constexpr size_t kNumShards = 16;
  static constexpr size_t kShardSlots = 16384;   // at most half of them used
  static constexpr size_t kMaxCachedWord = 256;  // longer words are rare; HF skips them too
  std::unique_ptr<Shard[]> shards_{new Shard[kNumShards]};
};

// ---- merging: templates, so the pair lookup inlines ----

template <typename PairFn>
void merge_symbols_scan(std::vector<BpeSymbol>& symbols, const PairFn& pair) {
  if (symbols.size() < 2) return;
  // ranks[i]: the merge of symbols i and i + 1.
  thread_local std::vector<BpeMerge> ranks;
  ranks.resize(symbols.size() - 1);
  for (size_t i = 0; i + 1 < symbols.size(); ++i) ranks[i] = pair(symbols[i], symbols[i + 1]);
  while (!ranks.empty()) {
    size_t best = ranks.size();
    int32_t best_rank = 0;
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i].rank >= 0 && (best == ranks.size() || ranks[i].rank < best_rank))
        best = i, best_rank = ranks[i].rank;
    }
    if (best == ranks.size()) break;
    BpeSymbol& left = symbols[best];
    left.length += symbols[best + 1].length;
    left.id = ranks[best].id;
    symbols.erase(symbols.begin() + std::ptrdiff_t(best) + 1);
    ranks.erase(ranks.begin() + std::ptrdiff_t(best));
    if (best < ranks.size()) ranks[best] = pair(symbols[best], symbols[best + 1]);
    if (best > 0) ranks[best - 1] = pair(symbols[best - 1], symbols[best]);
  }
}

template <typename PairFn>
void merge_symbols_heap(std::vector<BpeSymbol>& symbols, const PairFn& pair) {
  const size_t n = symbols.size();
  if (n < 2) return;
  // A doubly linked list over the symbols; merged-away symbols get length 0. The heap holds
  // (rank, position of the left symbol); an entry is stale when that pair has changed since.
  std::vector<int32_t> prev(n), next(n);
  for (size_t i = 0; i < n; ++i) prev[i] = int32_t(i) - 1, next[i] = i + 1 < n ? int32_t(i + 1) : -1;
  using Entry = std::pair<int64_t, int32_t>;  // (rank << 32 | merged id, position)
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  auto push = [&](int32_t i) {
    const BpeMerge m = pair(symbols[size_t(i)], symbols[size_t(next[size_t(i)])]);
    if (m.rank >= 0) heap.push({(int64_t(m.rank) << 32) | uint32_t(m.id), i});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(int32_t(i));
  while (!heap.empty()) {
    const auto [key, i] = heap.top();
    heap.pop();
    BpeSymbol& left = symbols[size_t(i)];
    if (left.length == 0 || next[size_t(i)] < 0) continue;
    const int32_t j = next[size_t(i)];
    const BpeMerge m = pair(left, symbols[size_t(j)]);
    if (m.rank < 0 || ((int64_t(m.rank) << 32) | uint32_t(m.id)) != key) continue;  // stale
    left.length += symbols[size_t(j)].length;
    left.id = m.id;
    symbols[size_t(j)].length = 0;
    next[size_t(i)] = next[size_t(j)];
    if (next[size_t(i)] >= 0) prev[size_t(next[size_t(i)])] = i;
    if (prev[size_t(i)] >= 0) push(prev[size_t(i)]);
    if (next[size_t(i)] >= 0) push(i);
  }
  size_t kept = 0;
  for (size_t i = 0; i < n; ++i)
    if (symbols[i].length > 0) symbols[kept++] = symbols[i];
  symbols.resize(kept);
}

template <typename PairFn>
void merge_symbols(std::vector<BpeSymbol>& symbols, const PairFn& pair) {
  // The scan costs O(n^2) lookups-free compares; past a few dozen symbols the heap wins.
  if (symbols.size() <= 48)
    merge_symbols_scan(symbols, pair);
  else
    merge_symbols_heap(symbols, pair);
}

}  // namespace kiln::text
