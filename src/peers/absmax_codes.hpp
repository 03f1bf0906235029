// Internal helpers of the CacheGen-family peers (lmcache, cachegen_paper): LMCache's per-vector
// absmax quantizer, its inverse, and the paper's delta quantizer.
//
// The quantizer (LMCache's torch_quant_vectorized, with the scale at the precision it is shipped):
//   s   = max |x_c| over the vector, stored as float16 s16 (round half to even); sf = s16 as float
//   q_c = clamp(round_half_even(x_c * (MAX / sf) + MAX), 0, 2 MAX)     (sf = 0: q_c = MAX)
//   x^_c = (q_c - MAX) / MAX * sf
// LMCache's K/V are float16, so its s is exact; ours are float32, so s16 may be below s by up to
// 2^-11 s and the clamp catches the one code that would fall outside (LMCache has no s = 0 guard).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "veloxquant/core/dtype.hpp"

namespace vq::peers_detail {

// Quantize n floats; writes codes (0 .. 2 max_q) and reconstructions; returns the float16 bits of s.
template <class Code>
std::uint16_t absmax_quantize(const float* x, std::int64_t n, int max_q, Code* codes, float* recon) {
  float s = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) s = std::max(s, std::fabs(x[i]));
  const std::uint16_t s16 = f32_to_f16(s);
  const float sf = f16_to_f32(s16);
  const float m = static_cast<float>(max_q);
  if (!(sf > 0.0f)) {
    for (std::int64_t i = 0; i < n; ++i) codes[i] = static_cast<Code>(max_q), recon[i] = 0.0f;
    return s16;
  }
  const float factor = m / sf;
  for (std::int64_t i = 0; i < n; ++i) {
    const float q = std::clamp(std::nearbyint(x[i] * factor + m), 0.0f, 2.0f * m);
    codes[i] = static_cast<Code>(q);
    recon[i] = (q - m) / m * sf;
  }
  return s16;
}

// The reconstruction of one code (exactly what absmax_quantize wrote to recon).
inline float absmax_dequantize(int code, int max_q, std::uint16_t s16) {
  const float m = static_cast<float>(max_q), sf = f16_to_f32(s16);
  if (!(sf > 0.0f)) return 0.0f;
  return (static_cast<float>(code) - m) / m * sf;
}

// Bits a fixed-width code of `alphabet` symbols takes: ceil(log2(alphabet)), at least 1.
inline int fixed_code_bits(int alphabet) {
  int b = 1;
  while ((1 << b) < alphabet) ++b;
  return b;
}

// The CacheGen paper's delta quantizer, against the reconstructed anchor a (so that anchor error
// does not add to delta error): d = x - a; s = max |d| as float16 sf; step = bin * sf;
// q = clamp(round_half_even(d / step), -max_q, max_q); symbol = q + max_q; x^ = a + q * step
// (sf = 0: every symbol max_q, x^ = a). Returns the float16 bits of s.
inline std::uint16_t delta_quantize(const float* x, const float* a, std::int64_t n, float bin, int max_q, std::uint16_t* symbols,
                                    float* recon) {
  float s = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) s = std::max(s, std::fabs(x[i] - a[i]));
  const std::uint16_t s16 = f32_to_f16(s);
  const float step = bin * f16_to_f32(s16), m = static_cast<float>(max_q);
  for (std::int64_t i = 0; i < n; ++i) {
    const float q = step > 0.0f ? std::clamp(std::nearbyint((x[i] - a[i]) / step), -m, m) : 0.0f;
    symbols[i] = static_cast<std::uint16_t>(q + m);
    recon[i] = a[i] + q * step;
  }
  return s16;
}

// The reconstruction of one delta symbol (exactly what delta_quantize wrote to recon).
inline float delta_dequantize(int symbol, float a, float bin, int max_q, std::uint16_t s16) {
  const float step = bin * f16_to_f32(s16);
  const float q = step > 0.0f ? static_cast<float>(symbol - max_q) : 0.0f;
  return a + q * step;
}

}  // namespace vq::peers_detail
