// The zigzag split of context parallelism (parallel/context_parallel.h) without MPI: every token on
// exactly one rank, the zigzag chunks, attention work within 5% of the mean on long sequences, short
// and empty sequences, and the local batches' positions.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <vector>

#include "parallel/context_parallel.h"
#include "model/config.h"
#include "tests/test_util.h"

namespace kiln::parallel {
namespace {

std::vector<int64_t> cu_of(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> cu = {0};
  for (int64_t n : lengths) cu.push_back(cu.back() + n);
  return cu;
}

// Every token once, pieces contiguous and in order, and the local batch's tokens and positions.
void check_cover(const std::vector<int64_t>& lengths, int ranks) {
  const std::vector<int64_t> cu = cu_of(lengths);
  const ContextSplit split(cu, ranks);
  const int64_t T = cu.back();
  std::vector<int> seen(size_t(T), 0);
  at::Tensor tokens = at::arange(T, at::kLong) * 7 + 3;  // token = f(row): checks the local rows
  for (int r = 0; r < ranks; ++r) {
    const std::vector<int64_t> rows = split.rows(r);
    ASSERT_EQ(int64_t(rows.size()), split.num_tokens(r));
    for (int64_t row : rows) ++seen[size_t(row)];
    const model::PackedBatch b = split.local_batch(tokens, r);
    ASSERT_EQ(b.num_tokens(), split.num_tokens(r));
    ASSERT_EQ(b.num_sequences(), int64_t(split.pieces(r).size()));
    at::Tensor pos = b.positions();
    for (size_t i = 0; i < rows.size(); ++i) {
      EXPECT_EQ(b.tokens[int64_t(i)].item<int64_t>(), rows[i] * 7 + 3);
      const int64_t s = int64_t(std::upper_bound(cu.begin(), cu.end(), rows[i]) - cu.begin()) - 1;
      EXPECT_EQ(pos[int64_t(i)].item<int64_t>(), rows[i] - cu[size_t(s)]) << "rank " << r << " row " << rows[i];
    }
    const auto& pieces = split.pieces(r);
    for (size_t i = 0; i < pieces.size(); ++i) {
      const ContextPiece& p = pieces[i];
      EXPECT_GT(p.length, 0);
      EXPECT_EQ(p.last, p.start + p.length == lengths[size_t(p.sequence)]);
      if (i > 0 && pieces[i - 1].sequence == p.sequence)  // a rank's touching chunks are one piece
        EXPECT_LT(pieces[i - 1].start + pieces[i - 1].length, p.start);
      if (i > 0) EXPECT_LE(pieces[i - 1].sequence, p.sequence);
    }
  }
  for (int64_t t = 0; t < T; ++t) EXPECT_EQ(seen[size_t(t)], 1) << "row " << t << " at ranks=" << ranks;
}

TEST(ContextSplit, EveryTokenOnExactlyOneRank) {
  for (int ranks : {1, 2, 3, 4, 8}) {
    check_cover({1, 19, 111, 4097}, ranks);
    check_cover({5, 0, 2, 1, 16, 17, 3}, ranks);
  }
}

TEST(ContextSplit, ZigzagChunks) {
  // 8 * 13 tokens over 4 ranks: 8 chunks of 13; rank r holds chunks r and 7 - r, rank 3 one piece.
  const ContextSplit split({0, 104}, 4);
  for (int r = 0; r < 4; ++r) {
    const auto& p = split.pieces(r);
    if (r == 3) {
      ASSERT_EQ(p.size(), 1u);
      EXPECT_EQ(p[0].start, 3 * 13);
      EXPECT_EQ(p[0].length, 26);
      continue;
    }
    ASSERT_EQ(p.size(), 2u) << r;
    EXPECT_EQ(p[0].start, r * 13);
    EXPECT_EQ(p[0].length, 13);
    EXPECT_EQ(p[1].start, (7 - r) * 13);
    EXPECT_EQ(p[1].length, 13);
    EXPECT_EQ(p[1].last, r == 0);
  }
}

// The (query, key) pairs by brute force: what attention_work's closed loop must give.
TEST(ContextSplit, AttentionWorkCountsQueryKeyPairs) {
  const std::vector<int64_t> lengths = {1, 19, 111};
  const ContextSplit split(cu_of(lengths), 3);
  for (int64_t window : {int64_t(0), int64_t(8)}) {
    int64_t total = 0, expect = 0;
    for (int r = 0; r < 3; ++r) total += split.attention_work(r, window);
    for (int64_t n : lengths)
      for (int64_t q = 0; q < n; ++q)
        for (int64_t k = 0; k <= q; ++k) expect += window <= 0 || k > q - window;
    EXPECT_EQ(total, expect) << "window " << window;
  }
}

// Long sequences (at least 2N windows of Muse Spark Open, W = 2048): each rank's token count and
// full-attention work within 5% of the mean. A window layer is even only where n >> W N: rank 0's
// front chunk holds the positions below W, whose queries see fewer keys, about W N / (2n) of the
// mean short; so the whole model's attention work (16 full, 46 window layers) is asserted from
// n >= 4 W N and a window layer's alone from 10 W N. The equal-token chunks keep the per-token work
// (projections, norms, the MoE, the head) even instead. Prints the largest
// deviations for each kind, all lengths included.
TEST(ContextSplit, BalancedOnLongSequences) {
  const model::ModelConfig cfg =
      model::ModelConfig::from_yaml_file(test::source_path("configs/muse-spark-open-816b.yaml"));
  const int64_t W = cfg.sliding_window;
  const std::vector<std::vector<int64_t>> batches = {{32768}, {131072, 40001}, {65537, 70000, 50000}, {1 << 20}};
  for (int ranks : {2, 4, 8}) {
    const char* names[4] = {"tokens", "full layer", "model", "window layer"};
    const int64_t asserted_from[4] = {0, 0, 4 * W * ranks, 10 * W * ranks};
    double worst[4] = {0, 0, 0, 0}, worst_asserted[4] = {0, 0, 0, 0};
    for (const auto& lengths : batches) {
      const ContextSplit split(cu_of(lengths), ranks);
      const int64_t shortest = *std::min_element(lengths.begin(), lengths.end());
      for (int kind = 0; kind < 4; ++kind) {
        std::vector<double> work;
        for (int r = 0; r < ranks; ++r)
          work.push_back(kind == 0   ? double(split.num_tokens(r))
                         : kind == 1 ? double(split.attention_work(r))
                         : kind == 2 ? double(split.attention_work(r, cfg))
                                     : double(split.attention_work(r, W)));
        const double mean = std::accumulate(work.begin(), work.end(), 0.0) / ranks;
        for (double w : work) {
          const double dev = std::abs(w - mean) / mean;
          worst[kind] = std::max(worst[kind], dev);
          if (shortest < asserted_from[kind]) continue;
          worst_asserted[kind] = std::max(worst_asserted[kind], dev);
          EXPECT_LE(dev, 0.05) << "ranks " << ranks << " " << names[kind] << " shortest " << shortest;
        }
      }
    }
    for (int kind = 0; kind < 4; ++kind)
      std::printf("cp=%d %-12s largest deviation from the mean %.4f%% (%.4f%% where asserted)\n", ranks,
                  names[kind], 100 * worst[kind], 100 * worst_asserted[kind]);
  }
}

// Sequences shorter than 2N tokens leave chunks empty; the left-over tokens rotate over the ranks,
// so a batch of short sequences is spread evenly (to one token) instead of landing on rank 0.
TEST(ContextSplit, ShortSequencesSpreadOverRanks) {
  const ContextSplit ones(cu_of(std::vector<int64_t>(9, 1)), 4);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(ones.num_tokens(r), r == 0 ? 3 : 2) << r;
  const ContextSplit mixed(cu_of({3, 1, 7, 2, 5}), 4);  // 18 tokens
  for (int r = 0; r < 4; ++r) {
    EXPECT_GE(mixed.num_tokens(r), 4) << r;
    EXPECT_LE(mixed.num_tokens(r), 5) << r;
  }
}

TEST(ContextSplit, RefusesFewerTokensThanRanks) {
  EXPECT_TRUE(
      test::throws_with([] { (void)ContextSplit({0, 1, 3}, 4); }, {"rank 3 of 4 gets no tokens", "at least 4"}));
  EXPECT_TRUE(test::throws_with([] { (void)ContextSplit({0, 4}, 0); }, {"at least one rank"}));
}

TEST(ContextSplit, LocalRowsOfPerTokenTensors) {
  const ContextSplit split(cu_of({19, 4}), 2);
  at::Tensor whole = at::arange(23 * 3, at::kDouble).view({23, 3});
  for (int r = 0; r < 2; ++r) {
    at::Tensor local = split.local_rows(whole, r);
    const auto rows = split.rows(r);
    for (size_t i = 0; i < rows.size(); ++i)
      EXPECT_TRUE(test::all_equal(local[int64_t(i)], whole[rows[i]]));
  }
  EXPECT_TRUE(test::throws_with([&] { split.local_rows(whole.narrow(0, 0, 5), 0); }, {"5 rows, expected 23"}));
}

}  // namespace
}  // namespace kiln::parallel
