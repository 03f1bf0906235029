// Private helpers of the entropy stage: LEB128 varints and a bounds-checked byte reader.
// Every read of untrusted bytes goes through ByteReader, which throws vq::FormatError (never reads
// past the end).
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "veloxquant/core/error.hpp"

namespace vq::entropy_detail {

inline void put_varint(std::vector<std::uint8_t>& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<std::uint8_t>(v | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<std::uint8_t>(v));
}

inline std::size_t varint_size(std::uint64_t v) {
  std::size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

class ByteReader {
 public:
  ByteReader(std::span<const std::uint8_t> bytes, const char* what) : bytes_(bytes), what_(what) {}

  std::size_t pos() const { return pos_; }
  std::size_t remaining() const { return bytes_.size() - pos_; }

  [[noreturn]] void fail(const std::string& why) const {
    throw FormatError(std::string(what_) + ": " + why + " (at byte " + std::to_string(pos_) + " of " +
                      std::to_string(bytes_.size()) + ")");
  }

  std::uint8_t u8() {
    if (pos_ >= bytes_.size()) fail("truncated");
    return bytes_[pos_++];
  }

  std::uint32_t u32le() {
    if (remaining() < 4) fail("truncated");
    const std::uint8_t* p = bytes_.data() + pos_;
    pos_ += 4;
    return static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
           static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24;
  }

  // An unsigned LEB128 value of at most 10 bytes whose value is <= max.
  std::uint64_t varint(std::uint64_t max, const char* field) {
    std::uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      const std::uint8_t b = u8();
      const std::uint64_t part = static_cast<std::uint64_t>(b & 0x7f);
      if (shift == 63 && part > 1) fail(std::string(field) + " varint overflows 64 bits");
      v |= part << shift;
      if (!(b & 0x80)) {
        if (v > max) fail(std::string(field) + " = " + std::to_string(v) + " exceeds " + std::to_string(max));
        return v;
      }
    }
    fail(std::string(field) + " varint longer than 10 bytes");
  }

  std::span<const std::uint8_t> rest() const { return bytes_.subspan(pos_); }
  void skip(std::size_t n) {
    if (n > remaining()) fail("truncated");
    pos_ += n;
  }

 private:
  std::span<const std::uint8_t> bytes_;
  const char* what_;
  std::size_t pos_ = 0;
};

}  // namespace vq::entropy_detail
