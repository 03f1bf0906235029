// Private to the Redis backends: an integer of a store URL or of a node name a server sent
// (host:port), bounded, or InvalidArgument naming `what`.
#pragma once
#include <charconv>
#include <string>
#include <string_view>

#include <fmt/core.h>

#include "veloxquant/core/error.hpp"

namespace vq::redis_detail {

inline int parse_int(std::string_view text, const char* what, long lo, long hi) {
  long v = 0;
  const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || p != text.data() + text.size() || v < lo || v > hi)
    throw InvalidArgument(fmt::format("store URL: {} must be an integer in [{}, {}], got '{}'", what, lo, hi, std::string(text)));
  return static_cast<int>(v);
}

}  // namespace vq::redis_detail
