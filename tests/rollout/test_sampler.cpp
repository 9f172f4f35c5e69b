// The rollout sampler alone: the host sampler's top-k, top-p, temperature and greedy draws, and a
// step's draws (draw_tokens) equal to drawing each row by itself, taking a graph step's ids only for
// unfiltered draws.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

#include "rollout/sampler.h"

namespace kiln {
namespace {

TEST(Sampling, TopKTopPAndTemperature) {
  at::Tensor logits = at::tensor({1.0, 3.0, 2.0, 3.0, -1.0}, at::kFloat);
  rollout::SamplingParams p;
  p.temperature = 0;
  auto [g, glp] = rollout::sample_token(logits, p, 1);
  EXPECT_EQ(g, 1);  // first of the tied maxima
  EXPECT_NEAR(glp, at::log_softmax(logits.to(at::kDouble), 0)[1].item<double>(), 1e-12);
  p.temperature = 1;
  p.top_k = 2;  // only ids 1 and 3 (tied), each 1/2
  std::map<int64_t, int> counts;
  for (uint64_t s = 0; s < 2000; ++s) {
    auto [id, lp] = rollout::sample_token(logits, p, s);
    counts[id]++;
    EXPECT_NEAR(lp, std::log(0.5), 1e-12);
  }
  EXPECT_EQ(counts.size(), 2u);
  EXPECT_NEAR(counts[1] / 2000.0, 0.5, 0.05);
  p.top_k = 0;
  p.top_p = 0.5;  // each of the two tied top ids holds ~0.42: both are needed to pass 0.5
  for (uint64_t s = 0; s < 200; ++s) {
    auto [id, lp] = rollout::sample_token(logits, p, s);
    EXPECT_TRUE(id == 1 || id == 3);
    EXPECT_NEAR(lp, std::log(0.5), 1e-12);
  }
  p.top_p = 1.0;
  p.temperature = 2.0;
  at::Tensor probs = at::softmax(logits.to(at::kDouble) / 2.0, 0);
  std::vector<int> hist(5, 0);
  for (uint64_t s = 0; s < 20000; ++s) hist[rollout::sample_token(logits, p, s).first]++;
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(hist[i] / 20000.0, probs[i].item<double>(), 0.015) << "id " << i;
}

TEST(Sampling, DrawTokensEqualsEachRowDrawnAlone) {
  at::manual_seed(4);
  const at::Tensor logits = at::randn({6, 37}) * 3;
  std::vector<rollout::SamplingParams> params(4);
  params[0].temperature = 0;    // greedy
  params[1].temperature = 0.7;  // whole distribution
  params[2].top_k = 5;          // filtered
  params[3].top_p = 0.6;        // filtered
  std::vector<rollout::Draw> draws;
  for (int64_t i = 0; i < 9; ++i) draws.push_back({(i * 5) % 6, &params[size_t(i % 4)], rollout::sample_stream_seed(9, i, 3)});
  const auto picked = rollout::draw_tokens(draws, logits);
  ASSERT_EQ(picked.size(), draws.size());
  for (size_t i = 0; i < draws.size(); ++i) {
    const auto alone = rollout::sample_token(logits[draws[i].row], *draws[i].params, draws[i].stream_seed);
    EXPECT_EQ(picked[i].first, alone.first) << "draw " << i;
    EXPECT_EQ(picked[i].second, alone.second) << "draw " << i;
  }
  EXPECT_FALSE(rollout::filtered(params[0]) || rollout::filtered(params[1]));
  EXPECT_TRUE(rollout::filtered(params[2]) && rollout::filtered(params[3]));
  // A graph step's own draws: taken for the unfiltered draws, ignored for the filtered ones.
  const at::Tensor ids = at::arange(100, 106, at::kLong), lps = -at::arange(1, 7, at::kFloat);
  const auto with_graph = rollout::draw_tokens(draws, logits, ids, lps);
  for (size_t i = 0; i < draws.size(); ++i) {
    if (rollout::filtered(*draws[i].params)) {
      EXPECT_EQ(with_graph[i], picked[i]) << "draw " << i;
    } else {
      EXPECT_EQ(with_graph[i].first, 100 + draws[i].row) << "draw " << i;
      EXPECT_EQ(with_graph[i].second, -double(draws[i].row + 1)) << "draw " << i;
    }
  }
  EXPECT_TRUE(rollout::draw_tokens({}, logits).empty());
}

}  // namespace
}  // namespace kiln
