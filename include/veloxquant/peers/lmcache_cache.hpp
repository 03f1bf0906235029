// LmcacheKVCache: LMCache's CacheGen codec (repo LMCache/LMCache, lmcache/storage_backend/serde/
// cachegen_*.py and csrc/) for one attention layer, coded with veloxquant's rANS.
//
// Quantization, per (batch, token): the token's K (or V) over all KV heads is one vector of
// C = H * D channels; s = max |x| over it, stored as float16; MAX = bins / 2 - 1;
// q = clamp(round_half_even(x * MAX / s + MAX), 0, 2 MAX); x ~= (q - MAX) / MAX * s
// (src/peers/absmax_codes.hpp). "32 bins" is 31 levels (alphabet 2 MAX + 1).
//
// Bins per layer (LMCache's table for 32-layer 7B/8B models: K 32 bins on layers [0, 10) then 16,
// V 32 on [0, 2) then 16), for attention layer l of L:
//   scaled (default): the boundaries keep their depth fraction: K has 32 bins when 32 l < 10 L,
//                     V when 32 l < 2 L (layer l starts before 10/32, resp. 2/32, of the depth).
//                     For L = 32 this is LMCache's table; stories260K (L = 5): K 32 on layers 0-1,
//                     V 32 on layer 0, else 16.
//   native:           LMCache's own rule for any L (lmcache/v1 CacheGenConfig): L < 10: 32 bins
//                     everywhere; else K 32 on [0, 10), V 32 on [0, 2), 16 elsewhere.
//
// Chunks: tokens [c * chunk, (c + 1) * chunk) of a sequence form chunk c (the last may be
// partial). Per chunk, per K/V, per channel, a probability table is built from the chunk's codes
// and shipped with the chunk, as LMCache does. Codes depend only on their own token, and chunk
// boundaries only on positions, so the cache and its bytes are the same whatever the host's call
// sizes (tested).
//
// Wire format of one chunk of one sequence (what stored_bytes() counts; little-endian, varint =
// unsigned LEB128). The layer's C_K, C_V and bins are model metadata known to both sides.
//   varint  T                          tokens in the chunk, 1 .. chunk
//   for K, then V:
//     u16     scale[T]                 float16 s of each token
//     table   table[C]                 FrequencyTable::serialize of channel c's codes in the chunk
//                                      (alphabet 2 MAX + 1; precision ceil(log2 T) bits, 1..12:
//                                      counts are multiples of 1/T, finer tables only cost bytes)
//     varint  n                        bytes of the rANS stream
//     u8      stream[n]                one rANS stream (entropy/rans.hpp), segment c = channel c's
//                                      T codes in token order, coded with table c
// LMCache itself ships 16-bit CDFs of maxbins + 1 entries per table (66 bytes at 32 bins) and one
// arithmetic-coded stream with an int32 length per (K/V, channel); ours are smaller on both counts.
//
// stored_bytes(): estimated_bytes = the exact size of those chunks (encoded for real);
// fixed_bytes = codes at ceil(log2(2 MAX + 1)) bits (5 at 32 bins, 4 at 16) + 2 bytes per token scale.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "veloxquant/peers/token_code_cache.hpp"

namespace vq {

struct LmcacheConfig {
  int chunk = 256;      // tokens per chunk (tables and streams restart); 1 .. 65536
  bool scaled = true;   // bins schedule: scaled to depth (true) or LMCache's native rule (false)
  void validate() const;  // throws InvalidArgument
};

struct LmcacheBins {
  int key = 32, value = 32;
};
// Bins of attention layer `layer` (0-based) of `n_layers`; throws InvalidArgument unless 0 <= layer < n_layers.
LmcacheBins lmcache_bins(int layer, int n_layers, bool scaled);

// Codes, scales, trimming and the chunk-size memo live in TokenCodeKVCache; this class adds the
// quantizer and the chunk codec.
class LmcacheKVCache : public TokenCodeKVCache {
 public:
  // `layer` of `n_layers` attention layers decides the bins. Throws InvalidArgument on a bad config.
  LmcacheKVCache(LmcacheConfig config, int layer, int n_layers);

  // update_and_fetch throws InvalidArgument (cache unchanged) on a mismatch, NaN/Inf or
  // |x| > 65504 (scales are float16).
  CacheBytes stored_bytes() const override;
  std::string kind() const override { return "LmcacheKVCache"; }

  const LmcacheConfig& config() const { return config_; }
  const LmcacheBins& bins() const { return bins_; }

  // The wire bytes of chunk c of sequence b (format above).
  std::vector<std::uint8_t> encode_chunk(std::int64_t b, std::int64_t c) const override;
  // The wire bytes of a chunk given by its codes and scales (C_K, C_V = codes[kv].size() / tokens):
  // encode_chunk(b, c) is this of chunk c's codes and scales. Throws InvalidArgument on
  // inconsistent sizes or a code outside the bins' alphabet.
  static std::vector<std::uint8_t> encode_chunk(const Chunk& chunk, const LmcacheBins& bins);
  // Parse and decode one chunk (exactly `bytes`); throws FormatError on anything malformed,
  // truncated, trailing, or holding more than max_tokens tokens. Any valid tables (and overlong
  // varints) are accepted, so encode_chunk(decode_chunk(bytes)) may differ from `bytes`; it decodes
  // to the same chunk.
  static Chunk decode_chunk(std::span<const std::uint8_t> bytes, std::int64_t key_channels, std::int64_t value_channels,
                            const LmcacheBins& bins, std::int64_t max_tokens);

 private:
  void check_input(const Tensor& keys, const Tensor& values) const override;
  void quantize_tokens(std::int64_t t0) override;
  LmcacheConfig config_;
  LmcacheBins bins_;
};

}  // namespace vq
