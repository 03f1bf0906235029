#include "veloxquant/quant/group_quant.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/core/kernel_clones.hpp"

namespace vq {

namespace {
const char* const kRangeOverflow = "cannot quantize: a group's range overflows float32 (|values| too large)";
}  // namespace

void check_quant_params(int bits, int group_size) {
  require(bits >= 1 && bits <= 8, "bits must be in 1..8, got {}", bits);
  require(group_size >= 1, "group_size must be >= 1, got {}", group_size);
}

VQ_KERNEL bool all_finite(const float* x, std::size_t n) {
  // Integer test of the exponent field: vectorises without -ffast-math.
  std::uint32_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t u;
    std::memcpy(&u, x + i, 4);
    bad |= static_cast<std::uint32_t>((u & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

namespace {
// Round half to even for 0 <= v < 2^23: adding 2^23 pushes the fraction out of the mantissa under
// the default round-to-nearest-even mode. Equal to std::nearbyint there (tested), and vectorises
// on baseline x86-64 where nearbyint would be a library call per element.
inline float rint_small(float v) {
  constexpr float kShift = 8388608.0f;  // 2^23
  return (v + kShift) - kShift;
}
}  // namespace

VQ_KERNEL bool quantize_group(const float* __restrict rows, int n_rows, int dim, int bits, std::uint8_t* __restrict codes,
                              float* __restrict scale, float* __restrict minv) {
  const float levels = static_cast<float>((1 << bits) - 1);
  float* mx = scale;  // reuse the scale array for the running maximum
  std::memcpy(minv, rows, sizeof(float) * static_cast<std::size_t>(dim));
  std::memcpy(mx, rows, sizeof(float) * static_cast<std::size_t>(dim));
  for (int r = 1; r < n_rows; ++r) {
    const float* x = rows + static_cast<std::ptrdiff_t>(r) * dim;
    for (int c = 0; c < dim; ++c) {
      minv[c] = x[c] < minv[c] ? x[c] : minv[c];
      mx[c] = x[c] > mx[c] ? x[c] : mx[c];
    }
  }
  for (int c = 0; c < dim; ++c) {
    const float s = (mx[c] - minv[c]) / levels;
    scale[c] = s > kMinScale ? s : kMinScale;
  }
  // A range that overflows float32 cannot be quantized (scale would be inf, codes NaN).
  std::uint32_t overflow = 0;
  for (int c = 0; c < dim; ++c) overflow |= static_cast<std::uint32_t>(scale[c] > 3.4028234e38f);
  if (overflow) return false;
  for (int r = 0; r < n_rows; ++r) {
    const float* x = rows + static_cast<std::ptrdiff_t>(r) * dim;
    std::uint8_t* q = codes + static_cast<std::ptrdiff_t>(r) * dim;
    for (int c = 0; c < dim; ++c) {
      float v = rint_small((x[c] - minv[c]) / scale[c]);
      v = v < 0.0f ? 0.0f : v;
      v = v > levels ? levels : v;
      q[c] = static_cast<std::uint8_t>(static_cast<int>(v));
    }
  }
  return true;
}

VQ_KERNEL void dequant_group(const std::uint8_t* __restrict codes, int n_rows, int dim, const float* __restrict scale,
                             const float* __restrict minv, float* __restrict out) {
  for (int r = 0; r < n_rows; ++r) {
    const std::uint8_t* q = codes + static_cast<std::ptrdiff_t>(r) * dim;
    float* o = out + static_cast<std::ptrdiff_t>(r) * dim;
    for (int c = 0; c < dim; ++c) o[c] = static_cast<float>(q[c]) * scale[c] + minv[c];
  }
}

GroupQuantized quantize_to_codes(std::span<const float> x, int n_tokens, int dim, int bits, int group_size) {
  check_quant_params(bits, group_size);
  require(n_tokens >= 0 && dim >= 1, "quantize_to_codes: bad slice shape [{}, {}]", n_tokens, dim);
  require(x.size() == static_cast<std::size_t>(n_tokens) * static_cast<std::size_t>(dim),
          "quantize_to_codes: {} values given for a [{}, {}] slice", x.size(), n_tokens, dim);
  require(all_finite(x.data(), x.size()), "cannot quantize NaN or Inf values");
  GroupQuantized q;
  q.n_tokens = n_tokens;
  q.dim = dim;
  q.bits = bits;
  q.group_size = group_size;
  const int ng = q.n_groups();
  q.codes.resize(x.size());
  q.scale.resize(static_cast<std::size_t>(ng) * dim);
  q.minv.resize(static_cast<std::size_t>(ng) * dim);
  for (int g = 0; g < ng; ++g) {
    const int r0 = g * group_size;
    const int n = std::min(group_size, n_tokens - r0);
    const std::size_t off = static_cast<std::size_t>(r0) * dim;
    if (!quantize_group(x.data() + off, n, dim, bits, q.codes.data() + off, q.scale.data() + static_cast<std::size_t>(g) * dim,
                        q.minv.data() + static_cast<std::size_t>(g) * dim))
      throw InvalidArgument(kRangeOverflow);
  }
  return q;
}

void dequant_codes(const GroupQuantized& q, std::span<float> out) {
  require(out.size() == static_cast<std::size_t>(q.n_tokens) * static_cast<std::size_t>(q.dim),
          "dequant_codes: output holds {} values, need {}", out.size(), q.n_tokens * q.dim);
  const int ng = q.n_groups();
  for (int g = 0; g < ng; ++g) {
    const int r0 = g * q.group_size;
    const int n = std::min(q.group_size, q.n_tokens - r0);
    const std::size_t off = static_cast<std::size_t>(r0) * q.dim;
    dequant_group(q.codes.data() + off, n, q.dim, q.scale.data() + static_cast<std::size_t>(g) * q.dim,
                  q.minv.data() + static_cast<std::size_t>(g) * q.dim, out.data() + off);
  }
}

}  // namespace vq
