// The HTTP endpoints: GET /health and /v1/models, POST /v1/chat/completions and /v1/completions;
// every error in the OpenAI error shape.
#include "serve/server.h"

#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <random>

#include "core/error.h"
#include "serve/engine_loop.h"
#include "text/tokenizer.h"

namespace kiln::serve {
namespace {

using json = nlohmann::json;

constexpr size_t kConnectionThreads = 256;
constexpr time_t kSocketTimeoutSeconds = 60;

// Strings of generated text may hold part of a UTF-8 character: written with U+FFFD for the
// invalid bytes (the exact bytes are in the token ids and "bytes").
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void reply(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(dump(body), "application/json");
}

void reply_error(httplib::Response& res, const ApiError& e) { reply(res, e.status, error_body(e)); }

// Compares every byte whatever the first difference, so the time taken tells nothing of the key.
bool same_key(const std::string& given, const std::string& key) {
  unsigned char diff = given.size() == key.size() ? 0 : 1;
  for (size_t i = 0; i < given.size(); ++i) diff |= static_cast<unsigned char>(given[i] ^ key[i % std::max<size_t>(1, key.size())]);
  return diff == 0;
}

uint64_t now_seconds() {
  return uint64_t(std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count());
}

}  // namespace

struct Server::Impl {
  Impl(rollout::Engine& engine, ServedModel m, ServeOptions o) : loop(engine), model(std::move(m)), options(std::move(o)) {
    // A thread per connection waiting on the engine: enough that the engine's batch, not the
    // pool, bounds how many requests run at once (httplib's default is 8).
    http.new_task_queue = [] { return new httplib::ThreadPool(kConnectionThreads); };
    // httplib's 5 s defaults cut connections that wait behind a busy engine on a loaded machine.
    http.set_read_timeout(kSocketTimeoutSeconds, 0);
    http.set_write_timeout(kSocketTimeoutSeconds, 0);
    http.set_keep_alive_timeout(kSocketTimeoutSeconds);
  }

  EngineLoop loop;
  ServedModel model;
  ServeOptions options;
  httplib::Server http;
  std::atomic<uint64_t> next_id{0};
  uint64_t seed_base = std::random_device{}();

