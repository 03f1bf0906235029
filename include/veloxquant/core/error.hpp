// Errors of the public API. Every message is one line a user can act on.
#pragma once
#include <stdexcept>
#include <string>

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

}  // namespace vq
