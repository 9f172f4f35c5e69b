// kiln serve in process: a small model behind the HTTP server on a free port, called with
// cpp-httplib's client. Chat (rendered by a ChatML template) and completions (text and token ids)
// return exactly what the engine samples for the same request and seed, token ids and log-probs,
// streamed or not; concurrent clients each get their own answer; bad requests get the OpenAI error
// shape and the server keeps serving; the API key is checked.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <thread>

#include "model/muse.h"
#include "rollout/engine.h"
#include "serve/server.h"
#include "tests/test_util.h"
#include "tests/trainer/small_model.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "text/unicode.h"

namespace kiln::serve {
namespace {

using json = nlohmann::json;

constexpr int64_t kImStart = 256, kImEnd = 257;

// A byte-level tokenizer (no merges) with ChatML's two specials and a ChatML chat template.
std::unique_ptr<text::Tokenizer> chatml_tokenizer(const std::string& dir) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[text::unicode::byte_level_char(uint8_t(b))] = b;
  const json tok = {
      {"version", "1.0"},
      {"added_tokens", json::array({{{"id", kImStart}, {"content", "<|im_start|>"}, {"special", true}, {"normalized", false}},
                                    {{"id", kImEnd}, {"content", "<|im_end|>"}, {"special", true}, {"normalized", false}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}}};
  std::ofstream(dir + "/tokenizer.json") << tok.dump();
  const json config = {
      {"eos_token", "<|im_end|>"},
      {"chat_template",
       "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
       "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"}};
  std::ofstream(dir + "/tokenizer_config.json") << config.dump();
  return text::load_tokenizer(dir);
}

model::ModelConfig config() {
  model::ModelConfig c = test::byte_vocab_config();
  c.vocab_size = 260;
  c.max_position_embeddings = 512;
  return c;
}

// The server on a free port with its own engine; `reference` is a second engine on the same
// weights, for what the same request samples outside the server.
struct Served {
  explicit Served(std::string api_key = "")
      : model(model::Muse::init(config(), 3, at::kFloat, at::kCPU)),
        tokenizer(chatml_tokenizer(dir.path())),
        chat(tokenizer->chat_template(), "chatml"),
        engine(model, rollout::EngineConfig()),
        reference(model, rollout::EngineConfig()) {
    ServedModel m;
    m.name = "tiny";
    m.tokenizer = tokenizer.get();
    m.chat = &chat;
    m.vocab_size = config().vocab_size;
    m.context_length = config().max_position_embeddings;
    ServeOptions o;
    o.port = 0;
    o.api_key = std::move(api_key);
    server = std::make_unique<Server>(engine, m, o);
    port = server->bind();
    thread = std::thread([this] { server->run(); });
  }
  ~Served() {
    server->stop();
    thread.join();
  }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(120, 0);
    c.set_write_timeout(120, 0);
    return c;
  }
  std::pair<int, json> post(const std::string& path, const json& body, const std::string& key = "") const {
    httplib::Client c = client();
    httplib::Headers h;
    if (!key.empty()) h.emplace("Authorization", "Bearer " + key);
    // A connection the client saw cut before any answer is tried again, as OpenAI's clients do
    // (seen here only with many clients on 2 loaded cores); an HTTP answer is never retried.
    auto res = c.Post(path, h, body.dump(), "application/json");
    for (int retry = 0; retry < 2 && !res; ++retry) res = c.Post(path, h, body.dump(), "application/json");
    if (!res) return {0, json{{"client_error", httplib::to_string(res.error())}}};
    return {res->status, json::parse(res->body)};
  }
  rollout::Sample sample(const std::vector<int64_t>& prompt, const rollout::SamplingParams& p) {
    return reference.generate({rollout::Request{prompt, p}})[0].samples[0];
  }

  test::TempDir dir;
  model::Muse model;
  std::unique_ptr<text::Tokenizer> tokenizer;
  text::ChatTemplate chat;
  rollout::Engine engine, reference;
  std::unique_ptr<Server> server;
  int port = 0;
  std::thread thread;
};

rollout::SamplingParams params(int64_t max_tokens, uint64_t seed, std::vector<int64_t> stop = {kImEnd}) {
  rollout::SamplingParams p;
  p.max_tokens = max_tokens;
  p.seed = seed;
  p.stop_token_ids = std::move(stop);
  return p;
}

void expect_error(const std::pair<int, json>& r, int status, const std::string& param, const std::string& part) {
  EXPECT_EQ(r.first, status) << r.second.dump();
  ASSERT_TRUE(r.second.contains("error")) << r.second.dump();
  const json& e = r.second["error"];
  EXPECT_TRUE(e.contains("message") && e.contains("type") && e.contains("param") && e.contains("code")) << e.dump();
  if (!param.empty()) EXPECT_EQ(e["param"], param) << e.dump();
  EXPECT_NE(e["message"].get<std::string>().find(part), std::string::npos) << e.dump();
}

TEST(Serve, ChatIsTheEnginesSampleTokenForToken) {
  Served s;
  const json messages = json::array({{{"role", "user"}, {"content", "2+3="}}});
  const auto [status, body] = s.post("/v1/chat/completions", {{"model", "tiny"}, {"messages", messages}, {"max_tokens", 12},
                                                              {"seed", 7}, {"logprobs", true}, {"n", 2}});
  ASSERT_EQ(status, 200) << body.dump();
  const std::string rendered = "<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n";
  const std::vector<int64_t> prompt = s.tokenizer->encode(rendered);
  EXPECT_EQ(body["kiln"]["prompt_token_ids"].get<std::vector<int64_t>>(), prompt);
  rollout::SamplingParams p = params(12, 7);
  p.n = 2;
  const rollout::RequestOutput ref = s.reference.generate({rollout::Request{prompt, p}})[0];
  ASSERT_EQ(body["choices"].size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const rollout::Sample& want = ref.samples[i];
    const json& got = body["kiln"]["choices"][i];
    EXPECT_EQ(got["token_ids"].get<std::vector<int64_t>>(), want.tokens) << i;
    EXPECT_EQ(got["logprobs"].get<std::vector<float>>(), want.logprobs) << i;
    std::vector<int64_t> shown = want.tokens;
    if (!shown.empty() && shown.back() == kImEnd) shown.pop_back();
    EXPECT_EQ(body["choices"][i]["message"]["content"], s.tokenizer->decode(shown)) << i;
    EXPECT_EQ(body["choices"][i]["finish_reason"], want.tokens.back() == kImEnd ? "stop" : "length");
    EXPECT_EQ(body["choices"][i]["logprobs"]["content"].size(), shown.size());
  }
  EXPECT_EQ(body["object"], "chat.completion");
  EXPECT_EQ(body["usage"]["prompt_tokens"], int64_t(prompt.size()));
  EXPECT_EQ(body["usage"]["completion_tokens"], int64_t(ref.samples[0].tokens.size() + ref.samples[1].tokens.size()));
}

TEST(Serve, CompletionsFromTextAndFromIdsAndTheModelsList) {
  Served s;
  const std::vector<int64_t> ids = {10, 20, 30, 40};
  const auto [status, body] = s.post("/v1/completions", {{"model", "tiny"}, {"prompt", ids}, {"max_tokens", 9}, {"seed", 3},
                                                         {"temperature", 0.7}, {"logprobs", 1}, {"kiln", {{"routing", true}}}});
  ASSERT_EQ(status, 200) << body.dump();
  rollout::SamplingParams p = params(9, 3);
  p.temperature = 0.7;
  const rollout::Sample want = s.sample(ids, p);
  EXPECT_EQ(body["kiln"]["choices"][0]["token_ids"].get<std::vector<int64_t>>(), want.tokens);
  EXPECT_EQ(body["kiln"]["choices"][0]["logprobs"].get<std::vector<float>>(), want.logprobs);
  EXPECT_EQ(body["kiln"]["choices"][0]["routing"]["shape"][0], int64_t(ids.size() + want.tokens.size()));
  EXPECT_EQ(body["object"], "text_completion");
  EXPECT_FALSE(body["choices"][0]["logprobs"]["tokens"].empty());

  const auto text = s.post("/v1/completions", {{"model", "tiny"}, {"prompt", "hi"}, {"max_tokens", 5}, {"seed", 1}, {"echo", true}});
  ASSERT_EQ(text.first, 200) << text.second.dump();
  EXPECT_EQ(text.second["kiln"]["prompt_token_ids"].get<std::vector<int64_t>>(), s.tokenizer->encode("hi", true));
  EXPECT_EQ(text.second["choices"][0]["text"].get<std::string>().rfind("hi", 0), 0u) << "echo puts the prompt first";

  httplib::Client c = s.client();
  const auto models = c.Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(json::parse(models->body)["data"][0]["id"], "tiny");
  const auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

// Many clients at once: the engine batches them, and each gets the sample of its own seed.
TEST(Serve, ConcurrentClientsEachGetTheirOwnAnswer) {
  Served s;
  constexpr int kClients = 64;
  std::vector<std::future<std::pair<int, json>>> answers;
  for (int i = 0; i < kClients; ++i)
    answers.push_back(std::async(std::launch::async, [&s, i] {
      return s.post("/v1/completions", {{"model", "tiny"}, {"prompt", std::vector<int64_t>{5, 6, int64_t(7 + i)}},
                                        {"max_tokens", 6}, {"seed", 100 + i}});
    }));
  for (int i = 0; i < kClients; ++i) {
    const auto [status, body] = answers[size_t(i)].get();
    ASSERT_EQ(status, 200) << body.dump();
    const rollout::Sample want = s.sample({5, 6, int64_t(7 + i)}, params(6, uint64_t(100 + i)));
    EXPECT_EQ(body["kiln"]["choices"][0]["token_ids"].get<std::vector<int64_t>>(), want.tokens) << "client " << i;
  }
}

// The server-sent events of a streamed call: every "data: " payload, [DONE] included.
std::vector<std::string> events(const std::string& body) {
  std::vector<std::string> out;
  for (size_t at = 0; at < body.size();) {
    const size_t end = body.find("\n\n", at);
    const std::string event = body.substr(at, end == std::string::npos ? std::string::npos : end - at);
    EXPECT_EQ(event.rfind("data: ", 0), 0u) << event;
    out.push_back(event.substr(6));
    at = end == std::string::npos ? body.size() : end + 2;
  }
  return out;
}

// Streamed, a call gives the same samples as unstreamed: each choice's deltas add up to its text,
// its last chunk has the finish reason, the last event before [DONE] holds the usage and the ids.
TEST(Serve, StreamingGivesTheSameSamplesChunkByChunk) {
  Served s;
  const json msgs = json::array({{{"role", "user"}, {"content", "hello"}}});
  for (const std::string path : {"/v1/chat/completions", "/v1/completions"}) {
    const bool chat = path == "/v1/chat/completions";
    json body = {{"model", "tiny"}, {"max_tokens", 20}, {"seed", 11}, {"n", 2}, {"temperature", 0.8}};
    if (chat) body["messages"] = msgs;
    else body["prompt"] = "12+34=";
    const auto whole = s.post(path, body);
    ASSERT_EQ(whole.first, 200) << whole.second.dump();
    body["stream"] = true;
    body["stream_options"] = {{"include_usage", true}};
    httplib::Client c = s.client();
    const auto res = c.Post(path, body.dump(), "application/json");
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200) << res->body;
    EXPECT_NE(res->get_header_value("Content-Type").find("text/event-stream"), std::string::npos);
    const std::vector<std::string> ev = events(res->body);
    ASSERT_GE(ev.size(), 3u);
    EXPECT_EQ(ev.back(), "[DONE]");
    std::vector<std::string> texts(2);
    std::vector<std::string> finish(2);
    size_t chunks = 0;
    for (size_t i = 0; i + 2 < ev.size(); ++i) {
      const json chunk = json::parse(ev[i]);
      EXPECT_EQ(chunk["object"], chat ? "chat.completion.chunk" : "text_completion") << ev[i];
      ASSERT_EQ(chunk["choices"].size(), 1u) << ev[i];
      const json& choice = chunk["choices"][0];
      const size_t k = choice["index"].get<size_t>();
      ASSERT_LT(k, 2u);
      EXPECT_TRUE(finish[k].empty()) << "a chunk after choice " << k << "'s finish";
      if (!choice["finish_reason"].is_null()) finish[k] = choice["finish_reason"];
      else texts[k] += chat ? choice["delta"].value("content", "") : choice["text"].get<std::string>();
      ++chunks;
    }
    EXPECT_GT(chunks, 4u) << "the text came in one piece, not as it was drawn";
    const json last = json::parse(ev[ev.size() - 2]);
    EXPECT_TRUE(last["choices"].empty());
    EXPECT_EQ(last["usage"], whole.second["usage"]);
    for (size_t k = 0; k < 2; ++k) {
      const json& want = whole.second["choices"][k];
      EXPECT_EQ(texts[k], chat ? want["message"]["content"] : want["text"]) << path << " choice " << k;
      EXPECT_EQ(finish[k], want["finish_reason"]) << path << " choice " << k;
      EXPECT_EQ(last["kiln"]["choices"][k]["token_ids"], whole.second["kiln"]["choices"][k]["token_ids"]) << path;
    }
  }
  const json bad = {{"model", "tiny"}, {"messages", msgs}, {"stream", true}, {"logprobs", true}};
  expect_error(s.post("/v1/chat/completions", bad), 400, "logprobs", "streaming");
}

TEST(Serve, BadRequestsGetTheApiErrorShapeAndTheServerGoesOn) {
  Served s("sesame");
  const json msgs = json::array({{{"role", "user"}, {"content", "hi"}}});
  expect_error(s.post("/v1/chat/completions", {{"model", "tiny"}, {"messages", msgs}}), 401, "", "API key");
  expect_error(s.post("/v1/chat/completions", {{"model", "tiny"}, {"messages", msgs}}, "sesamf"), 401, "", "API key");
  auto call = [&](const std::string& path, const json& body) { return s.post(path, body, "sesame"); };
  expect_error(call("/v1/chat/completions", {{"model", "other"}, {"messages", msgs}}), 404, "model", "does not exist");
  expect_error(call("/v1/chat/completions", {{"messages", msgs}}), 400, "model", "required");
  expect_error(call("/v1/chat/completions", {{"model", "tiny"}, {"messages", json::array()}}), 400, "messages", "non-empty");
  expect_error(call("/v1/chat/completions", {{"model", "tiny"}, {"messages", msgs}, {"n", 0}}), 400, "n", "[1, 128]");
  expect_error(call("/v1/chat/completions", {{"model", "tiny"}, {"messages", msgs}, {"max_tokens", 600}}), 400, "max_tokens",
               "context");
  expect_error(call("/v1/chat/completions", {{"model", "tiny"}, {"messages", msgs}, {"stream_options", json::object()}}),
               400, "stream_options", "streamed");
  expect_error(call("/v1/chat/completions", {{"model", "tiny"}, {"messages", msgs}, {"best_of", 2}}), 400, "best_of",
               "unrecognized");
  expect_error(call("/v1/chat/completions", {{"model", "tiny"}, {"messages", msgs}, {"temperature", "hot"}}), 400,
               "temperature", "number");
  expect_error(call("/v1/completions", {{"model", "tiny"}, {"prompt", std::vector<int64_t>(600, 1)}}), 400, "prompt",
               "context");
  expect_error(call("/v1/completions", {{"model", "tiny"}, {"prompt", std::vector<int64_t>{1, 999}}}), 400, "prompt",
               "vocabulary");
  expect_error(call("/v1/completions", {{"model", "tiny"}, {"prompt", json::array({"a", "b"})}}), 400, "prompt",
               "one prompt per request");
  httplib::Client c = s.client();
  httplib::Headers h = {{"Authorization", "Bearer sesame"}};
  const auto broken = c.Post("/v1/completions", h, "{not json", "application/json");
  ASSERT_TRUE(broken);
  expect_error({broken->status, json::parse(broken->body)}, 400, "", "not valid JSON");
  const auto missing = c.Get("/v1/embeddings", h);
  ASSERT_TRUE(missing);
  expect_error({missing->status, json::parse(missing->body)}, 404, "", "no endpoint");
  // After all that, a good request still works.
  const auto ok = call("/v1/chat/completions", {{"model", "tiny"}, {"messages", msgs}, {"max_tokens", 3}});
  EXPECT_EQ(ok.first, 200) << ok.second.dump();
}

}  // namespace
}  // namespace kiln::serve
