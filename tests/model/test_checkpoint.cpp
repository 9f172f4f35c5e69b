// Muse checkpoints: HF names and dtypes, save/load round trips (single and sharded), seeded init,
// expert-sharded init and load, and clear errors for missing, unexpected and mis-shaped tensors.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "core/safetensors.h"
#include "model/checkpoint.h"
#include "model/expert_parallel.h"
#include "tests/model/reference.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using model::Muse;

using test::error_of;

model::ForwardOutput run(const Muse& m) {
  model::ForwardOptions opt;
  opt.return_logits = true;
  return m.forward(model::PackedBatch::from_sequences({{1, 2, 3, 4}, {5, 6, 7}}, m.device()), opt);
}

TEST(Checkpoint, HfNamesShapesAndDtypes) {
  model::ModelConfig cfg = test::micro_config();
  cfg.dtype = "bfloat16";
  Muse m = Muse::init(cfg, 1, at::kFloat, at::kCPU);
  test::TempDir dir;
  model::save_checkpoint(m, dir.path());
  auto ck = safetensors::Checkpoint::open(dir.path());
  const auto& router = ck.info("model.layers.1.mlp.router.weight");
  EXPECT_EQ(router.dtype, safetensors::DType::F32);
  EXPECT_EQ(router.shape, (std::vector<int64_t>{4, 8}));
  const auto& gate = ck.info("model.layers.0.mlp.experts.3.gate_proj.weight");
  EXPECT_EQ(gate.dtype, safetensors::DType::BF16);
  EXPECT_EQ(gate.shape, (std::vector<int64_t>{6, 4}));
  EXPECT_EQ(ck.info("model.layers.0.mlp.experts.3.down_proj.weight").shape, (std::vector<int64_t>{4, 6}));
  EXPECT_EQ(ck.info("model.layers.0.mlp.experts.0.norm.weight").shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(ck.info("model.layers.0.mlp.pooler.weight").shape, (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(ck.info("model.layers.0.mlp.unpooler.weight").shape, (std::vector<int64_t>{8, 4}));
  EXPECT_EQ(ck.info("model.layers.1.self_attn.k_proj.weight").shape, (std::vector<int64_t>{4, 8}));
  EXPECT_TRUE(ck.contains("model.layers.1.pre_moe_layernorm.weight"));
  EXPECT_TRUE(ck.contains("lm_head.weight"));
  // 3 global + 2 layers x (11 non-expert + 4 experts x 4 tensors)
  EXPECT_EQ(ck.names().size(), 3u + 2u * (11u + 16u));
  EXPECT_TRUE(std::filesystem::exists(dir / "config.json"));
}

TEST(Checkpoint, RoundTripIsExactSingleAndSharded) {
  Muse m = Muse::init(test::micro_config(), 2, at::kFloat, at::kCPU);
  auto before = run(m);
  for (uint64_t shard : {uint64_t(5) << 30, uint64_t(600)}) {
    test::TempDir dir;
    model::save_checkpoint(m, dir.path(), shard);
    if (shard < 1000) EXPECT_TRUE(std::filesystem::exists(dir / "model.safetensors.index.json"));
    Muse back = model::load_checkpoint(dir.path(), at::kFloat, at::kCPU);
    auto a = m.named_parameters(), b = back.named_parameters();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].first, b[i].first);
      EXPECT_TRUE(test::all_equal(a[i].second, b[i].second)) << a[i].first;
    }
    auto after = run(back);
    EXPECT_TRUE(test::all_equal(after.logits, before.logits));
    EXPECT_TRUE(test::all_equal(after.routing, before.routing));
  }
}

