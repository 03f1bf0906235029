// CachegenPaperKVCache: the CacheGen paper's codec (Liu et al., SIGCOMM 2024, arXiv 2310.07240)
// for one attention layer: 8-bit anchors every `group` tokens, deltas to the reconstructed anchor
// with a bin size per depth third, coded with veloxquant's rANS under tables profiled offline
// (cachegen_paper_profile.hpp, which also states the quantizers exactly).
//
// Codes depend only on a token and its group's anchor, and groups and chunks only on positions,
// so the cache and its bytes are the same whatever the host's call sizes (tested). Trimming drops
// whole tokens (an anchor that survives keeps its group decodable).
//
// Wire format of one chunk of one sequence (what stored_bytes() counts; little-endian, varint =
// unsigned LEB128). The profile, the layer's channels and bins are known to both sides and not
// stored: that is the paper's point.
//   varint  T                          tokens in the chunk, 1 .. chunk (the chunk starts at an anchor)
//   for K, then V:
//     u16     scale[T]                 float16 s of each token (anchor: max |x|; other: max |x - a|)
//     varint  n                        bytes of the rANS stream
//     u8      stream[n]                one rANS stream (entropy/rans.hpp); for each channel c in
//                                      order, two segments: the chunk's anchor symbols of c (profile
//                                      anchor table c), then its delta symbols of c (delta table c)
//
// stored_bytes(): estimated_bytes = the exact size of those chunks (encoded for real); fixed_bytes =
// anchors at 8 bits, deltas at ceil(log2(2 max_q + 1)) bits, + 2 bytes per token scale.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "veloxquant/peers/cachegen_paper_profile.hpp"
#include "veloxquant/peers/token_code_cache.hpp"

namespace vq {

// Codes, scales, trimming and the chunk-size memo live in TokenCodeKVCache; this class adds the
// quantizers and the chunk codec.
class CachegenPaperKVCache : public TokenCodeKVCache {
 public:
  // Attention layer `layer` of `n_layers`, with the model's profile (not null; it must match the
  // config and depth: InvalidArgument otherwise).
  CachegenPaperKVCache(CachegenPaperConfig config, int layer, int n_layers, std::shared_ptr<const CachegenPaperProfile> profile);

  // update_and_fetch throws InvalidArgument (cache unchanged) on a mismatch, NaN/Inf, |x| > 32752,
  // or a channel count (H * D) other than the profile's for this layer. codes() are symbols
  // (anchors 0..254, deltas 0..2 max_q).
  CacheBytes stored_bytes() const override;
  std::string kind() const override { return "CachegenPaperKVCache"; }

  const CachegenPaperConfig& config() const { return config_; }
  float bin() const { return bin_; }
  int delta_max_q() const { return max_q_; }
  int layer() const { return layer_; }

  std::vector<std::uint8_t> encode_chunk(std::int64_t b, std::int64_t c) const override;
  // The wire bytes of a chunk of attention layer `layer` given by its symbols and scales:
  // encode_chunk(b, c) is this of chunk c's. Throws InvalidArgument on sizes other than the
  // profile's channels or a symbol outside its table. The format has one encoding per chunk but
  // for overlong varints, so encode_chunk(decode_chunk(bytes)) is `bytes` whenever it is as long.
  static std::vector<std::uint8_t> encode_chunk(const Chunk& chunk, const CachegenPaperProfile& profile, int layer);
  // Parse and decode one chunk of attention layer `layer` (exactly `bytes`); throws FormatError on
  // anything malformed, truncated, trailing, or holding more than max_tokens tokens.
  static Chunk decode_chunk(std::span<const std::uint8_t> bytes, const CachegenPaperProfile& profile, int layer,
                            std::int64_t max_tokens);
  // The float32 reconstruction of K (kv = 0) or V of a decoded chunk, token-major.
  static std::vector<float> dequantize_chunk(const Chunk& chunk, int kv, const CachegenPaperProfile& profile, int layer);

 private:
  void check_input(const Tensor& keys, const Tensor& values) const override;
  void quantize_tokens(std::int64_t t0) override;
  CachegenPaperConfig config_;
  int layer_ = 0;
  std::shared_ptr<const CachegenPaperProfile> profile_;
  float bin_ = 1.0f;
  int max_q_ = 1;
};

}  // namespace vq
