#include "veloxquant/peers/head_rotation.hpp"

#include <cmath>

#include "veloxquant/core/error.hpp"

namespace vq {

namespace {

// splitmix64's (i+1)-th output from seed 0 (Steele, Lea and Flood; the reference constants).
std::uint64_t splitmix64(std::uint64_t i) {
  std::uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

HeadRotation::HeadRotation(std::int64_t dim) : dim_(dim) {
  require(dim >= 1, "head rotation: head dim must be >= 1, got {}", dim);
  signs_.resize(static_cast<std::size_t>(dim));
  for (std::int64_t i = 0; i < dim; ++i) signs_[static_cast<std::size_t>(i)] = (splitmix64(static_cast<std::uint64_t>(i)) >> 63) ? -1.0f : 1.0f;
}

void HeadRotation::hadamard_blocks(float* x) const {
  std::int64_t start = 0;
  for (int bit = 62; bit >= 0; --bit) {
    const std::int64_t n = std::int64_t{1} << bit;
    if (!(dim_ & n)) continue;
    float* y = x + start;
    for (std::int64_t len = 1; len < n; len <<= 1)
      for (std::int64_t i = 0; i < n; i += 2 * len)
        for (std::int64_t j = i; j < i + len; ++j) {
          const float a = y[j], b = y[j + len];
          y[j] = a + b;
          y[j + len] = a - b;
        }
    if (n > 1) {
      const float norm = 1.0f / std::sqrt(static_cast<float>(n));
      for (std::int64_t j = 0; j < n; ++j) y[j] *= norm;
    }
    start += n;
  }
}

void HeadRotation::rotate(float* x) const {
  for (std::int64_t i = 0; i < dim_; ++i) x[i] *= signs_[static_cast<std::size_t>(i)];
  hadamard_blocks(x);
}

void HeadRotation::unrotate(float* x) const {
  hadamard_blocks(x);
  for (std::int64_t i = 0; i < dim_; ++i) x[i] *= signs_[static_cast<std::size_t>(i)];
}

}  // namespace vq