TEST(Checkpoint, InitIsSeededPerTensor) {
  Muse a = Muse::init(test::micro_config(), 5, at::kFloat, at::kCPU);
  Muse b = Muse::init(test::micro_config(), 5, at::kFloat, at::kCPU);
  Muse c = Muse::init(test::micro_config(), 6, at::kFloat, at::kCPU);
  EXPECT_TRUE(test::all_equal(a.weights().layers[1].expert_up, b.weights().layers[1].expert_up));
  EXPECT_FALSE(at::equal(a.weights().layers[1].expert_up, c.weights().layers[1].expert_up));
  // Experts are drawn independently: expert 0 of layer 0 differs from expert 1.
  EXPECT_FALSE(at::equal(a.weights().layers[0].expert_gate[0], a.weights().layers[0].expert_gate[1]));
  // Changing the number of experts leaves the shared experts' weights alone (sharding-stable).
  model::ModelConfig more = test::micro_config();
  more.num_experts = 6;
  Muse d = Muse::init(more, 5, at::kFloat, at::kCPU);
  EXPECT_TRUE(test::all_equal(d.weights().layers[0].expert_gate.narrow(0, 0, 4), a.weights().layers[0].expert_gate));
}

// Every tensor of a and b, by name, bitwise.
::testing::AssertionResult same_model(const Muse& a, const Muse& b) {
  auto na = a.named_parameters(), nb = b.named_parameters();
  if (na.size() != nb.size()) return ::testing::AssertionFailure() << na.size() << " vs " << nb.size() << " tensors";
  for (size_t i = 0; i < na.size(); ++i) {
    if (na[i].first != nb[i].first) return ::testing::AssertionFailure() << na[i].first << " vs " << nb[i].first;
    auto r = test::all_equal(na[i].second, nb[i].second);
    if (!r) return r << " (" << na[i].first << ")";
  }
  return ::testing::AssertionSuccess();
}

// A rank's shard drawn or read alone equals the whole model cut (model/expert_parallel.h), at 1, 2
// and 4 ranks, so the union of the shards is the one-process model; the other ranks' experts are
// never drawn or read.
TEST(Checkpoint, ShardedInitAndLoadEqualTheWholeModelCut) {
  const model::ModelConfig cfg = test::micro_config();
  ASSERT_EQ(cfg.num_experts % 4, 0);
  const Muse whole = Muse::init(cfg, 11, at::kFloat, at::kCPU);
  test::TempDir dir;
  model::save_checkpoint(whole, dir.path(), /*max_shard_bytes=*/20000);  // several files
  for (int size : {1, 2, 4})
    for (int rank = 0; rank < size; ++rank) {
      const Muse cut = size == 1 ? whole : model::shard_experts(whole, rank, size);
      const Muse drawn = Muse::init_shard(cfg, 11, at::kFloat, at::kCPU, rank, size);
      EXPECT_EQ(drawn.weights().layers[0].expert_gate.size(0), cfg.num_experts / size);
      EXPECT_TRUE(same_model(drawn, cut)) << "init, rank " << rank << " of " << size;
      const Muse read = model::load_checkpoint_shard(dir.path(), at::kFloat, at::kCPU, rank, size);
      EXPECT_TRUE(same_model(read, cut)) << "load, rank " << rank << " of " << size;
    }
  EXPECT_TRUE(test::throws_with([&] { Muse::init_shard(cfg, 11, at::kFloat, at::kCPU, 0, 3); },
                                {"experts do not split evenly over 3 ranks"}));
  EXPECT_TRUE(test::throws_with([&] { model::load_checkpoint_shard(dir.path(), at::kFloat, at::kCPU, 4, 4); },
                                {"rank 4"}));
}

