// Chat templates: renders a tokenizer's `chat_template` (a Jinja subset) exactly as transformers'
// apply_chat_template(..., tokenize=False) does. The engine lives in text/jinja_*; this is its public face.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace kiln::text {

namespace jinja {
struct Stmt;
}

// Contexts are ordered_json so that key order survives: transformers' tojson prints dict keys in insertion
// order, and a tool schema rendered with sorted keys would not match. A nlohmann::json converts implicitly
// (its keys are already sorted by then).
class ChatTemplate {
 public:
  // Parses once; syntax errors and unsupported filters/tests/tags read "chat template <name>:<line>:<col>: ...".
  ChatTemplate(std::string source, std::string name);

  // Renders with `context`, a JSON object (messages, tools, add_generation_prompt, bos_token, eos_token and
  // any extra kwargs). Errors, including the template's raise_exception, name the template and position.
  std::string render(const nlohmann::ordered_json& context) const;

  const std::string& name() const { return name_; }
  const std::string& source() const { return source_; }

 private:
  std::string source_;
  std::string name_;
  std::shared_ptr<const std::vector<std::unique_ptr<jinja::Stmt>>> body_;
};

struct ChatOptions {
  bool add_generation_prompt = true;
  nlohmann::ordered_json tools;                                     // null: no tools (the template sees none)
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();  // enable_thinking, reasoning_effort, ...
  std::string bos_token, eos_token;                                 // "" leaves the variable undefined
};

// Renders `messages` (a JSON array of {role, content, ...}) like transformers' apply_chat_template with
// tokenize=False: the context is messages, tools, documents (null), add_generation_prompt, the special tokens
// and the extra kwargs, which may override the special tokens but not the other three.
std::string apply_chat_template(const ChatTemplate& t, const nlohmann::ordered_json& messages,
                                const ChatOptions& options);

}  // namespace kiln::text
