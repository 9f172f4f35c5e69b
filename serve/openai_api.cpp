// Parsing and checking OpenAI chat and completion requests into engine requests, and building the
// API's response and error objects from the engine's samples.
#include "serve/openai_api.h"

#include <ATen/ATen.h>

#include <set>

#include "core/error.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace kiln::serve {
namespace {

using json = nlohmann::json;

constexpr int64_t kMaxN = 128;

// What each endpoint accepts. Keys outside these are refused by name: a client that sends one
// expects it to act, and silence would sample something else than it asked for.
const std::set<std::string> kCommonKeys = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
                                           "stop_token_ids", "stream", "stream_options", "logprobs", "user",
                                           "frequency_penalty", "presence_penalty", "kiln"};
const std::set<std::string> kChatKeys = {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                         "parallel_tool_calls", "response_format", "chat_template_kwargs", "metadata",
                                         "store"};
const std::set<std::string> kCompletionKeys = {"prompt", "echo"};

ApiError bad(const std::string& param, const std::string& message) { return ApiError(400, message, param); }

int64_t int_in(const json& body, const char* key, int64_t lo, int64_t hi, int64_t fallback) {
  if (!body.contains(key) || body[key].is_null()) return fallback;
  const json& v = body[key];
  if (!v.is_number_integer()) throw bad(key, std::string("'") + key + "' must be an integer");
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi)
    throw bad(key, std::string("'") + key + "' must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                       "] (got " + std::to_string(x) + ")");
  return x;
}

double number_in(const json& body, const char* key, double lo, double hi, bool lo_open, double fallback) {
  if (!body.contains(key) || body[key].is_null()) return fallback;
  const json& v = body[key];
  if (!v.is_number()) throw bad(key, std::string("'") + key + "' must be a number");
  const double x = v.get<double>();
  if (x > hi || x < lo || (lo_open && x == lo))
    throw bad(key, std::string("'") + key + "' must be in " + (lo_open ? "(" : "[") + std::to_string(lo) + ", " +
                       std::to_string(hi) + "] (got " + std::to_string(x) + ")");
  return x;
}

bool flag(const json& body, const char* key) {
  if (!body.contains(key) || body[key].is_null()) return false;
  if (!body[key].is_boolean()) throw bad(key, std::string("'") + key + "' must be true or false");
  return body[key].get<bool>();
}

