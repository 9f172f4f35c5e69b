// Data parallelism at the world size mpirun gives: summed gradients equal one rank's full-batch
// gradients, a ZeRO-1 step equals the unsharded step, and a GRPO run matches the one-rank run.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/files.h"
#include "model/checkpoint.h"
#include "model/expert_parallel.h"
#include "model/lora.h"
#include "model/muse.h"
#include "optimizers/optimizer.h"
#include "tests/test_util.h"
#include "tests/trainer/small_model.h"
#include "tests/trainer/grpo_fixtures.h"
#include "trainer/grpo.h"
#include "trainer/sft.h"
#include "trainer/tasks.h"
#include "parallel/parallel.h"

namespace kiln::trainer {
namespace {

using comm::Group;
using namespace parallel;  // the layout, reducers and ZeRO-1 under test

std::vector<std::vector<int64_t>> sequences(int64_t count) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(7);
  std::vector<std::vector<int64_t>> out;
  for (int64_t i = 0; i < count; ++i) {
    at::Tensor t = at::randint(128, {3 + 5 * (i % 4)}, g, at::kLong);
    out.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
  }
  return out;
}

// -sum(log p(next token)) over `seqs`, divided by `norm`; backward into the model's grads.
double loss_and_backward(model::Muse& m, const std::vector<std::vector<int64_t>>& seqs, double norm) {
  if (seqs.empty()) return 0;
  std::vector<int64_t> targets;
  for (const auto& s : seqs)
    for (size_t j = 0; j < s.size(); ++j) targets.push_back(j + 1 < s.size() ? s[j + 1] : -100);
  model::ForwardOptions o;
  o.targets = at::tensor(targets, at::kLong);
  auto out = m.forward(model::PackedBatch::from_sequences(seqs, at::kCPU), o);
  at::Tensor loss = -out.logprobs.sum() / norm;
  loss.backward();
  return loss.item<double>();
}

int64_t predicted_tokens(const std::vector<std::vector<int64_t>>& seqs) {
  int64_t n = 0;
  for (const auto& s : seqs) n += int64_t(s.size()) - 1;
  return n;
}

TEST(DataParallel, SummedGradientsEqualTheFullBatch) {
  const Group& w = Group::world();
  auto seqs = sequences(11);  // not a multiple of the world size
  const double norm = double(predicted_tokens(seqs));
  model::Muse full = model::Muse::init(test::byte_vocab_config(), 3, at::kFloat, at::kCPU);
  model::Muse dp = model::Muse::init(test::byte_vocab_config(), 3, at::kFloat, at::kCPU);
  full.set_requires_grad(true);
  dp.set_requires_grad(true);
  const double full_loss = loss_and_backward(full, seqs, norm);
  const size_t b = seqs.size() * size_t(w.rank()) / size_t(w.size()), e = seqs.size() * size_t(w.rank() + 1) / size_t(w.size());
  double my_loss = loss_and_backward(dp, {seqs.begin() + long(b), seqs.begin() + long(e)}, norm);
  std::vector<at::Tensor> params;
  for (auto& [n, p] : dp.named_parameters()) params.push_back(p);
  all_reduce_grads(w, params, /*bucket_bytes=*/4096);  // many buckets
  EXPECT_NEAR(w.all_reduce(my_loss), full_loss, 1e-5 * std::abs(full_loss));
  auto fp = full.named_parameters(), dpp = dp.named_parameters();
  for (size_t i = 0; i < fp.size(); ++i)
    EXPECT_TRUE(test::all_close(dpp[i].second.grad(), fp[i].second.grad(), 1e-5, 1e-7)) << fp[i].first;
}

// ZeRO-1 with the owner's state in each placement (`nvme` files are tagged by rank).
void check_zero_one(optimizers::Placement placement) {
  const Group& w = Group::world();
  test::TempDir dir;
  model::Muse a = model::Muse::init(test::byte_vocab_config(), 5, at::kFloat, at::kCPU);
  model::Muse b = model::Muse::init(test::byte_vocab_config(), 5, at::kFloat, at::kCPU);
  std::vector<at::Tensor> pa, pb;
  for (auto& [n, p] : a.named_parameters()) pa.push_back(p);
  for (auto& [n, p] : b.named_parameters()) pb.push_back(p);
  optimizers::OptimizerConfig oc;
  oc.adamw.lr = oc.muon.lr = 1e-2;
  optimizers::Optimizer whole(a.named_parameters(), oc);
  oc.state = placement;
  oc.nvme_dir = dir.path();
  oc.state_tag = "rank" + std::to_string(w.rank());
  const std::vector<int> owners = zero_owners(pb, w.size());
  std::vector<std::pair<std::string, at::Tensor>> mine;
  for (size_t i = 0; i < pb.size(); ++i)
    if (owners[i] == w.rank()) mine.push_back(b.named_parameters()[i]);
  ASSERT_FALSE(mine.empty()) << "every rank should own something";
  optimizers::Optimizer shard(mine, oc);
  for (int step = 0; step < 3; ++step) {
    at::manual_seed(step);
    for (size_t i = 0; i < pa.size(); ++i) {
      pa[i].mutable_grad() = at::randn(pa[i].sizes());
      pb[i].mutable_grad() = pa[i].grad().clone();
    }
    whole.step();
    shard.step();
    broadcast_from_owners(w, pb, owners);
  }
  // Bitwise where the owner runs the same arithmetic; the fused CPU AdamW of cpu_update and nvme
  // differs from ATen's in rounding.
  const bool fused = placement == optimizers::Placement::kHostCpu || placement == optimizers::Placement::kNvme;
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(fused ? test::all_close(pb[i].detach(), pa[i].detach(), 1e-5, 1e-6)
                      : test::all_equal(pb[i].detach(), pa[i].detach()))
        << optimizers::placement_name(placement) << " parameter " << i;
}

TEST(DataParallel, ZeroOneStepEqualsTheUnshardedStepInEveryPlacement) {
  for (auto p : {optimizers::Placement::kDevice, optimizers::Placement::kHost, optimizers::Placement::kHostCpu,
                 optimizers::Placement::kNvme})
    check_zero_one(p);
}

// The GRPO steps of these tests: 8 prompts x 4 samples of one token, micro-batches of 5.
GrpoConfig dp_grpo() {
  GrpoConfig cfg;
  cfg.prompts_per_step = 8;
  cfg.samples_per_prompt = 4;
  cfg.max_tokens = 1;
  cfg.micro_batch_seqs = 5;
  cfg.engine.kv_cache_bytes = 8 << 20;
  return cfg;
}

using Named = std::vector<std::pair<std::string, at::Tensor>>;

// The tensors `part` holds (placeholders skipped; a smaller expert stack is expert shard
// `expert_rank`), each with the same slice of its namesake in `whole`.
std::vector<std::pair<std::string, std::pair<at::Tensor, at::Tensor>>> held(const Named& whole, const Named& part,
                                                                            int64_t expert_rank) {
  EXPECT_EQ(whole.size(), part.size());
  std::vector<std::pair<std::string, std::pair<at::Tensor, at::Tensor>>> out;
  for (size_t i = 0; i < std::min(whole.size(), part.size()); ++i) {
    const at::Tensor& p = part[i].second;
    if (p.numel() == 0) continue;
    at::Tensor w = whole[i].second;
    if (p.size(0) != w.size(0)) w = w.narrow(0, expert_rank * p.size(0), p.size(0));
    out.push_back({part[i].first, {w, p}});
  }
  return out;
}

// A GRPO run over every rank (experts sharded over `ep` of them, the dense part under ZeRO-3 when
// zero3) against the same run on one rank. With `share` each rank's policy is only its share
// (trainer::policy_share, drawn by Muse::init_owned, as kiln train builds it): the trainer then
// never holds the whole model, and the share is compared with the same slice of the one-rank run.
void check_grpo(int64_t ep, int64_t mini_steps, double kl_coef = 0, const std::string& rollout = "replica",
                int64_t lora_rank = 0, bool zero3 = false, bool share = false, int64_t cp = 1) {
  const Group& w = Group::world();
  const Group alone = w.split(w.rank(), 0);  // a one-rank group: the reference run
  model::ModelConfig mc = test::byte_vocab_config();
  mc.init_std = 1.0;  // sharp enough that the greedy reply is sampled often, but not always
  model::Muse m1 = model::Muse::init(mc, 3, at::kFloat, at::kCPU);
  Dataset data = test::self_consistent_problems(m1, 200);
  GrpoConfig cfg = dp_grpo();
  cfg.mini_steps = mini_steps;
  cfg.loss.kl_coef = kl_coef;
  cfg.mismatch_ab = true;
  cfg.optim.adamw.lr = cfg.optim.muon.lr = 1e-2;
  if (lora_rank > 0) cfg.lora = model::LoraConfig{lora_rank, 2.0 * double(lora_rank)};
  GrpoTrainer one(m1, cfg, test::byte_tokenizer(), data, alone);
  cfg.parallel.ep = ep;
  cfg.parallel.cp = cp;
  cfg.parallel.rollout = parse_rollout_placement(rollout);
  if (zero3) cfg.parallel.dense = DenseSharding::kZero3;
  const PolicyShare ps = policy_share(mc, at::kFloat, cfg.parallel, w);
  const int64_t er = ps.expert_rank;
  auto policy = [&](uint64_t seed) {
    if (!share) return model::Muse::init(mc, seed, at::kFloat, at::kCPU);
    EXPECT_FALSE(ps.whole());
    const auto keep = ps.keep ? ps.keep : [](const std::string&) { return true; };
    return model::Muse::init_owned(mc, seed, at::kFloat, at::kCPU, ps.expert_rank, ps.expert_ranks, keep);
  };
  model::Muse mw = policy(3);
  if (share && w.size() > 1) {  // a share indeed: placeholders (ZeRO-3) or fewer experts
    int64_t missing = 0;
    for (const auto& [name, t] : mw.named_parameters())
      missing += t.numel() == 0 || (model::is_expert_tensor(name) && t.size(0) < mc.num_experts);
    EXPECT_GT(missing, 0);
  }
  GrpoTrainer all(mw, cfg, test::byte_tokenizer(), data, w);
  for (int s = 0; s < 3; ++s) {
    StepMetrics a = one.step(), b = all.step();
    EXPECT_EQ(b.reward, a.reward) << "step " << s;
    EXPECT_EQ(b.accuracy, a.accuracy) << "step " << s;
    EXPECT_EQ(b.tokens, a.tokens) << "step " << s;
    // With the KL term, later steps measure the drift from the frozen start, and the two runs'
    // weights differ by AdamW's amplified rounding noise (see below): 1% there, 1e-5 otherwise.
    const double loose = kl_coef != 0 && s > 0 ? 1e-2 : 0;
    EXPECT_NEAR(b.loss, a.loss, std::max(loose * std::abs(a.loss), 1e-5 * std::max(1.0, std::abs(a.loss))))
        << "step " << s;
    EXPECT_NEAR(b.kl, a.kl, 1e-6 + std::max(loose, 1e-4) * std::abs(a.kl)) << "step " << s;
    if (kl_coef != 0 && s > 0) EXPECT_GT(a.kl, 0) << "step " << s;
    // fp32 gradients summed in another order, through a sharp (init_std 1) model: 1e-3.
    EXPECT_NEAR(b.grad_norm, a.grad_norm, 1e-3 * a.grad_norm) << "step " << s;
    if (s == 0) EXPECT_GT(a.grad_norm, 0) << "all advantages zero: the comparison would be empty";
    // Both mismatches are fp32 noise (~1e-6); they must stay at that level.
    EXPECT_LT(b.mismatch.mean_abs_token, 1e-5) << "step " << s;
    // The sync check runs under expert parallelism too (both forwards exchange tokens).
    EXPECT_GE(b.sync_check, 0.0) << "step " << s;
    EXPECT_LT(b.sync_check, 1e-5) << "step " << s;
    EXPECT_NEAR(b.routing_disagreement, a.routing_disagreement, 1e-12) << "step " << s;
  }
  EXPECT_NEAR(all.evaluate(test::eval_prompts(20)).all.mean_at_k, one.evaluate(test::eval_prompts(20)).all.mean_at_k,
              1e-12);
  all.sync_policy();  // a share is current already
  auto p1 = m1.named_parameters(), pw = mw.named_parameters();
  if (lora_rank > 0) {  // the base is frozen; the adapters (the experts' gathered back) are what trained
    for (const auto& [name, t] : held(p1, pw, er)) EXPECT_TRUE(test::all_equal(t.second, t.first)) << name;
    p1 = model::lora_parameters(m1);
    pw = model::lora_parameters(mw);
    ASSERT_EQ(p1.size(), pw.size());
  }
  if ((ep > 1 || zero3) && lora_rank == 0) {
    // The checkpoint: each expert shard's first copy wrote its experts, rank 0 the rest and the
    // index (under ZeRO-3 each rank its own tensors). It loads as the gathered policy, bitwise, and
    // a second trainer resumes from it.
    at::Tensor id = at::tensor(std::vector<int64_t>{int64_t(::getpid())});
    w.broadcast(id, 0);  // one directory for every rank (they share the machine)
    const std::string dir = "/tmp/kiln-mpi-ckpt-" + std::to_string(id.item<int64_t>()) + "-" + rollout +
                            std::to_string(ep) + (kl_coef != 0 ? "kl" : "") + (zero3 ? "z3" : "") + "cp" +
                            std::to_string(cp);
    all.save(dir);
    {  // every rank: what it holds is what was written
      const model::Muse saved = model::load_checkpoint(dir + "/model", at::kFloat, at::kCPU);
      for (const auto& [name, t] : held(saved.named_parameters(), mw.named_parameters(), er))
        EXPECT_TRUE(test::all_equal(t.second, t.first)) << name;
    }
    if (w.rank() == 0) {
      int parts = 0;
      for (const auto& f : std::filesystem::directory_iterator(dir + "/model"))
        parts += f.path().filename().string().rfind("model-rank", 0) == 0;
      // One or more files per expert shard; under ZeRO-3 per rank (each writes what it owns).
      EXPECT_GE(parts, zero3 ? int64_t(w.size()) : ep);
      if (kl_coef != 0) {  // the frozen reference is the starting policy, however it was written
        model::Muse ref = model::load_checkpoint(dir + "/reference", at::kFloat, at::kCPU);
        const model::Muse start = model::Muse::init(mc, 3, at::kFloat, at::kCPU);
        auto pr = ref.named_parameters(), p0 = start.named_parameters();
        for (size_t i = 0; i < pr.size(); ++i) EXPECT_TRUE(test::all_equal(pr[i].second, p0[i].second)) << pr[i].first;
      }
    }
    model::Muse mr = policy(4);  // other weights: the load must replace them
    GrpoTrainer resumed(mr, cfg, test::byte_tokenizer(), data, w);
    resumed.load(dir);
    resumed.sync_policy();
    for (const auto& [name, t] : held(mw.named_parameters(), mr.named_parameters(), er))
      EXPECT_TRUE(test::all_equal(t.second, t.first)) << name;
    w.barrier();
    if (w.rank() == 0) remove_tree(dir);  // not std::filesystem::remove_all (core/files.h)
  }
  for (const auto& [name, t] : held(p1, pw, er)) {
    // Not element-wise: AdamW turns gradient elements at rounding-noise level into full-size
    // steps whose sign the summation order decides (seen: lm_head rows, 0.014 apart at 4 ranks),
    // and Muon amplifies weak directions. Each tensor as a whole must agree to 1% (a slice that
    // never trained, such as a zero LoRA B, exactly).
    const double diff = (t.second - t.first).norm().item<double>(), ref = t.first.norm().item<double>();
    EXPECT_LE(diff, 1e-2 * ref) << name << " ep=" << ep;
  }
}

TEST(DataParallel, GrpoOnAllRanksMatchesOneRank) { check_grpo(1, 3); }  // mini-steps crossing ranks

// Expert parallel over all ranks (ep = world), and dp=2 x ep=2 at 4 ranks; mini-steps cross ranks
// (a rank the mini-step does not reach joins its exchanges with empty micro-batches).
TEST(DataParallel, GrpoWithExpertParallelMatchesOneRank) {
  check_grpo(Group::world().size(), 3);
  if (Group::world().size() == 4) check_grpo(2, 1);
  check_grpo(Group::world().size(), 1, /*kl_coef=*/0.05);  // the reference is an expert shard too
  // The rollout engines serve their shards, exchanging tokens in lockstep (needs ep > 1: at one
  // rank, as on the one-GPU machine, the layout rightly refuses it).
  if (Group::world().size() > 1) check_grpo(Group::world().size(), 1, 0, "sharded");
  // LoRA: the experts' adapters are sharded with the experts; replica and sharded engines.
  check_grpo(Group::world().size(), 1, 0.05, "replica", /*lora_rank=*/4);
  if (Group::world().size() > 1) check_grpo(Group::world().size(), 1, 0, "sharded", 4);
  if (Group::world().size() == 4) check_grpo(2, 1, 0, "sharded");
}

// Context parallelism (parallel.cp): each cp group trains the trajectories its ranks rolled out,
// every micro-batch's tokens split over the group, and the run is one rank's: cp over every rank,
// with the KL reference scored split too, with LoRA; cp folded over expert parallelism (the ranks
// of a cp group hold different experts and send their own tokens to the owners), with sharded
// engines; at 4 ranks dp 2 x cp 2, ep 2 and ep 4 under cp 2, and ZeRO-3 under cp 2, each of the
// sharded layouts resumed from its checkpoint.
TEST(DataParallel, GrpoWithContextParallelMatchesOneRank) {
  const int64_t world = Group::world().size();
  check_grpo(1, 3, 0, "replica", 0, false, false, /*cp=*/world);
  check_grpo(1, 1, /*kl_coef=*/0.05, "replica", /*lora_rank=*/4, false, false, world);
  check_grpo(world, 3, 0, "replica", 0, false, false, world);
  if (world > 1) check_grpo(world, 1, 0, "sharded", 0, false, false, world);  // a shard needs ep > 1
  if (world == 4) {
    check_grpo(4, 1, 0, "replica", 0, false, false, 2);
    check_grpo(1, 3, 0.05, "replica", 0, false, false, 2);
    check_grpo(2, 1, 0, "replica", 0, false, false, 2);
    check_grpo(1, 1, 0, "replica", 0, /*zero3=*/true, false, 2);
  }
}

// rollout.numerics bitwise over every rank, data parallel and with the experts sharded: lp_old is
// the rollout's (no second forward), and the first mini-step measures the mismatch over every
// rank's tokens, exactly 0, also where a rank has no trajectory in that mini-step (3 mini-steps
// over 32 trajectories) and joins the gathers with none; the run is one rank's.
TEST(DataParallel, BitwiseGrpoTakesLpOldFromTheRolloutOnEveryRank) {
  const Group& w = Group::world();
  const Group alone = w.split(w.rank(), 0);
  model::ModelConfig mc = test::byte_vocab_config();
  mc.init_std = 1.0;
  const model::Muse init = model::Muse::init(mc, 3, at::kFloat, at::kCPU);
  Dataset data = test::self_consistent_problems(init, 200);
  for (int64_t ep : {int64_t(1), int64_t(w.size())}) {
    GrpoConfig cfg = dp_grpo();
    cfg.engine.numerics = model::Numerics::kBitwise;
    cfg.mini_steps = 3;
    model::Muse m1 = init.clone(), mw = init.clone();
    GrpoTrainer one(m1, cfg, test::byte_tokenizer(), data, alone);
    cfg.parallel.ep = ep;
    GrpoTrainer all(mw, cfg, test::byte_tokenizer(), data, w);
    for (int s = 0; s < 2; ++s) {
      const StepMetrics a = one.step(), b = all.step();
      EXPECT_TRUE(b.lp_old_from_rollout) << "ep " << ep;
      EXPECT_GT(b.mismatch.tokens, 0) << "ep " << ep;
      EXPECT_EQ(b.mismatch.tokens, a.mismatch.tokens) << "ep " << ep << ": the same first mini-step";
      EXPECT_EQ(b.mismatch.max_abs, 0.0) << "ep " << ep;
      EXPECT_EQ(b.reward, a.reward) << "ep " << ep;
      EXPECT_NEAR(b.loss, a.loss, 1e-5 * std::max(1.0, std::abs(a.loss))) << "ep " << ep << " step " << s;
    }
  }
}

// An NVFP4 rollout served by expert-sharded engines (each rank quantises its own experts and,
// after each step, re-quantises the shard it is sent) samples what one rank's NVFP4 replica
// samples: the same rewards and tokens, step after step; the sync check reads the shards.
TEST(DataParallel, Nvfp4RolloutOnShardedEnginesMatchesOneRank) {
  const Group& w = Group::world();
  if (w.size() == 1) GTEST_SKIP() << "a sharded rollout needs ep > 1";
  const Group alone = w.split(w.rank(), 0);
  model::ModelConfig mc = test::byte_vocab_config();
  mc.init_std = 0.5;  // at 1.0 NVFP4 moves the probe's log-probs by 2 nats, past the sync check's 1
  const model::Muse init = model::Muse::init(mc, 3, at::kFloat, at::kCPU);
  Dataset data = test::self_consistent_problems(init, 200);
  GrpoConfig cfg = dp_grpo();
  cfg.engine.quantization = rollout::Quantization::kNvfp4;
  cfg.optim.adamw.lr = cfg.optim.muon.lr = 1e-2;
  model::Muse m1 = init.clone(), mw = init.clone();
  GrpoTrainer one(m1, cfg, test::byte_tokenizer(), data, alone);
  cfg.parallel.ep = w.size();
  cfg.parallel.rollout = parallel::RolloutPlacement::kSharded;
  GrpoTrainer all(mw, cfg, test::byte_tokenizer(), data, w);
  for (int s = 0; s < 3; ++s) {
    const StepMetrics a = one.step(), b = all.step();
    EXPECT_EQ(b.reward, a.reward) << "step " << s;
    EXPECT_EQ(b.tokens, a.tokens) << "step " << s;
    EXPECT_NEAR(b.loss, a.loss, 1e-4 * std::max(1.0, std::abs(a.loss))) << "step " << s;
    // The quantisation's own gap, alike. Not closer: the trained weights differ by AdamW's
    // amplified rounding noise (check_grpo), and re-quantising them flips a code here and there.
    EXPECT_GT(a.sync_check, 0.0) << "step " << s;
    EXPECT_NEAR(b.sync_check, a.sync_check, 0.1 * a.sync_check) << "step " << s;
    EXPECT_NEAR(b.mismatch.mean_abs_token, a.mismatch.mean_abs_token, 0.1 * a.mismatch.mean_abs_token) << "step " << s;
  }
}

// The dense part under ZeRO-3 (each tensor on one rank, gathered a layer at a time): alone (dp =
// world), with the KL reference sharded too, with the experts sharded by expert parallelism, and
// LoRA over a sharded frozen base, and beside sharded engines; mini-steps crossing ranks.
TEST(DataParallel, GrpoWithZero3MatchesOneRank) {
  const int64_t W = Group::world().size();
  check_grpo(1, 3, 0, "replica", 0, /*zero3=*/true);
  check_grpo(1, 1, 0.05, "replica", 0, true);
  check_grpo(W, 3, 0, "replica", 0, true);
  check_grpo(1, 1, 0.05, "replica", 4, true);
  if (W > 1) {  // sharded engines serve the owners' dense part beside their own experts
    check_grpo(W, 1, 0.05, "sharded", 0, true);
    check_grpo(W, 1, 0, "sharded", 4, true);
  }
}

// Each rank given only its share of the policy (trainer::policy_share, as kiln train builds it):
// the engines are filled tensor by tensor from the owners and the ranks' experts, the checkpoint
// is written and read by share, and no rank ever holds the whole model.
TEST(DataParallel, GrpoFromSharesMatchesOneRank) {
  const int64_t W = Group::world().size();
  check_grpo(1, 3, 0.05, "replica", 0, /*zero3=*/true, /*share=*/true);
  check_grpo(W, 1, 0.05, "replica", 0, true, true);
  check_grpo(1, 1, 0, "replica", 4, true, true);  // LoRA over a sharded frozen base
  if (W > 1) {
    check_grpo(W, 1, 0.05, "sharded", 0, true, true);
    check_grpo(W, 1, 0, "replica", 4, false, true);  // expert shards alone, the dense part replicated
  }
}

// SFT under the layouts GRPO uses (experts over ep ranks, the dense part under ZeRO-3), from a
// whole model or from shares, against the same steps on one rank: the same losses and token
// accuracies, each rank's tensors the same slice of the one-rank run's, and save_model written by
// share loads as what the ranks hold.
void check_sft(int64_t ep, bool zero3, bool share, int64_t cp = 1) {
  const Group& w = Group::world();
  const Group alone = w.split(w.rank(), 0);
  const model::ModelConfig mc = test::byte_vocab_config();
  model::Muse m1 = model::Muse::init(mc, 3, at::kFloat, at::kCPU);
  const std::vector<Example> train = arithmetic_problems(64, 1, 3);
  SftConfig sc;
  sc.batch_size = 8;
  sc.optim.adamw.lr = sc.optim.muon.lr = 1e-2;
  SftTrainer one(m1, sc, test::byte_tokenizer(), train, alone);
  ParallelConfig par;
  par.ep = ep;
  par.cp = cp;
  if (zero3) par.dense = DenseSharding::kZero3;
  const PolicyShare ps = policy_share(mc, at::kFloat, par, w);
  const auto keep = ps.keep ? ps.keep : [](const std::string&) { return true; };
  model::Muse mw = share ? model::Muse::init_owned(mc, 3, at::kFloat, at::kCPU, ps.expert_rank, ps.expert_ranks, keep)
                         : model::Muse::init(mc, 3, at::kFloat, at::kCPU);
  SftTrainer all(mw, sc, test::byte_tokenizer(), train, w, nullptr, par);
  const std::string what = str_cat("ep=", ep, " zero3=", zero3, " share=", share, " cp=", cp);
  for (int s = 0; s < 3; ++s) {
    const SftMetrics a = one.step(), b = all.step();
    EXPECT_NEAR(b.loss, a.loss, 1e-5 * std::max(1.0, std::abs(a.loss))) << what << " step " << s;
    EXPECT_NEAR(b.token_accuracy, a.token_accuracy, 1e-12) << what << " step " << s;
  }
  all.sync_policy();
  for (const auto& [name, t] : held(m1.named_parameters(), mw.named_parameters(), ps.expert_rank)) {
    const double diff = (t.second - t.first).norm().item<double>(), ref = t.first.norm().item<double>();
    EXPECT_LE(diff, 1e-2 * ref) << name << " " << what;
  }
  at::Tensor id = at::tensor(std::vector<int64_t>{int64_t(::getpid())});
  w.broadcast(id, 0);
  const std::string dir = str_cat("/tmp/kiln-mpi-sft-", id.item<int64_t>(), "-", ep, zero3, share, cp);
  all.save_model(dir);
  const model::Muse saved = model::load_checkpoint(dir, at::kFloat, at::kCPU);
  for (const auto& [name, t] : held(saved.named_parameters(), mw.named_parameters(), ps.expert_rank))
    EXPECT_TRUE(test::all_equal(t.second, t.first)) << name << " " << what;
  w.barrier();
  if (w.rank() == 0) remove_tree(dir);
}

TEST(DataParallel, SftUnderExpertParallelAndZero3MatchesOneRank) {
  const int64_t W = Group::world().size();
  check_sft(W, false, false);  // experts sharded from a whole model
  check_sft(1, true, true);    // every tensor under ZeRO-3, from shares
  check_sft(W, true, true);    // experts sharded and the dense part under ZeRO-3, from shares
}

// SFT under parallel.cp: each cp group trains one share of the batch, its sequences' tokens split
// over the group; cp over every rank, also with the experts over every rank, and at 4 ranks ep 2
// with cp 2 and ZeRO-3 from shares with cp 2.
TEST(DataParallel, SftUnderContextParallelMatchesOneRank) {
  const int64_t W = Group::world().size();
  check_sft(1, false, false, /*cp=*/W);
  check_sft(W, false, false, W);  // cp folded over ep: a cp group's ranks hold different experts
  if (W == 4) {
    check_sft(2, false, false, 2);
    check_sft(1, true, true, 2);
  }
}

// Dynamic sampling over every rank: each rank drops its flat groups, the rounds continue while
// the ranks together hold fewer than prompts_per_step, and the trim keeps each rank training (at
// least one group each); the step's counts agree on every rank. Expert parallelism is refused.
TEST(DataParallel, DynamicSamplingRunsOnEveryRank) {
  const Group& w = Group::world();
  model::ModelConfig mc = test::byte_vocab_config();
  mc.init_std = 1.0;
  model::Muse m = model::Muse::init(mc, 3, at::kFloat, at::kCPU);
  Dataset data = test::self_consistent_problems(m, 200);
  GrpoConfig cfg = dp_grpo();
  cfg.dynamic_sampling = true;
  cfg.max_sampling_rounds = 2;
  GrpoTrainer all(m, cfg, test::byte_tokenizer(), data, w);
  int64_t rounds = 0;
  for (int s = 0; s < 3; ++s) {
    const StepMetrics st = all.step();
    EXPECT_GE(st.groups_trained, w.size()) << st.to_json();
    EXPECT_LE(st.groups_trained, cfg.prompts_per_step + w.size() - 1) << st.to_json();
    EXPECT_TRUE(std::isfinite(st.loss)) << st.to_json();
    const double lo = -w.all_reduce(-double(st.groups_trained), comm::ReduceOp::kMax);
    EXPECT_EQ(lo, double(st.groups_trained)) << "ranks disagree on the groups trained";
    rounds += st.sampling_rounds;
  }
  EXPECT_GT(rounds, 3) << "no step needed a second round: the test saw no flat group";
  if (w.size() > 1) {
    cfg.parallel.ep = w.size();
    model::Muse m2 = model::Muse::init(mc, 3, at::kFloat, at::kCPU);
    EXPECT_TRUE(test::throws_with([&] { GrpoTrainer t(m2, cfg, test::byte_tokenizer(), data, w); }, {"dynamic_sampling"}));
  }
}

// A step whose failed samples, over all ranks, pass the reward's max_failure_fraction stops on every
// rank alike, ranks without a failure included, with the same message (the first failure of the
// lowest rank that has one): none is left waiting in a collective. The odd ranks' workers fail every
// request, so half the samples fail.
TEST(DataParallel, AFailureBudgetPassedOnSomeRanksStopsEveryRank) {
  const Group& w = Group::world();
  if (w.size() == 1) GTEST_SKIP() << "needs a rank whose worker fails and one whose does not";
  test::TempDir dir;
  const std::string script = dir / "worker.py";
  std::ofstream(script) << "import json, sys\nfail = " << (w.rank() % 2 == 1 ? "True" : "False")
                        << "\nfor line in sys.stdin:\n    i = json.loads(line)['id']\n"
                           "    print(json.dumps({'id': i, 'error': 'judge down'} if fail else {'id': i, 'reward': 1.0}),"
                           " flush=True)\n";
  model::Muse m = model::Muse::init(test::byte_vocab_config(), 3, at::kFloat, at::kCPU);
  GrpoConfig cfg = dp_grpo();
  cfg.reward.type = RewardType::kWorker;
  cfg.reward.worker.command = {access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3", script};
  cfg.reward.worker.on_failure = OnFailure::kZero;
  cfg.reward.worker.start_check_s = 0.2;
  cfg.reward.worker.max_failure_fraction = 0.25;
  GrpoTrainer trainer(m, cfg, test::byte_tokenizer(), split(arithmetic_problems(64, 1, 6), 0.25, 1), w);
  const std::string error = test::error_of([&] { trainer.step(); });
  EXPECT_NE(error.find("grpo: 16 of the 32 samples of step 1 failed (reward errors)"), std::string::npos) << error;
  EXPECT_NE(error.find("the first failure (rank 1): worker error: judge down"), std::string::npos) << error;
  w.barrier();  // every rank got here: none waits for another
}

TEST(DataParallel, LayoutErrorsNameEveryValue) {
  ParallelConfig p;
  p.dp = 3;
  EXPECT_TRUE(test::throws_with([&] { p.resolve(4, 8); }, {"dp x ep must equal the world size", "dp=3", "world size 4"}));
  ParallelConfig q;
  q.ep = 3;
  EXPECT_TRUE(test::throws_with([&] { q.resolve(4, 8); }, {"divide num_experts", "ep=3", "num_experts 8"}));
  ParallelConfig r;
  r.dp.reset();
  r.resolve(4, 8);
  ASSERT_TRUE(r.dp.has_value());
  EXPECT_EQ(*r.dp, 4);
  ParallelConfig with_cp;
  with_cp.cp = 2;
  with_cp.ep = 4;  // cp folds over the ranks ep lays out
  with_cp.resolve(4, 8);
  EXPECT_EQ(*with_cp.dp, 1);
  EXPECT_NE(with_cp.describe().find("cp=2"), std::string::npos) << with_cp.describe();
  ParallelConfig odd_cp;
  odd_cp.cp = 3;
  EXPECT_TRUE(test::throws_with([&] { odd_cp.resolve(4, 8); }, {"cp must divide the world size", "cp=3", "world size 4"}));
  ParallelConfig sharded_alone;
  sharded_alone.rollout = RolloutPlacement::kSharded;
  EXPECT_TRUE(test::throws_with([&] { sharded_alone.resolve(4, 8); }, {"rollout sharded needs ep > 1", "ep=1"}));
  EXPECT_EQ(parse_rollout_placement("sharded"), RolloutPlacement::kSharded);
  EXPECT_EQ(parse_rollout_placement("auto"), RolloutPlacement::kAuto);
  EXPECT_EQ(ParallelConfig{}.rollout, RolloutPlacement::kAuto);  // the default: kiln train's plan decides
  EXPECT_STREQ(rollout_placement_name(RolloutPlacement::kReplica), "replica");
  EXPECT_TRUE(test::throws_with([] { parse_rollout_placement("both"); }, {"replica or sharded", "'both'"}));
}

TEST(DataParallel, ReductionOverlappedWithBackwardEqualsTheFullBatch) {
  const comm::Group& w = comm::Group::world();
  auto seqs = sequences(14);
  const double norm = double(predicted_tokens(seqs));
  model::Muse full = model::Muse::init(test::byte_vocab_config(), 3, at::kFloat, at::kCPU);
  model::Muse dp = model::Muse::init(test::byte_vocab_config(), 3, at::kFloat, at::kCPU);
  full.set_requires_grad(true);
  dp.set_requires_grad(true);
  loss_and_backward(full, seqs, norm);
  std::vector<at::Tensor> params;
  for (auto& [n, p] : dp.named_parameters()) params.push_back(p);
  OverlappedGradReducer reducer(w, params, /*bucket_bytes=*/4096);
  // Two micro-batches on this rank: the first accumulates, the second backward overlaps the sums.
  const size_t b = seqs.size() * size_t(w.rank()) / size_t(w.size()), e = seqs.size() * size_t(w.rank() + 1) / size_t(w.size());
  const size_t mid = (b + e) / 2;
  for (int round = 0; round < 2; ++round) {  // twice: the reducer is reusable
    for (auto& p : params) p.mutable_grad().reset();
    loss_and_backward(dp, {seqs.begin() + long(b), seqs.begin() + long(mid)}, norm);
    reducer.arm();
    loss_and_backward(dp, {seqs.begin() + long(mid), seqs.begin() + long(e)}, norm);
    reducer.finish();
    if (w.size() > 1)  // one rank has nothing to reduce
      EXPECT_GT(reducer.buckets_started_in_backward(), 0) << "no bucket was reduced during backward";
    auto fp = full.named_parameters(), dpp = dp.named_parameters();
    for (size_t i = 0; i < fp.size(); ++i)
      EXPECT_TRUE(test::all_close(dpp[i].second.grad(), fp[i].second.grad(), 1e-5, 1e-6)) << fp[i].first;
  }
}

}  // namespace
}  // namespace kiln::trainer
