// Expert parallelism at the world size mpirun gives: with the experts sharded over ep ranks (and
// dp = world / ep copies of each shard), loss, log-probs, routing and gradients equal one rank's
// full-batch forward and backward; routing replay gives the same. A sharded load holds only the
// rank's share of a checkpoint in memory (peak RSS, measured). The fixed-shape exchange gives the
// same results as the variable one, and sharded rollout engines in lockstep sample what one
// rank's engine samples.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>

#include "core/files.h"
#include "parallel/zero3.h"
#include "model/checkpoint.h"
#include "model/expert_parallel.h"
#include "model/muse.h"
#include "model/nvfp4_model.h"
#include "rollout/engine.h"
#include "tests/parallel/next_token.h"
#include "tests/rollout/engine_fixtures.h"  // request
#include "tests/test_util.h"
#include "tests/trainer/small_model.h"

#if KILN_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace kiln::model {
namespace {

using comm::Group;
using test::LossRun;
using test::next_token_loss;

// `fixed`: the fixed-shape exchange (AllToAllDispatcher's padded buffers), which must give the same;
// `invariant`: batch-invariant numerics on both sides (the per-expert norm weights then picked by
// table_rows, whose gradient is a GEMM, not index_select's scattered adds).
void check(int ep, bool fixed = false, bool invariant = false) {
  const Group& w = Group::world();
  const int W = w.size(), e = w.rank() % ep, d = w.rank() / ep;
  ASSERT_EQ(W % ep, 0);
  const Group ep_group = w.split(d, e), dp_group = w.split(1000 + e, d);
  ASSERT_EQ(ep_group.size(), ep);
  const ModelConfig cfg = test::byte_vocab_config();
  const int64_t per = cfg.num_experts / ep;
  const test::Sequences seqs = test::token_sequences(11, 13, 2, 7);
  const double norm = test::target_count(seqs);

  Muse full = Muse::init(cfg, 9, at::kFloat, at::kCPU);
  full.set_requires_grad(true);
  ForwardOptions plain;
  plain.numerics = invariant ? model::Numerics::kBitwise : model::Numerics::kStandard;
  LossRun ref = next_token_loss(full, seqs, norm, plain);

  Muse shard = shard_experts(Muse::init(cfg, 9, at::kFloat, at::kCPU), e, ep);
  shard.set_requires_grad(true);
  const test::RankShare share = test::rank_share(seqs, w.rank(), W);
  const test::Sequences& mine = share.seqs;
  const int64_t t0 = share.first_row, tn = share.rows;  // this rank's token rows in the full batch
  ForwardOptions o = plain;
  const model::AllToAllDispatcher dispatcher(ep_group, fixed);
  o.experts = &dispatcher;
  LossRun got = next_token_loss(shard, mine, norm, o);

  EXPECT_NEAR(w.all_reduce(got.loss), ref.loss, 1e-5 * std::abs(ref.loss)) << "ep=" << ep;
  EXPECT_TRUE(test::all_close(got.logprobs, ref.logprobs.narrow(0, t0, tn), 1e-5, 1e-6)) << "ep=" << ep;
  EXPECT_TRUE(test::all_equal(got.routing, ref.routing.narrow(0, t0, tn))) << "ep=" << ep;
  // Gradients: the replicated tensors sum over every rank, an expert shard over its dp copies.
  auto fp = full.named_parameters(), sp = shard.named_parameters();
  for (size_t i = 0; i < sp.size(); ++i) {
    at::Tensor g = sp[i].second.grad().defined() ? sp[i].second.grad() : at::zeros_like(sp[i].second);
    g = g.contiguous();
    (is_expert_tensor(sp[i].first) ? dp_group : w).all_reduce(g);
    at::Tensor expect = fp[i].second.grad();
    if (is_expert_tensor(sp[i].first)) expect = expect.narrow(0, e * per, per);
    // 1e-5 relative; 1e-6 absolute for the elements near zero that fp32 sums in another order.
    EXPECT_TRUE(test::all_close(g, expect, 1e-5, 1e-6)) << sp[i].first << " ep=" << ep;
  }
  // Every slot sent to experts 0 and 1: the other ranks' experts receive no rows at all, yet
  // they take part in both exchanges, forward and backward.
  at::Tensor skewed = at::zeros_like(ref.routing);
  skewed.select(2, 1).fill_(1);
  ForwardOptions full_skew = plain;
  full_skew.replay_routing = skewed;
  LossRun ref_skew = next_token_loss(full, seqs, norm, full_skew);
  ForwardOptions skew = o;
  skew.replay_routing = skewed.narrow(0, t0, tn);
  for (auto& [n, p] : shard.named_parameters()) p.mutable_grad().reset();
  LossRun got_skew = next_token_loss(shard, mine, norm, skew);
  EXPECT_TRUE(test::all_close(got_skew.logprobs, ref_skew.logprobs.narrow(0, t0, tn), 1e-5, 1e-6)) << "skewed ep=" << ep;
  EXPECT_NEAR(w.all_reduce(got_skew.loss), ref_skew.loss, 1e-5 * std::abs(ref_skew.loss)) << "skewed ep=" << ep;

  // Routing replay: the recorded expert sets reproduce the log-probs through the exchange.
  ForwardOptions replay = o;
  replay.replay_routing = ref.routing.narrow(0, t0, tn);
  for (auto& [n, p] : shard.named_parameters()) p.mutable_grad().reset();
  LossRun again = next_token_loss(shard, mine, norm, replay);
  EXPECT_TRUE(test::all_close(again.logprobs, ref.logprobs.narrow(0, t0, tn), 1e-5, 1e-6)) << "replay ep=" << ep;
}

TEST(ExpertParallel, EveryRankAnExpertShardMatchesOneRank) { check(Group::world().size()); }

TEST(ExpertParallel, DataTimesExpertParallelMatchesOneRank) {
  if (Group::world().size() != 4) GTEST_SKIP() << "dp=2 x ep=2 needs 4 ranks";
  check(2);
}

// The fixed-shape exchange (what a captured sharded rollout needs): every rank sends each rank
// the same number of rows, padded, and the results are one rank's all the same; also when all
// slots go to rank 0's experts (the skewed case in check) and with ranks of different token counts.
TEST(ExpertParallel, FixedShapeExchangeMatchesOneRank) {
  check(Group::world().size(), /*fixed=*/true);
  if (Group::world().size() == 4) check(2, /*fixed=*/true);
}

// Batch-invariant numerics through both exchanges: the per-expert norm weights picked by
// table_rows under expert parallelism, as on one rank. On the CPU this checks the path's values and
// gradients; that its CUDA backward has no atomics is table_rows' own property.
TEST(ExpertParallel, BatchInvariantNumericsMatchOneRank) {
  check(Group::world().size(), /*fixed=*/false, /*invariant=*/true);
  check(Group::world().size(), /*fixed=*/true, /*invariant=*/true);
}

// A set capacity above the worst case gives the same results and no overflow; one below what some
// rank sends some rank drops those slots and counts the dispatches that did (overflow()); masked
// tokens send nothing.
TEST(ExpertParallel, FixedShapeCapacityOverflowIsCounted) {
  const Group& w = Group::world();
  if (w.size() == 1) GTEST_SKIP() << "one rank exchanges nothing";
  const ModelConfig cfg = test::byte_vocab_config();
  const Muse shard = shard_experts(Muse::init(cfg, 9, at::kFloat, at::kCPU), w.rank(), w.size());
  const PackedBatch batch = PackedBatch::from_sequences({{1, 2, 3, 4, 5}}, at::kCPU);
  ForwardOptions o;
  o.skip_head = true;
  model::AllToAllDispatcher fixed(w, /*fixed_shape=*/true), plain(w);
  o.experts = &plain;
  const at::Tensor expect = shard.forward(batch, o).hidden;
  fixed.set_capacity(5 * cfg.top_k + 3);  // every rank has 5 tokens
  // Each rank receives S x capacity rows; the rows expected to carry a slot (what the NVFP4 experts'
  // path choice counts) are a rank's own slot count.
  const auto routed = fixed.dispatch(at::randn({5, cfg.latent_size}), at::randint(cfg.num_experts, {5 * cfg.top_k}),
                                     cfg.top_k, cfg.num_experts / w.size());
  EXPECT_EQ(routed.rows.size(0), w.size() * (5 * cfg.top_k + 3));
  EXPECT_TRUE(routed.spare);
  EXPECT_EQ(routed.live_rows, 5 * cfg.top_k);
  o.experts = &fixed;
  EXPECT_TRUE(test::all_close(shard.forward(batch, o).hidden, expect, 1e-5, 1e-6));
  // The padding rows (most of the S x capacity each rank receives) reach no expert: the experts
  // of all ranks see exactly the slots, 5 tokens x top_k per rank and layer.
  double seen = 0;
  ForwardOptions observed = o;
  observed.observe_linear_input = [&](int64_t, const std::string& name, const at::Tensor& x) {
    if (name.find("experts") != std::string::npos && name.find("gate_proj") != std::string::npos) seen += double(x.size(0));
  };
  shard.forward(batch, observed);
  EXPECT_EQ(w.all_reduce(seen), double(w.size() * 5 * cfg.top_k * cfg.num_layers));
  ASSERT_TRUE(fixed.overflow().defined());
  EXPECT_EQ(fixed.overflow().item<int32_t>(), 0);
  fixed.set_capacity(2);  // 10 slots over the ranks: some rank gets more than 2 of them
  shard.forward(batch, o);
  EXPECT_EQ(fixed.overflow().item<int32_t>(), cfg.num_layers);  // every layer's dispatch
  fixed.clear_overflow();
  EXPECT_EQ(fixed.overflow().item<int32_t>(), 0);
  // Every slot to experts 0 and 1 (on ranks 0 and 1, or both on rank 0 at 2 ranks): 5 tokens
  // overflow a capacity of 2 there; with all but one token masked out (a decode bucket's padding)
  // the one token's slots fit, and its output is the unmasked exchange's.
  at::Tensor skew = at::zeros({5, cfg.num_layers, cfg.top_k}, at::kByte);
  skew.select(2, 1).fill_(1);
  o.replay_routing = skew;
  o.experts = &plain;
  const at::Tensor first = shard.forward(batch, o).hidden[0];
  o.experts = &fixed;
  shard.forward(batch, o);
  EXPECT_GT(fixed.overflow().item<int32_t>(), 0);
  fixed.clear_overflow();
  fixed.set_row_mask(at::tensor(std::vector<int64_t>{1, 0, 0, 0, 0}));
  const at::Tensor masked = shard.forward(batch, o).hidden;
  EXPECT_EQ(fixed.overflow().item<int32_t>(), 0);
  EXPECT_TRUE(test::all_close(masked[0], first, 1e-5, 1e-6));
}

// Every sample of `got` against one rank's `expected`: tokens and routing exactly, log-probs within
// `tol` (0: the same bits).
void expect_same_samples(const std::vector<rollout::RequestOutput>& got,
                         const std::vector<rollout::RequestOutput>& expected, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), expected.size()) << what;
  for (size_t r = 0; r < got.size(); ++r) {
    ASSERT_EQ(got[r].samples.size(), expected[r].samples.size()) << what << ": request " << r;
    for (size_t j = 0; j < got[r].samples.size(); ++j) {
      const rollout::Sample &a = expected[r].samples[j], &b = got[r].samples[j];
      const std::string where = what + ": request " + std::to_string(r) + " sample " + std::to_string(j);
      EXPECT_EQ(b.tokens, a.tokens) << where;
      EXPECT_TRUE(test::all_equal(b.routing, a.routing)) << where;
      if (tol == 0) {
        EXPECT_EQ(b.logprobs, a.logprobs) << where;
      } else {
        EXPECT_TRUE(test::all_close(at::tensor(std::vector<double>(b.logprobs.begin(), b.logprobs.end())),
                                    at::tensor(std::vector<double>(a.logprobs.begin(), a.logprobs.end())), tol, tol))
            << where;
      }
    }
  }
}

