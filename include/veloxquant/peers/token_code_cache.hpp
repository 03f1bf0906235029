// TokenCodeKVCache: the common base of the CacheGen-family peers (LmcacheKVCache,
// CachegenPaperKVCache). Each token of each sequence is quantized on its own into C = H * D codes
// and one float16 scale, for K and for V; a sequence's tokens are cut by position into chunks of
// `chunk` tokens (the last may be partial), which the subclass encodes into its wire format.
//
// This class owns the per-sequence codes and scales and keeps them in step with the dense buffer
// (the reconstruction): update_and_fetch appends and has the subclass quantize the new tokens,
// trim drops whole tokens, from_state feeds a state as one call. It also memoises the encoded size
// of every complete chunk for stored_bytes() (a complete chunk never changes until trim or
// from_state). A subclass supplies the input check, the quantizer and the chunk codec.
#pragma once
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "veloxquant/cache/kv_cache.hpp"

namespace vq {

class TokenCodeKVCache : public KVCache {
 public:
  // Checks the input (check_chunk, then the subclass's check_input; InvalidArgument leaves the
  // cache unchanged), appends it, and has the subclass quantize the new tokens.
  std::pair<Tensor, Tensor> update_and_fetch(const Tensor& keys, const Tensor& values) override;
  std::int64_t trim(std::int64_t n) override;      // drops whole tokens (codes are per token)
  void from_state(const KVState& state) override;  // feeds `state` as one chunk
  std::size_t nbytes() const override;             // the dense buffer plus the codes

  int chunk_tokens() const { return chunk_; }
  // Chunks of each sequence: ceil(offset / chunk).
  std::int64_t chunks() const { return (offset_ + chunk_ - 1) / chunk_; }
  // The codes (token-major, C per token) and float16 scale bits of sequence b, K (kv = 0) or V (1).
  std::span<const std::uint16_t> codes(std::int64_t b, int kv) const;
  std::span<const std::uint16_t> scales(std::int64_t b, int kv) const;

  // The wire bytes of chunk c of sequence b (the subclass's format).
  virtual std::vector<std::uint8_t> encode_chunk(std::int64_t b, std::int64_t c) const = 0;

  // One decoded chunk: its codes and scales as codes() / scales() lay them out, K then V.
  struct Chunk {
    std::int64_t tokens = 0;
    std::vector<std::uint16_t> codes[2], scales[2];
    friend bool operator==(const Chunk&, const Chunk&) = default;
  };

 protected:
  // `name` (a string literal) prefixes error messages; `chunk` >= 1 tokens per chunk (the
  // subclass validates its config).
  TokenCodeKVCache(const char* name, int chunk) : name_(name), chunk_(chunk) {}

  // Throws InvalidArgument when the (check_chunk-checked) input cannot be quantized.
  virtual void check_input(const Tensor& keys, const Tensor& values) const = 0;
  // Quantize tokens [t0, offset_) of every sequence: they are appended to the buffers and the
  // storage is sized; write their codes and scales, and their reconstructions into the buffers.
  virtual void quantize_tokens(std::int64_t t0) = 0;

  // C = H * D of K (kv = 0) or V (1); the cache must hold tokens.
  std::int64_t channels(int kv) const;
  // First token and token count of chunk c; throws InvalidArgument when there is no chunk c.
  std::pair<std::int64_t, std::int64_t> chunk_range(std::int64_t c) const;
  // The wire bytes of every chunk of every sequence (encode_chunk's sizes; complete chunks memoised).
  double encoded_bytes() const;

  // Per K/V ([0] K, [1] V), per sequence b: codes token-major (C per token), float16 scale bits.
  std::vector<std::vector<std::uint16_t>> codes_[2], scales_[2];

 private:
  void clear_codes();
  const char* name_;
  int chunk_;
  // Bytes of each complete chunk, per sequence, filled lazily by encoded_bytes(); cut by trim,
  // cleared by from_state and a restart. Not thread-safe, like every mutating call.
  mutable std::vector<std::vector<std::size_t>> chunk_bytes_;
};

}  // namespace vq
