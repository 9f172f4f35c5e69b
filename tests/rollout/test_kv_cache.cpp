// The rollout engine's paged KV cache on its own: pool sizing and its error, block allocation for
// full-attention positions and the window ring, rows of positions, copy-on-write after a fork,
// release, and blocks_needed against what make_writable really takes.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "rollout/kv_cache.h"
#include "tests/rollout/engine_fixtures.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using rollout::BlockPool;
using rollout::BlockTable;
using rollout::KvCache;
using rollout::KvLayout;

// test::paged_config(): layers 1 and 3 full, 0 and 2 window, window 5: a ring of ceil(5 / 4) + 1
// = 3 blocks of 4.
model::ModelConfig cache_config() { return test::paged_config(); }

constexpr int64_t kBlock = 4;

int64_t block_bytes(const model::ModelConfig& c) { return 2 * kBlock * 2 * c.kv_size() * int64_t(sizeof(float)); }

TEST(BlockPool, CountsHoldersAndReusesFreedBlocks) {
  BlockPool pool(3);
  EXPECT_EQ(pool.allocate(), 0);
  const int64_t b = pool.allocate();
  pool.retain(b);
  EXPECT_TRUE(pool.shared(b));
  pool.release(b);
  EXPECT_FALSE(pool.shared(b));
  EXPECT_EQ(pool.used(), 2);
  pool.release(b);
  EXPECT_EQ(pool.num_free(), 2);
  EXPECT_EQ(pool.allocate(), b);  // the last freed block comes back first
  pool.allocate();
  EXPECT_TRUE(test::throws_with([&] { pool.allocate(); }, {"KV block pool exhausted"}));
}

TEST(KvCache, SizesItsPoolsFromTheByteBudget) {
  const model::ModelConfig c = cache_config();
  const KvLayout l = KvLayout::of(c, kBlock, sizeof(float));
  EXPECT_EQ(l.full_block_bytes, block_bytes(c));  // two full-attention layers
  EXPECT_EQ(l.window_block_bytes, block_bytes(c));
  EXPECT_EQ(l.ring_blocks, 3);
  // 2 sequences: 6 ring blocks, then 5 full blocks and a remainder too small for a sixth.
  KvCache kv(c, kBlock, 11 * block_bytes(c) + 7, 2, at::kFloat, at::kCPU);
  EXPECT_EQ(kv.pool(false).total(), 6);
  EXPECT_EQ(kv.pool(true).total(), 5);
  EXPECT_EQ(kv.keys(true).sizes(), (std::vector<int64_t>{2, 6 * kBlock, c.num_kv_heads, c.head_dim}));  // + spare
  EXPECT_EQ(kv.values(false).size(1), 7 * kBlock);
  EXPECT_EQ(kv.group_of(0), 0);
  EXPECT_EQ(kv.group_of(3), 1);
  EXPECT_EQ(kv.graph_pools().scratch_full, 5);
  EXPECT_TRUE(test::throws_with([&] { KvCache(c, kBlock, 6 * block_bytes(c), 2, at::kFloat, at::kCPU); },
                                {"kv_cache_bytes=", "cannot hold the window rings", "max_num_seqs=2"}));
}

// With max_model_len the window pool holds what sequences of that length touch, not whole rings,
// and never less than one ring: a longer sequence still wraps through all of its ring's slots.
TEST(KvCache, MaxModelLenCutsTheReservedRingsToWhatSequencesTouch) {
  const model::ModelConfig c = cache_config();
  const KvLayout l = KvLayout::of(c, kBlock, sizeof(float));
  EXPECT_EQ(l.window_blocks_per_seq(std::nullopt), 3);  // any length: the whole ring
  EXPECT_EQ(l.window_blocks_per_seq(4), 1);
  EXPECT_EQ(l.window_blocks_per_seq(5), 2);
  EXPECT_EQ(l.window_blocks_per_seq(1000), 3);
  EXPECT_EQ(l.window_pool_blocks(4, 6), 8);
  EXPECT_EQ(l.window_pool_blocks(1, 4), 3);  // never less than one whole ring
  EXPECT_EQ(KvLayout::of(test::paged_config(1), kBlock, sizeof(float)).window_pool_blocks(4, 6), 0);  // no window layers
  KvCache cut(c, kBlock, 20 * block_bytes(c), 4, at::kFloat, at::kCPU, /*max_model_len=*/6);
  EXPECT_EQ(cut.pool(false).total(), 4 * 2);
  EXPECT_EQ(cut.pool(true).total(), 20 - 8);  // the bytes the rings no longer take are full blocks
  KvCache one(c, kBlock, 20 * block_bytes(c), 1, at::kFloat, at::kCPU, /*max_model_len=*/4);
  EXPECT_EQ(one.pool(false).total(), 3);  // one whole ring, not the 1 block that 4 tokens touch
  BlockTable t;
  one.make_writable(t, 0, 6);  // past max_model_len: the ring wraps as without it
  one.make_writable(t, 6, 7);
  EXPECT_EQ(one.pool(false).used(), 3);
  EXPECT_EQ(std::count_if(t.ring.begin(), t.ring.end(), [](int64_t b) { return b >= 0; }), 3);
  EXPECT_TRUE(test::throws_with([&] { KvCache(c, kBlock, 8 * block_bytes(c), 4, at::kFloat, at::kCPU, 6); },
                                {"cannot hold the window rings", "max_model_len=6", "or max_model_len"}));
}

