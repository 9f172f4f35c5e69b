// The engine's own thread: takes queued requests into the running batch between steps.
#include "serve/engine_loop.h"

#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "core/error.h"

namespace kiln::serve {

EngineLoop::EngineLoop(rollout::Engine& engine) : engine_(engine), thread_([this] { run(); }) {}

EngineLoop::~EngineLoop() { stop(); }

std::future<rollout::RequestOutput> EngineLoop::submit(rollout::Request request, TokenListener listener) {
  Pending p{std::move(request), {}, std::move(listener)};
  std::future<rollout::RequestOutput> f = p.done.get_future();
  {
    std::lock_guard<std::mutex> lk(mu_);
    KILN_CHECK(!stopping_, "serve: the server is shutting down");
    queued_.push_back(std::move(p));
    ++in_flight_;
  }
  cv_.notify_all();
  return f;
}

int64_t EngineLoop::in_flight() const {
  std::lock_guard<std::mutex> lk(mu_);
  return in_flight_;
}

void EngineLoop::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void EngineLoop::fail_running(const std::exception_ptr& error) {
  for (auto& [id, done] : running_) done.set_exception(error);
  listeners_.clear();
  std::lock_guard<std::mutex> lk(mu_);
  in_flight_ -= int64_t(running_.size());
  running_.clear();
}

// The engine's step trace (which costs a copy of each step's routing) only while a request streams.
void EngineLoop::trace_while_listened() {
  if (listeners_.empty() == !tracing_) return;
  tracing_ = !listeners_.empty();
  if (!tracing_) return engine_.set_trace({});
  engine_.set_trace([this](const rollout::StepTrace& trace) {
    for (const rollout::StepTrace::Item& item : trace.items) {
      auto it = listeners_.find(item.request_id);
      if (it == listeners_.end()) continue;
      for (const auto& [sample, token] : item.drawn) it->second(sample, token);
    }
  });
}

void EngineLoop::run() {
  at::NoGradGuard no_grad;  // grad mode is per thread
  const c10::DeviceGuard device(engine_.model().device());
  for (;;) {
    std::deque<Pending> arrived;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return !queued_.empty() || !running_.empty() || stopping_; });
      if (stopping_ && queued_.empty() && running_.empty()) return;
      arrived.swap(queued_);
    }
    for (Pending& p : arrived) {
      try {
        const int64_t id = engine_.add_request(p.request);
        running_.emplace(id, std::move(p.done));
        if (p.listener) listeners_.emplace(id, std::move(p.listener));
      } catch (...) {  // refused by the engine: this request alone
        p.done.set_exception(std::current_exception());
        std::lock_guard<std::mutex> lk(mu_);
        --in_flight_;
      }
    }
    if (running_.empty()) continue;
    trace_while_listened();
    std::vector<rollout::RequestOutput> finished;
    try {
      finished = engine_.step();
    } catch (...) {
      fail_running(std::current_exception());
      continue;
    }
    for (rollout::RequestOutput& out : finished) {
      auto it = running_.find(out.request_id);
      if (it == running_.end()) continue;
      listeners_.erase(out.request_id);
      it->second.set_value(std::move(out));
      running_.erase(it);
      std::lock_guard<std::mutex> lk(mu_);
      --in_flight_;
    }
  }
}

}  // namespace kiln::serve