// Sharded engines step in lockstep, each serving its expert shard with requests of its own (the
// last rank none, so that it joins every step with padding or a dummy token). Pure decode steps
// run the graph step's code with its fixed-shape exchange (uncaptured on the CPU) or eagerly, and
// under a tight cache some ranks preempt; every sample equals what one rank's whole-model engine
// draws for the same request: tokens and routing exactly, log-probs to fp32 noise.
//
// At one rank (on the one-GPU machine) the same on CUDA in bf16 with captured graphs: no exchange,
// but the group's agreement and the capture, bit for bit the plain engine's.
TEST(ExpertParallel, ShardedEnginesInLockstepMatchOneRank) {
  const Group& w = Group::world();
  const bool gpu = w.size() == 1;
  if (gpu && !at::hasCUDA()) GTEST_SKIP() << "one rank has no group to step with (but a GPU checks the capture)";
  ModelConfig cfg = test::byte_vocab_config();
  cfg.init_std = 0.5;  // varied routing
  const Muse full = Muse::init(cfg, 21, gpu ? at::kBFloat16 : at::kFloat, gpu ? at::Device(at::kCUDA) : at::kCPU);
  const Muse shard = shard_experts(full, w.rank(), w.size());
  std::vector<rollout::Request> reqs;
  const int mine = gpu ? 6 : w.rank() == w.size() - 1 ? 0 : 2 + 2 * w.rank();  // uneven loads
  for (int i = 0; i < mine; ++i)
    reqs.push_back(test::request(std::vector<int64_t>(size_t(1 + (3 * i + w.rank()) % 9), 5 + 7 * i + w.rank()),
                                 1 + i % 2, 6 + 5 * ((i + w.rank()) % 4), 1.0, uint64_t(100 * w.rank() + i)));
  rollout::EngineConfig ec;
  ec.block_size = 4;
  ec.max_num_seqs = 8;
  ec.max_batch_tokens = 64;
  ec.prefill_chunk = 8;
  ec.kv_cache_bytes = 1 << 20;
  rollout::Engine roomy(full, ec);
  const auto roomy_out = roomy.generate(reqs);
  const auto st = roomy.stats();
  for (const bool graphs : {true, false})
    for (const bool tight : {false, true}) {
      rollout::EngineConfig sharded = ec;
      sharded.cuda_graphs = graphs;
      // Tight: also an exchange of one row per rank pair, which overflows and is redone eagerly.
      if (tight && !gpu) sharded.expert_capacity = 1e-6;
      sharded.uncaptured_graph_steps = graphs && !gpu;
      if (tight) sharded.kv_cache_bytes = st.window_blocks_total * st.window_block_bytes + 12 * st.full_block_bytes;
      // On the GPU the plain engine runs the same schedule (bf16 results depend on it); on the CPU
      // any schedule gives the same samples.
      std::vector<rollout::RequestOutput> same;
      if (gpu) {
        rollout::Engine plain(full, sharded);
        same = plain.generate(reqs);
      }
      const auto& expected = gpu ? same : roomy_out;
      sharded.expert_group = &w;
      rollout::Engine engine(shard, sharded);
      const auto got = engine.generate(reqs);
      const std::string what = std::string(graphs ? "graph steps" : "eager") + (tight ? ", tight cache" : "");
      EXPECT_EQ(engine.stats().graph_steps > 0, graphs && mine > 0) << what;
      if (gpu) EXPECT_EQ(engine.stats().graphs_captured > 0, graphs) << what;
      if (tight && mine > 4) EXPECT_GT(engine.stats().preemptions, 0) << what;
      const double overflows = w.all_reduce(double(engine.stats().expert_overflow_steps), comm::ReduceOp::kMax);
      if (graphs && tight && !gpu) EXPECT_GT(overflows, 0) << what;
      // At 4 ranks some steps fit even one row per rank pair (the count is reset in every step,
      // and padding rows send nothing), so fewer steps were redone than ran.
      if (graphs && tight && w.size() == 4)
        EXPECT_LT(w.all_reduce(double(engine.stats().expert_overflow_steps)),
                  w.all_reduce(double(engine.stats().graph_steps))) << what;
      if (!tight) EXPECT_EQ(overflows, 0) << what;
      expect_same_samples(got, expected, gpu ? 0 : 1e-5, what);  // one GPU: the same kernels, the same bits
    }
  rollout::EngineConfig sharded = ec;
  sharded.expert_group = &w;
  rollout::Engine engine(shard, sharded);
  EXPECT_TRUE(test::throws_with([&] { engine.step(); }, {"steps in lockstep with its group", "generate()"}));
}

