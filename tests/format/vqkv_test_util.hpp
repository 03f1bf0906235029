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

}  // namespace vqtest
