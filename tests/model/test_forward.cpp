// The packed batched forward against the naive per-token reference; window semantics; log-probs;
// routing capture and replay; bf16 runs keep their FP32 boundaries.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "model/muse.h"
#include "tests/model/reference.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using model::ForwardOptions;
using model::Muse;
using model::PackedBatch;

std::vector<std::vector<int64_t>> random_sequences(const std::vector<int64_t>& lengths, int64_t vocab,
                                                   uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<std::vector<int64_t>> seqs;
  for (int64_t n : lengths) {
    at::Tensor t = at::randint(vocab, {n}, gen, at::kLong);
    seqs.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
  }
  return seqs;
}

// Checks the packed forward of several odd-length sequences against the reference.
void check_against_reference(const model::ModelConfig& cfg, at::ScalarType dtype, double rtol, double atol) {
  Muse m = Muse::init(cfg, 7, dtype, at::kCPU);
  if (cfg.router_score == model::RouterScore::kSigmoid) {
    at::manual_seed(1);  // a non-zero selection bias, so selection and weights differ
    for (auto& lw : m.weights().layers) lw.router_bias.copy_(at::randn_like(lw.router_bias) * 0.3);
  }
  auto seqs = random_sequences({1, 19, 5, 8}, cfg.vocab_size, 11);
  PackedBatch batch = PackedBatch::from_sequences(seqs, at::kCPU);
  ForwardOptions opt;
  opt.return_logits = true;
  auto out = m.forward(batch, opt);
  for (size_t s = 0; s < seqs.size(); ++s) {
    auto ref = test::reference_forward(m, seqs[s]);
    const int64_t b = batch.cu_seqlens[s], n = int64_t(seqs[s].size());
    KILN_EXPECT_CLOSE(out.logits.narrow(0, b, n), ref.logits, rtol, atol);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < cfg.num_layers; ++i)
        for (int64_t j = 0; j < cfg.top_k; ++j)
          ASSERT_EQ(out.routing[b + t][i][j].item<int64_t>(), ref.routing[t * cfg.num_layers + i][j])
              << "sequence " << s << " token " << t << " layer " << i << " slot " << j;
  }
}

TEST(Forward, PackedMatchesNaiveReferenceFp64) {
  check_against_reference(test::micro_config(), at::kDouble, 1e-10, 1e-10);
}

TEST(Forward, PackedMatchesNaiveReferenceFp32) {
  check_against_reference(test::micro_config(), at::kFloat, 1e-4, 1e-4);
}

TEST(Forward, PackedMatchesReferenceWithSigmoidRouterAndWideGqa) {
  model::ModelConfig cfg = test::micro_config();
  cfg.router_score = model::RouterScore::kSigmoid;
  cfg.num_q_heads = 4;
  cfg.num_kv_heads = 2;
  cfg.num_layers = 5;  // full layers 1 and 4: the pattern is anchored at the end
  cfg.full_attention_period = 3;
  check_against_reference(cfg, at::kDouble, 1e-10, 1e-10);
}

TEST(Forward, LongSequenceCrossesAttentionChunks) {
  // 1100 tokens > the 1024-query attention block: the blocked path must equal the reference.
  model::ModelConfig cfg = test::micro_config();
  cfg.sliding_window = 37;
  Muse m = Muse::init(cfg, 3, at::kDouble, at::kCPU);
  auto seqs = random_sequences({1100}, cfg.vocab_size, 5);
  ForwardOptions opt;
  opt.return_logits = true;
  auto out = m.forward(PackedBatch::from_sequences(seqs, at::kCPU), opt);
  auto ref = test::reference_forward(m, seqs[0]);
  KILN_EXPECT_CLOSE(out.logits, ref.logits, 1e-9, 1e-9);
}

TEST(Forward, PackingDoesNotLeakAcrossSequences) {
  Muse m = Muse::init(test::micro_config(), 1, at::kDouble, at::kCPU);
  auto seqs = random_sequences({7, 4, 9}, 11, 2);
  ForwardOptions opt;
  opt.return_logits = true;
  auto packed = m.forward(PackedBatch::from_sequences(seqs, at::kCPU), opt);
  int64_t b = 0;
  for (const auto& s : seqs) {
    auto alone = m.forward(PackedBatch::from_sequences({s}, at::kCPU), opt);
    KILN_EXPECT_CLOSE(packed.logits.narrow(0, b, int64_t(s.size())), alone.logits, 1e-12, 1e-12);
    b += int64_t(s.size());
  }
}

