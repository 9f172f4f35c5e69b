// The OpenAI API's shapes over kiln's rollout engine: chat and completion requests parsed and
// checked into engine requests, responses built from what the engine sampled (with the exact token
// ids and log-probs under "kiln"), and errors in the API's error shape.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "rollout/engine.h"

namespace kiln::text {
class Tokenizer;
class ChatTemplate;
}  // namespace kiln::text

namespace kiln::serve {

// A request the API refuses: its HTTP status and the error object's fields.
struct ApiError : std::runtime_error {
  ApiError(int status, const std::string& message, std::string param = "", std::string code = "",
           std::string type = "invalid_request_error");
  int status;
  std::string type, param, code;
};

// {"error": {"message", "type", "param", "code"}}, param and code null when empty.
nlohmann::json error_body(const ApiError& e);

// What the server serves: the model's name in the API, its tokenizer and chat template (null: the
// tokenizer has none, and chat requests are refused), and the longest sequence it runs.
struct ServedModel {
  std::string name;
  const text::Tokenizer* tokenizer = nullptr;
  const text::ChatTemplate* chat = nullptr;
  int64_t vocab_size = 0;
  int64_t context_length = 0;  // prompt + generated tokens
  uint64_t created = 0;        // /v1/models' "created" (the server's start)
};

// One API call as the engine runs it.
struct Job {
  bool chat = false;
  rollout::Request request;  // prompt ids and sampling parameters (n included)
  std::string prompt_text;   // the rendered chat, or the completion's text prompt
  bool logprobs = false;     // return each sampled token's log-prob
  bool echo = false;         // completions: the prompt before each choice's text
  bool routing = false;      // kiln extension: each choice's routing record
  bool seeded = false;       // the request gave a seed
  bool stream = false;       // server-sent events, a chunk per token
  bool include_usage = false;  // stream_options.include_usage: usage in the last chunk
};

// POST /v1/chat/completions and /v1/completions bodies -> a job, or an ApiError naming the field.
// Unsupported parameters (stop strings, top_logprobs > 0, logprobs while streaming, several
// prompts) are refused by name rather than ignored. `default_seed` serves a request without "seed".
Job parse_chat(const nlohmann::json& body, const ServedModel& model, uint64_t default_seed);
Job parse_completion(const nlohmann::json& body, const ServedModel& model, uint64_t default_seed);

// The response objects: OpenAI's fields, with "kiln": {"prompt_token_ids", "choices": [{"token_ids",
// "logprobs", "routing"?}]}, the ids exactly as sampled (a stop token included, as the trainer sees
// it) while "content" / "text" leave a final stop token out.
nlohmann::json chat_response(const Job& job, const rollout::RequestOutput& out, const ServedModel& model,
                             const std::string& id, uint64_t created);
nlohmann::json completion_response(const Job& job, const rollout::RequestOutput& out, const ServedModel& model,
                                   const std::string& id, uint64_t created);
nlohmann::json models_response(const ServedModel& model);

// Streaming: choice `index`'s next piece of text (chat: a delta, with the role in the first), or
// with `finish` its last chunk; and the stream's last chunk, with no choices: usage (when asked
// for) and kiln's extras. Each is one server-sent event's data.
nlohmann::json stream_chunk(const Job& job, const ServedModel& model, const std::string& id, uint64_t created,
                            int64_t index, const std::string& text, const char* finish, bool first);
nlohmann::json stream_last_chunk(const Job& job, const rollout::RequestOutput& out, const ServedModel& model,
                                 const std::string& id, uint64_t created);

}  // namespace kiln::serve
