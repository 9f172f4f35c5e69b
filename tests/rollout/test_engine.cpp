// The rollout engine against the full forward: greedy = repeated argmax, log-probs and routing
// equal the forward's, bounded window-layer memory, completion under a full cache (with
// preemption), shared prefill, chunked prefill, determinism, graph decode steps run uncaptured,
// weight updates, bad requests, and multi-turn sessions (continued without recomputing the prefix;
// evicted and recomputed).
#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <gtest/gtest.h>

#include "model/lora.h"
#include "model/muse.h"
#include "rollout/engine.h"
#include "tests/model/reference.h"
#include "tests/rollout/engine_fixtures.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using rollout::Engine;
using rollout::EngineConfig;
using rollout::Request;

model::ModelConfig engine_config() {
  model::ModelConfig c = test::micro_config();
  c.vocab_size = 23;
  c.num_layers = 4;              // layers 1 and 3 full, 0 and 2 window
  c.full_attention_period = 2;
  c.sliding_window = 5;
  c.init_std = 0.2;  // sharp enough for varied routing; 0.3 left fp32 differences at the 1e-5 edge
  return c;
}

using test::request;
using test::small_engine;

std::vector<Request> mixed_requests() {
  return {request({1, 2, 3}, 2, 9, 1.0, 1), request({4}, 3, 12, 1.0, 2),
          request({5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21}, 2, 7, 1.0, 3)};
}

// Full forward of prompt + generated: log-probs (at temperature T) and routing of every token.
struct Scored {
  at::Tensor logprobs;  // [generated]
  at::Tensor routing;   // [prompt + generated, L, k]
};
Scored score(const model::Muse& m, const std::vector<int64_t>& prompt, const std::vector<int64_t>& gen, double T) {
  std::vector<int64_t> all = prompt;
  all.insert(all.end(), gen.begin(), gen.end());
  model::ForwardOptions opt;
  opt.return_logits = true;
  auto out = m.forward(model::PackedBatch::from_sequences({all}, at::kCPU), opt);
  at::Tensor lp = at::log_softmax(out.logits / T, -1);
  at::Tensor picked = at::empty({int64_t(gen.size())}, at::kDouble);
  for (size_t t = 0; t < gen.size(); ++t) picked[t] = lp[int64_t(prompt.size() + t) - 1][gen[t]];
  return {picked, out.routing};
}

TEST(Engine, GreedyEqualsRepeatedArgmaxOfTheFullForward) {
  model::Muse m = model::Muse::init(engine_config(), 1, at::kFloat, at::kCPU);
  Engine engine(m, small_engine());
  std::vector<Request> reqs = {request({1, 2, 3}, 2, 10, 0.0, 0), request({7, 7, 1, 9, 4, 2, 2, 8}, 1, 13, 0.0, 0)};
  auto outs = engine.generate(reqs);
  for (size_t r = 0; r < reqs.size(); ++r) {
    for (const auto& s : outs[r].samples) {
      std::vector<int64_t> seq = reqs[r].prompt;
      for (size_t t = 0; t < s.tokens.size(); ++t) {
        model::ForwardOptions opt;
        opt.return_logits = true;
        auto full = m.forward(model::PackedBatch::from_sequences({seq}, at::kCPU), opt);
        const int64_t expect = full.logits[int64_t(seq.size()) - 1].argmax().item<int64_t>();
        ASSERT_EQ(s.tokens[t], expect) << "request " << r << " token " << t;
        seq.push_back(expect);
      }
      EXPECT_EQ(int64_t(s.tokens.size()), reqs[r].params.max_tokens);
      EXPECT_EQ(s.finish, rollout::FinishReason::kLength);
    }
    EXPECT_EQ(outs[r].samples.front().tokens, outs[r].samples.back().tokens);  // greedy samples agree
  }
}

TEST(Engine, LogprobsAndRoutingEqualTheFullForward) {
  model::Muse m = model::Muse::init(engine_config(), 2, at::kFloat, at::kCPU);
  for (double T : {1.0, 0.7}) {
    Engine engine(m, small_engine());
    auto reqs = mixed_requests();
    for (auto& r : reqs) r.params.temperature = T;
    auto outs = engine.generate(reqs);
    for (size_t r = 0; r < reqs.size(); ++r) {
      ASSERT_EQ(int64_t(outs[r].samples.size()), reqs[r].params.n);
      for (const auto& s : outs[r].samples) {
        Scored ref = score(m, reqs[r].prompt, s.tokens, T);
        at::Tensor got = at::tensor(std::vector<double>(s.logprobs.begin(), s.logprobs.end()), at::kDouble);
        KILN_EXPECT_CLOSE(got, ref.logprobs, 1e-5, 1e-5);
        EXPECT_TRUE(test::all_equal(s.routing, ref.routing)) << "request " << r << " T=" << T;
      }
    }
  }
}