// A ZeRO-3 share without the whole: init_owned draws, clone(keep) copies and load_checkpoint_owned
// reads only the selected tensors; the rest are zero-element placeholders of the right dtype.
// Muse::shapes holds every shape on the meta device, experts cut as asked.
TEST(Checkpoint, OwnedInitAndCloneHoldOnlyTheirShare) {
  const model::ModelConfig cfg = test::micro_config();
  const Muse whole = Muse::init(cfg, 11, at::kFloat, at::kCPU);
  auto mine = [](const std::string& name) { return name.find("q_proj") != std::string::npos || name == "lm_head.weight"; };
  test::TempDir dir;
  model::save_checkpoint(whole, dir.path(), /*max_shard_bytes=*/20000);
  for (const Muse& m : {Muse::init_owned(cfg, 11, at::kFloat, at::kCPU, 0, 1, mine), whole.clone(mine),
                        model::load_checkpoint_owned(dir.path(), at::kFloat, at::kCPU, 0, 1, mine)}) {
    auto got = m.named_parameters(), want = whole.named_parameters();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].second.scalar_type(), want[i].second.scalar_type()) << got[i].first;
      if (mine(got[i].first))
        EXPECT_TRUE(test::all_equal(got[i].second, want[i].second)) << got[i].first;
      else
        EXPECT_EQ(got[i].second.numel(), 0) << got[i].first;
    }
  }
  const Muse shapes = Muse::shapes(cfg, at::kFloat, cfg.num_experts / 2);
  auto s = shapes.named_parameters(), c = model::shard_experts(whole, 1, 2).named_parameters();
  ASSERT_EQ(s.size(), c.size());
  for (size_t i = 0; i < s.size(); ++i) {
    EXPECT_EQ(s[i].second.device().type(), at::kMeta) << s[i].first;
    EXPECT_EQ(s[i].second.sizes(), c[i].second.sizes()) << s[i].first;
    EXPECT_EQ(s[i].second.scalar_type(), c[i].second.scalar_type()) << s[i].first;
  }
}

// Every rank writes its own part (its experts; rank 0 also the dense part), one merges the index:
// the directory loads whole and by shard exactly, no part holds another rank's experts, and a
// missing or doubled part is an error naming the tensors.
TEST(Checkpoint, PartsWrittenByEveryRankLoadWholeAndByShard) {
  const model::ModelConfig cfg = test::micro_config();
  const Muse whole = Muse::init(cfg, 13, at::kFloat, at::kCPU);
  for (int size : {1, 2, 4}) {
    test::TempDir dir;
    for (int rank = 0; rank < size; ++rank)
      model::save_checkpoint_part(size == 1 ? whole : model::shard_experts(whole, rank, size), dir.path(), rank, size,
                                  rank == 0, /*max_shard_bytes=*/8000);
    safetensors::merge_checkpoint_index(dir.path());
    int parts_left = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir.path()))
      parts_left += e.path().filename().string().rfind(".index-part-", 0) == 0;
    EXPECT_EQ(parts_left, 0);
    EXPECT_TRUE(same_model(model::load_checkpoint(dir.path(), at::kFloat, at::kCPU), whole)) << size << " ranks";
    for (int rank = 0; rank < size; ++rank)
      EXPECT_TRUE(same_model(model::load_checkpoint_shard(dir.path(), at::kFloat, at::kCPU, rank, size),
                             size == 1 ? whole : model::shard_experts(whole, rank, size)))
          << "rank " << rank << " of " << size;
    if (size == 4) {  // rank 1's files hold its expert (1) and nothing else
      int seen = 0;
      for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
        const std::string f = e.path().filename().string();
        if (f.rfind("model-rank00001-of-00004-", 0) != 0) continue;
        const auto file = safetensors::File::open(e.path().string());
        for (const auto& t : file->tensors()) {
          EXPECT_NE(t.name.find(".mlp.experts.1."), std::string::npos) << f << " holds " << t.name;
          ++seen;
        }
      }
      EXPECT_EQ(seen, cfg.num_layers * 4);  // gate, up, down, norm of one expert per layer
    }
  }
  test::TempDir missing, doubled;
  model::save_checkpoint_part(model::shard_experts(whole, 0, 2), missing.path(), 0, 2, true);
  safetensors::merge_checkpoint_index(missing.path());
  EXPECT_TRUE(test::throws_with([&] { model::load_checkpoint(missing.path(), at::kFloat, at::kCPU); },
                                {"missing=", "mlp.experts."}));
  model::save_checkpoint_part(model::shard_experts(whole, 0, 2), doubled.path(), 0, 2, true);
  model::save_checkpoint_part(model::shard_experts(whole, 1, 2), doubled.path(), 1, 2, true);
  EXPECT_TRUE(test::throws_with([&] { safetensors::merge_checkpoint_index(doubled.path()); },
                                {"is written by two checkpoint parts"}));
  test::TempDir none;
  EXPECT_TRUE(test::throws_with([&] { safetensors::merge_checkpoint_index(none.path()); }, {"no checkpoint parts"}));
  EXPECT_TRUE(test::throws_with([&] { model::save_checkpoint_part(whole, none.path(), 0, 2, true); },
                                {"writes 2 experts per layer but its model holds 4"}));
}