// Bitwise numerics on sharded engines in lockstep, graph steps and eager: every row's arithmetic is
// its own wherever its experts run, so the samples are one rank's to the bit. On the CPU in fp32
// with the graph steps uncaptured; on CUDA in bf16 with them captured, the exchange inside.
void check_bitwise_sharded(at::Device device, at::ScalarType dtype) {
  const Group& w = Group::world();
  ModelConfig cfg = test::byte_vocab_config();
  cfg.init_std = 0.5;
  const Muse full = Muse::init(cfg, 25, dtype, device);
  std::vector<rollout::Request> reqs;
  for (int i = 0; i < 1 + w.rank(); ++i)  // uneven loads
    reqs.push_back(test::request({int64_t(4 + 13 * i + w.rank()), 9, 2}, 2, 4 + 3 * i, 1.0, uint64_t(70 * w.rank() + i)));
  rollout::EngineConfig ec;
  ec.block_size = 4;
  ec.max_num_seqs = 4;
  ec.kv_cache_bytes = 1 << 20;
  ec.numerics = model::Numerics::kBitwise;
  rollout::Engine alone(full, ec);
  const auto expected = alone.generate(reqs);
  for (const bool graphs : {true, false}) {
    rollout::EngineConfig sharded = ec;
    sharded.expert_group = &w;
    sharded.cuda_graphs = graphs;
    sharded.uncaptured_graph_steps = graphs && !device.is_cuda();
    rollout::Engine engine(shard_experts(full, w.rank(), w.size()), sharded);
    const auto got = engine.generate(reqs);
    EXPECT_EQ(engine.stats().graph_steps > 0, graphs);
    if (device.is_cuda()) EXPECT_EQ(engine.stats().graphs_captured > 0, graphs);
    expect_same_samples(got, expected, 0, graphs ? "graph steps" : "eager");
  }
}