TEST(Engine, WindowLayerMemoryStaysBounded) {
  model::Muse m = model::Muse::init(engine_config(), 3, at::kFloat, at::kCPU);
  Engine engine(m, small_engine());
  auto outs = engine.generate({request({1, 2}, 2, 120, 1.0, 5)});
  auto st = engine.stats();
  // 2 sequences of 122 tokens, block 4: full layers grow to 31 blocks each, window layers keep a
  // ring of ceil(5 / 4) + 1 = 3 blocks each.
  EXPECT_EQ(st.window_ring_blocks, 3);
  EXPECT_LE(st.peak_window_blocks, 2 * 3);
  EXPECT_GE(st.peak_full_blocks, 2 * 30);
  EXPECT_EQ(st.full_blocks_used, 0);
  EXPECT_EQ(st.window_blocks_used, 0);
  for (const auto& s : outs[0].samples) EXPECT_EQ(s.tokens.size(), 120u);
  // reset_peaks starts the peaks again from what is in use (nothing, between batches); a shorter
  // batch then peaks lower than the first.
  engine.reset_peaks();
  EXPECT_EQ(engine.stats().peak_full_blocks, 0);
  engine.generate({request({1, 2}, 1, 10, 1.0, 6)});
  EXPECT_GT(engine.stats().peak_full_blocks, 0);
  EXPECT_LT(engine.stats().peak_full_blocks, st.peak_full_blocks);
}

TEST(Engine, EveryRequestCompletesWhenTheCacheIsFullAndResultsDoNotChange) {
  model::Muse m = model::Muse::init(engine_config(), 4, at::kFloat, at::kCPU);
  std::vector<Request> reqs;
  for (int i = 0; i < 6; ++i) reqs.push_back(request({1 + i, 2, 3, 4 + i}, 2, 30, 1.0, 10 + i));
  Engine roomy(m, small_engine());
  auto expected = roomy.generate(reqs);
  // Room for about one sample's full-layer blocks beyond the window rings.
  auto st = roomy.stats();
  const int64_t tight_bytes = st.window_blocks_total * st.window_block_bytes + 12 * st.full_block_bytes;
  Engine tight(m, small_engine(tight_bytes));
  auto got = tight.generate(reqs);
  EXPECT_GT(tight.stats().preemptions, 0);
  for (size_t r = 0; r < reqs.size(); ++r)
    for (size_t j = 0; j < got[r].samples.size(); ++j) {
      EXPECT_EQ(got[r].samples[j].tokens, expected[r].samples[j].tokens) << "request " << r << " sample " << j;
      EXPECT_TRUE(test::all_equal(got[r].samples[j].routing, expected[r].samples[j].routing));
    }
}

TEST(Engine, RoutingIsTheSamplingStepsAlsoWhenARecomputeRoutesDifferently) {
  // A preempted sequence is recomputed; here the weights change between the preemption and the
  // recompute (as an in-flight weight update would), so the recompute routes differently. The
  // recorded routing must stay the one each token's successor was drawn under.
  model::Muse a = model::Muse::init(engine_config(), 4, at::kFloat, at::kCPU);
  model::Muse b = model::Muse::init(engine_config(), 14, at::kFloat, at::kCPU);
  std::vector<Request> reqs;
  for (int i = 0; i < 6; ++i) reqs.push_back(request({1 + i, 2, 3, 4 + i}, 2, 30, 1.0, 10 + i));
  Engine roomy(a, small_engine());
  roomy.generate(reqs);
  const auto st = roomy.stats();
  Engine tight(a, small_engine(st.window_blocks_total * st.window_block_bytes + 12 * st.full_block_bytes));
  bool updated = false;
  const int64_t rerouted = test::check_routing_of_sampling_steps(tight, reqs, [&](Engine& e) {
    if (!updated && e.stats().preemptions > 0) {
      e.update_weights(b.named_parameters());
      updated = true;
    }
  });
  EXPECT_TRUE(updated);
  EXPECT_GT(rerouted, 0);  // the recomputes did route differently
}

