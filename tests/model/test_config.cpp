// ModelConfig: the shipped configs, validation errors with key and line, the layer pattern and
// the 816B parameter table of docs/MODEL.md §2.3.
#include <gtest/gtest.h>

#include <fstream>

#include "model/config.h"
#include "tests/test_util.h"

namespace kiln {
namespace {

using model::ModelConfig;

using test::error_of;

TEST(Config, FullModelReproducesThePublicTable) {
  ModelConfig c = ModelConfig::from_yaml_file(test::source_path("configs/muse-spark-open-816b.yaml"));
  model::ParamCounts p = model::count_parameters(c);
  auto billions = [](int64_t n) { return double(n) / 1e9; };
  EXPECT_NEAR(billions(p.experts), 798.9, 0.05);
  EXPECT_NEAR(billions(p.attention), 13.5, 0.05);
  EXPECT_NEAR(billions(p.latent), 4.2, 0.05);
  EXPECT_NEAR(billions(p.embedding + p.head), 3.3, 0.05);
  EXPECT_NEAR(billions(p.router), 0.13, 0.005);
  EXPECT_NEAR(billions(p.active_per_token), 42.8, 0.05);
  EXPECT_EQ(p.experts, 62ll * 256 * 3 * 4096 * 4096);
  EXPECT_EQ(p.attention, 62ll * (2 * 8192 * 12288 + 2 * 8192 * 1024));
  EXPECT_EQ(c.num_window_layers(), 46);
  EXPECT_EQ(c.num_full_layers(), 16);
  // Just over a quarter of an all-full model's KV cache at 1M tokens.
  ModelConfig all_full = c;
  all_full.full_attention_period = 1;
  const double ratio = model::kv_cache_bytes_per_token(c, 1 << 20) / model::kv_cache_bytes_per_token(all_full, 1 << 20);
  EXPECT_GT(ratio, 0.25);
  EXPECT_LT(ratio, 0.27);
}

TEST(Config, LayerPatternIsAnchoredAtTheEnd) {
  ModelConfig c = ModelConfig::from_yaml_file(test::source_path("configs/muse-spark-open-816b.yaml"));
  EXPECT_TRUE(c.is_full_attention(61));
  EXPECT_FALSE(c.is_full_attention(60));
  EXPECT_FALSE(c.is_full_attention(59));
  EXPECT_FALSE(c.is_full_attention(58));
  EXPECT_TRUE(c.is_full_attention(57));
  EXPECT_TRUE(c.is_full_attention(1));
  EXPECT_FALSE(c.is_full_attention(0));
  int full = 0;
  for (int i = 0; i < 62; ++i) full += c.is_full_attention(i);
  EXPECT_EQ(full, 16);
}

TEST(Config, SmallAndTinyConfigsLoad) {
  ModelConfig small = ModelConfig::from_yaml_file(test::source_path("configs/muse-small.yaml"));
  const double total = double(model::count_parameters(small).total());
  EXPECT_GT(total, 1.8e9);
  EXPECT_LT(total, 2.2e9);
  EXPECT_EQ(small.hidden_size, 2048);
  EXPECT_EQ(small.latent_size, 1024);
  EXPECT_EQ(small.num_experts, 64);
  EXPECT_EQ(small.top_k, 8);
  ModelConfig tiny = ModelConfig::from_yaml_file(test::source_path("configs/muse-tiny.yaml"));
  EXPECT_EQ(tiny.num_layers, 4);
  EXPECT_TRUE(tiny.is_full_attention(3));
  EXPECT_EQ(tiny.num_full_layers(), 1);
}

TEST(Config, JsonRoundTrip) {
  test::TempDir dir;
  ModelConfig c = ModelConfig::from_yaml_file(test::source_path("configs/muse-spark-open-816b.yaml"));
  std::ofstream(dir / "config.json") << c.to_json();
  ModelConfig back = ModelConfig::from_json_file(dir / "config.json");
  EXPECT_EQ(back.to_json(), c.to_json());
  EXPECT_EQ(back.to_yaml(), c.to_yaml());
}

// Found by fuzz_model_config: a config.json that is valid JSON but not an object.
TEST(Config, JsonThatIsNotAnObjectIsNamed) {
  test::TempDir dir;
  for (const char* text : {"5", "[1]", "\"muse\"", "null"}) {
    std::ofstream(dir / "config.json") << text;
    EXPECT_TRUE(test::throws_with([&] { ModelConfig::from_json_file(dir / "config.json"); },
                                  {"config.json", "expected a JSON object"}))
        << text;
  }
}

TEST(Config, JsonModelTypeOfTheWrongTypeIsAnError) {
  // Found by fuzzing: a numeric model_type threw nlohmann's type_error past the reader.
  test::TempDir dir;
  for (const char* text : {"{\"model_type\": 128}", "{\"model_type\": null}", "{}"}) {
    std::ofstream(dir / "config.json") << text;
    EXPECT_TRUE(test::throws_with([&] { ModelConfig::from_json_file(dir / "config.json"); },
                                  {"config.json", "model_type must be \"muse\""}))
        << text;
  }
}

TEST(Config, ErrorsNameTheKeyAndLine) {
  test::TempDir dir;
  std::string base;
  {
    std::ifstream in(test::source_path("configs/muse-tiny.yaml"));
    base.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto load_with = [&](const std::string& from, const std::string& to) {
    std::string text = base;
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
    std::ofstream(dir / "m.yaml") << text;
    return error_of([&] { ModelConfig::from_yaml_file(dir / "m.yaml"); });
  };
  std::string msg = load_with("top_k: 2", "top_k: 9");
  EXPECT_NE(msg.find("m.yaml:9: top_k"), std::string::npos) << msg;
  EXPECT_NE(msg.find("must not exceed num_experts"), std::string::npos) << msg;
  msg = load_with("top_k: 2", "top_k: 2\nhiden_size: 3");
  EXPECT_NE(msg.find("m.yaml:10: hiden_size: unknown key"), std::string::npos) << msg;
  msg = load_with("num_kv_heads: 2", "num_kv_heads: 3");
  EXPECT_NE(msg.find("num_kv_heads"), std::string::npos) << msg;
  EXPECT_NE(msg.find("multiple"), std::string::npos) << msg;
  msg = load_with("hidden_size: 128", "hidden_size: -4");
  EXPECT_NE(msg.find("hidden_size"), std::string::npos) << msg;
  EXPECT_NE(msg.find("positive"), std::string::npos) << msg;
  msg = load_with("hidden_size: 128", "hidden_size: wide");
  EXPECT_NE(msg.find("expected an integer"), std::string::npos) << msg;
  msg = load_with("num_experts: 8", "num_experts: 300");
  EXPECT_NE(msg.find("at most 256"), std::string::npos) << msg;
  msg = load_with("router_score: softmax", "router_score: relu");
  EXPECT_NE(msg.find("router_score"), std::string::npos) << msg;
  msg = load_with("vocab_size: 128\n", "");
  EXPECT_NE(msg.find("vocab_size: required key is missing"), std::string::npos) << msg;
}

}  // namespace
}  // namespace kiln