TEST(ExpertParallel, BitwiseShardedEnginesEqualOneRankExactly) {
  if (Group::world().size() == 1) GTEST_SKIP() << "one rank has no group to step with";
  check_bitwise_sharded(at::kCPU, at::kFloat);
}

// The same on a GPU per rank: NCCL inside captured graphs. It takes two GPUs to exchange anything
// (tools/gpu_check.sh section mpigpus, mpirun -np 2); on the one-GPU machine one rank checks the
// capture alone (ctest kiln_mpi_np1_cuda).
TEST(ExpertParallel, CudaBitwiseShardedEnginesInCapturedGraphsEqualOneRank) {
#if KILN_WITH_CUDA
  const Group& w = Group::world();
  if (!at::hasCUDA() || c10::cuda::device_count() < w.size()) GTEST_SKIP() << "needs a GPU per rank";
  c10::cuda::set_device(c10::DeviceIndex(w.local_rank()));
  check_bitwise_sharded(at::Device(at::kCUDA, c10::DeviceIndex(w.local_rank())), at::kBFloat16);
#else
  GTEST_SKIP() << "a CPU build";
#endif
}

// NVFP4 and W4A4 sharded engines: each rank quantises its own experts (per-expert scales, so the
// shard's codes are the whole model's slice) and serves them in lockstep. Under NVFP4 the samples
// equal one rank's quantised whole-model engine, also after a weight sync that sends each rank
// only its shard (re-quantised in place). W4A4 also rounds the activations to 4 bits, which turns
// fp32 summation-order noise into whole code steps now and then: it must run and give finite
// log-probs, not the same bits. W4A4 with static activation scales is refused on shards: a stack's
// scales act as one, its largest, which a shard does not know.
TEST(ExpertParallel, QuantisedShardedEnginesMatchOneRank) {
  const Group& w = Group::world();
  if (w.size() == 1) GTEST_SKIP() << "one rank has no group to step with";
  ModelConfig cfg = test::byte_vocab_config();
  cfg.init_std = 0.5;
  const Muse full = Muse::init(cfg, 23, at::kFloat, at::kCPU), next = Muse::init(cfg, 24, at::kFloat, at::kCPU);
  std::vector<rollout::Request> reqs;
  for (int i = 0; i < 3; ++i)
    reqs.push_back(test::request({int64_t(3 + 11 * i + w.rank()), 7, int64_t(9 + w.rank())}, 2, 5 + 3 * i, 1.0,
                                 uint64_t(50 * w.rank() + i)));
  for (const rollout::Quantization q : {rollout::Quantization::kNvfp4, rollout::Quantization::kW4a4}) {
    rollout::EngineConfig ec;
    ec.block_size = 4;
    ec.max_num_seqs = 4;
    ec.kv_cache_bytes = 1 << 20;
    ec.quantization = q;
    rollout::Engine alone(full, ec);
    ec.expert_group = &w;
    ec.uncaptured_graph_steps = true;
    rollout::Engine sharded(shard_experts(full, w.rank(), w.size()), ec);
    for (int round = 0; round < 2; ++round) {
      const auto expected = alone.generate(reqs), got = sharded.generate(reqs);
      const std::string what = std::string(rollout::quantization_name(q)) + " round " + std::to_string(round);
      EXPECT_GT(sharded.stats().graph_steps, 0) << what;
      ASSERT_EQ(got.size(), reqs.size());
      for (size_t r = 0; r < reqs.size(); ++r) {
        EXPECT_EQ(got[r].samples.size(), size_t(reqs[r].params.n)) << what;
        for (const rollout::Sample& b : got[r].samples)
          EXPECT_TRUE(at::tensor(b.logprobs).isfinite().all().item<bool>()) << what;
      }
      if (q == rollout::Quantization::kNvfp4) expect_same_samples(got, expected, 1e-5, what);
      alone.update_weights(next.named_parameters());
      sharded.update_weights(shard_experts(next, w.rank(), w.size()).named_parameters());
    }
  }
  Muse calibrated = full.clone();
  quantize_model(calibrated, /*kernel_layout=*/false, /*drop_dense=*/false);
  calibrate_input_scales(calibrated, PackedBatch::from_sequences({{3, 5, 7, 9}}, at::kCPU));
  rollout::EngineConfig ec;
  ec.kv_cache_bytes = 1 << 20;
  ec.quantization = rollout::Quantization::kW4a4;
  ec.expert_group = &w;
  const Muse shard = shard_experts(calibrated, w.rank(), w.size());
  EXPECT_TRUE(test::throws_with([&] { rollout::Engine e(shard, ec); }, {"static activation scales", "replica"}));
}

