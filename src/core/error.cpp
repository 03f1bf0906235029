#include "veloxquant/core/error.hpp"

namespace vq {

void require(bool condition, const std::string& message) {
  if (!condition) [[unlikely]]
    throw InvalidArgument(message);
}

void throw_invalid_argument(const std::string& message) { throw InvalidArgument(message); }

}  // namespace vq
