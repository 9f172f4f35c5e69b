// `kiln serve`'s HTTP server: the OpenAI API's endpoints (serve/openai_api.h) over an EngineLoop,
// with an optional bearer key. Built on Debian's cpp-httplib; httplib.h stays in server.cpp.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "serve/openai_api.h"

namespace kiln::serve {

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8000;      // 0: any free port (tests)
  std::string api_key;  // empty: no key asked
};

class Server {
 public:
  // Serves `model` with `engine` (used by the server's engine thread alone from here on).
  Server(rollout::Engine& engine, ServedModel model, ServeOptions options);
  ~Server();
  // Binds the address; returns the port (the one chosen, for port 0). Throws naming the address.
  int bind();
  // Answers requests until stop(); then finishes the requests under way and returns.
  void run();
  // From any thread (a signal's watcher, a test): run() returns once the requests under way end.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::serve