TEST(Forward, WindowQuerySeesExactlyTheLastWKeys) {
  // Perturb one value row at a time: query i must change iff i - W < j <= i (full: j <= i).
  const int64_t n = 19, W = 4, H = 2, hd = 3;
  at::manual_seed(0);
  at::Tensor q = at::randn({H, n, hd}, at::kDouble), k = at::randn({H, n, hd}, at::kDouble);
  at::Tensor v = at::randn({H, n, hd}, at::kDouble);
  for (bool full : {false, true}) {
    at::Tensor base = model::sequence_attention(q, k, v, full, W);
    for (int64_t j = 0; j < n; ++j) {
      at::Tensor v2 = v.clone();
      v2.select(1, j).add_(1.0);
      at::Tensor diff = (model::sequence_attention(q, k, v2, full, W) - base).abs().amax({0, 2});
      for (int64_t i = 0; i < n; ++i) {
        const bool visible = j <= i && (full || i - W < j);
        EXPECT_EQ(diff[i].item<double>() > 0, visible) << "full=" << full << " query " << i << " key " << j;
      }
    }
  }
}

TEST(Forward, PaddedAttentionGroupsQueryHeadsAsExpandedKeysWould) {
  // Problems of 1, 19 and 111 keys, each with its last query (decode) or all of them (prefill), four
  // query heads per KV head: the padded batch (KV heads unexpanded) against each problem alone on
  // keys and values expanded to every query head, in fp32 and bf16, full and windowed.
  const int64_t Hq = 8, Hkv = 2, hd = 16, W = 7;
  const std::vector<int64_t> lens = {1, 19, 111};
  at::manual_seed(3);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (bool decode : {true, false}) {
      std::vector<std::vector<int64_t>> q_rows, q_pos, k_rows, k_pos;
      int64_t tq = 0, tk = 0;
      for (int64_t n : lens) {
        const int64_t first = decode ? n - 1 : 0;
        q_rows.emplace_back(), q_pos.emplace_back(), k_rows.emplace_back(), k_pos.emplace_back();
        for (int64_t i = first; i < n; ++i) q_rows.back().push_back(tq++), q_pos.back().push_back(i);
        for (int64_t j = 0; j < n; ++j) k_rows.back().push_back(tk++), k_pos.back().push_back(j);
      }
      at::Tensor q = at::randn({tq, Hq, hd}).to(dtype), k = at::randn({tk, Hkv, hd}).to(dtype);
      at::Tensor v = at::randn({tk, Hkv, hd}).to(dtype);
      const model::PaddedLayout layout = model::PaddedLayout::build(q_rows, q_pos, k_rows, k_pos, at::kCPU);
      for (bool full : {true, false}) {
        at::Tensor got = model::padded_attention(layout, q, k, v, full, W);
        ASSERT_EQ(got.sizes(), q.sizes());
        int64_t qo = 0, ko = 0;  // the problem's first query and key row
        for (size_t b = 0; b < lens.size(); ++b) {
          const int64_t nq = int64_t(q_rows[b].size()), nk = lens[b];
          at::Tensor kb = model::expand_kv_heads(k.narrow(0, ko, nk).transpose(0, 1), Hq / Hkv);
          at::Tensor vb = model::expand_kv_heads(v.narrow(0, ko, nk).transpose(0, 1), Hq / Hkv);
          at::Tensor want =
              model::sequence_attention(q.narrow(0, qo, nq).transpose(0, 1), kb, vb, full, W, q_pos[b][0], 0);
          const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
          KILN_EXPECT_CLOSE(got.narrow(0, qo, nq).to(at::kFloat), want.transpose(0, 1).to(at::kFloat), tol, tol);
          qo += nq, ko += nk;
        }
      }
    }
  }
}

TEST(Forward, LogprobsEqualLogSoftmaxOfLogits) {
  Muse m = Muse::init(test::micro_config(), 4, at::kFloat, at::kCPU);
  auto seqs = random_sequences({6, 13}, 11, 3);
  PackedBatch batch = PackedBatch::from_sequences(seqs, at::kCPU);
  at::Tensor targets = at::randint(11, {19}, at::kLong);
  targets[5] = -100;
  ForwardOptions opt;
  opt.return_logits = true;
  opt.targets = targets;
  opt.logprob_chunk = 4;  // several chunks, one of them partial
  auto out = m.forward(batch, opt);
  at::Tensor expected = at::log_softmax(out.logits, -1).gather(1, targets.clamp_min(0).unsqueeze(1)).squeeze(1);
  expected[5] = 0;
  KILN_EXPECT_CLOSE(out.logprobs, expected, 1e-6, 1e-6);
  ForwardOptions lp_only;
  lp_only.targets = targets;
  auto out2 = m.forward(batch, lp_only);
  EXPECT_FALSE(out2.logits.defined());
  KILN_EXPECT_CLOSE(out2.logprobs, out.logprobs, 1e-6, 1e-6);
}

TEST(Forward, ReplayingOwnRoutingChangesNothing) {
  Muse m = Muse::init(test::micro_config(), 5, at::kFloat, at::kCPU);
  PackedBatch batch = PackedBatch::from_sequences(random_sequences({9, 19}, 11, 4), at::kCPU);
  ForwardOptions opt;
  opt.return_logits = true;
  auto own = m.forward(batch, opt);
  ASSERT_EQ(own.routing.scalar_type(), at::kByte);
  ASSERT_EQ(own.routing.sizes(), (std::vector<int64_t>{28, 2, 2}));
  opt.replay_routing = own.routing;
  auto replayed = m.forward(batch, opt);
  EXPECT_TRUE(test::all_equal(replayed.logits, own.logits));
  EXPECT_TRUE(test::all_equal(replayed.routing, own.routing));
}