TEST(KvCache, PositionsMapToTheirBlocksAndTheWindowRing) {
  const model::ModelConfig c = cache_config();
  KvCache kv(c, kBlock, 20 * block_bytes(c), 2, at::kFloat, at::kCPU);
  BlockTable t;
  kv.make_writable(t, 0, 7);  // positions 0..6: full blocks 0 and 1; the window keeps 2..6
  ASSERT_EQ(t.full.size(), 2u);
  EXPECT_EQ(kv.first_window_write(0, 7), 2);
  EXPECT_EQ(std::count_if(t.ring.begin(), t.ring.end(), [](int64_t b) { return b >= 0; }), 2);
  std::vector<int64_t> rows;
  kv.rows(t, 3, 6, /*full=*/true, rows);
  EXPECT_EQ(rows, (std::vector<int64_t>{t.full[0] * kBlock + 3, t.full[1] * kBlock, t.full[1] * kBlock + 1}));
  // Position 12 is in logical block 3: ring slot 0 again, the block that held positions 0..3.
  kv.make_writable(t, 7, 6);
  const int64_t slot0 = t.ring[0];
  rows.clear();
  kv.rows(t, 12, 13, /*full=*/false, rows);
  EXPECT_EQ(rows, std::vector<int64_t>{slot0 * kBlock});
  EXPECT_EQ(kv.pool(false).used(), 3);  // the ring never grows past 3 blocks
  EXPECT_EQ(kv.pool(true).used(), 4);
  kv.release(t);
  EXPECT_TRUE(t.full.empty() && t.ring.empty());
  EXPECT_EQ(kv.pool(true).used() + kv.pool(false).used(), 0);
}

TEST(KvCache, ForkedTablesCopyOnWrite) {
  const model::ModelConfig c = cache_config();
  KvCache kv(c, kBlock, 20 * block_bytes(c), 2, at::kFloat, at::kCPU);
  BlockTable parent;
  kv.make_writable(parent, 0, 6);
  kv.keys(true).normal_();
  kv.values(false).normal_();
  const at::Tensor keys_before = kv.keys(true).clone(), values_before = kv.values(false).clone();
  BlockTable child = parent;
  kv.share(child);
  EXPECT_TRUE(kv.pool(true).shared(parent.full[1]));
  // The child writes position 6 (in block 1, shared): it gets a copy; block 0 stays shared.
  EXPECT_EQ(kv.blocks_needed(child, 6, 1), (std::pair<int64_t, int64_t>{1, 1}));
  kv.make_writable(child, 6, 1);
  EXPECT_NE(child.full[1], parent.full[1]);
  EXPECT_EQ(child.full[0], parent.full[0]);
  EXPECT_NE(child.ring[1], parent.ring[1]);
  const int64_t from = parent.full[1] * kBlock, to = child.full[1] * kBlock;
  EXPECT_TRUE(test::all_equal(kv.keys(true).narrow(1, to, kBlock), keys_before.narrow(1, from, kBlock)));
  const int64_t wf = parent.ring[1] * kBlock, wt = child.ring[1] * kBlock;
  EXPECT_TRUE(test::all_equal(kv.values(false).narrow(1, wt, kBlock), values_before.narrow(1, wf, kBlock)));
  EXPECT_TRUE(test::all_equal(kv.keys(true).narrow(1, parent.full[1] * kBlock, kBlock),
                              keys_before.narrow(1, parent.full[1] * kBlock, kBlock)));  // the parent's stays
  // Releasing both returns every block.
  kv.release(parent);
  EXPECT_FALSE(kv.pool(true).shared(child.full[0]));
  kv.release(child);
  EXPECT_EQ(kv.pool(true).used() + kv.pool(false).used(), 0);
}

TEST(KvCache, BlocksNeededIsWhatMakeWritableTakes) {
  const model::ModelConfig c = cache_config();
  KvCache kv(c, kBlock, 200 * block_bytes(c), 4, at::kFloat, at::kCPU);
  std::mt19937 rng(3);
  std::vector<BlockTable> tables(4);
  std::vector<int64_t> length(4, 0);
  for (int it = 0; it < 200; ++it) {
    const size_t i = rng() % 4;
    if (rng() % 5 == 0 && length[i] > 0) {  // fork table i into table j (dropping j's blocks)
      const size_t j = (i + 1) % 4;
      kv.release(tables[j]);
      tables[j] = tables[i];
      kv.share(tables[j]);
      length[j] = length[i];
      continue;
    }
    const int64_t n = 1 + int64_t(rng() % 9);
    const auto [full, win] = kv.blocks_needed(tables[i], length[i], n);
    ASSERT_TRUE(kv.fits(tables[i], length[i], n));
    const int64_t free_full = kv.pool(true).num_free(), free_win = kv.pool(false).num_free();
    kv.make_writable(tables[i], length[i], n);
    // Allocated minus released-to-free (a copied block freed when its last other holder was gone).
    EXPECT_LE(free_full - kv.pool(true).num_free(), full) << "iteration " << it;
    EXPECT_LE(free_win - kv.pool(false).num_free(), win) << "iteration " << it;
    // Every position written is now the table's own.
    const int64_t first = length[i] / kBlock, last = (length[i] + n - 1) / kBlock;
    for (int64_t b = first; b <= last; ++b) EXPECT_FALSE(kv.pool(true).shared(tables[i].full[size_t(b)]));
    EXPECT_EQ(kv.blocks_needed(tables[i], length[i], n), (std::pair<int64_t, int64_t>{0, 0})) << "iteration " << it;
    length[i] += n;
    if (length[i] > 120) {
      kv.release(tables[i]);
      length[i] = 0;
    }
  }
  for (auto& t : tables) kv.release(t);
  EXPECT_EQ(kv.pool(true).used() + kv.pool(false).used(), 0);
}

}  // namespace
}  // namespace kiln
