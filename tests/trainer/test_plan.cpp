// The memory plan (trainer/plan.h): each item against the arithmetic done here from the parameter
// counts, layouts that cannot exist, the state placements, LoRA, recompute, the training peak, the
// plan against the peaks the H200 measured, the 816B plans the README quotes, and context
// parallelism's share of the activations and its key-value gathers.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "model/config.h"
#include "model/nvfp4_model.h"
#include "tests/test_util.h"
#include "trainer/grpo.h"
#include "trainer/plan.h"

namespace kiln::trainer {
namespace {

model::ModelConfig small() { return model::ModelConfig::from_yaml_file(test::source_path("configs/muse-small.yaml")); }
model::ModelConfig big() {
  return model::ModelConfig::from_yaml_file(test::source_path("configs/muse-spark-open-816b.yaml"));
}

double item(const Plan& p, const std::string& prefix) {
  for (const PlanItem& i : p.gpu)
    if (i.what.rfind(prefix, 0) == 0) return i.bytes;
  return -1;
}

// The README's 816B job: one 5,120-token sequence per micro-batch, layers recomputed, an NVFP4
// rollout on each rank's expert shard, a 16 GiB KV cache.
PlanJob readme_816b_job() {
  PlanJob job;
  job.micro_batch_seqs = 1;
  job.seq_len = 5120;
  job.recompute = true;
  job.rollout_quantization = "nvfp4";
  job.rollout_sharded = true;
  job.kv_cache_bytes = 16.0 * (1ll << 30);
  return job;
}

Cluster one_gpu() {
  Cluster c;
  c.nodes = 1;
  c.gpus_per_node = 1;
  return c;
}

TEST(Plan, ItemsFollowFromTheParameterCounts) {
  const model::ModelConfig cfg = small();
  const model::ParamCounts n = model::count_parameters(cfg);
  PlanJob job;  // bf16, Muon, fp32 masters and moments, state on the device
  Cluster c = one_gpu();
  c.gpus_per_node = 4;
  const Plan p = make_plan(cfg, job, c, {2, 2, 1, DenseSharding::kReplicated});
  ASSERT_TRUE(p.fits()) << p.report();
  const double experts = double(n.experts), dense = double(n.total() - n.experts);
  EXPECT_DOUBLE_EQ(item(p, "expert weights"), experts / 2 * 2);
  EXPECT_LT(item(p, "the other ranks' experts"), 0);  // each rank holds only its share
  // The engine's own bf16 copy of what it serves: every expert for a replica, 1/ep when sharded.
  EXPECT_DOUBLE_EQ(item(p, "rollout weights (bf16 replica)"), (experts + dense) * 2);
  PlanJob sharded = job;
  sharded.rollout_sharded = true;
  EXPECT_DOUBLE_EQ(item(make_plan(cfg, sharded, c, {2, 2, 1, DenseSharding::kReplicated}), "rollout weights (bf16 shard)"),
                   (experts / 2 + dense) * 2);
  // An NVFP4 replica holds what `kiln quantize` writes: codes and scales, the rest at its width.
  PlanJob nvfp4 = job;
  nvfp4.rollout_quantization = "nvfp4";
  const Plan q = make_plan(cfg, nvfp4, c, {2, 2, 1, DenseSharding::kReplicated});
  EXPECT_NEAR(item(q, "rollout nvfp4 weights (replica)") + item(q, "rollout weights kept"),
              double(model::nvfp4_footprint(cfg, true).bytes), 1.0);
  EXPECT_DOUBLE_EQ(item(p, "dense weights"), dense * 2);
  EXPECT_DOUBLE_EQ(item(p, "gradients"), (experts / 2 + dense) * 2);
  // Masters 4 B for all; Muon one fp32 moment (experts, attention, latent), AdamW two (the rest).
  const double muon = double(n.experts + n.attention + n.latent), adamw = double(n.total()) - muon;
  EXPECT_DOUBLE_EQ(item(p, "optimizer state"), (4.0 * double(n.total()) + 4 * muon + 8 * adamw) / 4);
  double sum = 0;
  for (const PlanItem& i : p.gpu) sum += i.bytes;
  EXPECT_DOUBLE_EQ(p.gpu_used, sum);
  EXPECT_DOUBLE_EQ(p.kv_left, c.gpu_bytes - c.reserve_bytes - sum);
  const double kv_token = model::kv_cache_bytes_per_token(cfg, job.seq_len);
  EXPECT_EQ(p.kv_tokens, int64_t(p.kv_left / kv_token));
  // ZeRO-3 splits the dense part and its gradients.
  const Plan z = make_plan(cfg, job, c, {2, 2, 1, DenseSharding::kZero3});
  EXPECT_DOUBLE_EQ(item(z, "dense weights"), dense / 4 * 2);
  EXPECT_DOUBLE_EQ(item(z, "gradients"), (experts / 2 + dense / 4) * 2);
  EXPECT_TRUE(z.layout.implemented());  // ZeRO-3 trains (parallel/zero3.h); dense tp does not
  EXPECT_TRUE(p.layout.implemented());
}

TEST(Plan, ImpossibleLayoutsAreNamed) {
  const model::ModelConfig cfg = small();  // 64 experts, 16 q and 2 kv heads
  Cluster c = one_gpu();
  c.gpus_per_node = 6;
  const Plan a = make_plan(cfg, PlanJob{}, c, {2, 3, 1, DenseSharding::kReplicated});
  ASSERT_FALSE(a.fits());
  EXPECT_NE(a.problems[0].find("ep 3 does not divide the 64 experts"), std::string::npos) << a.problems[0];
  const Plan b = make_plan(cfg, PlanJob{}, c, {1, 2, 1, DenseSharding::kReplicated});
  EXPECT_NE(b.problems[0].find("is not the cluster's 6 GPUs"), std::string::npos) << b.problems[0];
  c.gpus_per_node = 4;
  const Plan t = make_plan(cfg, PlanJob{}, c, {1, 1, 4, DenseSharding::kTensor});
  EXPECT_NE(t.problems[0].find("tp 4 must divide"), std::string::npos) << t.problems[0];
  EXPECT_FALSE(t.layout.implemented());
}

TEST(Plan, PlacementsLoraAndRecomputeMoveTheRightBytes) {
  const model::ModelConfig cfg = small();
  const Cluster c = one_gpu();
  const Layout l{1, 1, 1, DenseSharding::kReplicated};
  PlanJob job;
  const Plan device = make_plan(cfg, job, c, l);
  job.state_placement = "cpu";
  const Plan host = make_plan(cfg, job, c, l);
  EXPECT_LT(item(host, "optimizer state"), 0);
  EXPECT_DOUBLE_EQ(item(host, "optimizer chunk buffers"), 2 * job.chunk_bytes);
  ASSERT_EQ(host.host.size(), 1u);
  EXPECT_DOUBLE_EQ(host.host[0].bytes, item(device, "optimizer state"));
  job.state_placement = "nvme";
  const Plan nvme = make_plan(cfg, job, c, l);  // the cluster has no NVMe
  ASSERT_EQ(nvme.nvme.size(), 1u);
  EXPECT_FALSE(nvme.fits());
  EXPECT_NE(nvme.problems.back().find("NVMe: needs"), std::string::npos);

  job = PlanJob{};
  job.recompute = true;
  const Plan rc = make_plan(cfg, job, c, l);
  EXPECT_LT(rc.gpu_used, device.gpu_used);
  // Recompute keeps every layer's input instead of its activations (micro-batches accumulate here:
  // the item is the activations whole).
  const double tokens = double(job.micro_batch_seqs * job.seq_len), layer = layer_activation_bytes_per_token(cfg);
  EXPECT_NEAR(device.gpu_used - rc.gpu_used,
              tokens * double(cfg.num_layers) * layer - tokens * (double(cfg.num_layers) * 2.0 * double(cfg.hidden_size) + layer),
              1.0);

  job = PlanJob{};
  job.lora = true;
  job.lora_rank = 8;
  job.lora_targets = {"q_proj", "gate_proj"};
  const Plan lo = make_plan(cfg, job, c, l);
  const double expert_adapters = double(cfg.num_layers * cfg.num_experts * 8 * (cfg.latent_size + cfg.expert_ffn_size));
  const double q_adapters = double(cfg.num_layers * 8 * (cfg.hidden_size + cfg.q_size()));
  EXPECT_DOUBLE_EQ(item(lo, "LoRA adapters on the experts"), expert_adapters * 2);
  EXPECT_DOUBLE_EQ(item(lo, "LoRA adapters on the dense part"), q_adapters * 2);
  EXPECT_DOUBLE_EQ(item(lo, "gradients (adapters)"), (expert_adapters + q_adapters) * 2);
  // Masters and AdamW's two moments: adapters train with AdamW, as PEFT trains them.
  EXPECT_DOUBLE_EQ(item(lo, "optimizer state"), (expert_adapters + q_adapters) * (4 + 8));
  // A LoRA replica at ep 1 serves the frozen base itself: no second copy of the weights.
  EXPECT_LT(item(lo, "rollout weights"), 0);

  Cluster tiny = c;
  tiny.gpu_bytes = 8.0 * (1ll << 30);
  const Plan over = make_plan(cfg, PlanJob{}, tiny, l);
  ASSERT_FALSE(over.fits());
  EXPECT_NE(over.problems[0].find("short by"), std::string::npos) << over.problems[0];
  EXPECT_NE(over.report().find("does not fit"), std::string::npos);
}

// grpo.async.placement split: the training GPU holds no engine and no KV cache; the rollout rank
// holds the engine's copy and the KV cache.
TEST(Plan, SplitRolloutRanksHoldTheEngineAndTheKvCache) {
  const model::ModelConfig cfg = small();
  const model::ParamCounts n = model::count_parameters(cfg);
  const Cluster c = one_gpu();
  const Layout l{1, 1, 1, DenseSharding::kReplicated};
  PlanJob job;
  const Plan together = make_plan(cfg, job, c, l);
  job.rollout_split = true;
  const Plan apart = make_plan(cfg, job, c, l);
  ASSERT_TRUE(apart.fits()) << apart.report();
  const double whole = double(n.total()) * 2;  // bf16
  EXPECT_NEAR(apart.gpu_used, together.gpu_used - item(together, "rollout weights (bf16 replica)"), 1.0);
  EXPECT_LT(item(apart, "rollout weights"), 0);
  ASSERT_EQ(apart.rollout_gpu.size(), 1u) << apart.report();
  EXPECT_DOUBLE_EQ(apart.rollout_gpu_used, whole);  // the engine's copy
  EXPECT_DOUBLE_EQ(apart.kv_left, c.gpu_bytes - c.reserve_bytes - whole);
  EXPECT_NE(apart.report().find("per rollout rank"), std::string::npos);
  // A KV cache that fits beside the engine alone: refused together, accepted apart.
  job.kv_cache_bytes = c.gpu_bytes - c.reserve_bytes - whole - (1 << 20);
  EXPECT_TRUE(make_plan(cfg, job, c, l).fits());
  job.rollout_split = false;
  EXPECT_FALSE(make_plan(cfg, job, c, l).fits());
  // Too big even for a rollout rank: named.
  job.rollout_split = true;
  job.kv_cache_bytes = c.gpu_bytes;
  const Plan over = make_plan(cfg, job, c, l);
  ASSERT_FALSE(over.fits());
  EXPECT_NE(over.problems[0].find("rollout rank's GPU"), std::string::npos) << over.problems[0];
  // Only the layouts the split trains are searched: ep 1, the dense part replicated.
  Cluster eight = c;
  eight.gpus_per_node = 8;
  job = PlanJob{};
  job.rollout_split = true;
  const std::vector<Plan> layouts = search_layouts(cfg, job, eight);
  ASSERT_FALSE(layouts.empty());
  for (const Plan& p : layouts) {
    EXPECT_EQ(p.layout.ep, 1) << p.layout.describe();
    EXPECT_EQ(p.layout.dense, DenseSharding::kReplicated) << p.layout.describe();
  }
}

// The plan against the peaks an H200 measured (tools/gpu_check.sh calibrate;
// docs/PERFORMANCE.md): muse-small GRPO steps of 16 prompts x 8 samples, sequences of 22 tokens,
// a 2 GiB KV cache, in micro-batches of 128 or 64 sequences.
TEST(Plan, WithinTenPercentOfTheMeasuredPeaks) {
  struct Case {
    const char* name;
    bool lora;
    optimizers::Placement placement;
    int64_t micro;
    rollout::Quantization quantization;
    double measured_gib;
  };
  const Case cases[] = {
      {"bf16", false, optimizers::Placement::kDevice, 128, rollout::Quantization::kNone, 26.42},
      {"bf16, micro-batches of 64", false, optimizers::Placement::kDevice, 64, rollout::Quantization::kNone, 27.63},
      {"LoRA", true, optimizers::Placement::kDevice, 128, rollout::Quantization::kNone, 10.97},
      {"LoRA, micro-batches of 64", true, optimizers::Placement::kDevice, 64, rollout::Quantization::kNone, 9.54},
      {"state in CPU memory", false, optimizers::Placement::kHost, 128, rollout::Quantization::kNone, 10.19},
      {"state on NVMe", false, optimizers::Placement::kNvme, 128, rollout::Quantization::kNone, 10.19},
      {"NVFP4 rollout", false, optimizers::Placement::kDevice, 128, rollout::Quantization::kNvfp4, 28.37},
  };
  for (const Case& k : cases) {
    GrpoConfig g;
    g.prompts_per_step = 16;
    g.samples_per_prompt = 8;
    g.micro_batch_seqs = k.micro;
    g.optim.state = k.placement;
    g.engine.quantization = k.quantization;
    g.engine.kv_cache_bytes = 2ll << 30;
    if (k.lora) g.lora = model::LoraConfig{32, 64};
    PlanJob job = plan_job(g, "bf16");
    job.seq_len = 22;
    const Plan p = make_plan(small(), job, one_gpu(), {1, 1, 1, DenseSharding::kReplicated});
    const double planned = (p.gpu_used + job.kv_cache_bytes) / double(1ll << 30);
    EXPECT_NEAR(planned / k.measured_gib, 1.0, 0.1) << k.name << ": planned " << planned << " GiB\n" << p.report();
  }
  // The layer's count also stays within 10% of `kiln bench train` on the full-width layer (409 KB
  // per token, the head's logits subtracted).
  model::ModelConfig full =
      model::ModelConfig::from_yaml_file(test::source_path("configs/muse-full-layer.yaml"));
  EXPECT_NEAR(layer_activation_bytes_per_token(full) / 409.3e3, 1.0, 0.1);
}

// The training peak's item: one micro-batch's backward beside gradients that fill as activations
// free, several micro-batches' beside all of them, or the optimizer step's temporaries where those
// are higher (device Muon, tiny activations).
TEST(Plan, TheTrainingPeakIsTheBackwardsOrTheOptimizers) {
  const model::ModelConfig cfg = small();
  const Layout l{1, 1, 1, DenseSharding::kReplicated};
  PlanJob job;
  job.seq_len = 1024;
  job.micro_batch_seqs = 8;
  job.prompts_per_step = 2;
  job.samples_per_prompt = 8;  // two micro-batches: the second backward runs beside every gradient
  const Plan two = make_plan(cfg, job, one_gpu(), l);
  job.prompts_per_step = 1;  // one
  const Plan one = make_plan(cfg, job, one_gpu(), l);
  const double two_acts = item(two, "activations at the backward's peak"), grads = item(one, "gradients");
  ASSERT_GT(two_acts, 0) << two.report();
  EXPECT_NE(item(one, "activations at the backward's peak, micro-batches of 8192 tokens, beside the gradients"), -1)
      << one.report();
  EXPECT_NEAR(item(one, "activations at the backward's peak"), std::max(two_acts - grads, two_acts / 8), 1.0);
  EXPECT_LT(one.gpu_used, two.gpu_used);
  // Eight 22-token sequences: Muon's temporaries on the largest expert stack are the peak.
  job.seq_len = 22;
  const Plan tiny = make_plan(cfg, job, one_gpu(), l);
  EXPECT_DOUBLE_EQ(item(tiny, "the optimizer step's temporaries"),
                   16.0 * double(cfg.num_experts * cfg.expert_ffn_size * cfg.latent_size))
      << tiny.report();
  EXPECT_LT(item(tiny, "activations"), 0);
  // What one rank trains in one mini-step bounds the micro-batch: 4 prompts x 2 samples over 4
  // ranks are 2 sequences each.
  Cluster four = one_gpu();
  four.gpus_per_node = 4;
  job.seq_len = 1024;
  job.prompts_per_step = 4;
  job.samples_per_prompt = 2;
  const Plan shared = make_plan(cfg, job, four, {1, 4, 1, DenseSharding::kReplicated});
  EXPECT_NE(item(shared, "activations at the backward's peak, micro-batches of 2048 tokens, beside"), -1)
      << shared.report();
  // Each rank holds a contiguous block of prompts and each mini-step a contiguous range of the
  // step's sequences: 128 prompts x 8 over 8 ranks in 8 mini-steps give rank 0 all 128 sequences of
  // the first mini-step, two micro-batches of 64 that accumulate (not 1024 / 8 / 8 = 16 sequences).
  Cluster eight = one_gpu();
  eight.gpus_per_node = 8;
  job.prompts_per_step = 128;
  job.samples_per_prompt = 8;
  job.mini_steps = 8;
  job.micro_batch_seqs = 64;
  const Plan blocks = make_plan(cfg, job, eight, {1, 8, 1, DenseSharding::kReplicated});
  EXPECT_NE(item(blocks, "activations at the backward's peak, micro-batches of 65536 tokens ("), -1) << blocks.report();
}

// The README's plans: 816B full-parameter GRPO first fits on 16 nodes of 8 H200s (ep 128, the
// dense part under ZeRO-3), LoRA GRPO on 4.
TEST(Plan, The816bPlansOfTheReadme) {
  const model::ModelConfig cfg = big();
  const PlanJob job = readme_816b_job();
  auto fewest = [&](const PlanJob& j) {
    for (int64_t nodes = 1; nodes <= 64; ++nodes) {
      Cluster c;
      c.nodes = nodes;
      for (const Plan& p : search_layouts(cfg, j, c))
        if (p.fits()) return nodes;
    }
    return int64_t(-1);
  };
  EXPECT_EQ(fewest(job), 16);
  PlanJob lora = job;
  lora.lora = true;
  lora.lora_rank = 32;
  lora.lora_targets = {"q_proj", "k_proj", "v_proj", "o_proj", "pooler", "unpooler", "gate_proj", "up_proj", "down_proj"};
  EXPECT_EQ(fewest(lora), 4);
}

// parallel.rollout: auto takes a replica where one fits, else the expert shard where that fits and
// the recipe allows it; the report says which and why.
TEST(Plan, AutoRolloutTakesAReplicaWhereOneFitsElseTheShard) {
  PlanJob job;
  job.rollout_auto = true;
  Cluster four = one_gpu();
  four.gpus_per_node = 4;
  const Plan small_plan = make_plan(small(), job, four, {2, 2, 1, DenseSharding::kReplicated});
  EXPECT_TRUE(small_plan.fits());
  EXPECT_FALSE(small_plan.rollout_sharded);
  EXPECT_NE(small_plan.report().find("rollout: auto: a replica fits"), std::string::npos) << small_plan.report();
  // 816B on 16 nodes, where the README's sharded plan fits: a replica cannot.
  const model::ModelConfig cfg = big();
  const PlanJob sharded = readme_816b_job();
  Cluster c;
  c.nodes = 16;
  const std::vector<Plan> plans = search_layouts(cfg, sharded, c);
  ASSERT_TRUE(!plans.empty() && plans.front().fits());
  const Layout L = plans.front().layout;
  PlanJob automatic = sharded;
  automatic.rollout_sharded = false;
  automatic.rollout_auto = true;
  const Plan picked = make_plan(cfg, automatic, c, L);
  EXPECT_TRUE(picked.fits()) << picked.report();
  EXPECT_TRUE(picked.rollout_sharded);
  EXPECT_DOUBLE_EQ(picked.gpu_used, plans.front().gpu_used);
  EXPECT_NE(picked.rollout_choice.find("sharded, since a replica does not fit"), std::string::npos) << picked.rollout_choice;
  // Async rollouts need a replica: then the plan is the replica's, which does not fit.
  automatic.rollout_shard_allowed = false;
  const Plan replica = make_plan(cfg, automatic, c, L);
  EXPECT_FALSE(replica.fits());
  EXPECT_FALSE(replica.rollout_sharded);
  EXPECT_NE(replica.rollout_choice.find("async rollouts"), std::string::npos) << replica.rollout_choice;
  // What the recipe says decides that: async rollouts and environments need a replica; an NVFP4
  // rollout may be sharded.
  GrpoConfig g;
  g.parallel.rollout = parallel::RolloutPlacement::kAuto;
  EXPECT_TRUE(plan_job(g, "bf16").rollout_shard_allowed);
  g.engine.quantization = rollout::Quantization::kNvfp4;
  EXPECT_TRUE(plan_job(g, "bf16").rollout_shard_allowed);
  g.engine.quantization = rollout::Quantization::kNone;
  g.async = AsyncConfig{1};
  EXPECT_FALSE(plan_job(g, "bf16").rollout_shard_allowed);
}

// cp ranks share a micro-batch split by tokens: the per-token activations divide by cp, a full layer
// gathers the whole micro-batch's keys and values, and the weights, gradients and optimizer state
// are those of as many data ranks.
TEST(Plan, ContextParallelSplitsTheTokensAndGathersKeysAndValues) {
  const model::ModelConfig cfg = small();  // 8 layers: 2 full, 6 with a 2048-token window
  Cluster two = one_gpu();
  two.gpus_per_node = 2;
  PlanJob job;  // micro-batches of 64 sequences of 1024 tokens that accumulate
  job.recompute = true;
  const Plan dp = make_plan(cfg, job, two, {2, 1, 1, DenseSharding::kReplicated});
  const Plan cp = make_plan(cfg, job, two, {2, 1, 1, DenseSharding::kReplicated, 2});
  ASSERT_TRUE(dp.problems.empty() || dp.gpu_used > 0) << dp.report();
  ASSERT_TRUE(cp.problems.empty() || cp.gpu_used > 0) << cp.report();
  EXPECT_EQ(dp.layout.describe(), "dp 2 x ep 1 x tp 1, dense replicated");
  EXPECT_EQ(cp.layout.describe(), "dp 2 x ep 1 x tp 1, cp 2, dense replicated");
  EXPECT_TRUE(cp.layout.implemented());
  EXPECT_TRUE((Layout{1, 1, 1, DenseSharding::kZero3, 2}.implemented()));
  for (const char* what : {"expert weights", "dense weights", "gradients", "optimizer state"})
    EXPECT_DOUBLE_EQ(item(cp, what), item(dp, what)) << what;
  // Per token: half of the 65,536 tokens. The fixed workspace and the head's one chunk of logit
  // gradients (2048 rows: both ranks hold more tokens than that) stay.
  const double fixed = 0.63 * double(1ll << 30) + 2048.0 * 2.0 * double(cfg.vocab_size);
  const double whole = item(dp, "activations at the backward's peak, micro-batches of 65536 tokens (");
  const double half = item(cp, "activations at the backward's peak, micro-batches of 65536 tokens, cp 2: 32768 per rank (");
  ASSERT_GT(whole, 0) << dp.report();
  ASSERT_GT(half, 0) << cp.report();
  EXPECT_NEAR(half - fixed, (whole - fixed) / 2, 1.0);
  // One full layer's gather of the whole micro-batch's keys and values, and their gradient.
  const double row = 2.0 * double(cfg.kv_size()) * 2;  // bf16 key and value
  EXPECT_DOUBLE_EQ(item(cp, "cp K/V gather (one full layer"), 2 * 65536 * row);
  EXPECT_LT(item(dp, "cp K/V"), 0);
  EXPECT_DOUBLE_EQ(dp.activations, whole);
  EXPECT_DOUBLE_EQ(cp.activations, half + item(cp, "cp K/V"));
  EXPECT_NEAR(dp.gpu_used - cp.gpu_used, whole - cp.activations, 1.0);
  // Without recompute every layer keeps its gather. Each sequence is cut into 4 chunks of 256:
  // rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (one piece); chunk 3 ends the sequence, so
  // a window layer's halo is 256 + 512 rows a sequence.
  job.recompute = false;
  const Plan kept = make_plan(cfg, job, two, {2, 1, 1, DenseSharding::kReplicated, 2});
  EXPECT_DOUBLE_EQ(item(kept, "cp K/V gathers kept for the backward"),
                   (2 * 65536.0 + 6 * 64.0 * (256 + 512) + 65536) * row)
      << kept.report();
  // The data shards are world / cp: 2 prompts x 8 samples are one micro-batch of 8 on each of two
  // data ranks, but two micro-batches that accumulate on one cp group.
  job.prompts_per_step = 2;
  job.samples_per_prompt = 8;
  job.micro_batch_seqs = 8;
  EXPECT_GT(item(make_plan(cfg, job, two, {2, 1, 1, DenseSharding::kReplicated}),
                 "activations at the backward's peak, micro-batches of 8192 tokens, beside the gradients"),
            0);
  EXPECT_GT(item(make_plan(cfg, job, two, {2, 1, 1, DenseSharding::kReplicated, 2}),
                 "activations at the backward's peak, micro-batches of 8192 tokens, cp 2: 4096 per rank ("),
            0);
  // cp folds over ep: two ranks each with half the experts and half the tokens.
  const Plan folded = make_plan(cfg, job, two, {1, 2, 1, DenseSharding::kReplicated, 2});
  const Plan ep_only = make_plan(cfg, job, two, {1, 2, 1, DenseSharding::kReplicated});
  EXPECT_TRUE(folded.problems.empty() || folded.gpu_used > 0) << folded.report();
  EXPECT_DOUBLE_EQ(item(folded, "expert weights"), item(ep_only, "expert weights"));
  EXPECT_LT(folded.activations, ep_only.activations);
  const Plan odd = make_plan(cfg, job, two, {2, 1, 1, DenseSharding::kReplicated, 3});
  ASSERT_FALSE(odd.fits());
  EXPECT_NE(odd.problems[0].find("cp 3 does not divide the cluster's 2 GPUs"), std::string::npos) << odd.problems[0];
}

// The search tries cp over powers of two while each rank keeps at least 2 tokens of a sequence,
// and takes cp where the memory needs it: among layouts that fit, the smaller cp first.
TEST(Plan, SearchTriesContextParallelOnLongEnoughSequences) {
  const model::ModelConfig cfg = small();
  Cluster eight = one_gpu();
  eight.gpus_per_node = 8;
  PlanJob job;
  job.seq_len = 4;  // cp 1 and 2; cp 4 would cut a sequence into 8 chunks
  std::set<int64_t> cps;
  for (const Plan& p : search_layouts(cfg, job, eight)) {
    cps.insert(p.layout.cp);
    EXPECT_EQ(p.layout.dp * p.layout.ep * p.layout.tp, 8) << p.layout.describe();
    EXPECT_EQ(8 % p.layout.cp, 0) << p.layout.describe();
  }
  EXPECT_EQ(cps, (std::set<int64_t>{1, 2}));
  const Plan short_seqs = make_plan(cfg, job, eight, {8, 1, 1, DenseSharding::kReplicated, 4});
  ASSERT_FALSE(short_seqs.fits());
  EXPECT_NE(short_seqs.problems[0].find("cp 4 cuts each 4-token sequence into 8 chunks"), std::string::npos)
      << short_seqs.problems[0];
  // Sequences of 64K tokens: on GPUs between what cp 1 and the best cp need, only cp fits.
  job.seq_len = 65536;
  job.micro_batch_seqs = 1;
  job.recompute = true;
  double least_cp1 = 1e300, least_cp = 1e300;
  cps.clear();
  for (const Plan& p : search_layouts(cfg, job, eight)) {
    cps.insert(p.layout.cp);
    double& least = p.layout.cp == 1 ? least_cp1 : least_cp;
    least = std::min(least, p.gpu_used);
  }
  EXPECT_EQ(cps, (std::set<int64_t>{1, 2, 4, 8}));
  ASSERT_LT(least_cp, least_cp1);
  eight.gpu_bytes = eight.reserve_bytes + job.kv_cache_bytes + (least_cp + least_cp1) / 2;
  const std::vector<Plan> plans = search_layouts(cfg, job, eight);
  ASSERT_TRUE(!plans.empty() && plans.front().fits());
  EXPECT_GT(plans.front().layout.cp, 1) << plans.front().report();
  for (size_t i = 1; i < plans.size() && plans[i].fits(); ++i) {
    EXPECT_GT(plans[i].layout.cp, 1) << plans[i].layout.describe();
    if (plans[i].layout.implemented() == plans[i - 1].layout.implemented())
      EXPECT_GE(plans[i].layout.cp, plans[i - 1].layout.cp) << plans[i].layout.describe();
  }
}

TEST(Plan, SizesParseWithUnits) {
  EXPECT_DOUBLE_EQ(parse_bytes("141GiB", "x"), 141.0 * (1ll << 30));
  EXPECT_DOUBLE_EQ(parse_bytes("2 TB", "x"), 2e12);
  EXPECT_DOUBLE_EQ(parse_bytes("512mib", "x"), 512.0 * (1 << 20));
  EXPECT_DOUBLE_EQ(parse_bytes("0", "x"), 0);
  EXPECT_TRUE(test::throws_with([] { parse_bytes("12 parsecs", "plan: --gpu-mem"); },
                                {"plan: --gpu-mem", "unknown unit 'parsecs'"}));
  EXPECT_TRUE(test::throws_with([] { parse_bytes("lots", "plan: --host-mem"); }, {"plan: --host-mem", "not a size"}));
  EXPECT_TRUE(test::throws_with([] { parse_bytes("-3GB", "plan: --nvme"); }, {"non-negative"}));
  EXPECT_EQ(format_bytes(1536.0), "1.50 KiB");
}

}  // namespace
}  // namespace kiln::trainer