TEST(Checkpoint, InitOnDeviceHasInitsShapesDtypesAndScale) {
  const model::ModelConfig cfg = test::micro_config();
  Muse a = Muse::init(cfg, 5, at::kFloat, at::kCPU);
  Muse b = Muse::init_on_device(cfg, 5, at::kFloat, at::kCPU), c = Muse::init_on_device(cfg, 5, at::kFloat, at::kCPU);
  const auto na = a.named_parameters(), nb = b.named_parameters(), nc = c.named_parameters();
  ASSERT_EQ(na.size(), nb.size());
  for (size_t i = 0; i < na.size(); ++i) {
    EXPECT_EQ(na[i].first, nb[i].first);
    EXPECT_EQ(na[i].second.sizes(), nb[i].second.sizes()) << na[i].first;
    EXPECT_EQ(na[i].second.scalar_type(), nb[i].second.scalar_type()) << na[i].first;
    EXPECT_TRUE(test::all_equal(nb[i].second, nc[i].second)) << na[i].first;  // one seed, one draw
    if (na[i].second.numel() >= 256) {  // the same scale, within sampling noise
      const double sa = na[i].second.std().item<double>(), sb = nb[i].second.std().item<double>();
      EXPECT_NEAR(sb / sa, 1.0, 0.25) << na[i].first;
    }
  }
}

TEST(Checkpoint, DeviceForRankWrapsAroundTheVisibleDevices) {
  EXPECT_EQ(model::device_for_rank(0, 8), 0);
  EXPECT_EQ(model::device_for_rank(5, 8), 5);
  EXPECT_EQ(model::device_for_rank(3, 1), 0);  // srun --gpus-per-task=1: each rank sees its one GPU
  EXPECT_EQ(model::device_for_rank(9, 4), 1);
  EXPECT_TRUE(test::throws_with([] { model::device_for_rank(0, 0); }, {"sees 0 CUDA devices", "CUDA_VISIBLE_DEVICES"}));
}