TEST(ExpertParallel, ShardsAreTheRightSlices) {
  Muse full = Muse::init(test::byte_vocab_config(), 9, at::kFloat, at::kCPU);
  Muse s = shard_experts(full, 1, 2);
  EXPECT_TRUE(test::all_equal(s.weights().layers[0].expert_up, full.weights().layers[0].expert_up.narrow(0, 2, 2)));
  EXPECT_TRUE(s.weights().layers[0].pooler.is_same(full.weights().layers[0].pooler));
  EXPECT_TRUE(test::throws_with([&] { shard_experts(full, 0, 3); }, {"do not split evenly over 3"}));
}

// A line of /proc/self/status ("VmHWM", "VmRSS") in bytes; -1 where there is none.
int64_t status_bytes(const std::string& key) {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1)) * 1024;  // "...  123 kB"
  return -1;
}

// Resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0); false where the kernel refuses.
bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return bool(f);
}

// A 96 MiB checkpoint (16 experts of 3 MiB in each of 2 layers, a dense part under 1 MiB) written
// once for every rank, and the peak resident memory (VmHWM) a rank's load adds. Every block of
// 128 KiB or more comes straight from mmap and goes back when freed (glibc's dynamic threshold
// would otherwise keep the whole model's freed memory for the load to reuse unseen).
struct RssCheckpoint {
  ModelConfig cfg = test::byte_vocab_config();
  std::string dir;
  int64_t total = 0, experts = 0;
  std::map<std::string, int64_t> bytes;  // per in-memory name

