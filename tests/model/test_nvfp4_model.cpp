// NVFP4 models: which linears are quantised, NVFP4 serving against the dequantised model, the
// ModelOpt checkpoint (names, dtypes, hf_quant_config.json, round trip), calibration, re-quantising
// weight syncs in the rollout engine, and the errors for bad NVFP4 tensors.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/safetensors.h"
#include "model/checkpoint.h"
#include "model/expert_parallel.h"
#include "model/nvfp4_model.h"
#include "rollout/engine.h"
#include "tests/model/reference.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using model::Muse;

// Every quantised width a multiple of 16; layer 1 keeps BF16 experts.
model::ModelConfig nvfp4_config() {
  model::ModelConfig c = test::nvfp4_micro_config();
  c.bf16_expert_layers = {1};
  return c;
}

model::PackedBatch batch(const Muse& m) {
  return model::PackedBatch::from_sequences({{1, 2, 3, 4, 5, 6, 7}, {8, 9, 10}, {11}}, m.device());
}

at::Tensor logprobs(const Muse& m) {
  model::ForwardOptions o;
  model::PackedBatch b = batch(m);
  o.targets = (b.tokens + 1).remainder(m.config().vocab_size);
  return m.forward(b, o).logprobs;
}

TEST(Nvfp4Model, ServingMatchesTheDequantisedModel) {
  model::ModelConfig cfg = nvfp4_config();
  Muse m = Muse::init(cfg, 3, at::kFloat, at::kCPU);
  Muse served = m.clone();
  model::quantize_model(served, /*kernel_layout=*/false, /*drop_dense=*/true);
  const auto& l0 = served.weights().layers[0];
  const auto& l1 = served.weights().layers[1];
  EXPECT_FALSE(l0.q_proj.defined());
  EXPECT_FALSE(l0.expert_gate.defined());
  EXPECT_TRUE(l1.expert_gate.defined());           // a bf16_expert_layers layer
  EXPECT_FALSE(l1.nvfp4.expert_gate.packed.defined());
  EXPECT_FALSE(l1.pooler.defined());               // its pooler is quantised all the same
  EXPECT_TRUE(l0.router.defined() && l0.expert_norm.defined());
  EXPECT_EQ(l0.nvfp4.expert_down.packed.sizes(), at::IntArrayRef({4, 16, 16}));
  // The trainer's view: dense weights dequantised from the same codes.
  Muse trainer = served.clone();
  model::dequantize_model(trainer, at::kFloat);
  EXPECT_TRUE(trainer.weights().layers[0].q_proj.defined());
  at::Tensor a = logprobs(served), b = logprobs(trainer), orig = logprobs(m);
  // W4A16 applies s2 after the sum, the dequantised weights before it: fp32 rounding apart.
  EXPECT_LT((a - b).abs().max().item<double>(), 1e-4);
  EXPECT_GT((b - orig).abs().max().item<double>(), 1e-3);  // quantisation does change the model
  // W4A4 quantises the activations as well.
  for (auto& l : served.weights().layers) l.nvfp4.w4a4 = true;
  at::Tensor c = logprobs(served);
  EXPECT_GT((c - b).abs().max().item<double>(), 1e-5);
  EXPECT_TRUE(at::isfinite(c).all().item<bool>());  // the linear-level formula is checked in test_nvfp4.cpp
}