// The checks and fields chat and completions share: the body's shape, the model, unknown keys,
// what is not supported, and the sampling parameters (max_tokens is set once the prompt is known).
Job common(const json& body, const ServedModel& model, const std::set<std::string>& own, uint64_t default_seed) {
  if (!body.is_object()) throw ApiError(400, "the request body must be a JSON object");
  for (const auto& [key, value] : body.items())
    if (!kCommonKeys.count(key) && !own.count(key))
      throw bad(key, "unrecognized request argument supplied: " + key);
  if (!body.contains("model") || !body["model"].is_string()) throw bad("model", "'model' is required (a string)");
  const std::string name = body["model"].get<std::string>();
  if (name != model.name)
    throw ApiError(404, "the model '" + name + "' does not exist; this server serves '" + model.name + "'", "model",
                   "model_not_found");
  if (body.contains("stop") && !body["stop"].is_null() && !(body["stop"].is_array() && body["stop"].empty()))
    throw bad("stop", "stop strings are not supported; give token ids in 'stop_token_ids'");
  for (const char* penalty : {"frequency_penalty", "presence_penalty"})
    if (number_in(body, penalty, -2.0, 2.0, false, 0.0) != 0.0)
      throw bad(penalty, std::string("'") + penalty + "' is not supported (only 0)");
  Job job;
  job.stream = flag(body, "stream");
  if (body.contains("stream_options") && !body["stream_options"].is_null()) {
    const json& so = body["stream_options"];
    if (!job.stream) throw bad("stream_options", "'stream_options' is for streamed requests ('stream': true)");
    if (!so.is_object()) throw bad("stream_options", "'stream_options' must be an object");
    job.include_usage = flag(so, "include_usage");
  }
  rollout::SamplingParams& p = job.request.params;
  p.n = int_in(body, "n", 1, kMaxN, 1);
  p.temperature = number_in(body, "temperature", 0.0, 2.0, false, 1.0);
  p.top_p = number_in(body, "top_p", 0.0, 1.0, true, 1.0);
  p.top_k = int_in(body, "top_k", 0, model.vocab_size, 0);
  job.seeded = body.contains("seed") && !body["seed"].is_null();
  p.seed = job.seeded ? uint64_t(int_in(body, "seed", 0, std::numeric_limits<int64_t>::max(), 0)) : default_seed;
  if (body.contains("stop_token_ids") && !body["stop_token_ids"].is_null()) {
    const json& ids = body["stop_token_ids"];
    if (!ids.is_array()) throw bad("stop_token_ids", "'stop_token_ids' must be a list of token ids");
    for (const json& id : ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= model.vocab_size)
        throw bad("stop_token_ids", "'stop_token_ids' holds " + id.dump() + ", not a token id below " +
                                        std::to_string(model.vocab_size));
      p.stop_token_ids.push_back(id.get<int64_t>());
    }
  } else if (model.tokenizer) {
    p.stop_token_ids = model.tokenizer->stop_ids();
  }
  if (body.contains("kiln") && !body["kiln"].is_null()) {
    const json& k = body["kiln"];
    if (!k.is_object()) throw bad("kiln", "'kiln' must be an object, e.g. {\"routing\": true}");
    for (const auto& [key, value] : k.items())
      if (key != "routing") throw bad("kiln." + key, "unrecognized kiln argument: " + key + " (kiln takes routing)");
    job.routing = flag(k, "routing");
  }
  return job;
}

// The prompt's ids checked against the vocabulary and, with the generation, the context.
void finish(Job& job, const json& body, const ServedModel& model, const char* prompt_param,
            const std::vector<const char*>& max_keys, int64_t default_max) {
  const std::vector<int64_t>& ids = job.request.prompt;
  if (ids.empty()) throw bad(prompt_param, "the prompt encodes to no tokens");
  for (int64_t id : ids)
    if (id < 0 || id >= model.vocab_size)
      throw bad(prompt_param, "the prompt holds token id " + std::to_string(id) + ", outside the model's vocabulary of " +
                                  std::to_string(model.vocab_size));
  const int64_t room = model.context_length - int64_t(ids.size());
  if (room < 1)
    throw ApiError(400, "the prompt is " + std::to_string(ids.size()) + " tokens; this model's context is " +
                            std::to_string(model.context_length) + " tokens, with room for at least one generated",
                   prompt_param, "context_length_exceeded");
  int64_t max_tokens = std::min(default_max, room);
  for (const char* key : max_keys) {
    if (!body.contains(key) || body[key].is_null()) continue;
    max_tokens = int_in(body, key, 1, std::numeric_limits<int64_t>::max(), 0);
    if (max_tokens > room)
      throw ApiError(400, "the prompt (" + std::to_string(ids.size()) + " tokens) and '" + key + "' (" +
                              std::to_string(max_tokens) + ") pass this model's context of " +
                              std::to_string(model.context_length) + " tokens",
                     key, "context_length_exceeded");
  }
  job.request.params.max_tokens = max_tokens;
}

// A message's content: a string, or a list of text parts joined.
json text_content(const json& content, size_t i) {
  if (content.is_string() || content.is_null()) return content;
  const std::string param = "messages[" + std::to_string(i) + "].content";
  if (!content.is_array()) throw bad(param, "a message's content must be a string or a list of text parts");
  std::string text;
  for (const json& part : content) {
    if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string())
      throw bad(param, "only text parts ({\"type\": \"text\", \"text\": ...}) are supported in a message's content");
    text += part["text"].get<std::string>();
  }
  return text;
}

