// libFuzzer target: LmcacheKVCache::decode_chunk (peers/lmcache_cache.hpp) on arbitrary bytes.
// Byte 0 picks the layer's shape, which both sides know and the chunk does not store: bits 0-2 the
// key channels (1 + b), bits 3-5 the value channels, bit 6 / bit 7 16 (set) or 32 key / value bins.
// The rest is the chunk, decoded with at most 256 tokens.
// Checks: only vq::FormatError escapes; a decoded chunk has the shapes asked for and codes within
// the alphabet; it re-encodes (encode_chunk(Chunk)) without an error to bytes that decode to the
// same chunk and re-encode to themselves. The input itself need not come back: the decoder
// accepts any valid tables and overlong varints, the encoder writes its own.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "veloxquant/core/error.hpp"
#include "veloxquant/peers/lmcache_cache.hpp"

namespace {

constexpr std::int64_t kMaxTokens = 256;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::uint8_t shape = data[0];
  const std::int64_t channels[2] = {1 + (shape & 7), 1 + ((shape >> 3) & 7)};
  const vq::LmcacheBins bins{shape & 0x40 ? 16 : 32, shape & 0x80 ? 16 : 32};
  const std::span<const std::uint8_t> in(data + 1, size - 1);
  vq::LmcacheKVCache::Chunk chunk;
  try {
    chunk = vq::LmcacheKVCache::decode_chunk(in, channels[0], channels[1], bins, kMaxTokens);
  } catch (const vq::FormatError&) {
    return 0;
  }
  if (chunk.tokens < 1 || chunk.tokens > kMaxTokens) std::abort();
  const auto T = static_cast<std::size_t>(chunk.tokens);
  for (int kv = 0; kv < 2; ++kv) {
    const int alphabet = (kv == 0 ? bins.key : bins.value) - 1;
    if (chunk.scales[kv].size() != T || chunk.codes[kv].size() != T * static_cast<std::size_t>(channels[kv])) std::abort();
    for (std::uint16_t q : chunk.codes[kv])
      if (q >= alphabet) std::abort();
  }
  const std::vector<std::uint8_t> again = vq::LmcacheKVCache::encode_chunk(chunk, bins);
  const auto back = vq::LmcacheKVCache::decode_chunk(again, channels[0], channels[1], bins, kMaxTokens);
  if (!(back == chunk)) std::abort();
  if (vq::LmcacheKVCache::encode_chunk(back, bins) != again) std::abort();
  return 0;
}
