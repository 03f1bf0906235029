// Internal helpers of the peer caches: a token's row of all heads, read and written as float32.
#pragma once
#include <cstdint>

#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/tensor.hpp"

namespace vq::peers_detail {

// out[h*D + d] = t[b, h, s, d] as float32, for every head h.
inline void gather_token(const Tensor& t, std::int64_t b, std::int64_t s, float* out) {
  const std::int64_t D = t.dim(3);
  for (std::int64_t h = 0; h < t.dim(1); ++h) to_f32(t.row(b, h, s), t.dtype(), out + h * D, static_cast<std::size_t>(D));
}

// t[b, h, s, d] = in[h*D + d] converted to t's dtype (round to nearest even).
inline void scatter_token(Tensor& t, std::int64_t b, std::int64_t s, const float* in) {
  const std::int64_t D = t.dim(3);
  for (std::int64_t h = 0; h < t.dim(1); ++h) from_f32(in + h * D, t.row(b, h, s), t.dtype(), static_cast<std::size_t>(D));
}

}  // namespace vq::peers_detail
