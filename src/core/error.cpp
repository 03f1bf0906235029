#include "veloxquant/core/error.hpp"

namespace vq {

void require(bool condition, const std::string& message) {
  if (!condition) throw InvalidArgument(message);
}

}  // namespace vq
