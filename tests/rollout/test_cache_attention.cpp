// The rollout engine's attention over its paged cache, alone: steps that mix prefill pieces and
// decode items of two sequences (one of them forked, so its first write copies a shared block)
// give, row for row, the attention of each whole sequence at once, for full and window layers.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "model/muse.h"
#include "rollout/cache_attention.h"
#include "tests/rollout/engine_fixtures.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using rollout::Seq;
using rollout::Work;

constexpr int64_t kBlock = 4;

TEST(CacheAttention, StepsOverTheCacheEqualWholeSequenceAttention) {
  at::manual_seed(5);
  const model::ModelConfig c = test::paged_config();  // layers 0, 2 window (5); 1, 3 full
  rollout::KvCache kv(c, kBlock, 64 * rollout::KvLayout::of(c, kBlock, sizeof(double)).full_block_bytes, 2,
                      at::kDouble, at::kCPU);
  rollout::CacheAttention attention(kv, c);
  const int64_t len = 13, hd = c.head_dim, group = c.num_q_heads / c.num_kv_heads;
  // Two sequences; each layer's queries, keys and values at every position.
  std::vector<at::Tensor> q(2), k(2), v(2);
  for (int s = 0; s < 2; ++s) {
    q[s] = at::randn({c.num_layers, len, c.num_q_heads, hd}, at::kDouble);
    k[s] = at::randn({c.num_layers, len, c.num_kv_heads, hd}, at::kDouble);
    v[s] = at::randn({c.num_layers, len, c.num_kv_heads, hd}, at::kDouble);
  }
  Seq a, b;
  // Steps as (start, n) per sequence; n = 0: not in the step. b forks from a after a's 6-token
  // prefill (same first 6 positions), then each goes its own way.
  const std::vector<std::vector<std::pair<int64_t, int64_t>>> steps = {
      {{0, 6}, {0, 0}}, {{6, 1}, {6, 3}}, {{7, 1}, {9, 1}}, {{8, 5}, {10, 1}}, {{0, 0}, {11, 2}}};
  std::vector<std::vector<at::Tensor>> got(2, std::vector<at::Tensor>(size_t(c.num_layers)));
  for (size_t step = 0; step < steps.size(); ++step) {
    if (step == 1) {  // the fork: b shares a's blocks and its first 6 positions
      b.blocks = a.blocks;
      kv.share(b.blocks);
      for (std::vector<at::Tensor>* t : {&q, &k, &v}) (*t)[1].narrow(1, 0, 6).copy_((*t)[0].narrow(1, 0, 6));
    }
    std::vector<Work> work;
    int64_t offset = 0;
    for (int s = 0; s < 2; ++s) {
      const auto [start, n] = steps[step][size_t(s)];
      if (n == 0) continue;
      Seq& seq = s == 0 ? a : b;
      kv.make_writable(seq.blocks, start, n);
      Work w;
      w.seq = &seq;
      w.start = start;
      w.n = n;
      w.offset = offset;
      w.window_lo = std::max<int64_t>(0, start - c.sliding_window + 1);
      w.window_write_from = kv.first_window_write(start, n);
      w.seq->request = s;
      offset += n;
      work.push_back(w);
    }
    attention.plan(work);
    for (int64_t l = 0; l < c.num_layers; ++l) {
      std::vector<at::Tensor> qs, ks, vs;
      for (const Work& w : work) {
        const int s = int(w.seq->request);
        qs.push_back(q[s][l].narrow(0, w.start, w.n));
        ks.push_back(k[s][l].narrow(0, w.start, w.n));
        vs.push_back(v[s][l].narrow(0, w.start, w.n));
      }
      at::Tensor o = attention.attend(l, c.is_full_attention(l), model::PackedBatch{}, at::cat(qs), at::cat(ks), at::cat(vs));
      for (const Work& w : work) {
        at::Tensor& g = got[size_t(w.seq->request)][size_t(l)];
        at::Tensor rows = o.narrow(0, w.offset, w.n);
        g = g.defined() ? at::cat({g, rows}) : rows;
      }
    }
  }
  for (int s = 0; s < 2; ++s)
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const bool full = c.is_full_attention(l);
      at::Tensor want = model::sequence_attention(q[s][l].transpose(0, 1), model::expand_kv_heads(k[s][l].transpose(0, 1), group),
                                                  model::expand_kv_heads(v[s][l].transpose(0, 1), group), full,
                                                  c.sliding_window)
                            .transpose(0, 1);
      // b's rows start at its fork: its first 6 positions were a's prefill.
      const at::Tensor& g = got[size_t(s)][size_t(l)];
      EXPECT_TRUE(test::all_close(g, want.narrow(0, len - g.size(0), g.size(0)), 1e-12, 1e-12))
          << "sequence " << s << " layer " << l << (full ? " (full)" : " (window)");
    }
  kv.release(a.blocks);
  kv.release(b.blocks);
  EXPECT_EQ(kv.pool(true).used() + kv.pool(false).used(), 0);
}

}  // namespace
}  // namespace kiln
