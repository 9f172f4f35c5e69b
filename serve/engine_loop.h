// The rollout engine behind concurrent HTTP requests: one thread owns the engine and runs its
// continuous batching; request threads hand it requests and wait for their outputs.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "rollout/engine.h"

namespace kiln::serve {

class EngineLoop {
 public:
  // The engine outlives the loop; nothing else may use it while the loop runs.
  explicit EngineLoop(rollout::Engine& engine);
  ~EngineLoop();  // stop()
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  // Called on the engine's thread with each token a sample draws, as it is drawn (streaming).
  using TokenListener = std::function<void(int64_t sample, int64_t token)>;

  // Queues a request; the future holds its output once its samples are done, or the engine's
  // error (a request it refuses, or a failed step, which fails every request in it).
  std::future<rollout::RequestOutput> submit(rollout::Request request, TokenListener listener = {});
  // Requests submitted and not yet answered.
  int64_t in_flight() const;
  // Finishes what was submitted, then ends the thread; later submits fail.
  void stop();

 private:
  struct Pending {
    rollout::Request request;
    std::promise<rollout::RequestOutput> done;
    TokenListener listener;
  };
  void run();
  void fail_running(const std::exception_ptr& error);
  void trace_while_listened();

  rollout::Engine& engine_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> queued_;
  std::map<int64_t, std::promise<rollout::RequestOutput>> running_;  // by the engine's request id (loop thread only)
  std::map<int64_t, TokenListener> listeners_;                         // the streamed ones among them
  bool tracing_ = false;
  int64_t in_flight_ = 0;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace kiln::serve