TEST(Nvfp4Model, CheckpointIsModelOptShaped) {
  model::ModelConfig cfg = nvfp4_config();
  cfg.dtype = "bfloat16";
  Muse m = Muse::init(cfg, 4, at::kFloat, at::kCPU);
  model::quantize_model(m, false, false);
  model::calibrate_input_scales(m, batch(m));
  test::TempDir dir;
  model::save_nvfp4_checkpoint(m, dir.path());
  EXPECT_TRUE(model::is_nvfp4_checkpoint(dir.path()));
  auto ck = safetensors::Checkpoint::open(dir.path());
  // The config-only count (`kiln info`) is the checkpoint's tensor bytes, exactly.
  int64_t stored = 0;
  for (const std::string& name : ck.names()) stored += int64_t(ck.info(name).end - ck.info(name).begin);
  const model::Nvfp4Footprint fp = model::nvfp4_footprint(cfg);
  EXPECT_EQ(fp.bytes, stored);
  EXPECT_EQ(fp.quantized_params + fp.kept_params, model::count_parameters(cfg).total());
  EXPECT_LT(model::nvfp4_footprint(cfg, /*input_scales=*/false).bytes, fp.bytes);
  const auto& w = ck.info("model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(w.dtype, safetensors::DType::U8);
  EXPECT_EQ(w.shape, (std::vector<int64_t>{32, 16}));
  const auto& sf = ck.info("model.layers.0.mlp.experts.2.down_proj.weight_scale");
  EXPECT_EQ(sf.dtype, safetensors::DType::F8_E4M3);
  EXPECT_EQ(sf.shape, (std::vector<int64_t>{16, 2}));
  const auto& s2 = ck.info("model.layers.1.mlp.unpooler.weight_scale_2");
  EXPECT_EQ(s2.dtype, safetensors::DType::F32);
  EXPECT_TRUE(s2.shape.empty());
  EXPECT_TRUE(ck.contains("model.layers.0.mlp.pooler.input_scale"));
  // Excluded modules keep their dtypes: BF16 experts of layer 1, F32 router, BF16 norms and embeddings.
  EXPECT_EQ(ck.info("model.layers.1.mlp.experts.0.gate_proj.weight").dtype, safetensors::DType::BF16);
  EXPECT_FALSE(ck.contains("model.layers.1.mlp.experts.0.gate_proj.weight_scale"));
  EXPECT_EQ(ck.info("model.layers.0.mlp.router.weight").dtype, safetensors::DType::F32);
  EXPECT_EQ(ck.info("lm_head.weight").dtype, safetensors::DType::BF16);
  std::ifstream f(dir.path() + "/hf_quant_config.json");
  nlohmann::json j = nlohmann::json::parse(f);
  EXPECT_EQ(j["quantization"]["quant_algo"], "NVFP4");
  EXPECT_EQ(j["quantization"]["group_size"], 16);
  const auto ex = j["quantization"]["exclude_modules"].get<std::vector<std::string>>();
  for (const char* name : {"lm_head", "model.embed_tokens", "model.layers.*.mlp.router", "model.layers.1.mlp.experts.*"})
    EXPECT_NE(std::find(ex.begin(), ex.end(), name), ex.end()) << name;

  // Round trip: the NVFP4 copies bitwise, the dense weights dequantised from them.
  Muse back = model::load_checkpoint(dir.path(), at::kBFloat16, at::kCPU);
  const auto& q0 = m.weights().layers[0].nvfp4.expert_up;
  const auto& r0 = back.weights().layers[0].nvfp4.expert_up;
  EXPECT_TRUE(test::all_equal(r0.packed, q0.packed));
  EXPECT_TRUE(test::all_equal(r0.block_scale, q0.block_scale));
  EXPECT_TRUE(test::all_equal(r0.tensor_scale, q0.tensor_scale));
  EXPECT_TRUE(test::all_equal(r0.input_scale, q0.input_scale));
  EXPECT_EQ(r0.input_scale.sizes(), at::IntArrayRef({4}));
  EXPECT_TRUE(test::all_equal(back.weights().layers[0].expert_up, kernels::nvfp4_dequantize_reference(q0, at::kBFloat16)));
  EXPECT_TRUE(test::all_equal(back.weights().layers[1].expert_up, m.weights().layers[1].expert_up.to(at::kBFloat16)));
}

// A rank reads only its experts of an NVFP4 checkpoint, codes and scales and the dense weights
// dequantised from them, and gets the whole checkpoint cut (model::shard_experts, which slices the
// NVFP4 stacks too) at 2 and 4 ranks.
TEST(Nvfp4Model, CheckpointLoadsByShardAsTheWholeCut) {
  const model::ModelConfig cfg = nvfp4_config();
  ASSERT_EQ(cfg.num_experts % 4, 0);
  Muse m = Muse::init(cfg, 6, at::kFloat, at::kCPU);
  model::quantize_model(m, false, false);
  model::calibrate_input_scales(m, batch(m));
  test::TempDir dir;
  model::save_nvfp4_checkpoint(m, dir.path());
  const Muse whole = model::load_nvfp4_checkpoint(dir.path(), at::kFloat, at::kCPU);
  for (int size : {2, 4})
    for (int rank = 0; rank < size; ++rank) {
      const std::string where = str_cat("rank ", rank, " of ", size);
      const Muse cut = model::shard_experts(whole, rank, size);
      const Muse read = model::load_checkpoint_shard(dir.path(), at::kFloat, at::kCPU, rank, size);
      const auto pc = cut.named_parameters(), pr = read.named_parameters();
      ASSERT_EQ(pc.size(), pr.size()) << where;
      for (size_t i = 0; i < pc.size(); ++i) EXPECT_TRUE(test::all_equal(pr[i].second, pc[i].second)) << where << " " << pc[i].first;
      for (int64_t l = 0; l < cfg.num_layers; ++l) {
        const auto &a = read.weights().layers[size_t(l)].nvfp4, &b = cut.weights().layers[size_t(l)].nvfp4;
        for (auto q : {&model::LayerWeights::Nvfp4::expert_gate, &model::LayerWeights::Nvfp4::expert_down}) {
          ASSERT_EQ((a.*q).packed.defined(), (b.*q).packed.defined()) << where << " layer " << l;
          if (!(a.*q).packed.defined()) continue;
          EXPECT_EQ((a.*q).packed.size(0), cfg.num_experts / size) << where;
          EXPECT_TRUE(test::all_equal((a.*q).packed, (b.*q).packed)) << where << " layer " << l;
          EXPECT_TRUE(test::all_equal((a.*q).block_scale, (b.*q).block_scale)) << where << " layer " << l;
          EXPECT_TRUE(test::all_equal((a.*q).tensor_scale, (b.*q).tensor_scale)) << where << " layer " << l;
          EXPECT_TRUE(test::all_equal((a.*q).input_scale, (b.*q).input_scale)) << where << " layer " << l;
        }
      }
    }
}

TEST(Nvfp4Model, CalibrationRecordsEveryLinearsInputRange) {
  Muse m = Muse::init(nvfp4_config(), 5, at::kFloat, at::kCPU);
  model::quantize_model(m, false, false);
  model::calibrate_input_scales(m, batch(m));
  const auto& l0 = m.weights().layers[0];
  // The q/k/v input is the normed hidden state: its amax over the batch, over 6 * 448.
  model::ForwardOptions o;
  at::Tensor h_amax;
  o.observe_linear_input = [&](int64_t layer, const std::string& name, const at::Tensor& x) {
    if (layer == 0 && name == "self_attn.q_proj") h_amax = x.abs().max();
  };
  m.forward(batch(m), o);
  EXPECT_FLOAT_EQ(l0.nvfp4.q_proj.input_scale.item<float>(), h_amax.item<float>() / (6 * 448));
  EXPECT_EQ(l0.nvfp4.expert_gate.input_scale.sizes(), at::IntArrayRef({4}));
  EXPECT_TRUE((l0.nvfp4.expert_down.input_scale > 0).all().item<bool>());
}

TEST(Nvfp4Model, BadTensorsAreNamed) {
  model::ModelConfig cfg = nvfp4_config();
  Muse m = Muse::init(cfg, 6, at::kFloat, at::kCPU);
  model::quantize_model(m, false, false);
  test::TempDir dir;
  model::save_nvfp4_checkpoint(m, dir.path());
  // Rewrite the checkpoint with one tensor changed or dropped.
  auto rewrite = [&](const std::string& name, const at::Tensor& replacement, std::optional<safetensors::DType> dt) {
    auto ck = safetensors::Checkpoint::open(dir.path());
    std::vector<safetensors::NamedTensor> out;
    for (const auto& n : ck.names()) {
      if (n != name) {
        auto info = ck.info(n);
        out.push_back({n, ck.load(n).view(info.dtype == safetensors::DType::F8_E4M3 ? at::kByte : ck.load(n).scalar_type()),
                       info.dtype == safetensors::DType::F8_E4M3 ? std::optional(info.dtype) : std::nullopt});
      } else if (replacement.defined()) {
        out.push_back({n, replacement, dt});
      }
    }
    test::TempDir bad;
    safetensors::write_checkpoint(bad.path(), out);
    std::filesystem::copy_file(dir.path() + "/config.json", bad.path() + "/config.json");
    std::filesystem::copy_file(dir.path() + "/hf_quant_config.json", bad.path() + "/hf_quant_config.json");
    return test::error_of([&] { model::load_checkpoint(bad.path(), at::kFloat, at::kCPU); });
  };
  const std::string q = "model.layers.0.self_attn.q_proj";
  std::string e = rewrite(q + ".weight", at::zeros({32, 8}, at::kByte), std::nullopt);
  EXPECT_NE(e.find(q + ".weight has shape [32, 8], expected [32, 16]"), std::string::npos) << e;
  e = rewrite(q + ".weight_scale", at::zeros({32, 3}, at::kByte), safetensors::DType::F8_E4M3);
  EXPECT_NE(e.find(q + ".weight_scale has shape [32, 3], expected [32, 2]"), std::string::npos) << e;
  e = rewrite(q + ".weight_scale", at::zeros({32, 2}, at::kByte), std::nullopt);
  EXPECT_NE(e.find("has dtype U8, expected F8_E4M3"), std::string::npos) << e;
  e = rewrite(q + ".weight_scale_2", at::Tensor(), std::nullopt);
  EXPECT_NE(e.find(q + ".weight_scale_2"), std::string::npos) << e;
  EXPECT_NE(e.find("missing"), std::string::npos) << e;
  // Scale values that would make the layer's output garbage: NaN or negative block scales, and a
  // tensor scale that is zero, negative or NaN.
  at::Tensor blocks = at::full({32, 2}, 0x38, at::kByte);  // E4M3 1.0
  blocks[3][1] = 0x7F;
  e = rewrite(q + ".weight_scale", blocks, safetensors::DType::F8_E4M3);
  EXPECT_NE(e.find(q + ".weight_scale holds 1 NaN block scale(s)"), std::string::npos) << e;
  blocks[3][1] = 0xB8;  // -1.0
  e = rewrite(q + ".weight_scale", blocks, safetensors::DType::F8_E4M3);
  EXPECT_NE(e.find(q + ".weight_scale holds 1 negative block scale(s)"), std::string::npos) << e;
  for (float bad : {0.0f, -2.0f, NAN}) {
    e = rewrite(q + ".weight_scale_2", at::scalar_tensor(bad, at::kFloat), std::nullopt);
    EXPECT_NE(e.find(q + ".weight_scale_2 must be finite and > 0"), std::string::npos) << e;
  }
  const std::string expert = "model.layers.0.mlp.experts.1.up_proj";
  e = rewrite(expert + ".weight_scale_2", at::scalar_tensor(0.0f, at::kFloat), std::nullopt);
  EXPECT_NE(e.find(expert + ".weight_scale_2 must be finite and > 0 (got 0)"), std::string::npos) << e;
  // K not a multiple of 16 cannot be quantised.
  model::ModelConfig odd = test::micro_config();
  odd.bf16_expert_layers = {};
  Muse o = Muse::init(odd, 1, at::kFloat, at::kCPU);
  EXPECT_TRUE(test::throws_with([&] { model::quantize_model(o, false, true); }, {"multiple of 16", "[8, 8]"}));
  // exclude_modules that keep other layers' experts than config.json says.
  {
    std::ifstream in(dir.path() + "/hf_quant_config.json");
    nlohmann::json j = nlohmann::json::parse(in);
    j["quantization"]["exclude_modules"] = {"lm_head", "model.layers.0.mlp.experts.*"};
    std::ofstream(dir.path() + "/hf_quant_config.json") << j.dump();
  }
  EXPECT_TRUE(test::throws_with([&] { model::load_checkpoint(dir.path(), at::kFloat, at::kCPU); },
                                {"bf16_expert_layers [1]", "disagree", "layers [0]"}));
  // A checkpoint that is not NVFP4.
  {
    std::ofstream f(dir.path() + "/hf_quant_config.json");
    f << R"({"quantization": {"quant_algo": "FP8"}})";
  }
  EXPECT_TRUE(test::throws_with([&] { model::load_checkpoint(dir.path(), at::kFloat, at::kCPU); },
                                {"hf_quant_config.json", "quant_algo must be \"NVFP4\"", "\"FP8\""}));
}

TEST(Nvfp4Model, EngineServesNvfp4AndRequantisesOnSync) {
  model::ModelConfig cfg = nvfp4_config();
  Muse m = Muse::init(cfg, 7, at::kFloat, at::kCPU);
  rollout::EngineConfig ec;
  ec.quantization = rollout::Quantization::kNvfp4;
  rollout::Engine engine(m, ec);
  EXPECT_FALSE(engine.model().weights().layers[0].o_proj.defined());
  rollout::Request r;
  r.prompt = {1, 2, 3};
  r.params.max_tokens = 6;
  r.params.temperature = 0;
  auto out = engine.generate({r});
  // Its greedy log-probs are the NVFP4 model's: score the sampled tokens with the dequantised model.
  Muse deq = engine.model().clone();
  model::dequantize_model(deq, at::kFloat);
  std::vector<int64_t> seq = r.prompt;
  const auto& s = out[0].samples[0];
  seq.insert(seq.end(), s.tokens.begin(), s.tokens.end());
  model::ForwardOptions o;
  model::PackedBatch b = model::PackedBatch::from_sequences({seq}, at::kCPU);
  o.targets = at::full({b.num_tokens()}, -100L);
  for (size_t t = 0; t < s.tokens.size(); ++t) o.targets[int64_t(r.prompt.size() + t - 1)] = s.tokens[t];
  at::Tensor lp = deq.forward(b, o).logprobs;
  for (size_t t = 0; t < s.tokens.size(); ++t)
    EXPECT_NEAR(lp[int64_t(r.prompt.size() + t - 1)].item<double>(), s.logprobs[t], 1e-4) << t;

  // A full-weight sync re-quantises in place.
  Muse next = m.clone();
  for (auto& [name, t] : next.named_parameters()) t.mul_(1.5);
  const at::Tensor before = engine.model().weights().layers[0].nvfp4.q_proj.packed;
  const void* addr = before.data_ptr();
  engine.update_weights(next.named_parameters());
  const auto& q = engine.model().weights().layers[0].nvfp4.q_proj;
  EXPECT_EQ(q.packed.data_ptr(), addr);
  kernels::Nvfp4Tensor fresh = kernels::nvfp4_quantize_reference(next.weights().layers[0].q_proj);
  EXPECT_TRUE(test::all_equal(q.packed, fresh.packed));
  EXPECT_TRUE(test::all_equal(q.tensor_scale, fresh.tensor_scale));
  EXPECT_TRUE(test::all_equal(engine.model().weights().layers[0].router, next.weights().layers[0].router));
  auto names = next.named_parameters();
  names.pop_back();
  EXPECT_TRUE(test::throws_with([&] { engine.update_weights(names); }, {"did not get lm_head.weight"}));
  names = next.named_parameters();
  names.push_back(names[0]);
  EXPECT_TRUE(test::throws_with([&] { engine.update_weights(names); }, {"model.embed_tokens.weight twice"}));
  EXPECT_TRUE(test::throws_with([&] { rollout::parse_quantization("fp8"); }, {"none, nvfp4 or w4a4", "fp8"}));
  for (auto q : {rollout::Quantization::kNone, rollout::Quantization::kNvfp4, rollout::Quantization::kW4a4})
    EXPECT_EQ(rollout::parse_quantization(rollout::quantization_name(q)), q);
}

}  // namespace
}  // namespace kiln