std::string decode(const text::Tokenizer& tok, const std::vector<int64_t>& ids) {
  return tok.decode(ids, /*skip_special_tokens=*/false);
}

// The generated ids a reader sees: without a final stop token.
std::vector<int64_t> visible(const rollout::Sample& s, const rollout::SamplingParams& p) {
  std::vector<int64_t> ids = s.tokens;
  if (s.finish == rollout::FinishReason::kStop && !ids.empty() &&
      std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), ids.back()) != p.stop_token_ids.end())
    ids.pop_back();
  return ids;
}

const char* finish_name(rollout::FinishReason r) { return r == rollout::FinishReason::kStop ? "stop" : "length"; }

json kiln_extras(const Job& job, const rollout::RequestOutput& out) {
  json choices = json::array();
  for (size_t i = 0; i < out.samples.size(); ++i) {
    const rollout::Sample& s = out.samples[i];
    json c = {{"index", i}, {"token_ids", s.tokens}, {"logprobs", s.logprobs}};
    if (job.routing && s.routing.defined()) {
      const at::Tensor r = s.routing.to(at::kCPU, at::kLong).contiguous();
      c["routing"] = {{"shape", r.sizes().vec()},
                      {"expert_ids", std::vector<int64_t>(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel())}};
    }
    choices.push_back(std::move(c));
  }
  return {{"prompt_token_ids", job.request.prompt}, {"choices", std::move(choices)}};
}

// What every response and chunk starts with.
json envelope(const char* object, const std::string& id, uint64_t created, const ServedModel& model, json choices) {
  return {{"id", id}, {"object", object}, {"created", created}, {"model", model.name}, {"choices", std::move(choices)}};
}

json usage(const Job& job, const rollout::RequestOutput& out) {
  int64_t generated = 0;
  for (const rollout::Sample& s : out.samples) generated += int64_t(s.tokens.size());
  const int64_t prompt = int64_t(job.request.prompt.size());
  return {{"prompt_tokens", prompt}, {"completion_tokens", generated}, {"total_tokens", prompt + generated}};
}

// One token's text and bytes (a piece may hold part of a UTF-8 character: its bytes are exact, its
// string is made valid when the response is written).
std::pair<std::string, std::vector<int>> piece(const text::Tokenizer& tok, int64_t id) {
  const std::string s = tok.token_bytes(id);
  std::vector<int> bytes;
  for (unsigned char c : s) bytes.push_back(c);
  return {s, bytes};
}

}  // namespace

ApiError::ApiError(int status_, const std::string& message, std::string param_, std::string code_, std::string type_)
    : std::runtime_error(message), status(status_), type(std::move(type_)), param(std::move(param_)),
      code(std::move(code_)) {}

json error_body(const ApiError& e) {
  return {{"error",
           {{"message", e.what()},
            {"type", e.type},
            {"param", e.param.empty() ? json() : json(e.param)},
            {"code", e.code.empty() ? json() : json(e.code)}}}};
}

