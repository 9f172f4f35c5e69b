// The data: section's JSONL keys and the prompt: section of a recipe: read strictly (errors at
// file:line) and written back in the resolved recipe, in the same key order. Apart from
// dataset.cpp so that fuzz_jsonl builds the JSONL reader without the YAML one.
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include "core/yaml_util.h"
#include "text/unicode.h"
#include "trainer/dataset.h"

namespace kiln::trainer {

namespace {

const char* chat_mode_name(ChatMode m) {
  return m == ChatMode::kAlways ? "always" : m == ChatMode::kNever ? "never" : "auto";
}

// A free-form YAML value (template variables) as JSON: scalars become booleans, integers, numbers
// or strings, as YAML 1.2's core schema reads them.
nlohmann::json yaml_to_json(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return nullptr;
  if (n.IsMap()) {
    nlohmann::json j = nlohmann::json::object();
    for (const auto& kv : n) j[kv.first.Scalar()] = yaml_to_json(kv.second);  // keys: names (yaml::load_file)
    return j;
  }
  if (n.IsSequence()) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& v : n) j.push_back(yaml_to_json(v));
    return j;
  }
  const std::string text = n.Scalar();
  if (n.Tag() == "!") return text;  // quoted: a string whatever it looks like
  if (text == "true" || text == "True") return true;
  if (text == "false" || text == "False") return false;
  try {
    size_t used = 0;
    const long long i = std::stoll(text, &used);
    if (used == text.size()) return i;
    const double d = std::stod(text, &used);
    if (used == text.size()) return d;
  } catch (const std::exception&) {
  }
  return text;
}

void write_json(YAML::Emitter& e, const nlohmann::json& j) {
  if (j.is_object()) {
    e << YAML::BeginMap;
    for (auto& [k, v] : j.items()) {
      e << YAML::Key << k << YAML::Value;
      write_json(e, v);
    }
    e << YAML::EndMap;
  } else if (j.is_array()) {
    e << YAML::BeginSeq;
    for (const auto& v : j) write_json(e, v);
    e << YAML::EndSeq;
  } else if (j.is_string()) {
    e << YAML::DoubleQuoted << j.get<std::string>();
  } else if (j.is_null()) {
    e << YAML::Null;
  } else {
    e << j.dump();
  }
}

}  // namespace

void read_yaml(yaml::MapReader& d, JsonlOptions& o) {
  d.get("data_source", o.data_source);
  std::string bad = o.bad_lines == BadLines::kSkip ? "skip" : "error";
  d.get("bad_lines", bad);
  if (bad != "error" && bad != "skip") d.fail("bad_lines", "must be error or skip (got " + bad + ")");
  o.bad_lines = bad == "skip" ? BadLines::kSkip : BadLines::kError;
  auto k = d.child("keys");
  k.get("prompt", o.keys.prompt);
  k.get("label", o.keys.label);
  k.get("data_source", o.keys.data_source);
  k.get("metadata", o.keys.metadata);
  k.finish();
  if (o.keys.prompt.empty()) k.fail("prompt", "the prompt key cannot be empty");
}

void write_yaml(YAML::Emitter& e, const JsonlOptions& o) {
  if (!o.data_source.empty()) e << YAML::Key << "data_source" << YAML::Value << o.data_source;
  e << YAML::Key << "bad_lines" << YAML::Value << (o.bad_lines == BadLines::kSkip ? "skip" : "error");
  e << YAML::Key << "keys" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "prompt" << YAML::Value << o.keys.prompt;
  e << YAML::Key << "label" << YAML::Value << o.keys.label;
  e << YAML::Key << "data_source" << YAML::Value << o.keys.data_source;
  e << YAML::Key << "metadata" << YAML::Value << o.keys.metadata;
  e << YAML::EndMap;
}

void read_yaml(yaml::MapReader& p, PromptFormat& f) {
  std::string chat = chat_mode_name(f.chat);
  p.get("chat", chat);
  if (chat != "auto" && chat != "always" && chat != "never")
    p.fail("chat", "must be auto (chats through the template, text as it is), always or never (got " + chat + ")");
  f.chat = chat == "always" ? ChatMode::kAlways : chat == "never" ? ChatMode::kNever : ChatMode::kAuto;
  p.get("system", f.system_prompt);
  // Prompts and template variables become JSON for the chat template: text must be UTF-8.
  if (!text::unicode::is_valid_utf8(f.system_prompt)) p.fail("system", "must be UTF-8 text");
  p.get("add_generation_prompt", f.add_generation_prompt);
  int64_t max_prompt_tokens = f.max_prompt_tokens.value_or(0);  // 0: no limit; a negative fails in validate
  p.get("max_prompt_tokens", max_prompt_tokens);
  f.max_prompt_tokens = max_prompt_tokens != 0 ? std::optional<int64_t>(max_prompt_tokens) : std::nullopt;
  const YAML::Node kw = p.raw("template_kwargs");
  if (kw.IsDefined()) {
    if (!kw.IsMap()) p.fail("template_kwargs", "must be a mapping of template variables, e.g. {enable_thinking: false}");
    try {
      f.template_kwargs = yaml_to_json(kw).dump();
    } catch (const nlohmann::json::exception&) {  // found by fuzz_recipe: invalid UTF-8 ended the run
      p.fail("template_kwargs", "must be UTF-8 text");
    }
  }
  p.finish();
  p.check("", [&] { f.validate(); });
}

void write_yaml(YAML::Emitter& e, const PromptFormat& f) {
  e << YAML::Key << "chat" << YAML::Value << chat_mode_name(f.chat);
  if (!f.system_prompt.empty()) e << YAML::Key << "system" << YAML::Value << YAML::DoubleQuoted << f.system_prompt;
  e << YAML::Key << "add_generation_prompt" << YAML::Value << f.add_generation_prompt;
  e << YAML::Key << "max_prompt_tokens" << YAML::Value << f.max_prompt_tokens.value_or(0);
  e << YAML::Key << "template_kwargs" << YAML::Value;
  write_json(e, nlohmann::json::parse(f.template_kwargs));
}

}  // namespace kiln::trainer
