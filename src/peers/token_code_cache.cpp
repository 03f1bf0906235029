#include "veloxquant/peers/token_code_cache.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"

namespace vq {

std::pair<Tensor, Tensor> TokenCodeKVCache::update_and_fetch(const Tensor& keys, const Tensor& values) {
  check_chunk(keys, values);
  check_input(keys, values);
  if (offset_ == 0) clear_codes();
  const std::int64_t t0 = offset_;
  append(keys, values);
  const auto B = static_cast<std::size_t>(keys_buf_.dim(0));
  for (int kv = 0; kv < 2; ++kv) {
    const auto C = channels(kv);
    codes_[kv].resize(B);
    scales_[kv].resize(B);
    for (auto& c : codes_[kv]) c.resize(static_cast<std::size_t>(offset_ * C));
    for (auto& s : scales_[kv]) s.resize(static_cast<std::size_t>(offset_));
  }
  quantize_tokens(t0);
  return {keys_buf_.slice(2, 0, offset_), values_buf_.slice(2, 0, offset_)};
}

std::int64_t TokenCodeKVCache::trim(std::int64_t n) {
  const std::int64_t dropped = KVCache::trim(n);
  if (dropped == 0) return 0;
  for (int kv = 0; kv < 2; ++kv) {
    const std::int64_t C = channels(kv);
    for (auto& c : codes_[kv]) c.resize(static_cast<std::size_t>(offset_ * C));
    for (auto& s : scales_[kv]) s.resize(static_cast<std::size_t>(offset_));
  }
  for (auto& sizes : chunk_bytes_) sizes.resize(std::min(sizes.size(), static_cast<std::size_t>(offset_ / chunk_)));
  return dropped;
}

void TokenCodeKVCache::from_state(const KVState& state) {
  refeed_state(state, [this] { clear_codes(); });
}

std::size_t TokenCodeKVCache::nbytes() const {
  std::size_t n = KVCache::nbytes();
  for (int kv = 0; kv < 2; ++kv) {
    for (const auto& c : codes_[kv]) n += c.capacity() * sizeof(std::uint16_t);
    for (const auto& s : scales_[kv]) n += s.capacity() * sizeof(std::uint16_t);
  }
  return n;
}

std::span<const std::uint16_t> TokenCodeKVCache::codes(std::int64_t b, int kv) const {
  require(kv == 0 || kv == 1, "{}: kv must be 0 (K) or 1 (V)", name_);
  require(b >= 0 && b < static_cast<std::int64_t>(codes_[kv].size()), "{}: no sequence {}", name_, b);
  return codes_[kv][static_cast<std::size_t>(b)];
}

std::span<const std::uint16_t> TokenCodeKVCache::scales(std::int64_t b, int kv) const {
  require(kv == 0 || kv == 1, "{}: kv must be 0 (K) or 1 (V)", name_);
  require(b >= 0 && b < static_cast<std::int64_t>(scales_[kv].size()), "{}: no sequence {}", name_, b);
  return scales_[kv][static_cast<std::size_t>(b)];
}

std::int64_t TokenCodeKVCache::channels(int kv) const {
  const Tensor& buf = kv == 0 ? keys_buf_ : values_buf_;
  return buf.dim(1) * buf.dim(3);
}

std::pair<std::int64_t, std::int64_t> TokenCodeKVCache::chunk_range(std::int64_t c) const {
  require(c >= 0 && c < chunks(), "{}: chunk {} does not exist ({} chunks)", name_, c, chunks());
  const std::int64_t t0 = c * chunk_;
  return {t0, std::min<std::int64_t>(chunk_, offset_ - t0)};
}

double TokenCodeKVCache::encoded_bytes() const {
  if (offset_ == 0) return 0;
  const std::int64_t B = keys_buf_.dim(0);
  chunk_bytes_.resize(static_cast<std::size_t>(B));
  const std::int64_t complete = offset_ / chunk_;
  double total = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    auto& sizes = chunk_bytes_[static_cast<std::size_t>(b)];
    for (auto c = static_cast<std::int64_t>(sizes.size()); c < complete; ++c) sizes.push_back(encode_chunk(b, c).size());
    for (std::size_t s : sizes) total += static_cast<double>(s);
    if (complete < chunks()) total += static_cast<double>(encode_chunk(b, complete).size());
  }
  return total;
}

void TokenCodeKVCache::clear_codes() {
  for (int kv = 0; kv < 2; ++kv) codes_[kv].clear(), scales_[kv].clear();
  chunk_bytes_.clear();
}

}  // namespace vq
