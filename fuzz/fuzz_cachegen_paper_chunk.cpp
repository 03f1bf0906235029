// libFuzzer target: CachegenPaperKVCache::decode_chunk (peers/cachegen_paper_cache.hpp) on
// arbitrary bytes, against a fixed profile (cachegen_paper_fuzz_profile.hpp). Byte 0 picks the
// layer (byte % 3); the rest is the chunk, decoded with at most 64 tokens.
// Checks: only vq::FormatError escapes; a decoded chunk has the profile's shapes and dequantizes;
// it re-encodes (encode_chunk(Chunk)) without an error to exactly the input, or, when the input
// spends bytes on overlong varints (the only freedom the format leaves), to fewer bytes that
// decode to the same chunk.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "veloxquant/core/error.hpp"
#include "veloxquant/peers/cachegen_paper_cache.hpp"
#include "cachegen_paper_fuzz_profile.hpp"

namespace {

constexpr std::int64_t kMaxTokens = 64;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const vq::CachegenPaperProfile profile = vqfuzz::cachegen_fuzz_profile();
  if (size == 0) return 0;
  const int layer = data[0] % profile.n_layers();
  const std::span<const std::uint8_t> in(data + 1, size - 1);
  vq::CachegenPaperKVCache::Chunk chunk;
  try {
    chunk = vq::CachegenPaperKVCache::decode_chunk(in, profile, layer, kMaxTokens);
  } catch (const vq::FormatError&) {
    return 0;
  }
  if (chunk.tokens < 1 || chunk.tokens > kMaxTokens) std::abort();
  const auto T = static_cast<std::size_t>(chunk.tokens);
  for (int kv = 0; kv < 2; ++kv) {
    const auto C = static_cast<std::size_t>(profile.layers[static_cast<std::size_t>(layer)][kv].channels);
    if (chunk.scales[kv].size() != T || chunk.codes[kv].size() != T * C) std::abort();
    if (vq::CachegenPaperKVCache::dequantize_chunk(chunk, kv, profile, layer).size() != T * C) std::abort();
  }
  const std::vector<std::uint8_t> again = vq::CachegenPaperKVCache::encode_chunk(chunk, profile, layer);
  if (again.size() > in.size()) std::abort();
  if (again.size() == in.size()) {
    if (!std::equal(again.begin(), again.end(), in.begin())) std::abort();
  } else if (!(vq::CachegenPaperKVCache::decode_chunk(again, profile, layer, kMaxTokens) == chunk)) {
    std::abort();
  }
  return 0;
}