// The graph decode step's code (static buffers, rows padded to a bucket, block tables read by the
// paged kernel) run without capture, as the CPU can: the samples equal the eager engine's, under
// preemption too, and each token's recorded routing is its sampling step's.
TEST(Engine, GraphDecodeStepsWithoutCaptureEqualTheEagerEngine) {
  model::Muse m = model::Muse::init(engine_config(), 4, at::kFloat, at::kCPU);
  std::vector<Request> reqs = mixed_requests();
  for (int i = 0; i < 4; ++i) reqs.push_back(request({1 + i, 2, 3, 4 + i}, 1, 25, 1.0, 10 + i));
  Engine eager(m, small_engine());
  const auto expected = eager.generate(reqs);
  EXPECT_EQ(eager.stats().graph_steps, 0);
  const auto st = eager.stats();
  for (const int64_t bytes : {small_engine().kv_cache_bytes,  // roomy, then tight enough to preempt
                              st.window_blocks_total * st.window_block_bytes + 14 * st.full_block_bytes}) {
    EngineConfig ec = small_engine(bytes);
    ec.uncaptured_graph_steps = true;
    Engine graphed(m, ec);
    const auto got = graphed.generate(reqs);
    EXPECT_GT(graphed.stats().graph_steps, 0);
    if (bytes != small_engine().kv_cache_bytes) EXPECT_GT(graphed.stats().preemptions, 0);
    for (size_t r = 0; r < reqs.size(); ++r)
      for (size_t j = 0; j < got[r].samples.size(); ++j) {
        const rollout::Sample &a = expected[r].samples[j], &b = got[r].samples[j];
        EXPECT_EQ(b.tokens, a.tokens) << "request " << r << " sample " << j;
        EXPECT_TRUE(test::all_equal(b.routing, a.routing)) << "request " << r << " sample " << j;
        KILN_EXPECT_CLOSE(at::tensor(std::vector<double>(b.logprobs.begin(), b.logprobs.end())),
                          at::tensor(std::vector<double>(a.logprobs.begin(), a.logprobs.end())), 1e-5, 1e-5);
      }
    Engine traced(m, ec);
    test::check_routing_of_sampling_steps(traced, reqs, nullptr);
  }
}

TEST(Engine, KvCacheBytesForHoldsWholeSequencesWithoutPreemption) {
  model::Muse m = model::Muse::init(engine_config(), 4, at::kFloat, at::kCPU);
  std::vector<Request> reqs;
  for (int i = 0; i < 4; ++i) reqs.push_back(request({1 + i, 2, 3, 4 + i}, 2, 30, 1.0, 10 + i));
  EngineConfig ec = small_engine();
  ec.kv_cache_bytes = rollout::kv_cache_bytes_for(m.config(), ec, sizeof(float), 4 + 30);
  Engine exact(m, ec);
  exact.generate(reqs);
  EXPECT_EQ(exact.stats().preemptions, 0);
  // The budget is the layout's: every ring plus 9 full-attention blocks (34 tokens) per sequence.
  const auto st = exact.stats();
  EXPECT_EQ(ec.kv_cache_bytes, ec.max_num_seqs * (st.window_ring_blocks * st.window_block_bytes + 9 * st.full_block_bytes));
  ec.kv_cache_bytes -= 6 * st.full_block_bytes;  // short of that: the same requests preempt
  Engine tight(m, ec);
  tight.generate(reqs);
  EXPECT_GT(tight.stats().preemptions, 0);
}