  RssCheckpoint() {
    const Group& w = Group::world();
    cfg.latent_size = 256;
    cfg.expert_ffn_size = 1024;
    cfg.num_experts = 16;
    mallopt(M_MMAP_THRESHOLD, 128 * 1024);
    at::Tensor id = at::tensor(std::vector<int64_t>{int64_t(::getpid())});
    w.broadcast(id, 0);  // one directory for every rank (they share the machine)
    dir = "/tmp/kiln-mpi-rss-" + std::to_string(id.item<int64_t>());
    Muse whole = Muse::init_shard(cfg, 5, at::kFloat, at::kCPU, 0, 1);
    for (const auto& [name, t] : whole.named_parameters()) {
      bytes[name] = t.numel() * int64_t(t.element_size());
      total += bytes[name];
      experts += name.find("experts") != std::string::npos ? bytes[name] : 0;
    }
    if (w.rank() == 0) save_checkpoint(whole, dir);
    w.barrier();
  }
  ~RssCheckpoint() {
    Group::world().barrier();
    if (Group::world().rank() == 0) remove_tree(dir);  // not std::filesystem::remove_all (core/files.h)
  }
  // How much `load` raises the peak RSS, checked against twice `share` (the mapped pages until the
  // files close, the tensors) plus `copies` (a stacked tensor's per-expert copies beyond the 24 MiB
  // slack) plus 24 MiB, and against what a whole load and cut costs (twice the checkpoint).
  Muse check_load(const std::function<Muse()>& load, int64_t share, int64_t copies = 0) const {
    malloc_trim(0);
    EXPECT_TRUE(reset_peak_rss()) << "/proc/self/clear_refs refused the peak reset";
    const int64_t before = status_bytes("VmRSS");
    Muse m = load();
    const int64_t grew = status_bytes("VmHWM") - before;
    const std::string what = str_cat("rank ", Group::world().rank(), " of ", Group::world().size(), ": peak RSS grew by ",
                                      grew / 1048576.0, " MiB loading a share of ", share / 1048576.0,
                                      " MiB (checkpoint ", total / 1048576.0, " MiB)");
    std::printf("%s\n", what.c_str());  // the numbers docs/PERFORMANCE.md quotes
    EXPECT_LT(grew, 2 * share + copies + (int64_t(24) << 20)) << what;
    EXPECT_LT(grew, 3 * total / 2) << what << ": a whole load and cut grows by twice the checkpoint";
    return m;
  }
};

