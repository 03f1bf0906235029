// CacheGenKVCache: a KVCache that group-quantizes what it stores and accounts its bytes the way
// the CacheGen reference does (entropy of the token-delta code stream), for one layer.
//
// Resident-compressed: per side, the cache holds only its QuantizedStream (cache/quantized_stream.hpp):
// the codes packed at the bit width (4-bit codes two per byte), the reference's float32 scale and
// minimum per (group, channel), and the exact residual (group_aligned: tokens not yet in a closed
// group, in the input dtype). No dense copy of quantized tokens exists; keys_buf_ / values_buf_
// hold only the layout [B, H, 0, D]. nbytes() is exactly what those vectors have allocated.
// - attend() reads tiles dequantized straight from the codes (read_key_tile / read_value_tile).
// - update() appends without materialising anything.
// - update_and_fetch() and state() materialise: they dequantize every closed token into fresh dense
//   tensors [B, H, offset, D] in the input dtype, owned by the caller (the cache keeps no reference).
//   Cost per call: O(offset * H * D) dequantization and B*H*offset*(D_k + D_v)*sizeof(dtype) bytes
//   allocated, what a dense cache holds, for as long as the caller holds them. The values are
//   bit-identical to what the dense (pre-resident) cache returned: code * scale + min in float32,
//   rounded to the input dtype. A host that attends through attend() never pays it.
// (The reference deliberately has no `bits` attribute so mlx_lm keeps it on the dense SDPA path;
// this class likewise exposes its bit width only through config().)
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

// Everything needed to rebuild a CacheGenKVCache exactly (deep copies): the streams hold the
// codes, scales, minima and the exact residual (each holds offset tokens).
struct CacheGenState {
  KVCacheConfig config;
  std::int64_t offset = 0;
  QuantizedStream key_stream, value_stream;
};

class CacheGenKVCache : public KVCache {
 public:
  // Throws InvalidArgument when the config is invalid.
  explicit CacheGenKVCache(KVCacheConfig config = {});

  // As KVCache::update_and_fetch, returning fresh dense tensors (see Resident above); additionally
  // throws InvalidArgument on NaN or Inf input (before changing anything).
  std::pair<Tensor, Tensor> update_and_fetch(const Tensor& keys, const Tensor& values) override;
  // Appends (quantizing what closes) without materialising anything.
  void update(const Tensor& keys, const Tensor& values) override;
  // The reconstruction, fresh tensors in the input dtype (see Resident above).
  KVState state() const override;
  std::int64_t trim(std::int64_t n) override;
  // Dense tensors alone cannot rebuild the codes: use full_state()/from_full_state(). Throws.
  void from_state(const KVState& state) override;
  std::size_t nbytes() const override;
  // The estimate (fixed-width and entropy-estimated bytes of both sides, residual at fp16).
  CacheBytes stored_bytes() const override;
  std::string kind() const override { return "CacheGenKVCache"; }
  // Tiles dequantized straight from the packed codes (closed tokens) or the residual.
  const float* read_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const override;
  const float* read_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const override;

  CacheGenState full_state() const;
  // Taken by value: pass std::move(state) to hand over its streams without copying them. Throws
  // InvalidArgument when the streams disagree with the offset or with each other.
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
