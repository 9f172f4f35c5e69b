// Context parallelism (parallel/context_parallel.h) at the world size mpirun gives: a small Muse (three
// window layers to one full one, GQA) over sequences of 1, 19, 111 and 203 tokens split over the cp
// ranks; per-token log-probs, routing, the load-balance loss and every parameter gradient (summed
// over the cp group) equal one rank's forward and backward over the whole batch: within 1e-10 in
// fp64, within fp32 tolerance in fp32; with a GPU per rank, through FlashAttention in bf16. Window
// layers receive only the halo rows.
#include <ATen/ATen.h>
#if KILN_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "core/comm.h"
#include "model/muse.h"
#include "parallel/context_parallel.h"
#include "tests/test_util.h"
#include "tests/trainer/small_model.h"

namespace kiln::parallel {
namespace {

using comm::Group;
using model::ForwardOptions;
using model::Muse;

constexpr double kBalanceWeight = 0.1;  // the load-balance term's weight in the test's loss

// Four layers, the last full (period 4), the others windows of 8 tokens: shorter than every long
// sequence and longer than the chunks of the 19-token one at 4 ranks, so halos span several chunks.
model::ModelConfig cp_config() {
  model::ModelConfig c = test::byte_vocab_config();
  c.name = "cp-test";
  c.num_layers = 4;
  c.num_q_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.full_attention_period = 4;
  return c;
}

// Odd lengths: one token, shorter than 2N chunks of the window, and longer than 2 * 4 ranks * W.
model::PackedBatch whole_batch(std::vector<int64_t>* targets) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(31);
  std::vector<std::vector<int64_t>> seqs;
  for (int64_t n : {1, 19, 111, 203}) {
    at::Tensor t = at::randint(128, {n}, g, at::kLong);
    seqs.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
    for (int64_t j = 0; j < n; ++j) targets->push_back(j + 1 < n ? seqs.back()[size_t(j + 1)] : -100);
  }
  return model::PackedBatch::from_sequences(seqs, at::kCPU);
}

struct Run {
  at::Tensor logprobs, routing, balance;  // [T], [T, L, k], scalar
  std::vector<at::Tensor> grads;          // named_parameters' order
};

// -sum(log-probs) / norm + kBalanceWeight * balance, forward and backward.
Run run(const Muse& m, const model::PackedBatch& batch, const ForwardOptions& o, double norm) {
  model::ForwardOutput out = m.forward(batch, o);
  at::Tensor loss = -out.logprobs.sum() / norm + kBalanceWeight * out.load_balance_loss;
  loss.backward();
  Run r{out.logprobs.detach(), out.routing, out.load_balance_loss.detach(), {}};
  for (const auto& [name, t] : m.named_parameters())
    r.grads.push_back(t.grad().defined() ? t.grad() : at::zeros_like(t));
  return r;
}

struct Case {
  at::ScalarType dtype = at::kDouble;
  bool replay = false;     // replay one rank's routing (fp32: a near tie may route differently)
  bool recompute = false;  // layers recomputed in the backward: the gathers run again there
  int64_t padded_bytes = int64_t(256) << 20;  // 0: attention piece by piece, not one padded batch
  int cp = 0;              // cp group size; 0: the world (else the world is dp x cp)
};

void check(const Case& c) {
  const Group& w = Group::world();
  const int cp = c.cp ? c.cp : w.size();
  if (w.size() % cp != 0 || cp > w.size()) GTEST_SKIP() << "cp " << cp << " does not divide the world";
  const Group group = cp == w.size() ? w : w.split(w.rank() / cp, w.rank() % cp);
  const bool fp64 = c.dtype == at::kDouble;
  const double rtol = fp64 ? 1e-10 : 1e-4, atol = fp64 ? 1e-12 : 1e-5;
  const std::string what = std::string(fp64 ? "fp64" : "fp32") + (c.replay ? " replay" : "") +
                           (c.recompute ? " recompute" : "") + (c.padded_bytes ? "" : " piecewise") +
                           " cp=" + std::to_string(cp);
  const model::ModelConfig cfg = cp_config();
  std::vector<int64_t> target_list;
  const model::PackedBatch whole = whole_batch(&target_list);
  const at::Tensor targets = at::tensor(target_list, at::kLong);
  const double norm = double(whole.num_tokens() - whole.num_sequences());

  Muse one = Muse::init(cfg, 7, c.dtype, at::kCPU);
  one.set_requires_grad(true);
  ForwardOptions o;
  o.targets = targets;
  const Run ref = run(one, whole, o, norm);

  Muse m = Muse::init(cfg, 7, c.dtype, at::kCPU);
  m.set_requires_grad(true);
  ContextParallel ctx(group, whole.cu_seqlens, cfg, at::kCPU, c.padded_bytes);
  ForwardOptions lo = ctx.options({});
  lo.targets = ctx.local_rows(targets);
  lo.recompute = c.recompute;
  if (c.replay) lo.replay_routing = ctx.local_rows(ref.routing);
  const Run got = run(m, ctx.local_batch(whole.tokens), lo, norm);

  EXPECT_TRUE(test::all_close(got.logprobs, ctx.local_rows(ref.logprobs), rtol, atol)) << what;
  EXPECT_TRUE(test::all_close(ctx.gather(got.logprobs), ref.logprobs, rtol, atol)) << what;
  EXPECT_TRUE(test::all_equal(got.routing, ctx.local_rows(ref.routing))) << what;
  EXPECT_TRUE(test::all_close(got.balance, ref.balance, rtol, atol)) << "load balance " << what;
  const auto names = m.named_parameters();
  for (size_t i = 0; i < names.size(); ++i) {
    at::Tensor g = got.grads[i].contiguous().clone();
    group.all_reduce(g);  // what the trainer's gradient all-reduce over dp x cp does
    EXPECT_TRUE(test::all_close(g, ref.grads[i], rtol, atol)) << names[i].first << " " << what;
    EXPECT_GT(ref.grads[i].abs().max().item<double>(), 0) << names[i].first << ": a gradient the test cannot miss";
  }
}

TEST(ContextParallel, Fp64MatchesOneRank) { check({}); }
TEST(ContextParallel, Fp64PiecewiseAttentionMatchesOneRank) { check({at::kDouble, false, false, 0}); }
TEST(ContextParallel, Fp64RecomputeMatchesOneRank) { check({at::kDouble, false, true}); }
TEST(ContextParallel, Fp32ReplayMatchesOneRank) { check({at::kFloat, true}); }
TEST(ContextParallel, Fp64TwoRankGroupsOfTheWorld) { check({at::kDouble, false, false, int64_t(256) << 20, 2}); }

#if KILN_WITH_CUDA
// A GPU per rank, bf16, fused kernels: every layer attends through FlashAttention (each piece's
// queries after its gathered keys), against one rank's forward of the whole batch, which runs
// FlashAttention over whole sequences. The routing is replayed (bf16 near-ties); log-probs and
// gradients agree to bf16's precision.
TEST(ContextParallel, CudaFlashBf16MatchesOneRank) {
  const Group& w = Group::world();
  if (!at::hasCUDA() || c10::cuda::device_count() < w.size()) GTEST_SKIP() << "needs a GPU per rank";
  c10::cuda::set_device(c10::DeviceIndex(w.local_rank()));
  const at::Device gpu(at::kCUDA, c10::DeviceIndex(w.local_rank()));
  const model::ModelConfig cfg = cp_config();
  std::vector<int64_t> target_list;
  model::PackedBatch whole = whole_batch(&target_list);
  whole.tokens = whole.tokens.to(gpu);
  const at::Tensor targets = at::tensor(target_list, at::kLong).to(gpu);
  const double norm = double(whole.num_tokens() - whole.num_sequences());
  auto model_on_gpu = [&] {
    Muse m = Muse::init(cfg, 7, at::kBFloat16, gpu);
    m.set_requires_grad(true);
    return m;
  };
  Muse one = model_on_gpu();
  ForwardOptions o;
  o.targets = targets;
  const auto ref = run(one, whole, o, norm);

  Muse m = model_on_gpu();
  ContextParallel ctx(w, whole.cu_seqlens, cfg, gpu);
  ForwardOptions lo = ctx.options(ForwardOptions{});
  lo.targets = ctx.local_rows(targets);
  lo.replay_routing = ctx.local_rows(ref.routing);
  const auto got = run(m, ctx.local_batch(whole.tokens), lo, norm);
  EXPECT_EQ(ctx.exchanged().flash_layers, cfg.num_layers) << "a layer did not take FlashAttention";
  auto rel = [](const at::Tensor& a, const at::Tensor& b) {
    const at::Tensor x = a.detach().cpu().to(at::kDouble), y = b.detach().cpu().to(at::kDouble);
    return (x - y).norm().item<double>() / std::max(y.norm().item<double>(), 1e-6);
  };
  EXPECT_LT(rel(ctx.gather(got.logprobs), ref.logprobs), 2e-2);
  const auto names = m.named_parameters();
  for (size_t i = 0; i < names.size(); ++i) {
    at::Tensor g = got.grads[i].contiguous().clone();
    w.all_reduce(g);
    EXPECT_LT(rel(g, ref.grads[i]), 5e-2) << names[i].first;
  }
}
#endif

// A window layer receives the last min(W - 1, length) rows of every piece that does not end its
// sequence, counted here from the split itself: far fewer than the batch. A full layer receives all.
TEST(ContextParallel, WindowLayersGatherOnlyTheHalo) {
  const Group& w = Group::world();
  const model::ModelConfig cfg = cp_config();
  std::vector<int64_t> targets;
  const model::PackedBatch whole = whole_batch(&targets);
  const Muse m = Muse::init(cfg, 7, at::kDouble, at::kCPU);
  ContextParallel ctx(w, whole.cu_seqlens, cfg, at::kCPU);
  int64_t halo = 0;
  for (int r = 0; r < w.size(); ++r)
    for (const ContextPiece& p : ctx.split().pieces(r)) halo += p.last ? 0 : std::min(cfg.sliding_window - 1, p.length);
  {
    at::NoGradGuard no_grad;
    m.forward(ctx.local_batch(whole.tokens), ctx.options({}));
  }
  const ContextParallel::Exchanged& e = ctx.exchanged();
  EXPECT_EQ(e.full_layers, 1);
  EXPECT_EQ(e.window_layers, 3);
  EXPECT_EQ(e.full_rows, whole.num_tokens());
  EXPECT_EQ(e.window_rows, 3 * halo);
  EXPECT_EQ(halo > 0, w.size() > 1) << "one rank holds whole sequences: no halo";
  EXPECT_LT(halo * 2, whole.num_tokens()) << "a halo is a few rows per piece, not the sequence";
  // By hand at 2 ranks (4 chunks, W - 1 = 7; leftover tokens rotate from rank 0): the 1-token
  // sequence is one last piece (0 rows); 19 -> rank 0 [0,5), rank 1 [5,15), rank 0 [15,19): 5 + 7;
  // 111 -> [0,28), [28,83), [83,111): 7 + 7; 203 -> [0,51), [51,153), [153,203): 7 + 7.
  if (w.size() == 2) EXPECT_EQ(halo, 40);
  if (w.rank() == 0)
    std::printf("cp=%d: a window layer gathers %lld rows, a full layer %lld (batch of %lld tokens)\n", w.size(),
                static_cast<long long>(halo), static_cast<long long>(whole.num_tokens()),
                static_cast<long long>(whole.num_tokens()));
}

}  // namespace
}  // namespace kiln::parallel
