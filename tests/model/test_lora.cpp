// LoRA: B = 0 is exactly the base, unmerged equals merged, only adapters get gradients, PEFT names
// shapes and round trip, and the rollout engine's adapter and full-weight syncs (also over an
// NVFP4 base), with wrong-shaped tensors refused.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/safetensors.h"
#include "model/lora.h"
#include "model/nvfp4_model.h"
#include "rollout/engine.h"
#include "tests/model/reference.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using model::Muse;

model::ModelConfig lora_config() { return test::nvfp4_micro_config(); }  // NVFP4 can quantise it too

model::LoraConfig lora(int64_t rank = 4) {
  model::LoraConfig l;
  l.rank = rank;
  l.alpha = 8;
  return l;
}

at::Tensor logprobs(const Muse& m, bool base_only = false) {
  model::ForwardOptions o;
  model::PackedBatch b = model::PackedBatch::from_sequences({{1, 2, 3, 4, 5, 6, 7}, {8, 9, 10}, {11}}, m.device());
  o.targets = (b.tokens * 5 + 1).remainder(m.config().vocab_size);
  o.disable_lora = base_only;
  return m.forward(b, o).logprobs;
}

void randomise_b(Muse& m, double scale = 0.2) {
  at::NoGradGuard g;
  for (auto& [name, t] : model::lora_parameters(m))
    if (name.find("lora_B") != std::string::npos) t.copy_(at::randn_like(t) * scale);
}

TEST(Lora, ZeroBIsExactlyTheBaseAndMergedEqualsUnmerged) {
  Muse base = Muse::init(lora_config(), 1, at::kFloat, at::kCPU);
  Muse m = base.clone();
  model::add_lora(m, lora(), 7);
  EXPECT_EQ(model::lora_rank(m), 4);
  EXPECT_EQ(m.weights().layers[0].lora.gate_a.sizes(), at::IntArrayRef({4, 4, 16}));  // [E, r, d_l]
  EXPECT_EQ(m.weights().layers[0].lora.down_b.sizes(), at::IntArrayRef({4, 16, 4}));  // [E, d_l, r]
  EXPECT_TRUE(test::all_equal(logprobs(m), logprobs(base)));
  at::manual_seed(2);
  randomise_b(m);
  at::Tensor unmerged = logprobs(m);
  EXPECT_GT((unmerged - logprobs(base)).abs().max().item<double>(), 1e-3);
  EXPECT_TRUE(test::all_equal(logprobs(m, /*base_only=*/true), logprobs(base)));  // the KL reference
  Muse merged = m.clone();
  model::merge_lora(merged);
  EXPECT_EQ(model::lora_rank(merged), 0);
  EXPECT_LT((logprobs(merged) - unmerged).abs().max().item<double>(), 1e-5);
  // Same seed, same adapters; targets restrict them.
  Muse again = base.clone();
  model::add_lora(again, lora(), 7);
  EXPECT_TRUE(test::all_equal(again.weights().layers[1].lora.q_a, m.weights().layers[1].lora.q_a));
  model::LoraConfig attn = lora();
  attn.targets = {"q_proj", "v_proj"};
  model::add_lora(again, attn, 7);
  EXPECT_EQ(model::lora_parameters(again).size(), 2u * 2 * 2);  // 2 layers x 2 modules x (A, B)
  attn.targets = {"lm_head"};
  EXPECT_TRUE(test::throws_with([&] { model::add_lora(again, attn, 7); }, {"unknown target 'lm_head'"}));
}

TEST(Lora, OnlyAdaptersGetGradients) {
  Muse m = Muse::init(lora_config(), 1, at::kFloat, at::kCPU);
  model::add_lora(m, lora(), 3);
  randomise_b(m);
  m.set_requires_grad(false);
  for (auto& [n, t] : model::lora_parameters(m)) t.requires_grad_(true);
  logprobs(m).sum().backward();
  for (auto& [n, t] : model::lora_parameters(m))
    EXPECT_TRUE(t.grad().defined() && t.grad().abs().sum().item<double>() > 0) << n;
  for (auto& [n, t] : m.named_parameters()) EXPECT_FALSE(t.grad().defined()) << n;
}

