#include "veloxquant/core/error.hpp"

namespace vq {

void require(bool condition, const std::string& message) {
  if (!condition) [[unlikely]]
    throw InvalidArgument(message);
}

void throw_invalid_argument(const std::string& message) { throw InvalidArgument(message); }

void throw_invalid_argument_vformat(fmt::string_view format, fmt::format_args args) {
  throw InvalidArgument(fmt::vformat(format, args));
}

}  // namespace vq
