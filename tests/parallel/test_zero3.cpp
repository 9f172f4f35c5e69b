// ZeRO-3 of the dense part (parallel/zero3.h) at the world size mpirun gives: each tensor whole on one
// rank, the others holding placeholders; loss, log-probs, routing and every owner's gradient equal
// one rank's full-batch forward and backward, alone and with the experts sharded (expert
// parallelism), with routing replay, with LoRA over a sharded frozen base, and without a gradient.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include "parallel/zero3.h"
#include "model/expert_parallel.h"
#include "model/lora.h"
#include "model/muse.h"
#include "tests/parallel/next_token.h"
#include "tests/test_util.h"
#include "tests/trainer/small_model.h"

#if KILN_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace kiln::parallel {
namespace {

using comm::Group;
using model::ForwardOptions;
using model::Muse;

using test::LossRun;
using test::next_token_loss;

struct Case {
  int ep = 1;          // experts sharded over ep ranks (dp = world / ep copies of each shard)
  bool replay = false; // replay the one-rank run's routing
  bool lora = false;   // adapters on every target, the base frozen (and sharded)
  bool grad = true;
  at::Device device = at::kCPU;  // CUDA: the gathers and reductions go through NCCL
};

void check(const Case& c) {
  const Group& w = Group::world();
  const int W = w.size(), e = w.rank() % c.ep, d = w.rank() / c.ep;
  ASSERT_EQ(W % c.ep, 0);
  const Group ep_group = w.split(d, e), dp_group = w.split(1000 + e, d);
  const model::ModelConfig cfg = test::byte_vocab_config();
  const int64_t per = cfg.num_experts / c.ep;
  const std::string what = "ep=" + std::to_string(c.ep) + (c.replay ? " replay" : "") + (c.lora ? " lora" : "") +
                           (c.grad ? "" : " no grad");
  const test::Sequences seqs = test::token_sequences(23, 11, 1, 9);
  const double norm = test::target_count(seqs);
  auto make = [&] {
    Muse m = Muse::init(cfg, 9, at::kFloat, c.device);
    if (c.lora) {
      model::add_lora(m, {4, 8}, 3);
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
      for (auto& [n, t] : model::lora_parameters(m))  // nonzero B: every adapter's gradient is nonzero
        if (n.find("lora_B") != std::string::npos) t.normal_(0, 0.05, gen);
    }
    return m;
  };
  auto set_trained = [&](Muse& m) {  // after any sharding: the shards' tensors are new leaves
    m.set_requires_grad(c.grad && !c.lora);
    if (c.lora)
      for (auto& [n, t] : model::lora_parameters(m)) t.requires_grad_(c.grad);
  };
  auto trained = [&](const Muse& m) {
    auto named = c.lora ? model::lora_parameters(m) : m.named_parameters();
    return named;
  };

  Muse full = make();
  set_trained(full);
  LossRun ref = next_token_loss(full, seqs, norm, {}, c.grad);

  Muse part = c.ep > 1 ? model::shard_experts(make(), e, c.ep) : make();
  set_trained(part);
  // The dense part (and at ep = 1 the experts too) sharded over every rank.
  Zero3 zero(part, w, [&](const std::string& n) { return c.ep == 1 || !model::is_expert_tensor(n); });
  int64_t held = 0, total = 0;
  for (const auto& en : zero.entries()) {
    held += en.own.numel();
    total += c10::multiply_integers(en.shape);
    EXPECT_EQ(en.own.numel() > 0, zero.owns(en)) << en.name;
  }
  EXPECT_EQ(int64_t(w.all_reduce(double(held))), total) << "every sharded tensor lives on exactly one rank";

  const test::RankShare share = test::rank_share(seqs, w.rank(), W);
  const int64_t t0 = share.first_row, tn = share.rows;
  ForwardOptions o;
  o.gather = &zero;
  const model::AllToAllDispatcher dispatcher(ep_group);
  if (c.ep > 1) o.experts = &dispatcher;
  if (c.replay) o.replay_routing = ref.routing.narrow(0, t0, tn);
  ASSERT_GT(tn, 0);
  LossRun got = next_token_loss(part, share.seqs, norm, o, c.grad);
  EXPECT_NEAR(w.all_reduce(got.loss), ref.loss, 1e-5 * std::abs(ref.loss)) << what;
  EXPECT_TRUE(test::all_close(got.logprobs, ref.logprobs.narrow(0, t0, tn), 1e-5, 1e-6)) << what;
  EXPECT_TRUE(test::all_equal(got.routing, ref.routing.narrow(0, t0, tn))) << what;
  if (!c.grad) return;
  // Gradients: a ZeRO-3 tensor's whole sum is on its owner; a replicated one (adapters, expert
  // shards) sums over the ranks that hold it, as data parallelism would.
  auto fp = trained(full), pp = trained(part);
  ASSERT_EQ(fp.size(), pp.size());
  for (size_t i = 0; i < pp.size(); ++i) {
    const at::Tensor& p = pp[i].second;
    at::Tensor expect = fp[i].second.grad();
    const Zero3::Entry* z = zero.find(p);
    if (z) {
      if (zero.owns(*z)) EXPECT_TRUE(test::all_close(p.grad(), expect, 1e-5, 1e-6)) << pp[i].first << " " << what;
      continue;
    }
    at::Tensor g = p.grad().defined() ? p.grad().contiguous() : at::zeros_like(p);
    const bool expert = c.ep > 1 && model::is_expert_tensor(pp[i].first);
    (expert ? dp_group : w).all_reduce(g);
    if (expert) expect = expect.narrow(0, e * per, per);
    EXPECT_TRUE(test::all_close(g, expect, 1e-5, 1e-6)) << pp[i].first << " " << what;
  }
}

TEST(Zero3, DenseShardedOverEveryRankMatchesOneRank) { check({}); }
TEST(Zero3, WithRoutingReplay) { check({1, true}); }
TEST(Zero3, WithoutAGradient) { check({1, false, false, false}); }
TEST(Zero3, LoraOverAShardedFrozenBase) { check({1, false, true}); }
TEST(Zero3, WithTheExpertsShardedByExpertParallelism) { check({Group::world().size()}); }
// On a GPU per rank the broadcasts and reductions are NCCL calls, those of the backward issued from
// autograd's device thread (one GPU runs it at one rank: ctest kiln_mpi_np1_cuda).
TEST(Zero3, CudaTensorsGoThroughNccl) {
#if KILN_WITH_CUDA
  if (!at::hasCUDA() || c10::cuda::device_count() < Group::world().size()) GTEST_SKIP() << "needs a GPU per rank";
  c10::cuda::set_device(c10::DeviceIndex(Group::world().local_rank()));
  check({1, true, false, true, at::Device(at::kCUDA, c10::DeviceIndex(Group::world().local_rank()))});
#else
  GTEST_SKIP() << "a CPU build";
#endif
}

TEST(Zero3, WithDataTimesExpertParallelism) {
  if (Group::world().size() != 4) GTEST_SKIP() << "dp=2 x ep=2 needs 4 ranks";
  check({2, true});
}

// Sharded from the start: each rank draws only the tensors it owns (and its experts), planned from
// the shapes on the meta device; it holds what sharding a whole init leaves it, bit for bit.
void check_sharded_init(int ep) {
  const Group& w = Group::world();
  const int e = w.rank() % ep;
  const model::ModelConfig cfg = test::byte_vocab_config();
  const Muse shapes = Muse::shapes(cfg, at::kFloat, cfg.num_experts / ep);
  EXPECT_EQ(shapes.device().type(), at::kMeta);
  auto select = [&](const std::string& n) { return ep == 1 || !model::is_expert_tensor(n); };
  const auto owner = Zero3::owners(shapes, w.size(), select);
  Muse part = Muse::init_owned(cfg, 9, at::kFloat, at::kCPU, e, ep, [&](const std::string& n) {
    const auto it = owner.find(n);
    return it == owner.end() || it->second == w.rank();  // its experts under ep > 1, else what it owns
  });
  Zero3 zero(part, w, select, &shapes);
  const Muse whole = Muse::init(cfg, 9, at::kFloat, at::kCPU);
  Muse cut = model::shard_experts(whole.clone(), e, ep);  // its own tensors: ZeRO-3 releases them in place
  Zero3 reference(cut, w, select);  // sharding a whole init, the usual way
  auto pp = part.named_parameters(), pc = cut.named_parameters();
  ASSERT_EQ(pp.size(), pc.size());
  for (size_t i = 0; i < pp.size(); ++i) {
    EXPECT_EQ(pp[i].second.sizes(), pc[i].second.sizes()) << pp[i].first << " ep=" << ep;
    if (pp[i].second.numel() > 0) EXPECT_TRUE(test::all_equal(pp[i].second, pc[i].second)) << pp[i].first;
  }
  Muse gathered = Muse::init(cfg, 1, at::kFloat, at::kCPU);
  zero.gather_into(gathered);
  auto pg = gathered.named_parameters(), pw = whole.named_parameters();
  for (size_t i = 0; i < pg.size(); ++i)
    if (select(pg[i].first)) EXPECT_TRUE(test::all_equal(pg[i].second, pw[i].second)) << pg[i].first << " ep=" << ep;
  Muse unplanned = Muse::init_owned(cfg, 9, at::kFloat, at::kCPU, e, ep, [&](const std::string&) { return false; });
  EXPECT_TRUE(test::throws_with([&] { Zero3 z(unplanned, w, select); }, {"needs the whole model's shapes"}));
}

TEST(Zero3, ShardedInitDrawsOnlyWhatEachRankOwns) {
  check_sharded_init(1);
  check_sharded_init(Group::world().size());
}

// The whole model back from the shards, and the shards from a whole model.
TEST(Zero3, GatherIntoAndTakeFromAWholeModel) {
  const Group& w = Group::world();
  const model::ModelConfig cfg = test::byte_vocab_config();
  Muse part = Muse::init(cfg, 9, at::kFloat, at::kCPU);
  Zero3 zero(part, w, [](const std::string&) { return true; });
  Muse whole = Muse::init(cfg, 1, at::kFloat, at::kCPU);
  zero.gather_into(whole);
  const Muse ref = Muse::init(cfg, 9, at::kFloat, at::kCPU);
  auto a = whole.named_parameters(), r = ref.named_parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(test::all_equal(a[i].second, r[i].second)) << a[i].first;
  const Muse other = Muse::init(cfg, 4, at::kFloat, at::kCPU);
  zero.take_from(other);
  zero.gather_into(whole);
  auto o = other.named_parameters();
  a = whole.named_parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(test::all_equal(a[i].second, o[i].second)) << a[i].first;
}

}  // namespace
}  // namespace kiln::parallel
