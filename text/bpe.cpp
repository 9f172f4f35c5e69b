// The byte-level BPE model: token tables, the (a, b) -> merge map, word encoding and its cache.
#include "text/bpe.h"

#include <cstring>

#include "core/error.h"

namespace kiln::text {
namespace {

inline uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

inline size_t mix(uint64_t k) {  // splitmix64's finaliser: ids are small and dense, so spread them
  k ^= k >> 30;
  k *= 0xbf58476d1ce4e5b9ull;
  k ^= k >> 27;
  k *= 0x94d049bb133111ebull;
  k ^= k >> 31;
  return size_t(k);
}

}  // namespace

void PairRanks::reserve(size_t num_pairs) {
  size_t cap = 16;
  while (cap < num_pairs * 2) cap *= 2;
  slots_.assign(cap, Slot{});
  size_ = 0;
}

void PairRanks::insert(int32_t a, int32_t b, BpeMerge merge) {
  if ((size_ + 1) * 2 > slots_.size()) {
    std::vector<Slot> old = std::move(slots_);
    reserve(std::max<size_t>(old.size(), 8));
    for (const Slot& s : old)
      if (s.key != kEmpty) insert(int32_t(s.key >> 32), int32_t(uint32_t(s.key)), s.merge);
  }
  const uint64_t key = pair_key(a, b);
  const size_t mask = slots_.size() - 1;
  for (size_t i = mix(key) & mask;; i = (i + 1) & mask) {
    if (slots_[i].key == kEmpty) {
      slots_[i] = {key, merge};
      ++size_;
      return;
    }
    if (slots_[i].key == key) {
      slots_[i].merge = merge;
      return;
    }
  }
}

BpeMerge PairRanks::find(int32_t a, int32_t b) const {
  if (slots_.empty()) return {};
  const uint64_t key = pair_key(a, b);
  const size_t mask = slots_.size() - 1;
  for (size_t i = mix(key) & mask;; i = (i + 1) & mask) {
    if (slots_[i].key == key) return slots_[i].merge;
    if (slots_[i].key == kEmpty) return {};
  }
}

void BpeModel::index_tokens() {
  ids_.reserve(token_bytes_.size());
  for (size_t id = 0; id < token_bytes_.size(); ++id) {
    if (token_bytes_[id].empty()) continue;
    // The first id wins when two tokens share bytes (HF would only ever reach one of them).
    ids_.emplace(std::string_view(token_bytes_[id]), int32_t(id));
  }
  for (int b = 0; b < 256; ++b) {
    const char c = char(b);
    auto it = ids_.find(std::string_view(&c, 1));
    byte_ids_[b] = it == ids_.end() ? -1 : it->second;
  }
}

std::unique_ptr<BpeModel> BpeModel::with_merges(std::vector<std::string> token_bytes,
                                                const std::vector<std::array<int32_t, 3>>& merges, bool ignore_merges,
                                                int32_t unk_id, bool fuse_unk) {
  std::unique_ptr<BpeModel> m(new BpeModel());
  m->merging_ = Merging::kPairRanks;
  m->ignore_merges_ = ignore_merges;
  m->unk_id_ = unk_id;
  m->fuse_unk_ = fuse_unk;
  m->token_bytes_ = std::move(token_bytes);
  m->index_tokens();
  m->pairs_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank)
    m->pairs_.insert(merges[rank][0], merges[rank][1], BpeMerge{int32_t(rank), merges[rank][2]});
  return m;
}

std::unique_ptr<BpeModel> BpeModel::with_token_ranks(std::vector<std::string> token_bytes) {
  std::unique_ptr<BpeModel> m(new BpeModel());
  m->merging_ = Merging::kTokenRanks;
  m->ignore_merges_ = true;  // tiktoken looks the whole piece up first
  m->token_bytes_ = std::move(token_bytes);
  m->index_tokens();
  for (int b = 0; b < 256; ++b)
    KILN_CHECK(m->byte_ids_[b] >= 0, "tokenizer: the tiktoken ranks lack the single byte ", b,
               " (every byte must be a token, or some text cannot be encoded); use a complete rank file");
  return m;
}

std::optional<int32_t> BpeModel::find(std::string_view bytes) const {
  auto it = ids_.find(bytes);
  if (it == ids_.end()) return std::nullopt;
  return it->second;
}