Job parse_chat(const json& body, const ServedModel& model, uint64_t default_seed) {
  Job job = common(body, model, kChatKeys, default_seed);
  job.chat = true;
  if (!model.chat || !model.tokenizer)
    throw bad("messages", "this model's tokenizer has no chat template; use /v1/completions");
  if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
    throw bad("messages", "'messages' must be a non-empty list of {role, content} objects");
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  for (size_t i = 0; i < body["messages"].size(); ++i) {
    const json& m = body["messages"][i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw bad("messages[" + std::to_string(i) + "]", "each message must be an object with a string 'role'");
    nlohmann::ordered_json copy = nlohmann::ordered_json::parse(m.dump());
    if (m.contains("content")) copy["content"] = nlohmann::ordered_json::parse(text_content(m["content"], i).dump());
    messages.push_back(std::move(copy));
  }
  job.logprobs = flag(body, "logprobs");
  if (job.logprobs && job.stream)
    throw bad("logprobs", "'logprobs' while streaming is not supported yet; the last chunk's 'kiln' holds every log-prob");
  if (int_in(body, "top_logprobs", 0, 20, 0) > 0)
    throw bad("top_logprobs", "'top_logprobs' is not supported yet (each sampled token's log-prob is: logprobs true)");
  if (body.contains("tool_choice") && !body["tool_choice"].is_null() &&
      !(body["tool_choice"].is_string() && (body["tool_choice"] == "auto" || body["tool_choice"] == "none")))
    throw bad("tool_choice", "'tool_choice' may be \"auto\" or \"none\"; the model decides when to call a tool");
  if (body.contains("response_format") && !body["response_format"].is_null() &&
      body["response_format"].value("type", "") != "text")
    throw bad("response_format", "only {\"type\": \"text\"} is supported as 'response_format'");
  text::ChatOptions options;
  options.add_generation_prompt = true;
  options.bos_token = model.tokenizer->bos_token();
  options.eos_token = model.tokenizer->eos_token();
  if (body.contains("tools") && !body["tools"].is_null()) {
    if (!body["tools"].is_array()) throw bad("tools", "'tools' must be a list");
    options.tools = nlohmann::ordered_json::parse(body["tools"].dump());
  }
  if (body.contains("chat_template_kwargs") && !body["chat_template_kwargs"].is_null()) {
    if (!body["chat_template_kwargs"].is_object()) throw bad("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    options.extra = nlohmann::ordered_json::parse(body["chat_template_kwargs"].dump());
  }
  try {
    job.prompt_text = text::apply_chat_template(*model.chat, messages, options);
  } catch (const std::exception& e) {
    throw bad("messages", std::string("the chat template could not render these messages: ") + e.what());
  }
  job.request.prompt = model.tokenizer->encode(job.prompt_text, /*add_special_tokens=*/false);
  finish(job, body, model, "messages", {"max_tokens", "max_completion_tokens"}, model.context_length);
  return job;
}

Job parse_completion(const json& body, const ServedModel& model, uint64_t default_seed) {
  Job job = common(body, model, kCompletionKeys, default_seed);
  if (!body.contains("prompt")) throw bad("prompt", "'prompt' is required: a string or a list of token ids");
  json prompt = body["prompt"];
  if (prompt.is_array() && prompt.size() == 1 && (prompt[0].is_string() || prompt[0].is_array())) prompt = prompt[0];
  if (prompt.is_string()) {
    if (!model.tokenizer) throw bad("prompt", "this server has no tokenizer; give the prompt as token ids");
    job.prompt_text = prompt.get<std::string>();
    job.request.prompt = model.tokenizer->encode(job.prompt_text, /*add_special_tokens=*/true);
  } else if (prompt.is_array() && !prompt.empty() && std::all_of(prompt.begin(), prompt.end(), [](const json& v) {
               return v.is_number_integer();
             })) {
    job.request.prompt = prompt.get<std::vector<int64_t>>();
    if (model.tokenizer) {
      for (int64_t id : job.request.prompt)
        if (id < 0 || id >= model.vocab_size) throw bad("prompt", "the prompt holds token id " + std::to_string(id) +
                                                                      ", outside the model's vocabulary of " +
                                                                      std::to_string(model.vocab_size));
      job.prompt_text = decode(*model.tokenizer, job.request.prompt);
    }
  } else {
    throw bad("prompt", "'prompt' must be one string or one list of token ids (one prompt per request)");
  }
  if (job.stream && !model.tokenizer) throw bad("stream", "streaming needs the server's tokenizer");
  job.echo = flag(body, "echo");
  if (job.echo && job.stream) throw bad("echo", "'echo' while streaming is not supported yet");
  const int64_t logprobs = int_in(body, "logprobs", 0, 5, 0);
  if (logprobs > 1)
    throw bad("logprobs", "'logprobs' above 1 (alternatives per token) is not supported yet; 1 gives each sampled token's");
  job.logprobs = logprobs == 1;
  if (job.logprobs && job.stream)
    throw bad("logprobs", "'logprobs' while streaming is not supported yet; the last chunk's 'kiln' holds every log-prob");
  if (job.echo && job.logprobs) throw bad("echo", "'echo' with 'logprobs' (the prompt's log-probs) is not supported yet");
  finish(job, body, model, "prompt", {"max_tokens"}, 16);
  return job;
}

json chat_response(const Job& job, const rollout::RequestOutput& out, const ServedModel& model, const std::string& id,
                   uint64_t created) {
  json choices = json::array();
  for (size_t i = 0; i < out.samples.size(); ++i) {
    const rollout::Sample& s = out.samples[i];
    const std::vector<int64_t> ids = visible(s, job.request.params);
    json c = {{"index", i},
              {"message", {{"role", "assistant"}, {"content", decode(*model.tokenizer, ids)}}},
              {"logprobs", nullptr},
              {"finish_reason", finish_name(s.finish)}};
    if (job.logprobs) {
      json content = json::array();
      for (size_t t = 0; t < ids.size(); ++t) {
        auto [token, bytes] = piece(*model.tokenizer, ids[t]);
        content.push_back({{"token", token}, {"logprob", s.logprobs[t]}, {"bytes", bytes}, {"top_logprobs", json::array()}});
      }
      c["logprobs"] = {{"content", std::move(content)}};
    }
    choices.push_back(std::move(c));
  }
  json r = envelope("chat.completion", id, created, model, std::move(choices));
  r["usage"] = usage(job, out);
  r["kiln"] = kiln_extras(job, out);
  return r;
}

json completion_response(const Job& job, const rollout::RequestOutput& out, const ServedModel& model,
                         const std::string& id, uint64_t created) {
  json choices = json::array();
  for (size_t i = 0; i < out.samples.size(); ++i) {
    const rollout::Sample& s = out.samples[i];
    const std::vector<int64_t> ids = visible(s, job.request.params);
    const std::string text = model.tokenizer ? decode(*model.tokenizer, ids) : std::string();
    json c = {{"index", i},
              {"text", job.echo ? job.prompt_text + text : text},
              {"logprobs", nullptr},
              {"finish_reason", finish_name(s.finish)}};
    if (job.logprobs && model.tokenizer) {
      json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
      int64_t offset = 0;
      for (size_t t = 0; t < ids.size(); ++t) {
        const std::string token = piece(*model.tokenizer, ids[t]).first;
        tokens.push_back(token);
        lps.push_back(s.logprobs[t]);
        tops.push_back({{token, s.logprobs[t]}});
        offsets.push_back(offset);
        offset += int64_t(token.size());
      }
      c["logprobs"] = {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
    }
    choices.push_back(std::move(c));
  }
  json r = envelope("text_completion", id, created, model, std::move(choices));
  r["usage"] = usage(job, out);
  r["kiln"] = kiln_extras(job, out);
  return r;
}

json models_response(const ServedModel& model) {
  return {{"object", "list"},
          {"data", json::array({{{"id", model.name}, {"object", "model"}, {"created", model.created}, {"owned_by", "kiln"}}})}};
}

json stream_chunk(const Job& job, const ServedModel& model, const std::string& id, uint64_t created, int64_t index,
                  const std::string& text, const char* finish, bool first) {
  json choice = {{"index", index}, {"logprobs", nullptr}, {"finish_reason", finish ? json(finish) : json()}};
  if (job.chat) {
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (!finish) delta["content"] = text;
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = text;
  }
  return envelope(job.chat ? "chat.completion.chunk" : "text_completion", id, created, model,
                  json::array({std::move(choice)}));
}

json stream_last_chunk(const Job& job, const rollout::RequestOutput& out, const ServedModel& model,
                       const std::string& id, uint64_t created) {
  json chunk = envelope(job.chat ? "chat.completion.chunk" : "text_completion", id, created, model, json::array());
  chunk["kiln"] = kiln_extras(job, out);
  if (job.include_usage) chunk["usage"] = usage(job, out);
  return chunk;
}

}  // namespace kiln::serve
