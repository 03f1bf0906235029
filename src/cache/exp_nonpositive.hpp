// exp(x) for x <= 0, written so that a loop over it vectorises (the softmax inputs after the
// running maximum is subtracted). Private to the cache stage: the attention loop's kernels use it.
//
// Cody-Waite range reduction x = n ln2 + r and Cephes' degree-6 expf polynomial: within 2 ulp of
// std::exp on [-87, 0]. Below -87 it returns ~2^-126 instead of a denormal, which is invisible
// next to the softmax maximum's exp(0) = 1. Moved here from the transformer's own attention
// (which the cache's attend() replaced).
#pragma once
#include <bit>
#include <cstdint>

namespace vq::detail {

inline float exp_nonpositive(float x) {
  // Clamp at -87 on the bits: for x <= 0 a larger magnitude has larger unsigned bits. (A float
  // compare would keep the loop scalar: GCC will not if-convert it under -ftrapping-math.)
  const std::uint32_t lim = std::bit_cast<std::uint32_t>(-87.0f);
  const std::uint32_t b = std::bit_cast<std::uint32_t>(x);
  x = std::bit_cast<float>(b > lim ? lim : b);
  const float rounder = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer, half to even
  const float n = (x * 1.44269504088896341f + rounder) - rounder;
  float r = x - n * 0.693359375f;  // ln2 split in a part exact in float and the rest
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // 2^n from the rounder trick's bits: n + 127 is in [0, 127] here, so it fits the exponent field.
  const std::int32_t e = (static_cast<std::int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(e);
}

}  // namespace vq::detail
