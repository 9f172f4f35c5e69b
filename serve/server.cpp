// The HTTP endpoints: GET /health and /v1/models, POST /v1/chat/completions and /v1/completions;
// every error in the OpenAI error shape.
#include "serve/server.h"

#include <httplib.h>

#include <chrono>
#include <random>

#include "core/error.h"
#include "serve/engine_loop.h"

namespace kiln::serve {
namespace {

using json = nlohmann::json;

constexpr size_t kConnectionThreads = 256;

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
