// Chat templates: parse once, render a context, and build transformers' apply_chat_template context.
#include "text/chat_template.h"

#include "core/error.h"
#include "text/jinja_eval.h"
#include "text/jinja_parser.h"

namespace kiln::text {

ChatTemplate::ChatTemplate(std::string source, std::string name) : source_(std::move(source)), name_(std::move(name)) {
  try {
    auto body = std::make_shared<jinja::Body>(jinja::parse_template(source_));
    jinja::check_supported(*body);
    body_ = std::move(body);
  } catch (const jinja::TemplateError& e) {
    KILN_FAIL("chat template ", name_, ":", e.pos.line, ":", e.pos.col, ": ", e.what(),
              "; fix the template or keep to the Jinja subset kiln renders (text/README.md)");
  }
}

std::string ChatTemplate::render(const nlohmann::ordered_json& context) const {
  KILN_CHECK(context.is_object(), "chat template ", name_,
             ": the render context must be a JSON object (type=", context.type_name(),
             "); pass {\"messages\": [...], ...}");
  try {
    std::unordered_map<std::string, jinja::Value> vars;
    for (auto it = context.begin(); it != context.end(); ++it) vars[it.key()] = jinja::from_json(it.value());
    return jinja::render(*body_, vars);
  } catch (const jinja::TemplateError& e) {
    KILN_FAIL("chat template ", name_, ":", e.pos.line, ":", e.pos.col, ": ", e.what(),
              "; check the conversation against what the template expects");
  }
}

std::string apply_chat_template(const ChatTemplate& t, const nlohmann::ordered_json& messages,
                                const ChatOptions& options) {
  KILN_CHECK(messages.is_array(), "apply_chat_template: messages must be a JSON array (type=", messages.type_name(),
             ", template=", t.name(), "); pass [{\"role\": ..., \"content\": ...}, ...]");
  KILN_CHECK(options.extra.is_object(),
             "apply_chat_template: ChatOptions::extra must be a JSON object (type=", options.extra.type_name(),
             "); put kwargs such as enable_thinking in an object");
  for (const char* reserved : {"messages", "tools", "add_generation_prompt"}) {
    KILN_CHECK(!options.extra.contains(reserved), "apply_chat_template: ChatOptions::extra sets '", reserved,
               "' (template=", t.name(), "); use the ChatOptions field or the messages argument instead");
  }
  // The order transformers uses: render(messages=, tools=, documents=, add_generation_prompt=,
  // **special_tokens, **kwargs); a special token that is None there is simply absent.
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  context["messages"] = messages;
  context["tools"] = options.tools;
  context["documents"] = nullptr;
  context["add_generation_prompt"] = options.add_generation_prompt;
  if (!options.bos_token.empty()) context["bos_token"] = options.bos_token;
  if (!options.eos_token.empty()) context["eos_token"] = options.eos_token;
  for (auto it = options.extra.begin(); it != options.extra.end(); ++it) context[it.key()] = it.value();
  return t.render(context);
}

}  // namespace kiln::text