// max_model_len sizes the window pool by the sequences' length when the window is longer: the
// budget for whole sequences shrinks, the samples stay the same, and sequences longer than
// max_model_len still run to the same samples (preempting others for ring blocks).
TEST(Engine, MaxModelLenCutsTheWindowRingsWithoutChangingSamples) {
  model::ModelConfig cfg = engine_config();
  cfg.sliding_window = 64;  // a ring of 17 blocks of 4; a 34-token sequence touches 9 of them
  model::Muse m = model::Muse::init(cfg, 4, at::kFloat, at::kCPU);
  std::vector<Request> reqs;
  for (int i = 0; i < 4; ++i) reqs.push_back(request({1 + i, 2, 3, 4 + i}, 2, 30, 1.0, 10 + i));
  EngineConfig whole = small_engine();
  whole.kv_cache_bytes = rollout::kv_cache_bytes_for(cfg, whole, sizeof(float), 34);
  Engine reference(m, whole);
  const auto expected = reference.generate(reqs);
  EngineConfig cut = whole;
  cut.max_model_len = 34;
  cut.kv_cache_bytes = rollout::kv_cache_bytes_for(cfg, cut, sizeof(float), 34);
  const auto st = reference.stats();
  EXPECT_EQ(whole.kv_cache_bytes - cut.kv_cache_bytes, 8 * (17 - 9) * st.window_block_bytes);
  Engine engine(m, cut);
  auto expect_same = [](const std::vector<rollout::RequestOutput>& got,
                        const std::vector<rollout::RequestOutput>& want) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t r = 0; r < got.size(); ++r)
      for (size_t j = 0; j < got[r].samples.size(); ++j) {
        EXPECT_EQ(got[r].samples[j].tokens, want[r].samples[j].tokens) << "request " << r << " sample " << j;
        EXPECT_TRUE(test::all_equal(got[r].samples[j].routing, want[r].samples[j].routing));
      }
  };
  expect_same(engine.generate(reqs), expected);
  EXPECT_EQ(engine.stats().window_blocks_total, 8 * 9);
  EXPECT_EQ(engine.stats().preemptions, 0);
  // 60 new tokens: longer than max_model_len, so the cut pools cannot hold all eight at once.
  std::vector<Request> longer = reqs;
  for (auto& r : longer) r.params.max_tokens = 60;
  const int64_t before = engine.stats().preemptions;
  expect_same(engine.generate(longer), reference.generate(longer));
  EXPECT_GT(engine.stats().preemptions, before);
  // One sequence at a time: kv_cache_bytes_for still counts a whole ring, the pool's least.
  EngineConfig one = cut;
  one.max_num_seqs = 1;
  one.kv_cache_bytes = rollout::kv_cache_bytes_for(cfg, one, sizeof(float), 64);
  Engine single(m, one);
  Request alone = longer[0];
  alone.params.n = 1;
  expect_same(single.generate({alone}), reference.generate({alone}));
  EXPECT_EQ(single.stats().window_blocks_total, 17);
  EXPECT_EQ(single.stats().preemptions, 0);
}

TEST(Engine, SamplesShareTheirPromptPrefill) {
  model::Muse m = model::Muse::init(engine_config(), 5, at::kFloat, at::kCPU);
  Engine engine(m, small_engine());
  std::vector<int64_t> prompt(21, 3);
  engine.generate({request(prompt, 4, 6, 1.0, 1)});
  // The prompt runs once; each sample then runs its 6 generated tokens (the last one only for its
  // routing).
  EXPECT_EQ(engine.stats().model_tokens, 21 + 4 * 6);
  EXPECT_EQ(engine.stats().sampled_tokens, 4 * 6);
}

TEST(Engine, ChunkedPrefillAndBatchCompositionDoNotChangeSamples) {
  model::Muse m = model::Muse::init(engine_config(), 6, at::kFloat, at::kCPU);
  Request target = request({9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7, 6, 5, 4, 3, 2, 1, 1, 1, 1, 2, 2}, 3, 15, 1.0, 77);
  Engine alone(m, small_engine());
  auto a = alone.generate({target})[0];
  EngineConfig chunked = small_engine();
  chunked.prefill_chunk = 5;
  chunked.max_batch_tokens = 11;
  Engine crowded(m, chunked);
  auto reqs = mixed_requests();
  reqs.insert(reqs.begin() + 1, target);
  auto b = crowded.generate(reqs)[1];
  for (size_t j = 0; j < a.samples.size(); ++j) {
    EXPECT_EQ(b.samples[j].tokens, a.samples[j].tokens) << "sample " << j;
    at::Tensor la = at::tensor(std::vector<double>(a.samples[j].logprobs.begin(), a.samples[j].logprobs.end()));
    at::Tensor lb = at::tensor(std::vector<double>(b.samples[j].logprobs.begin(), b.samples[j].logprobs.end()));
    KILN_EXPECT_CLOSE(lb, la, 1e-5, 1e-5);
  }
  EXPECT_NE(a.samples[0].tokens, a.samples[1].tokens);  // samples of one prompt differ
}

TEST(Engine, StopTokensEndSamples) {
  model::Muse m = model::Muse::init(engine_config(), 7, at::kFloat, at::kCPU);
  Engine engine(m, small_engine());
  Request r = request({1, 2, 3}, 8, 40, 1.0, 3);
  r.params.stop_token_ids = {5, 6};
  auto out = engine.generate({r})[0];
  int stopped = 0;
  for (const auto& s : out.samples) {
    if (s.finish == rollout::FinishReason::kStop) {
      ++stopped;
      EXPECT_TRUE(s.tokens.back() == 5 || s.tokens.back() == 6);
    } else {
      EXPECT_EQ(s.tokens.size(), 40u);
    }
    for (size_t t = 0; t + 1 < s.tokens.size(); ++t) EXPECT_TRUE(s.tokens[t] != 5 && s.tokens[t] != 6);
    EXPECT_EQ(s.routing.size(0), int64_t(3 + s.tokens.size()));
  }
  EXPECT_GT(stopped, 0);
}

