// Progress of a long subcommand on stderr: quiet for short runs; then, on a terminal, one line
// rewritten in place (at most every 0.25 s), in a log a line every `log_every` seconds.
#pragma once
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <utility>

#include <fmt/format.h>

namespace vqcli {

class Progress {
 public:
  // Lines read "<prefix> 42.0%  3s elapsed, ~4s left"; nothing before `quiet_for` seconds.
  Progress(std::string prefix, double quiet_for, double log_every)
      : prefix_(std::move(prefix)), quiet_for_(quiet_for), log_every_(log_every) {}
  void operator()(double frac) {
    const double t = elapsed();
    if (t < quiet_for_ || (frac < 1.0 && t - last_ < (tty_ ? 0.25 : log_every_))) return;
    last_ = t;
    const double eta = frac > 0 ? t / frac - t : 0;
    fmt::print(stderr, "{}{} {:5.1f}%  {:.1f}s elapsed, ~{:.0f}s left{}", tty_ ? "\r" : "", prefix_, 100.0 * frac, t, eta,
               tty_ ? "   " : "\n");
    shown_ = tty_;
  }
  double elapsed() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
  ~Progress() {
    if (shown_) fmt::print(stderr, "\n");
  }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

 private:
  std::string prefix_;
  double quiet_for_, log_every_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  double last_ = -1e9;
  bool tty_ = isatty(fileno(stderr)) != 0;
  bool shown_ = false;
};

}  // namespace vqcli
