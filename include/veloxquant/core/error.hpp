// Errors of the public API. Every message is one line a user can act on.
#pragma once
#include <stdexcept>
#include <string>
#include <utility>

#include <fmt/format.h>

namespace vq {

// Base of every error veloxquant throws on purpose.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A caller passed a bad argument: wrong shape, dtype, range, option. (Python: ValueError.)
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// Input bytes (a file, a stream) are malformed, truncated or corrupt.
class FormatError : public Error {
 public:
  using Error::Error;
};

// The operating system refused: missing file, no permission, disk full.
class IoError : public Error {
 public:
  using Error::Error;
};

// Throw InvalidArgument with `message` unless `condition` holds.
void require(bool condition, const std::string& message);

[[noreturn]] void throw_invalid_argument(const std::string& message);

// Throw InvalidArgument with fmt::format(format, args...) unless `condition` holds. The message is
// formatted only when the check fails: a passing check costs one branch, so checks may sit in hot
// loops (require(ok, "code {} of row {}", q, r) instead of require(ok, fmt::format(...))).
// (The formatting sits in a separate cold, never-inlined function that takes fmt's type-erased
// arguments, so a check inside a loop costs the loop a compare and a branch, no registers or code:
// measured by bench/bench_vq_codec.cpp's BM_VqCheckLoop.)
[[noreturn, gnu::cold, gnu::noinline]] void throw_invalid_argument_vformat(fmt::string_view format, fmt::format_args args);

template <typename... Args>
  requires(sizeof...(Args) > 0)
inline void require(bool condition, fmt::format_string<Args...> format, Args&&... args) {
  if (!condition) [[unlikely]]
    throw_invalid_argument_vformat(fmt::string_view(format), fmt::make_format_args(args...));
}

}  // namespace vq
