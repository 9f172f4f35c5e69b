// Wall-clock intervals for the phase times that metrics report (steady_clock, in seconds).
#pragma once
#include <chrono>

namespace kiln {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace kiln