TEST(Engine, UpdateWeightsReplacesTheModelInPlace) {
  model::Muse a = model::Muse::init(engine_config(), 8, at::kFloat, at::kCPU);
  model::Muse b = model::Muse::init(engine_config(), 9, at::kFloat, at::kCPU);
  Engine engine(a, small_engine());
  const void* before = engine.model().weights().layers[0].expert_up.data_ptr();
  engine.update_weights(b.named_parameters());
  EXPECT_EQ(engine.model().weights().layers[0].expert_up.data_ptr(), before);
  Engine fresh(b, small_engine());
  auto reqs = mixed_requests();
  auto x = engine.generate(reqs), y = fresh.generate(reqs);
  for (size_t r = 0; r < reqs.size(); ++r)
    for (size_t j = 0; j < x[r].samples.size(); ++j) EXPECT_EQ(x[r].samples[j].tokens, y[r].samples[j].tokens);
  auto wrong = b.named_parameters();
  wrong[3].second = at::zeros({2, 2});
  EXPECT_THROW(engine.update_weights(wrong), Error);
}

// An engine over a share of a model (every other tensor a placeholder, the experts half a stack),
// its missing weights fetched one at a time by a WeightSource, samples what an engine over the
// whole model samples: unquantised, and NVFP4 with each linear quantised as it arrives. The
// source is asked for every tensor once, in the model's order. An update through a source equals
// a whole update, and a placeholder the source leaves empty is an error naming it.
void check_engine_from_a_share(const model::ModelConfig& cfg, rollout::Quantization q) {
  const model::Muse whole = model::Muse::init(cfg, 8, at::kFloat, at::kCPU);
  const model::Muse next = model::Muse::init(cfg, 9, at::kFloat, at::kCPU);
  int n = 0;
  model::Muse share = whole.clone([&](const std::string&) { return n++ % 2 == 0; });
  for (model::LayerWeights& l : share.weights().layers)
    for (at::Tensor* t : {&l.expert_gate, &l.expert_up, &l.expert_down, &l.expert_norm})
      if (t->numel() > 0) *t = t->narrow(0, 0, cfg.num_experts / 2).clone();
  std::map<std::string, at::Tensor> by_name;
  std::vector<std::string> asked;
  auto source_of = [&](const model::Muse& m) -> rollout::WeightSource {
    by_name.clear();
    asked.clear();
    for (const auto& [name, t] : m.named_parameters()) by_name[name] = t;
    return [&](const std::string& name, const at::Tensor& own) {
      asked.push_back(name);
      const at::Tensor& w = by_name.at(name);
      return own.sizes() == w.sizes() ? at::Tensor() : w;
    };
  };
  EngineConfig ec = small_engine();
  ec.quantization = q;
  Engine from_share(share, ec, source_of(whole));
  std::vector<std::string> order;
  for (const auto& [name, t] : whole.named_parameters()) order.push_back(name);
  EXPECT_EQ(asked, order);
  Engine from_whole(whole, ec);
  auto same_samples = [&](Engine& a, Engine& b) {
    auto reqs = mixed_requests();
    auto x = a.generate(reqs), y = b.generate(reqs);
    for (size_t r = 0; r < reqs.size(); ++r)
      for (size_t j = 0; j < x[r].samples.size(); ++j) {
        EXPECT_EQ(x[r].samples[j].tokens, y[r].samples[j].tokens) << "request " << r << " sample " << j;
        EXPECT_EQ(x[r].samples[j].logprobs, y[r].samples[j].logprobs) << "request " << r << " sample " << j;
        EXPECT_TRUE(test::all_equal(x[r].samples[j].routing, y[r].samples[j].routing));
      }
  };
  same_samples(from_share, from_whole);
  // The update: `next` through a share of it, against `next` whole.
  model::Muse next_share = share.clone();
  auto mine = next_share.named_parameters(), theirs = next.named_parameters();
  for (size_t i = 0; i < mine.size(); ++i)
    if (mine[i].second.numel() > 0) mine[i].second.copy_(theirs[i].second.narrow(0, 0, mine[i].second.size(0)));
  EXPECT_GT(from_share.update_weights(next_share, source_of(next)), 0);
  EXPECT_EQ(asked, order);
  from_whole.update_weights(next.named_parameters());
  same_samples(from_share, from_whole);
  EXPECT_TRUE(test::throws_with([&] { Engine bad(share, ec, [](const std::string&, const at::Tensor&) { return at::Tensor(); }); },
                                {"rollout: the model holds no weights for", "placeholder"}));
}

