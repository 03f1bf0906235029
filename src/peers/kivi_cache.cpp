#include "veloxquant/peers/kivi_cache.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"

namespace vq {

namespace {

constexpr float kF16Max = 65504.0f;

// Asymmetric min/max quantization of n values (stride apart) in place: x <- q * scale16 + min16.
void quantize_group(float* x, std::int64_t n, std::int64_t stride, int bits) {
  float mn = x[0], mx = x[0];
  for (std::int64_t i = 1; i < n; ++i) {
    mn = std::min(mn, x[i * stride]);
    mx = std::max(mx, x[i * stride]);
  }
  const float qmax = static_cast<float>((1 << bits) - 1);
  const float scale = f16_to_f32(f32_to_f16((mx - mn) / qmax));
  const float zero = f16_to_f32(f32_to_f16(mn));
  for (std::int64_t i = 0; i < n; ++i) {
    float& v = x[i * stride];
    const float q = scale > 0.0f ? std::clamp(std::nearbyint((v - zero) / scale), 0.0f, qmax) : 0.0f;
    v = q * scale + zero;
  }
}

// Keys per channel: tokens [t0, t1) of every (b, h) of `buf`, groups of `group` tokens from t0.
void quantize_keys(Tensor& buf, std::int64_t t0, std::int64_t t1, int group, int bits) {
  const std::int64_t D = buf.dim(3);
  std::vector<float> x(static_cast<std::size_t>(group * D));
  for (std::int64_t b = 0; b < buf.dim(0); ++b)
    for (std::int64_t h = 0; h < buf.dim(1); ++h)
      for (std::int64_t g = t0; g < t1; g += group) {
        for (std::int64_t s = 0; s < group; ++s) to_f32(buf.row(b, h, g + s), buf.dtype(), x.data() + s * D, static_cast<std::size_t>(D));
        for (std::int64_t d = 0; d < D; ++d) quantize_group(x.data() + d, group, D, bits);
        for (std::int64_t s = 0; s < group; ++s) from_f32(x.data() + s * D, buf.row(b, h, g + s), buf.dtype(), static_cast<std::size_t>(D));
      }
}

// Values per token: tokens [t0, t1), groups of `group` channels.
void quantize_values(Tensor& buf, std::int64_t t0, std::int64_t t1, int group, int bits) {
  const std::int64_t D = buf.dim(3);
  std::vector<float> x(static_cast<std::size_t>(D));
  for (std::int64_t b = 0; b < buf.dim(0); ++b)
    for (std::int64_t h = 0; h < buf.dim(1); ++h)
      for (std::int64_t s = t0; s < t1; ++s) {
        to_f32(buf.row(b, h, s), buf.dtype(), x.data(), static_cast<std::size_t>(D));
        for (std::int64_t c = 0; c < D; c += group) quantize_group(x.data() + c, group, 1, bits);
        from_f32(x.data(), buf.row(b, h, s), buf.dtype(), static_cast<std::size_t>(D));
      }
}

bool within_f16(const Tensor& t) {
  const std::vector<float> v = t.to_f32_vector();
  return std::all_of(v.begin(), v.end(), [](float x) { return std::fabs(x) <= kF16Max; });  // false for NaN too
}

}  // namespace

void KiviConfig::validate() const {
  if (bits != 2 && bits != 4) throw InvalidArgument(fmt::format("kivi: bits={} is not valid; use bits=2 or bits=4", bits));
  if (group < 1) throw InvalidArgument(fmt::format("kivi: group={} must be >= 1", group));
  if (residual < group || residual % group != 0)
    throw InvalidArgument(fmt::format("kivi: residual={} must be a positive multiple of group={} (keys are flushed a whole "
                                      "residual block of whole groups at a time)",
                                      residual, group));
}

KiviKVCache::KiviKVCache(KiviConfig config) : config_(config) { config_.validate(); }

std::pair<Tensor, Tensor> KiviKVCache::update_and_fetch(const Tensor& keys, const Tensor& values) {
  check_chunk(keys, values);
  const std::int64_t dv = values.dim(3), gv = value_group(dv);
  if (dv % gv != 0)
    throw InvalidArgument(fmt::format("kivi: value head_dim {} is not a multiple of the value group {} (group={})", dv, gv, config_.group));
  if (!within_f16(keys) || !within_f16(values))
    throw InvalidArgument("kivi: keys and values must be finite and within float16 range (|x| <= 65504): scales and zeros are float16");
  if (offset_ == 0) key_quantized_ = value_quantized_ = 0;
  append(keys, values);
  const std::int64_t R = config_.residual;
  const std::int64_t kq = offset_ / R * R, vq = std::max<std::int64_t>(0, offset_ - R);
  if (kq > key_quantized_) quantize_keys(keys_buf_, key_quantized_, kq, config_.group, config_.bits);
  if (vq > value_quantized_) quantize_values(values_buf_, value_quantized_, vq, static_cast<int>(gv), config_.bits);
  key_quantized_ = std::max(key_quantized_, kq);
  value_quantized_ = std::max(value_quantized_, vq);
  return {keys_buf_.slice(2, 0, offset_), values_buf_.slice(2, 0, offset_)};
}

std::int64_t KiviKVCache::trim(std::int64_t n) {
  require(n >= 0, "trim: n must be >= 0, got {}", n);
  if (n == 0 || offset_ == 0) return 0;
  throw InvalidArgument("kivi: the cache is not trimmable (its quantized tokens cannot be restored to full precision)");
}

void KiviKVCache::from_state(const KVState& state) {
  refeed_state(state, [this] { key_quantized_ = value_quantized_ = 0; });
}

CacheBytes KiviKVCache::stored_bytes() const {
  if (offset_ == 0) return {};
  const double bh = static_cast<double>(keys_buf_.dim(0) * keys_buf_.dim(1));
  const double dk = static_cast<double>(keys_buf_.dim(3)), dv = static_cast<double>(values_buf_.dim(3));
  const double bits = config_.bits, kq = static_cast<double>(key_quantized_), vq = static_cast<double>(value_quantized_);
  const double n = static_cast<double>(offset_);
  const double key_bytes = kq * dk * bits / 8.0 + (kq / config_.group) * dk * 4.0 + (n - kq) * dk * 2.0;
  const double value_bytes = vq * dv * bits / 8.0 + vq * (dv / value_group(values_buf_.dim(3))) * 4.0 + (n - vq) * dv * 2.0;
  const double bytes = bh * (key_bytes + value_bytes);
  return {bytes, bytes};
}

}  // namespace vq