void BpeModel::encode_word_uncached(std::string_view word, std::vector<int64_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    auto it = ids_.find(word);
    if (it != ids_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  thread_local std::vector<BpeSymbol> symbols;
  symbols.clear();
  // One symbol per byte. Bytes without a token become unk (fused runs when fuse_unk) or vanish.
  for (uint32_t i = 0; i < word.size(); ++i) {
    const int32_t id = byte_ids_[static_cast<unsigned char>(word[i])];
    if (id >= 0) {
      symbols.push_back({id, i, 1});
    } else if (unk_id_ >= 0) {
      if (fuse_unk_ && !symbols.empty() && symbols.back().id == unk_id_ &&
          symbols.back().start + symbols.back().length == i)
        ++symbols.back().length;
      else
        symbols.push_back({unk_id_, i, 1});
    }
  }
  if (merging_ == Merging::kPairRanks) {
    merge_symbols(symbols, [this](const BpeSymbol& a, const BpeSymbol& b) { return pairs_.find(a.id, b.id); });
  } else {
    const char* base = word.data();
    merge_symbols(symbols, [this, base](const BpeSymbol& a, const BpeSymbol& b) {
      auto it = ids_.find(std::string_view(base + a.start, a.length + b.length));
      return it == ids_.end() ? BpeMerge{} : BpeMerge{it->second, it->second};
    });
  }
  for (const BpeSymbol& s : symbols) out.push_back(s.id);
}

namespace {

// A fast hash for short byte strings (8 bytes at a time); never 0, which marks an empty slot.
uint64_t word_hash(std::string_view w) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (w.size() * 0xff51afd7ed558ccdull);
  size_t i = 0;
  for (; i + 8 <= w.size(); i += 8) {
    uint64_t k;
    std::memcpy(&k, w.data() + i, 8);
    h = (h ^ k) * 0xbf58476d1ce4e5b9ull;
    h ^= h >> 29;
  }
  if (i < w.size()) {
    uint64_t k = 0;
    std::memcpy(&k, w.data() + i, w.size() - i);
    h = (h ^ k) * 0x94d049bb133111ebull;
  }
  h ^= h >> 32;
  h *= 0xd6e8feb86659fd93ull;
  h ^= h >> 32;
  return h | 1;
}

}  // namespace

void BpeModel::encode_word(std::string_view word, std::vector<int64_t>& out) const {
  if (word.size() > kMaxCachedWord) return encode_word_uncached(word, out);
  const uint64_t hash = word_hash(word);
  Shard& shard = shards_[(hash >> 56) % kNumShards];
  const size_t mask = kShardSlots - 1;
  {
    std::lock_guard<std::mutex> lock(shard.mutex);
    if (!shard.slots.empty()) {
      for (size_t i = hash & mask;; i = (i + 1) & mask) {
        const Slot& s = shard.slots[i];
        if (s.hash == 0) break;
        if (s.hash == hash && s.key_length == word.size() &&
            std::memcmp(shard.keys.data() + s.key_offset, word.data(), word.size()) == 0) {
          const int32_t* ids = shard.ids.data() + s.ids_offset;
          out.insert(out.end(), ids, ids + s.ids_length);
          return;
        }
      }
    }
  }
  const size_t first = out.size();
  encode_word_uncached(word, out);
  std::lock_guard<std::mutex> lock(shard.mutex);
  if (shard.slots.empty() || shard.used * 2 >= kShardSlots) {
    shard.slots.assign(kShardSlots, Slot{});
    shard.used = 0;
    shard.keys.clear();
    shard.ids.clear();
  }
  size_t i = hash & mask;
  for (;; i = (i + 1) & mask) {
    const Slot& s = shard.slots[i];
    if (s.hash == 0) break;
    if (s.hash == hash && s.key_length == word.size() &&
        std::memcmp(shard.keys.data() + s.key_offset, word.data(), word.size()) == 0)
      return;  // another thread was quicker
  }
  Slot& slot = shard.slots[i];
  slot.hash = hash;
  slot.key_offset = uint32_t(shard.keys.size());
  slot.key_length = uint32_t(word.size());
  slot.ids_offset = uint32_t(shard.ids.size());
  slot.ids_length = uint32_t(out.size() - first);
  shard.keys.append(word.data(), word.size());
  for (size_t k = first; k < out.size(); ++k) shard.ids.push_back(int32_t(out[k]));
  ++shard.used;
}

}  // namespace kiln::text