TEST(Lora, ParameterCountFromTheConfigMatchesAddLora) {
  for (const std::vector<std::string>& targets :
       {model::LoraConfig().targets, std::vector<std::string>{"q_proj", "down_proj"}}) {
    model::LoraConfig lc = lora();
    lc.targets = targets;
    Muse m = Muse::init(lora_config(), 1, at::kFloat, at::kCPU);
    model::add_lora(m, lc, 3);
    int64_t n = 0;
    for (auto& [name, t] : model::lora_parameters(m)) n += t.numel();
    EXPECT_GT(n, 0);
    EXPECT_EQ(model::lora_parameter_count(lora_config(), lc), n) << targets.size() << " targets";
  }
}

TEST(Lora, PeftNamesShapesAndRoundTrip) {
  Muse m = Muse::init(lora_config(), 1, at::kFloat, at::kCPU);
  model::add_lora(m, lora(), 3);
  at::manual_seed(4);
  randomise_b(m);
  test::TempDir dir;
  model::save_peft_adapter(m, dir.path());
  auto f = safetensors::File::open(dir.path() + "/adapter_model.safetensors");
  const auto* qa = f->find("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
  ASSERT_TRUE(qa);
  EXPECT_EQ(qa->shape, (std::vector<int64_t>{4, 32}));
  const auto* db = f->find("base_model.model.model.layers.1.mlp.experts.3.down_proj.lora_B.weight");
  ASSERT_TRUE(db);
  EXPECT_EQ(db->shape, (std::vector<int64_t>{16, 4}));
  EXPECT_TRUE(f->find("base_model.model.model.layers.1.mlp.unpooler.lora_A.weight"));
  EXPECT_EQ(f->tensors().size(), size_t(2 * 2 * (6 + 3 * 4)));  // layers x (A, B) x (6 + 3 per expert x 4)
  std::ifstream cf(dir.path() + "/adapter_config.json");
  nlohmann::json c = nlohmann::json::parse(cf);
  EXPECT_EQ(c["r"], 4);
  EXPECT_EQ(c["lora_alpha"], 8.0);
  EXPECT_EQ(c["peft_type"], "LORA");
  EXPECT_EQ(c["target_modules"].size(), 9u);
  Muse back = Muse::init(lora_config(), 1, at::kFloat, at::kCPU);
  model::load_peft_adapter(back, dir.path());
  EXPECT_TRUE(test::all_equal(logprobs(back), logprobs(m)));
  // A wrong shape and a missing key are named.
  {
    std::vector<safetensors::NamedTensor> ts;
    for (const auto& t : f->tensors()) ts.push_back({t.name, f->load(t.name)});
    ts[0].tensor = at::zeros({3, 3});
    safetensors::write_file(dir.path() + "/adapter_model.safetensors", ts);
  }
  const std::string e = test::error_of([&] { model::load_peft_adapter(back, dir.path()); });
  EXPECT_NE(e.find("has shape [3, 3], expected"), std::string::npos) << e;
  std::ofstream(dir.path() + "/adapter_config.json") << R"({"r": 4, "target_modules": ["q_proj"]})";
  EXPECT_TRUE(test::throws_with([&] { model::load_peft_adapter(back, dir.path()); }, {"missing key lora_alpha"}));
  std::ofstream(dir.path() + "/adapter_config.json")
      << R"({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "use_rslora": true})";
  EXPECT_TRUE(test::throws_with([&] { model::load_peft_adapter(back, dir.path()); }, {"use_rslora", "not supported"}));
}

TEST(Lora, EngineAppliesAdaptersUnmergedAndSyncsThem) {
  Muse policy = Muse::init(lora_config(), 1, at::kFloat, at::kCPU);
  model::add_lora(policy, lora(), 3);
  rollout::Engine engine(policy, {});
  at::manual_seed(5);
  randomise_b(policy);
  EXPECT_GT((logprobs(engine.model()) - logprobs(policy)).abs().max().item<double>(), 1e-3);  // not synced yet
  const int64_t bytes = engine.update_adapters(model::lora_parameters(policy));
  int64_t want = 0;
  for (auto& [n, t] : model::lora_parameters(policy)) want += t.numel() * 4;
  EXPECT_EQ(bytes, want);
  EXPECT_LT((logprobs(engine.model()) - logprobs(policy)).abs().max().item<double>(), 1e-5);
  // Sampled log-probs come from the adapted model.
  rollout::Request r;
  r.prompt = {1, 2, 3};
  r.params.max_tokens = 4;
  r.params.temperature = 0;
  auto out = engine.generate({r});
  std::vector<int64_t> seq = r.prompt;
  for (int64_t t : out[0].samples[0].tokens) seq.push_back(t);
  model::ForwardOptions o;
  model::PackedBatch b = model::PackedBatch::from_sequences({seq}, at::kCPU);
  o.targets = at::full({b.num_tokens()}, -100L);
  for (size_t i = 0; i < out[0].samples[0].tokens.size(); ++i) o.targets[int64_t(r.prompt.size() + i - 1)] = seq[r.prompt.size() + i];
  at::Tensor lp = policy.forward(b, o).logprobs;
  for (size_t i = 0; i < out[0].samples[0].tokens.size(); ++i)
    EXPECT_NEAR(lp[int64_t(r.prompt.size() + i - 1)].item<double>(), out[0].samples[0].logprobs[i], 1e-5);
  // Refusals: a wrong shape, an unknown name, a short list.
  auto named = model::lora_parameters(policy);
  auto bad = named;
  bad[0].second = at::zeros({1, 1});
  EXPECT_TRUE(test::throws_with([&] { engine.update_adapters(bad); }, {"has shape [1, 1], expected"}));
  bad = named;
  bad[0].first = "model.layers.0.self_attn.q_proj.lora_C";
  EXPECT_TRUE(test::throws_with([&] { engine.update_adapters(bad); }, {"lora_C", "not one of the engine's adapters"}));
  bad = named;
  const std::string last = bad.back().first;
  bad.pop_back();
  EXPECT_TRUE(test::throws_with([&] { engine.update_adapters(bad); }, {"did not get " + last}));
  // A full sync of a perturbed base: the rollout scores as the trainer does.
  Muse perturbed = policy.clone();
  {
    at::NoGradGuard g;
    for (auto& [n, t] : perturbed.named_parameters()) t.add_(at::randn_like(t) * 0.05);
  }
  engine.update_weights(perturbed.named_parameters());
  engine.update_adapters(model::lora_parameters(perturbed));
  EXPECT_LT((logprobs(engine.model()) - logprobs(perturbed)).abs().max().item<double>(), 1e-5);
  auto wrong = perturbed.named_parameters();
  wrong[3].second = at::zeros({2, 2});
  EXPECT_TRUE(test::throws_with([&] { engine.update_weights(wrong); }, {"has shape [2, 2], expected"}));
}

TEST(Lora, AdaptersOverAnNvfp4Base) {
  Muse policy = Muse::init(lora_config(), 1, at::kFloat, at::kCPU);
  model::quantize_model(policy, false, false);
  model::dequantize_model(policy, at::kFloat);  // the trainer's base: the NVFP4 codes, dequantised
  model::add_lora(policy, lora(), 3);
  at::manual_seed(6);
  randomise_b(policy);
  rollout::EngineConfig ec;
  ec.quantization = rollout::Quantization::kNvfp4;
  rollout::Engine engine(policy, ec);  // keeps the policy's codes, adds its adapters unmerged
  EXPECT_FALSE(engine.model().weights().layers[0].expert_up.defined());
  EXPECT_TRUE(engine.model().weights().layers[0].lora.up_a.defined());
  EXPECT_LT((logprobs(engine.model()) - logprobs(policy)).abs().max().item<double>(), 1e-4);
  randomise_b(policy, 0.3);
  engine.update_adapters(model::lora_parameters(policy));
  EXPECT_LT((logprobs(engine.model()) - logprobs(policy)).abs().max().item<double>(), 1e-4);
  Muse plain = policy.clone();
  EXPECT_TRUE(test::throws_with(
      [&] {
        Muse nv = plain.clone();
        model::quantize_model(nv, false, true);
        model::merge_lora(nv);
      },
      {"NVFP4 only", "dequantise it first"}));
}

}  // namespace
}  // namespace kiln