// Each rank loads its expert shard: the growth stays under twice its share; loading the whole
// checkpoint and cutting it, as before sharded loading, fails both bounds at 2 and 4 ranks.
TEST(ExpertParallel, ShardedLoadHoldsOnlyTheRanksShare) {
  const Group& w = Group::world();
  const int W = w.size();
  if (W == 1) GTEST_SKIP() << "the share is the whole checkpoint at one rank";
  const RssCheckpoint ck;
  ASSERT_GT(ck.experts, ck.total * 9 / 10) << "the experts must dominate the checkpoint for the bound to mean anything";
  const Muse shard = ck.check_load([&] { return load_checkpoint_shard(ck.dir, at::kFloat, at::kCPU, w.rank(), W); },
                                   (ck.total - ck.experts) + ck.experts / W);
  EXPECT_EQ(shard.weights().layers[0].expert_up.size(0), ck.cfg.num_experts / W);
}

// ZeRO-3 at ep 1 (what kiln train reads for parallel.dense: zero3): each rank reads only the
// tensors it owns, whole, and its peak grows by about its share.
TEST(ExpertParallel, ZeroThreeLoadHoldsOnlyTheOwnedTensors) {
  const Group& w = Group::world();
  const int W = w.size();
  if (W == 1) GTEST_SKIP() << "the share is the whole checkpoint at one rank";
  const RssCheckpoint ck;
  const auto owner = parallel::Zero3::owners(Muse::shapes(ck.cfg, at::kFloat), W, [](const std::string&) { return true; });
  const auto keep = [&](const std::string& name) { return owner.at(name) == w.rank(); };
  int64_t share = 0, largest = 0;
  for (const auto& [name, b] : ck.bytes)
    if (keep(name)) share += b, largest = std::max(largest, b);
  // A whole expert stack is read at once here: its per-expert copies (up to the largest tensor) count.
  const Muse part =
      ck.check_load([&] { return load_checkpoint_owned(ck.dir, at::kFloat, at::kCPU, 0, 1, keep); }, share, largest);
  int64_t held = 0;
  for (const auto& [name, t] : part.named_parameters()) held += t.numel() * int64_t(t.element_size());
  EXPECT_EQ(held, share);
  EXPECT_EQ(int64_t(w.all_reduce(double(held))), ck.total) << "every tensor read by exactly one rank";
}

}  // namespace
}  // namespace kiln::model
