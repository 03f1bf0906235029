// CacheGenKVCache: a KVCache that group-quantizes what it stores and accounts its bytes the way
// the CacheGen reference does (entropy of the token-delta code stream), for one layer.
//
// Fetch always returns dense K/V in the input dtype: attention never sees packed codes. (The
// reference deliberately has no `bits` attribute so mlx_lm keeps it on the dense SDPA path; this
// class likewise exposes its bit width only through config().)
//
// Flush modes (KVCacheConfig::cachegen_flush): per_call reproduces the reference exactly;
// group_aligned (default) quantizes whole groups once they are complete, keeping newer tokens in an
// exact residual, so one-token decode steps are quantized too and never billed a group of metadata.
//
// Counters always describe the cache as it stands: closed groups at their estimated and
// fixed-width sizes, the residual at 2 bytes per element. trim() rolls them back.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "veloxquant/cache/config.hpp"
#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/cache/quantized_stream.hpp"
#include "veloxquant/cache/stream_codec.hpp"

namespace vq {

// Everything needed to rebuild a CacheGenKVCache exactly (deep copies).
struct CacheGenState {
  KVCacheConfig config;
  std::int64_t offset = 0;
  Tensor keys, values;  // dense contents [B, H, offset, D], reconstructions plus residual
  QuantizedStream key_stream, value_stream;
};

class CacheGenKVCache : public KVCache {
 public:
  // Throws InvalidArgument when the config is invalid.
  explicit CacheGenKVCache(KVCacheConfig config = {});

  // As KVCache::update_and_fetch; additionally throws InvalidArgument on NaN or Inf input (before
  // changing anything).
  std::pair<Tensor, Tensor> update_and_fetch(const Tensor& keys, const Tensor& values) override;
  std::int64_t trim(std::int64_t n) override;
  // Dense tensors alone cannot rebuild the codes: use full_state()/from_full_state(). Throws.
  void from_state(const KVState& state) override;
  std::size_t nbytes() const override;
  // The estimate (fixed-width and entropy-estimated bytes of both sides, residual at fp16).
  CacheBytes stored_bytes() const override;
  std::string kind() const override { return "CacheGenKVCache"; }

  CacheGenState full_state() const;
  // Taken by value: pass std::move(state) to hand over its streams without copying them.
  void from_full_state(CacheGenState state);

  const KVCacheConfig& config() const { return config_; }

  std::uint64_t compressed_key_bytes() const;
  std::uint64_t compressed_value_bytes() const;
  std::uint64_t fixed_width_key_bytes() const;
  std::uint64_t fixed_width_value_bytes() const;
  std::uint64_t fp16_key_bytes() const;
  std::uint64_t fp16_value_bytes() const;
  // 1 - compressed_key / fixed_width_key (0 when empty).
  double entropy_savings() const;
  // 16 * compressed_key / fp16_key (the configured bits when empty).
  double assigned_avg_bits() const;

  // The real coder (cache/stream_codec.hpp): the closed codes of one side, their per-(slice,
  // channel) tables, float32 scales and minima, and a header, as one buffer. The residual (tokens
  // not yet in a closed group) is not in it: a holder stores those exactly (the .vqkv container,
  // format/vqkv.hpp, keeps them at the cache's dtype).
  std::vector<std::uint8_t> encode_keys(const StreamCodecOptions& options = {}) const;
  std::vector<std::uint8_t> encode_values(const StreamCodecOptions& options = {}) const;
  // Decode a buffer from encode_keys/encode_values (codes, scales, minima, for verification).
  // max_codes bounds what it may allocate (B * H * tokens * D of the side); FormatError on any
  // corrupt, truncated or oversized input.
  static DecodedStream decode(std::span<const std::uint8_t> bytes, std::uint64_t max_codes);
  // Measured: the size of encode_keys() / encode_values() with the default options, plus the
  // residual stored exactly, at the dtype's size (2 bytes per element for f16/bf16, 4 for f32),
  // as a .vqkv file holds it; 0 when empty. Computed on first read after a change
  // and kept until the next update_and_fetch, trim or from_full_state.
  std::uint64_t encoded_key_bytes() const;
  std::uint64_t encoded_value_bytes() const;

  // The quantized streams, for inspection and for encoders.
  const QuantizedStream& key_stream() const { return key_stream_; }
  const QuantizedStream& value_stream() const { return value_stream_; }

 private:
  KVCacheConfig config_;
  QuantizedStream key_stream_, value_stream_;
  mutable std::optional<std::uint64_t> encoded_keys_, encoded_values_;  // derived, see encoded_*_bytes
  std::uint64_t encoded_bytes(const QuantizedStream& stream, std::optional<std::uint64_t>& memo) const;
};

}  // namespace vq
