// Helpers for tests that take .vqkv files apart: block offsets, and recomputing checksums so that a
// deliberate corruption reaches the checks behind them.
#pragma once
#include <xxhash.h>

#include <cstdint>
#include <vector>

namespace vqtest {

inline std::uint64_t rd64(const std::vector<std::uint8_t>& b, std::size_t at) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(b[at + static_cast<std::size_t>(i)]) << (8 * i);
  return v;
}
inline std::size_t header_end(const std::vector<std::uint8_t>& b) {  // 16 + the header body size
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(b[12 + static_cast<std::size_t>(i)]) << (8 * i);
  return 16 + static_cast<std::size_t>(v);
}
inline void wr(std::vector<std::uint8_t>& b, std::size_t at, std::uint64_t v, int n) {
  for (int i = 0; i < n; ++i) b[at + static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(v >> (8 * i));
}

// Offsets of the blocks of a file (after the header section), as far as its sizes make sense.
inline std::vector<std::size_t> block_offsets(const std::vector<std::uint8_t>& b) {
  std::size_t pos = header_end(b) + 8;
  std::vector<std::size_t> out;
  while (pos + 40 <= b.size()) {
    out.push_back(pos);
    const std::uint64_t body = rd64(b, pos + 24);
    if (body > b.size()) break;  // corrupt (no wrap-around on arbitrary input)
    pos += 32 + body + 8;
  }
  return out;
}

// Recompute every checksum, so a mutation reaches the checks behind them.
inline void fix_checksums(std::vector<std::uint8_t>& b) {
  const std::size_t hs = header_end(b);
  if (hs + 8 <= b.size()) wr(b, hs, XXH64(b.data(), hs, 0), 8);
  for (const std::size_t at : block_offsets(b)) {
    const std::uint64_t body = rd64(b, at + 24);
    if (body > b.size() || at + 40 + body > b.size()) continue;  // runs past the end (no wrap-around)
    const std::size_t n = 32 + static_cast<std::size_t>(body);
    wr(b, at + n, XXH64(b.data() + at, n, 0), 8);
  }
}

// A file written field by field (docs/format.md), for headers no writer produces: `layers` layers
// of one class (0 plain; 1 CacheGen: 4 bits, group size `group`, per_call, per-channel tables at 10
// bits), each holding `offset` of the header's `tokens`, shape [1, 1, ., 1] float16, chunks of
// `chunk` tokens; then a TABLES block with no pieces for every non-empty CacheGen side and an END
// block counting them, every checksum valid. E.g. 2^32 tokens in chunks of 1 with empty layers is a
// ~100-byte file whose header claims far more than it holds.
struct CraftedFile {
  std::uint64_t tokens = 0;
  std::uint32_t chunk = 1;
  std::uint32_t layers = 1;
  std::uint8_t cls = 0;
  std::uint64_t offset = 0;
  std::uint32_t group = 4;
};
inline std::vector<std::uint8_t> crafted_file(const CraftedFile& f) {
  std::vector<std::uint8_t> body;
  auto put = [](std::vector<std::uint8_t>& b, std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) b.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  };
  const std::uint32_t dim = f.tokens > 0 ? 1 : 0;
  put(body, f.layers, 4);
  put(body, 1, 1);  // float16
  put(body, f.tokens, 8);
  for (int i = 0; i < 4; ++i) put(body, dim, 4);  // batch, heads, D_k, D_v
  put(body, f.chunk, 4);
  put(body, 0, 4);  // no metadata
  for (std::uint32_t l = 0; l < f.layers; ++l) {
    put(body, f.cls, 1);
    put(body, f.offset, 8);
    if (f.cls == 1) {
      put(body, 4, 1);        // bits
      put(body, 0, 1);        // resolved bits unset
      put(body, f.group, 4);  // group size
      put(body, 0, 1);        // use_delta
      put(body, 1, 1);        // per_channel
      put(body, 1, 4);        // layer groups
      put(body, 0, 1);        // per_call
      put(body, 0, 1);        // transform: codes
      put(body, 10, 1);       // table precision
    }
  }
  std::vector<std::uint8_t> out = {0x89, 'V', 'Q', 'K', 'V', 0x0D, 0x0A, 0x1A};
  put(out, 2, 2);  // version
  put(out, 0, 2);  // flags
  put(out, body.size(), 4);
  out.insert(out.end(), body.begin(), body.end());
  put(out, XXH64(out.data(), out.size(), 0), 8);
  std::uint64_t n_blocks = 0;
  auto block = [&](std::uint8_t type, std::uint8_t side, std::uint32_t layer, std::uint64_t count, const std::vector<std::uint8_t>& b) {
    const std::size_t at = out.size();
    put(out, type, 1);
    put(out, side, 1);
    put(out, 0, 2);
    put(out, layer, 4);
    put(out, 0, 8);  // first token
    put(out, count, 8);
    put(out, b.size(), 8);
    out.insert(out.end(), b.begin(), b.end());
    put(out, XXH64(out.data() + at, out.size() - at, 0), 8);
  };
  if (f.cls == 1 && f.offset > 0)
    for (std::uint32_t l = 0; l < f.layers; ++l)
      for (std::uint8_t side = 0; side < 2; ++side, ++n_blocks) block(1, side, l, 0, {0, 0, 0, 0});  // TABLES: no pieces
  block(4, 0, 0, n_blocks, {});
  return out;
}

}  // namespace vqtest