TEST(Engine, AShareFilledFromASourceServesTheWholeModel) {
  check_engine_from_a_share(engine_config(), rollout::Quantization::kNone);
  model::ModelConfig c = test::nvfp4_micro_config();
  c.full_attention_period = 2;
  c.sliding_window = 5;
  check_engine_from_a_share(c, rollout::Quantization::kNvfp4);
}

// share_weights: the engine serves its model's own base tensors (a frozen base: LoRA) with a copy
// of the adapters. It samples what a copying engine samples; the trainer's later adapter changes
// reach it only through update_adapters; update_weights is refused.
TEST(Engine, SharedWeightsServeTheFrozenBaseWithAdaptersOfTheirOwn) {
  model::Muse m = model::Muse::init(engine_config(), 8, at::kFloat, at::kCPU);
  model::LoraConfig lc;
  lc.rank = 2;
  lc.alpha = 4;
  model::add_lora(m, lc, 1);
  auto bump = [&](double by) {
    at::NoGradGuard g;
    for (auto& [name, t] : model::lora_parameters(m)) t.add_(by);  // B starts at zero: make the adapters matter
  };
  bump(0.05);
  EngineConfig ec = small_engine();
  ec.share_weights = true;
  Engine shared(m, ec);
  Engine copied(m, small_engine());
  EXPECT_TRUE(shared.model().weights().layers[0].q_proj.is_same(m.weights().layers[0].q_proj));
  EXPECT_TRUE(shared.model().weights().layers[1].expert_up.is_same(m.weights().layers[1].expert_up));
  EXPECT_FALSE(shared.model().weights().layers[0].lora.q_a.is_same(m.weights().layers[0].lora.q_a));
  auto same_samples = [&](bool want) {
    auto reqs = mixed_requests();
    auto x = shared.generate(reqs), y = copied.generate(reqs);
    bool all = true;
    for (size_t r = 0; r < reqs.size(); ++r)
      for (size_t j = 0; j < x[r].samples.size(); ++j) all &= x[r].samples[j].logprobs == y[r].samples[j].logprobs;
    EXPECT_EQ(all, want);
  };
  same_samples(true);
  bump(0.2);  // the trainer's step: neither engine sees it yet
  same_samples(true);
  shared.update_adapters(model::lora_parameters(m));
  same_samples(false);  // only the shared engine has the new adapters
  copied.update_adapters(model::lora_parameters(m));
  same_samples(true);
  EXPECT_TRUE(test::throws_with([&] { shared.update_weights(m.named_parameters()); }, {"shares its model's weights"}));
}

// Every generated token records the weight version it was drawn under: a sample that spans an
// update mid-generation carries both versions, in order; a refused update leaves the version alone.
TEST(Engine, TokensRecordTheWeightVersionTheyWereDrawnUnder) {
  model::Muse a = model::Muse::init(engine_config(), 8, at::kFloat, at::kCPU);
  model::Muse b = model::Muse::init(engine_config(), 9, at::kFloat, at::kCPU);
  Engine engine(a, small_engine());
  EXPECT_EQ(engine.weight_version(), 0);
  engine.add_request(request({1, 2, 3}, 2, 12, 1.0, 4));
  std::vector<rollout::RequestOutput> outs;
  for (int step = 0; engine.has_unfinished(); ++step) {
    if (step == 4) engine.update_weights(b.named_parameters());
    for (auto& o : engine.step()) outs.push_back(std::move(o));
  }
  EXPECT_EQ(engine.weight_version(), 1);
  ASSERT_EQ(outs.size(), 1u);
  for (const auto& s : outs[0].samples) {
    ASSERT_EQ(s.weight_versions.size(), s.tokens.size());
    EXPECT_TRUE(std::is_sorted(s.weight_versions.begin(), s.weight_versions.end()));
    EXPECT_EQ(s.weight_versions.front(), 0);
    EXPECT_EQ(s.weight_versions.back(), 1);  // 12 tokens outlast the 4 steps before the update
  }
  auto wrong = b.named_parameters();
  wrong[3].second = at::zeros({2, 2});
  EXPECT_THROW(engine.update_weights(wrong), Error);
  EXPECT_EQ(engine.weight_version(), 1);
}

