// The trainer's own deterministic randomness (splitmix64): data generation, splits and prompt
// orders give the same result with every standard library.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

namespace kiln::trainer::rng {

// Distinct salts keep the generator, the split and the stream independent under one seed.
constexpr uint64_t kSaltProblems = 0x61726974686d6574ull;
constexpr uint64_t kSaltSplit = 0x73706c6974000000ull;
constexpr uint64_t kSaltStream = 0x73747265616d0000ull;

inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t s = a;
  uint64_t h = splitmix64(s) ^ b;
  return splitmix64(h);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  // Uniform in [0, n), n >= 1; rejection keeps it unbiased.
  uint64_t below(uint64_t n) {
    const uint64_t threshold = (0 - n) % n;
    for (;;) {
      const uint64_t x = splitmix64(state_);
      if (x >= threshold) return x % n;
    }
  }
  int64_t between(int64_t lo, int64_t hi) { return lo + int64_t(below(uint64_t(hi - lo + 1))); }
  template <typename T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[below(i)]);
  }

 private:
  uint64_t state_;
};

}  // namespace kiln::trainer::rng