TEST(Forward, ReplayingOtherRoutingIsUsedAndChangesOutput) {
  Muse m = Muse::init(test::micro_config(), 5, at::kDouble, at::kCPU);
  auto seqs = random_sequences({9}, 11, 4);
  PackedBatch batch = PackedBatch::from_sequences(seqs, at::kCPU);
  ForwardOptions opt;
  opt.return_logits = true;
  auto own = m.forward(batch, opt);
  // Replay the two experts the model did not choose (E=4, k=2): a different set everywhere.
  at::Tensor chosen = at::zeros({9, 2, 4}, at::kLong).scatter_(2, own.routing.to(at::kLong), 1);
  at::Tensor other = std::get<1>(chosen.sort(2, /*descending=*/false)).narrow(2, 0, 2).to(at::kByte);
  opt.replay_routing = other;
  auto replayed = m.forward(batch, opt);
  EXPECT_TRUE(test::all_equal(replayed.routing, other));
  EXPECT_GT((replayed.logits - own.logits).abs().max().item<double>(), 1e-3);
  auto ref = test::reference_forward(m, seqs[0], other);
  KILN_EXPECT_CLOSE(replayed.logits, ref.logits, 1e-10, 1e-10);
}

TEST(Forward, ReplayGradientsReachTheRouter) {
  Muse m = Muse::init(test::micro_config(), 6, at::kFloat, at::kCPU);
  m.set_requires_grad(true);
  PackedBatch batch = PackedBatch::from_sequences(random_sequences({12}, 11, 8), at::kCPU);
  ForwardOptions opt;
  opt.targets = at::randint(11, {12}, at::kLong);
  {
    at::NoGradGuard g;
    opt.replay_routing = m.forward(batch, opt).routing;
  }
  m.forward(batch, opt).logprobs.sum().backward();
  for (const auto& lw : m.weights().layers) {
    ASSERT_TRUE(lw.router.grad().defined());
    EXPECT_GT(lw.router.grad().abs().sum().item<double>(), 0);
  }
}

TEST(Forward, BadInputsGiveClearErrors) {
  Muse m = Muse::init(test::micro_config(), 6, at::kFloat, at::kCPU);
  auto expect_error = [&](const PackedBatch& b, const ForwardOptions& o, const std::string& what) {
    try {
      m.forward(b, o);
      ADD_FAILURE() << "expected an error containing " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_error(PackedBatch::from_sequences({{1, 2, 11}}, at::kCPU), {}, "vocab_size");
  PackedBatch ok = PackedBatch::from_sequences({{1, 2, 3}}, at::kCPU);
  ForwardOptions bad_replay;
  bad_replay.replay_routing = at::zeros({3, 2, 3}, at::kByte);
  expect_error(ok, bad_replay, "replay_routing must be uint8");
  bad_replay.replay_routing = at::full({3, 2, 2}, 4, at::kByte);
  expect_error(ok, bad_replay, "expert id 4");
  ForwardOptions bad_targets;
  bad_targets.targets = at::tensor({1, 2}, at::kLong);
  expect_error(ok, bad_targets, "targets must be [3]");
}

TEST(Forward, Bf16KeepsFp32BoundariesAndTracksFp32) {
  model::ModelConfig cfg = test::micro_config();
  cfg.init_std = 0.1;
  Muse m32 = Muse::init(cfg, 9, at::kFloat, at::kCPU);
  Muse m16 = Muse::init(cfg, 9, at::kBFloat16, at::kCPU);
  EXPECT_EQ(m16.weights().layers[0].router.scalar_type(), at::kFloat);
  EXPECT_EQ(m16.weights().layers[0].pooler.scalar_type(), at::kBFloat16);
  PackedBatch batch = PackedBatch::from_sequences(random_sequences({19, 7}, 11, 10), at::kCPU);
  ForwardOptions opt;
  opt.targets = at::randint(11, {26}, at::kLong);
  auto a = m32.forward(batch, opt);
  opt.replay_routing = a.routing;  // same expert sets, so only precision differs
  m16.set_requires_grad(true);
  auto b = m16.forward(batch, opt);
  EXPECT_EQ(b.logprobs.scalar_type(), at::kFloat);
  KILN_EXPECT_CLOSE(b.logprobs, a.logprobs, 0.05, 0.05);
  b.logprobs.sum().backward();
  for (const auto& [name, p] : m16.named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_EQ(p.grad().scalar_type(), p.scalar_type()) << name;
    EXPECT_TRUE(p.grad().isfinite().all().item<bool>()) << name;
  }
}

}  // namespace
}  // namespace kiln
