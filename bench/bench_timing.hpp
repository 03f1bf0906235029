// Wall-clock helpers the standalone benchmarks share: milliseconds since a point, and the median of
// a round's timings (the upper one of an even count).
#pragma once
#include <algorithm>
#include <chrono>
#include <vector>

namespace vqbench {

using Clock = std::chrono::steady_clock;

inline double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace vqbench