TEST(Engine, BadRequestsGiveClearErrors) {
  model::Muse m = model::Muse::init(engine_config(), 1, at::kFloat, at::kCPU);
  Engine engine(m, small_engine());
  auto expect_error = [&](Request r, const std::string& what) {
    try {
      engine.add_request(r);
      ADD_FAILURE() << "expected an error containing " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_error(request({}, 1, 4, 1.0, 0), "empty prompt");
  expect_error(request({1, 23}, 1, 4, 1.0, 0), "outside [0, vocab_size=23)");
  expect_error(request({1}, 0, 4, 1.0, 0), "n must be at least 1");
  expect_error(request({1}, 1, 0, 1.0, 0), "max_tokens must be at least 1");
  Request r = request({1}, 1, 4, 1.0, 0);
  r.params.top_p = 0;
  expect_error(r, "top_p");
  EngineConfig tiny = small_engine();
  Engine cramped(m, tiny);
  auto st = cramped.stats();
  EngineConfig few = tiny;
  few.kv_cache_bytes = st.window_blocks_total * st.window_block_bytes + 2 * st.full_block_bytes;
  Engine small(m, few);
  try {
    small.add_request(request({1, 2, 3}, 1, 20, 1.0, 0));
    ADD_FAILURE() << "expected a cache-size error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("raise kv_cache_bytes"), std::string::npos) << e.what();
  }
  few.kv_cache_bytes = 10;
  EXPECT_THROW(Engine(m, few), Error);
}

// Runs the queued work to the end; the outputs by request id.
std::map<int64_t, rollout::RequestOutput> run_all(Engine& engine) {
  std::map<int64_t, rollout::RequestOutput> out;
  while (engine.has_unfinished())
    for (auto& r : engine.step()) out[r.request_id] = std::move(r);
  return out;
}

rollout::SamplingParams turn_params(int64_t max_tokens, uint64_t seed) {
  rollout::SamplingParams p;
  p.max_tokens = max_tokens;
  p.temperature = 0.8;
  p.seed = seed;
  return p;
}

// Each turn's log-probs and the routing of the whole session so far against a full forward of
// the session's tokens; appends the turn to `all`.
void expect_turn_matches_forward(const model::Muse& m, std::vector<int64_t>& all, const rollout::Sample& s) {
  Scored ref = score(m, all, s.tokens, 0.8);
  KILN_EXPECT_CLOSE(at::tensor(std::vector<double>(s.logprobs.begin(), s.logprobs.end()), at::kDouble), ref.logprobs,
                    1e-5, 1e-5);
  EXPECT_TRUE(test::all_equal(s.routing, ref.routing));
  all.insert(all.end(), s.tokens.begin(), s.tokens.end());
}

TEST(Engine, SessionsContinueTokenInTokenOutWithoutRecomputingThePrefix) {
  model::Muse m = model::Muse::init(engine_config(), 5, at::kFloat, at::kCPU);
  Engine engine(m, small_engine());
  Request first = request({1, 2, 3, 4, 5}, 2, 6, 0.8, 7);
  first.keep_cache = true;
  const int64_t id = engine.add_request(first);
  auto out = run_all(engine);
  ASSERT_EQ(out.at(id).samples.size(), 2u);
  EXPECT_EQ(engine.num_sessions(), 2);
  std::vector<std::vector<int64_t>> all;  // each session's tokens, exactly as sampled or given
  std::vector<int64_t> session;
  for (const rollout::Sample& s : out.at(id).samples) {
    session.push_back(s.session);
    all.push_back(first.prompt);
    expect_turn_matches_forward(m, all.back(), s);
  }
  EXPECT_NE(session[0], session[1]);
  // Two more turns: both sessions, then the first alone; observations of 3 and 1 tokens.
  const std::vector<std::vector<int64_t>> observations = {{9, 9, 10}, {11}};
  for (int turn = 0; turn < 2; ++turn) {
    std::map<int64_t, size_t> which;
    const int64_t before = engine.stats().model_tokens;
    int64_t expected = 0;
    for (size_t i = 0; i < session.size(); ++i) {
      if (turn == 1 && i == 1) continue;
      which[engine.continue_session(session[i], observations[i], turn_params(5, 20 + turn))] = i;
      all[i].insert(all[i].end(), observations[i].begin(), observations[i].end());
      expected += int64_t(observations[i].size()) + 5;
    }
    auto turn_out = run_all(engine);
    ASSERT_EQ(turn_out.size(), which.size());
    // Only the observations and the new tokens ran through the model: the prefix stayed cached.
    EXPECT_EQ(engine.stats().model_tokens - before, expected) << "turn " << turn;
    for (const auto& [rid, i] : which) {
      const rollout::Sample& s = turn_out.at(rid).samples.at(0);
      EXPECT_EQ(s.session, session[i]);
      ASSERT_EQ(s.tokens.size(), 5u);
      EXPECT_EQ(s.routing.size(0), int64_t(all[i].size() + s.tokens.size()));
      expect_turn_matches_forward(m, all[i], s);
    }
  }
  EXPECT_EQ(engine.num_sessions(), 2);
  for (int64_t sid : session) engine.end_session(sid);
  EXPECT_EQ(engine.num_sessions(), 0);
  EXPECT_EQ(engine.stats().full_blocks_used, 0);
  EXPECT_EQ(engine.stats().window_blocks_used, 0);
}

TEST(Engine, IdleSessionsGiveUpTheirCacheWhenARequestNeedsItAndRecomputeWhenContinued) {
  model::Muse m = model::Muse::init(engine_config(), 6, at::kFloat, at::kCPU);
  Engine roomy(m, small_engine());
  const auto st = roomy.stats();
  // 12 full-layer blocks of 4 tokens: the idle session's 25 tokens (7 blocks) and the next
  // request's 35 (9 blocks) cannot both stay.
  Engine tight(m, small_engine(st.window_blocks_total * st.window_block_bytes + 12 * st.full_block_bytes));
  Request first = request({1, 2, 3, 4, 5}, 1, 20, 0.8, 3);
  first.keep_cache = true;
  const int64_t id = tight.add_request(first);
  const rollout::Sample s0 = run_all(tight).at(id).samples.at(0);
  std::vector<int64_t> all = first.prompt;
  expect_turn_matches_forward(m, all, s0);
  const int64_t other = tight.add_request(request({6, 7, 8, 9, 10}, 1, 30, 0.8, 4));
  const rollout::Sample b = run_all(tight).at(other).samples.at(0);
  EXPECT_EQ(b.tokens.size(), 30u);
  EXPECT_EQ(tight.num_sessions(), 1);
  // The session gave its blocks up: continuing it recomputes its 25 tokens, then the new ones.
  const int64_t before = tight.stats().model_tokens;
  const int64_t rid = tight.continue_session(s0.session, {12, 13}, turn_params(4, 9));
  all.insert(all.end(), {12, 13});
  const rollout::Sample s1 = run_all(tight).at(rid).samples.at(0);
  EXPECT_EQ(tight.stats().model_tokens - before, 25 + 2 + 4);
  expect_turn_matches_forward(m, all, s1);
  tight.end_session(s1.session);
  EXPECT_EQ(tight.stats().full_blocks_used, 0);
}

TEST(Engine, BadSessionCallsGiveClearErrors) {
  model::Muse m = model::Muse::init(engine_config(), 1, at::kFloat, at::kCPU);
  Engine engine(m, small_engine());
  Request first = request({1, 2}, 1, 3, 1.0, 0);
  first.keep_cache = true;
  const int64_t id = engine.add_request(first);
  const int64_t sid = run_all(engine).at(id).samples.at(0).session;
  ASSERT_GE(sid, 0);
  EXPECT_TRUE(test::throws_with([&] { engine.continue_session(sid + 7, {1}, turn_params(2, 0)); },
                                {"no idle session " + std::to_string(sid + 7)}));
  rollout::SamplingParams two = turn_params(2, 0);
  two.n = 2;
  EXPECT_TRUE(test::throws_with([&] { engine.continue_session(sid, {1}, two); }, {"one sample (n = 1, got 2)"}));
  EXPECT_TRUE(test::throws_with([&] { engine.continue_session(sid, {}, turn_params(2, 0)); }, {"empty observation"}));
  EXPECT_TRUE(test::throws_with([&] { engine.continue_session(sid, {3, 23}, turn_params(2, 0)); },
                                {"observation token 1 is 23", "vocab_size=23"}));
  engine.continue_session(sid, {4}, turn_params(2, 0));  // running now: not idle
  EXPECT_TRUE(test::throws_with([&] { engine.continue_session(sid, {1}, turn_params(2, 0)); }, {"still running"}));
  run_all(engine);
  engine.end_session(sid);
  EXPECT_TRUE(test::throws_with([&] { engine.end_session(sid); }, {"no idle session"}));
}

}  // namespace
}  // namespace kiln