TEST(Checkpoint, MissingUnexpectedAndMisshapedTensorsAreNamed) {
  Muse m = Muse::init(test::micro_config(), 2, at::kFloat, at::kCPU);
  test::TempDir dir;
  model::save_checkpoint(m, dir.path());
  auto tensors = model::hf_tensors(m);
  auto rewrite = [&](const std::function<void(std::vector<safetensors::NamedTensor>&)>& edit) {
    std::vector<safetensors::NamedTensor> ts;
    for (auto& [n, t] : tensors) ts.push_back({n, t});
    edit(ts);
    safetensors::write_file(dir / "model.safetensors", ts);
    return error_of([&] { model::load_checkpoint(dir.path(), at::kFloat, at::kCPU); });
  };
  std::string msg = rewrite([](auto& ts) {
    ts.erase(std::remove_if(ts.begin(), ts.end(), [](auto& t) { return t.name == "model.layers.1.mlp.experts.2.up_proj.weight"; }),
             ts.end());
  });
  EXPECT_NE(msg.find("model.layers.1.mlp.experts.2.up_proj.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing"), std::string::npos) << msg;
  msg = rewrite([](auto& ts) { ts.push_back({"model.layers.0.mlp.shared_expert.weight", at::zeros({2})}); });
  EXPECT_NE(msg.find("model.layers.0.mlp.shared_expert.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unexpected"), std::string::npos) << msg;
  msg = rewrite([](auto& ts) {
    for (auto& t : ts)
      if (t.name == "model.layers.0.mlp.pooler.weight") t.tensor = at::zeros({8, 4});
  });
  EXPECT_NE(msg.find("model.layers.0.mlp.pooler.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("shape"), std::string::npos) << msg;
  // NaN or inf values, and bytes of another dtype (F32 bytes labelled I32), are named on load.
  msg = rewrite([](auto& ts) {
    for (auto& t : ts)
      if (t.name == "model.layers.1.self_attn.k_proj.weight") {
        t.tensor = t.tensor.clone();
        t.tensor.view({-1})[5] = INFINITY;
        t.tensor.view({-1})[9] = NAN;
      }
  });
  for (const char* part : {"model.layers.1.self_attn.k_proj.weight", "holds 2 NaN/inf value(s)", "flat index 5"})
    EXPECT_NE(msg.find(part), std::string::npos) << msg;
  msg = rewrite([](auto& ts) {
    for (auto& t : ts)
      if (t.name == "model.norm.weight") t.dtype = safetensors::DType::I32;
  });
  for (const char* part : {"model.norm.weight", "is I32", "needs F32"}) EXPECT_NE(msg.find(part), std::string::npos) << msg;
  msg = rewrite([](auto& ts) {
    for (auto& t : ts)
      if (t.name == "model.layers.0.mlp.router.weight") t.tensor = t.tensor.to(at::kBFloat16);
  });
  for (const char* part : {"model.layers.0.mlp.router.weight", "is BF16", "needs F32"})
    EXPECT_NE(msg.find(part), std::string::npos) << msg;
  std::filesystem::remove(dir / "config.json");
  EXPECT_NE(error_of([&] { model::load_checkpoint(dir.path(), at::kFloat, at::kCPU); }).find("config.json"),
            std::string::npos);
}

// A diverged model is never written: save_checkpoint names the first non-finite tensor and leaves
// the directory as it was.
TEST(Checkpoint, NonFiniteWeightsAreNeverSaved) {
  Muse m = Muse::init(test::micro_config(), 2, at::kFloat, at::kCPU);
  test::TempDir dir;
  m.weights().layers[0].expert_norm.view({-1})[3] = NAN;
  const std::string msg = error_of([&] { model::save_checkpoint(m, dir / "ck"); });
  for (const char* part : {"refusing to write", "model.layers.0.mlp.experts.", "norm.weight", "holds 1 NaN/inf"})
    EXPECT_NE(msg.find(part), std::string::npos) << msg;
  EXPECT_FALSE(std::filesystem::exists(dir / "ck"));
}

// Positions beyond max_position_embeddings are refused instead of extrapolating RoPE silently.
TEST(Checkpoint, ForwardRefusesPositionsBeyondTheConfig) {
  model::ModelConfig c = test::micro_config();
  c.max_position_embeddings = 6;
  Muse m = Muse::init(c, 2, at::kFloat, at::kCPU);
  EXPECT_NO_THROW(m.forward(model::PackedBatch::from_sequences({{1, 2, 3, 4, 5, 6}}, m.device()), {}));
  const std::string msg =
      error_of([&] { m.forward(model::PackedBatch::from_sequences({{1, 2}, {1, 2, 3, 4, 5, 6, 7}}, m.device()), {}); });
  for (const char* part : {"sequence 1 reaches position 7", "max_position_embeddings (6)"})
    EXPECT_NE(msg.find(part), std::string::npos) << msg;
}

}  // namespace
}  // namespace kiln
