#include "veloxquant/cache/cachegen_cache.hpp"

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"

namespace vq {

CacheGenKVCache::CacheGenKVCache(KVCacheConfig config) : config_(config) { config_.validate(); }

std::pair<Tensor, Tensor> CacheGenKVCache::update_and_fetch(const Tensor& keys, const Tensor& values) {
  check_chunk(keys, values);
  encoded_keys_.reset();
  encoded_values_.reset();
  const std::int64_t begin = offset_;
  if (begin == 0) {
    const int bits = config_.effective_bits();
    key_stream_ = QuantizedStream(keys.dim(0), keys.dim(1), static_cast<int>(keys.dim(3)), bits, config_);
    value_stream_ = QuantizedStream(values.dim(0), values.dim(1), static_cast<int>(values.dim(3)), bits, config_);
  }
  make_room(keys, values);
  // Both sides are checked while they are quantized; a failure undoes the call entirely.
  auto fail = [](const char* side, QuantStatus st) {
    throw InvalidArgument(st == QuantStatus::NonFinite
                              ? fmt::format("{} contain NaN or Inf, which cannot be quantized", side)
                              : fmt::format("{} span a range that overflows float32 (|values| near 3.4e38)", side));
  };
  if (const QuantStatus st = key_stream_.ingest(keys_buf_, keys, begin); st != QuantStatus::Ok) fail("keys", st);
  if (const QuantStatus st = value_stream_.ingest(values_buf_, values, begin); st != QuantStatus::Ok) {
    key_stream_.undo_last_ingest(keys_buf_);
    fail("values", st);
  }
  offset_ += keys.dim(2);
  return {keys_buf_.slice(2, 0, offset_), values_buf_.slice(2, 0, offset_)};
}

std::int64_t CacheGenKVCache::trim(std::int64_t n) {
  const std::int64_t dropped = KVCache::trim(n);
  if (dropped > 0) {
    encoded_keys_.reset();
    encoded_values_.reset();
    key_stream_.trim_to(offset_);
    value_stream_.trim_to(offset_);
  }
  return dropped;
}

void CacheGenKVCache::from_state(const KVState&) {
  throw InvalidArgument(
      "CacheGenKVCache cannot be rebuilt from dense keys/values alone (its codes and scales would be lost); "
      "use full_state() / from_full_state()");
}

std::size_t CacheGenKVCache::nbytes() const {
  return KVCache::nbytes() + key_stream_.memory_bytes() + value_stream_.memory_bytes();
}

CacheBytes CacheGenKVCache::stored_bytes() const {
  return {static_cast<double>(fixed_width_key_bytes() + fixed_width_value_bytes()),
          static_cast<double>(compressed_key_bytes() + compressed_value_bytes())};
}

CacheGenState CacheGenKVCache::full_state() const {
  CacheGenState s;
  s.config = config_;
  s.offset = offset_;
  if (offset_ > 0) {
    s.keys = keys_buf_.slice(2, 0, offset_).contiguous(true);
    s.values = values_buf_.slice(2, 0, offset_).contiguous(true);
  }
  s.key_stream = key_stream_;
  s.value_stream = value_stream_;
  return s;
}

void CacheGenKVCache::from_full_state(CacheGenState s) {
  s.config.validate();
  require(s.offset >= 0 && s.keys.dim(2) == s.offset && s.values.dim(2) == s.offset,
          "CacheGen state is inconsistent: offset {} but keys hold {} and values {} tokens", s.offset, s.keys.dim(2),
                      s.values.dim(2));
  if (s.offset > 0) {
    require(s.key_stream.slices() == s.keys.dim(0) * s.keys.dim(1) && s.key_stream.dim() == s.keys.dim(3) &&
                s.value_stream.slices() == s.values.dim(0) * s.values.dim(1) && s.value_stream.dim() == s.values.dim(3),
            "CacheGen state is inconsistent: streams do not match the tensors' shapes");
    require(s.key_stream.quantized_tokens() <= s.offset && s.value_stream.quantized_tokens() <= s.offset,
            "CacheGen state is inconsistent: more quantized tokens than the offset");
  }
  config_ = s.config;
  encoded_keys_.reset();
  encoded_values_.reset();
  offset_ = 0;
  keys_buf_ = Tensor();
  values_buf_ = Tensor();
  if (s.offset > 0) append(s.keys, s.values);
  key_stream_ = std::move(s.key_stream);
  value_stream_ = std::move(s.value_stream);
}

std::uint64_t CacheGenKVCache::compressed_key_bytes() const { return offset_ ? key_stream_.compressed_bytes(offset_) : 0; }
std::uint64_t CacheGenKVCache::compressed_value_bytes() const { return offset_ ? value_stream_.compressed_bytes(offset_) : 0; }
std::uint64_t CacheGenKVCache::fixed_width_key_bytes() const { return offset_ ? key_stream_.fixed_width_bytes(offset_) : 0; }
std::uint64_t CacheGenKVCache::fixed_width_value_bytes() const { return offset_ ? value_stream_.fixed_width_bytes(offset_) : 0; }
std::uint64_t CacheGenKVCache::fp16_key_bytes() const {
  return offset_ ? static_cast<std::uint64_t>(key_stream_.slices() * offset_ * key_stream_.dim()) * 2 : 0;
}
std::uint64_t CacheGenKVCache::fp16_value_bytes() const {
  return offset_ ? static_cast<std::uint64_t>(value_stream_.slices() * offset_ * value_stream_.dim()) * 2 : 0;
}

std::vector<std::uint8_t> CacheGenKVCache::encode_keys(const StreamCodecOptions& options) const {
  return encode_stream(key_stream_, options);
}
std::vector<std::uint8_t> CacheGenKVCache::encode_values(const StreamCodecOptions& options) const {
  return encode_stream(value_stream_, options);
}
DecodedStream CacheGenKVCache::decode(std::span<const std::uint8_t> bytes, std::uint64_t max_codes) {
  return decode_stream(bytes, max_codes);
}

std::uint64_t CacheGenKVCache::encoded_bytes(const QuantizedStream& stream, std::optional<std::uint64_t>& memo) const {
  if (offset_ == 0) return 0;
  if (!memo) {
    // The residual as a .vqkv file stores it: exact, at the cache's dtype size.
    const auto residual = static_cast<std::uint64_t>(stream.slices() * (offset_ - stream.quantized_tokens()) * stream.dim()) *
                          dtype_size(keys_buf_.dtype());
    memo = encode_stream(stream).size() + residual;
  }
  return *memo;
}
std::uint64_t CacheGenKVCache::encoded_key_bytes() const { return encoded_bytes(key_stream_, encoded_keys_); }
std::uint64_t CacheGenKVCache::encoded_value_bytes() const { return encoded_bytes(value_stream_, encoded_values_); }

double CacheGenKVCache::entropy_savings() const {
  const auto fixed = fixed_width_key_bytes();
  if (fixed == 0) return 0.0;
  return 1.0 - static_cast<double>(compressed_key_bytes()) / static_cast<double>(fixed);
}

double CacheGenKVCache::assigned_avg_bits() const {
  const auto fp16 = fp16_key_bytes();
  if (fp16 == 0) return static_cast<double>(config_.effective_bits());
  return 16.0 * static_cast<double>(compressed_key_bytes()) / static_cast<double>(fp16);
}

}  // namespace vq
