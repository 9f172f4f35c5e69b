// Shared by the CPU and CUDA engine tests: a small engine config (block 4, up to 8 sequences) and
// a one-line request builder.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "rollout/engine.h"

namespace kiln::test {

inline rollout::EngineConfig small_engine(int64_t kv_bytes = 1 << 20) {
  rollout::EngineConfig e;
  e.kv_cache_bytes = kv_bytes;
  e.block_size = 4;
  e.max_num_seqs = 8;
  e.max_batch_tokens = 64;
  e.prefill_chunk = 16;
  return e;
}

inline rollout::Request request(std::vector<int64_t> prompt, int64_t n, int64_t max_tokens, double temperature,
                                uint64_t seed) {
  rollout::Request r;
  r.prompt = std::move(prompt);
  r.params.n = n;
  r.params.max_tokens = max_tokens;
  r.params.temperature = temperature;
  r.params.seed = seed;
  return r;
}

}  // namespace kiln::test