  bool authorized(const httplib::Request& req, httplib::Response& res) const {
    if (options.api_key.empty()) return true;
    const std::string header = req.get_header_value("Authorization");
    const std::string prefix = "Bearer ";
    if (header.compare(0, prefix.size(), prefix) == 0 && same_key(header.substr(prefix.size()), options.api_key))
      return true;
    reply_error(res, ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)", "", "invalid_api_key",
                              "authentication_error"));
    return false;
  }

  // A completion endpoint: parse, queue, wait, answer; every failure as an API error.
  template <typename Parse, typename Build>
  void complete(const httplib::Request& req, httplib::Response& res, const char* prefix, const Parse& parse,
                const Build& build) {
    if (!authorized(req, res)) return;
    try {
      json body;
      try {
        body = json::parse(req.body);
      } catch (const json::exception& e) {
        throw ApiError(400, std::string("the request body is not valid JSON: ") + e.what());
      }
      const uint64_t n = next_id++;
      const Job job = parse(body, model, seed_base + n);
      if (job.stream) return stream(job, res, prefix + std::to_string(n), now_seconds());
      rollout::RequestOutput out;
      try {
        out = loop.submit(job.request).get();
      } catch (const std::exception& e) {
        throw ApiError(400, std::string("the engine refused the request: ") + e.what());
      }
      reply(res, 200, build(job, out, model, prefix + std::to_string(n), now_seconds()));
    } catch (const ApiError& e) {
      reply_error(res, e);
    }
  }

  // Server-sent events: each sample's text as its tokens are drawn (whole UTF-8 characters, no
  // stop token; a chat's first chunk names the role), its finish, then the last chunk (usage when
  // asked, kiln's extras) and [DONE]. A client that goes away stops the writing; its request
  // runs to its end in the engine.
  void stream(const Job& job, httplib::Response& res, const std::string& id, uint64_t created) {
    struct Drawn {
      std::mutex mu;
      std::condition_variable cv;
      std::deque<std::pair<int64_t, int64_t>> tokens;  // (sample, id) not yet written
      std::future<rollout::RequestOutput> out;
    };
    auto drawn = std::make_shared<Drawn>();
    try {
      drawn->out = loop.submit(job.request, [drawn](int64_t sample, int64_t token) {
        {
          std::lock_guard<std::mutex> lk(drawn->mu);
          drawn->tokens.emplace_back(sample, token);
        }
        drawn->cv.notify_all();
      });
    } catch (const std::exception& e) {
      throw ApiError(503, e.what(), "", "unavailable", "server_error");
    }
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider("text/event-stream", [this, drawn, job, id, created](size_t, httplib::DataSink& sink) {
      auto send = [&](const std::string& data) {
        const std::string event = "data: " + data + "\n\n";
        return sink.write(event.data(), event.size());
      };
      const std::vector<int64_t>& stops = job.request.params.stop_token_ids;
      std::vector<text::StreamDecoder> decoders(size_t(job.request.params.n), text::StreamDecoder(*model.tokenizer));
      std::vector<bool> first(decoders.size(), true);
      auto piece = [&](int64_t sample, const std::string& t, const char* finish) {
        const bool write = finish || !t.empty() || (job.chat && first[size_t(sample)]);
        const bool ok = !write || send(dump(stream_chunk(job, model, id, created, sample, t, finish, first[size_t(sample)])));
        if (write) first[size_t(sample)] = false;
        return ok;
      };
      for (bool done = false; !done;) {
        done = drawn->out.wait_for(std::chrono::seconds(0)) == std::future_status::ready;  // before taking the tokens
        std::deque<std::pair<int64_t, int64_t>> tokens;
        {
          std::unique_lock<std::mutex> lk(drawn->mu);
          if (!done) drawn->cv.wait_for(lk, std::chrono::milliseconds(50), [&] { return !drawn->tokens.empty(); });
          tokens.swap(drawn->tokens);
        }
        for (const auto& [sample, token] : tokens)
          if (std::find(stops.begin(), stops.end(), token) == stops.end() && !piece(sample, decoders[size_t(sample)].push(token), nullptr))
            return false;  // the client went away
      }
      try {
        const rollout::RequestOutput out = drawn->out.get();
        for (size_t i = 0; i < out.samples.size(); ++i) {
          const rollout::Sample& s = out.samples[i];
          if (!piece(int64_t(i), decoders[i].flush(), nullptr) ||
              !piece(int64_t(i), "", s.finish == rollout::FinishReason::kStop ? "stop" : "length"))
            return false;
        }
        send(dump(stream_last_chunk(job, out, model, id, created)));
      } catch (const std::exception& e) {
        send(dump(error_body(ApiError(500, std::string("the engine failed mid-stream: ") + e.what(), "", "internal_error",
                                      "server_error"))));
      }
      send("[DONE]");
      sink.done();
      return true;
    });
  }

  void routes() {
    http.Get("/health", [](const httplib::Request&, httplib::Response& res) { reply(res, 200, {{"status", "ok"}}); });
    http.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
      if (authorized(req, res)) reply(res, 200, models_response(model));
    });
    http.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
      complete(req, res, "chatcmpl-", parse_chat, chat_response);
    });
    http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      complete(req, res, "cmpl-", parse_completion, completion_response);
    });
    // A path or method nothing answers: the API's shape instead of httplib's empty body.
    http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      reply_error(res, ApiError(res.status, "no endpoint " + req.method + " " + req.path +
                                                "; this server has GET /health, GET /v1/models, POST "
                                                "/v1/chat/completions and POST /v1/completions",
                                "", "not_found"));
    });
    http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
      std::string what = "unknown error";
      try {
        std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      reply_error(res, ApiError(500, "internal error: " + what, "", "internal_error", "server_error"));
    });
  }
};

Server::Server(rollout::Engine& engine, ServedModel model, ServeOptions options)
    : impl_(std::make_unique<Impl>(engine, std::move(model), std::move(options))) {
  impl_->model.created = now_seconds();
  impl_->routes();
}

Server::~Server() = default;

int Server::bind() {
  const ServeOptions& o = impl_->options;
  const int port = o.port == 0 ? impl_->http.bind_to_any_port(o.host) : impl_->http.bind_to_port(o.host, o.port) ? o.port : -1;
  KILN_CHECK(port > 0, "serve: cannot listen on ", o.host, ":", o.port, " (in use, or not an address of this machine)");
  return port;
}

void Server::run() {
  impl_->http.listen_after_bind();
  impl_->loop.stop();  // the requests under way end before the engine goes
}

void Server::stop() { impl_->http.stop(); }

}  // namespace kiln::serve
