// Fuzz target: a chat template (Jinja subset) parsed and rendered with a small conversation.
// Only kiln::Error may come out; rendering must end (loops are bounded by the data).
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "text/chat_template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const nlohmann::ordered_json context = nlohmann::ordered_json::parse(R"({
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
                 {"role": "assistant", "content": "5", "reasoning_content": "2 + 3 = 5"},
                 {"role": "user", "content": [{"type": "text", "text": "and 4 * 4?"}]}],
    "tools": [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}],
    "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>", "enable_thinking": false})");
  try {
    kiln::text::ChatTemplate t(std::string(reinterpret_cast<const char*>(data), size), "fuzz");
    (void)t.render(context);
  } catch (const kiln::Error&) {
  }
  return 0;
}
