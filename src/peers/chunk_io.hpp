// Internal byte I/O of the CacheGen-family peers (lmcache, cachegen_paper chunks and the
// cachegen_paper profile): the entropy stage's varints and bounds-checked reader (every read of
// untrusted bytes goes through ByteReader, which throws vq::FormatError and never reads past the
// end), and the pieces both chunk formats share. The one place in src/peers that reaches into the
// entropy stage's private header.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../entropy/byte_io.hpp"

namespace vq::peers_detail {

using entropy_detail::ByteReader;
using entropy_detail::put_varint;

inline void put_u16le(std::vector<std::uint8_t>& out, std::uint16_t v) {
  out.push_back(static_cast<std::uint8_t>(v & 0xff));
  out.push_back(static_cast<std::uint8_t>(v >> 8));
}

// A chunk's token count T (varint, 1 .. max_tokens).
inline std::int64_t read_tokens(ByteReader& r, std::int64_t max_tokens) {
  const auto t = static_cast<std::int64_t>(r.varint(static_cast<std::uint64_t>(max_tokens), "tokens"));
  if (t == 0) r.fail("a chunk holds no tokens");
  return t;
}

// n u16 values, little-endian, appended to `out`.
inline void read_u16le(ByteReader& r, std::size_t n, std::vector<std::uint16_t>& out, const char* what) {
  if (r.remaining() / 2 < n) r.fail(std::string("truncated ") + what);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint16_t lo = r.u8(), hi = r.u8();
    out.push_back(static_cast<std::uint16_t>(lo | hi << 8));
  }
}

// A length-prefixed byte string (varint n, then n bytes): a chunk's rANS stream.
inline void put_stream(std::vector<std::uint8_t>& out, std::span<const std::uint8_t> stream) {
  put_varint(out, stream.size());
  out.insert(out.end(), stream.begin(), stream.end());
}
inline std::span<const std::uint8_t> read_stream(ByteReader& r) {
  const auto n = static_cast<std::size_t>(r.varint(r.remaining(), "stream bytes"));
  const auto stream = r.rest().first(n);
  r.skip(n);
  return stream;
}

}  // namespace vq::peers_detail
