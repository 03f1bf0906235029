#include "veloxquant/cache/cachegen_cache.hpp"

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"

namespace vq {

CacheGenKVCache::CacheGenKVCache(KVCacheConfig config) : config_(config) { config_.validate(); }

namespace {
// The layout a resident cache keeps in keys_buf_ / values_buf_: shape and dtype, no storage.
Tensor layout_of(std::int64_t B, std::int64_t H, std::int64_t D, DType dtype) { return Tensor::wrap(nullptr, {B, H, 0, D}, dtype); }
}  // namespace

void CacheGenKVCache::update(const Tensor& keys, const Tensor& values) {
  check_chunk(keys, values);
  encoded_keys_.reset();
  encoded_values_.reset();
  if (offset_ == 0) {
    const int bits = config_.effective_bits();
    key_stream_ = QuantizedStream(keys.dim(0), keys.dim(1), static_cast<int>(keys.dim(3)), bits, config_);
    value_stream_ = QuantizedStream(values.dim(0), values.dim(1), static_cast<int>(values.dim(3)), bits, config_);
  }
  // Both sides are checked while they are quantized; a failure undoes the call entirely.
  auto fail = [](const char* side, QuantStatus st) {
    throw InvalidArgument(st == QuantStatus::NonFinite
                              ? fmt::format("{} contain NaN or Inf, which cannot be quantized", side)
                              : fmt::format("{} span a range that overflows float32 (|values| near 3.4e38)", side));
  };
  if (const QuantStatus st = key_stream_.ingest(keys); st != QuantStatus::Ok) fail("keys", st);
  if (const QuantStatus st = value_stream_.ingest(values); st != QuantStatus::Ok) {
    key_stream_.undo_last_ingest();
    fail("values", st);
  }
  key_stream_.commit_ingest();
  value_stream_.commit_ingest();
  if (offset_ == 0) {
    keys_buf_ = layout_of(keys.dim(0), keys.dim(1), keys.dim(3), keys.dtype());
    values_buf_ = layout_of(values.dim(0), values.dim(1), values.dim(3), values.dtype());
  }
  offset_ += keys.dim(2);
}

std::pair<Tensor, Tensor> CacheGenKVCache::update_and_fetch(const Tensor& keys, const Tensor& values) {
  update(keys, values);
  KVState s = state();
  return {std::move(s.keys), std::move(s.values)};
}

KVState CacheGenKVCache::state() const {
  if (offset_ == 0) return {};
  return {key_stream_.materialise(), value_stream_.materialise()};
}

const float* CacheGenKVCache::read_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const {
  key_stream_.read_tile(b * key_stream_.heads() + h, t0, n, scratch);
  return scratch;
}

const float* CacheGenKVCache::read_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const {
  value_stream_.read_tile(b * value_stream_.heads() + h, t0, n, scratch);
  return scratch;
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
    s.key_stream = key_stream_;
    s.value_stream = value_stream_;
  }
  return s;
}

void CacheGenKVCache::from_full_state(CacheGenState s) {
  s.config.validate();
  require(s.offset >= 0, "CacheGen state is inconsistent: offset {}", s.offset);
  if (s.offset > 0) {
    const QuantizedStream &k = s.key_stream, &v = s.value_stream;
    require(k.tokens() == s.offset && v.tokens() == s.offset,
            "CacheGen state is inconsistent: offset {} but the key stream holds {} and the value stream {} tokens", s.offset, k.tokens(),
            v.tokens());
    require(k.batch() == v.batch() && k.heads() == v.heads() && k.dtype() == v.dtype() && k.batch() >= 1 && k.heads() >= 1,
            "CacheGen state is inconsistent: the key and value streams disagree in batch, heads or dtype");
  }
  config_ = s.config;
  encoded_keys_.reset();
  encoded_values_.reset();
  offset_ = s.offset;
  keys_buf_ = Tensor();
  values_buf_ = Tensor();
  if (s.offset > 0) {
    keys_buf_ = layout_of(s.key_stream.batch(), s.key_stream.heads(), s.key_stream.dim(), s.key_stream.dtype());
    values_buf_ = layout_of(s.value_stream.batch(), s.value_stream.heads(), s.value_stream.dim(), s.value_stream.dtype());
  }
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
