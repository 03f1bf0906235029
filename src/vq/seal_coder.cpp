#include "seal_coder.hpp"

#include <bit>
#include <cstring>

namespace vq::seal {
namespace {

inline std::uint32_t zigzag(std::int32_t q) { return (static_cast<std::uint32_t>(q) << 1) ^ static_cast<std::uint32_t>(q >> 31); }
inline std::int32_t unzigzag(std::uint32_t z) { return static_cast<std::int32_t>(z >> 1) ^ -static_cast<std::int32_t>(z & 1); }

inline unsigned rice_bits(std::uint32_t z, unsigned k) {
  const std::uint32_t u = z >> k;
  return u < kRiceEscape ? u + 1 + k : kRiceEscape + kRiceRawBits;
}

// The value coded for code r of coefficient c: the code, or (delta) its difference from row r - 1's
// (row 0's from 0).
inline std::int32_t coded_value(const std::int16_t* codes, std::int64_t r, int n, int c, bool delta) {
  const std::int32_t q = codes[r * n + c];
  return delta && r > 0 ? q - codes[(r - 1) * n + c] : q;
}

// Per coefficient the (delta, k) in {0, 1} x 0..15 with the fewest bits over the tile: mode[c] = k | delta << 4.
void choose_modes(const std::int16_t* codes, std::int64_t rows, int n, std::vector<std::uint8_t>& mode) {
  mode.assign(static_cast<std::size_t>(n), 0);
  std::uint64_t bits[32];
  for (int c = 0; c < n; ++c) {
    std::fill(bits, bits + 32, 0);
    for (std::int64_t r = 0; r < rows; ++r)
      for (unsigned d = 0; d < 2; ++d) {
        const std::uint32_t z = zigzag(coded_value(codes, r, n, c, d != 0));
        for (unsigned k = 0; k < 16; ++k) bits[d * 16 + k] += rice_bits(z, k);
      }
    std::uint64_t best = ~std::uint64_t{0};
    for (unsigned m = 0; m < 32; ++m)
      if (bits[m] < best) best = bits[m], mode[static_cast<std::size_t>(c)] = static_cast<std::uint8_t>((m & 15) | (m >> 4) << 4);
  }
}

struct BitWriter {
  std::vector<std::uint8_t>& out;
  std::uint64_t acc = 0;
  unsigned fill = 0;
  void put(std::uint64_t v, unsigned nbits) {  // nbits <= 32
    acc |= v << fill;
    fill += nbits;
    while (fill >= 8) {
      out.push_back(static_cast<std::uint8_t>(acc));
      acc >>= 8;
      fill -= 8;
    }
  }
  void finish() {
    if (fill > 0) out.push_back(static_cast<std::uint8_t>(acc));
    acc = 0, fill = 0;
  }
};

}  // namespace

void encode_tile(const std::int16_t* codes, std::int64_t rows, int n, std::vector<std::uint8_t>& out) {
  std::vector<std::uint8_t> mode;
  choose_modes(codes, rows, n, mode);
  BitWriter w{out};
  for (int c = 0; c < n; ++c) w.put(mode[static_cast<std::size_t>(c)], 5);
  for (std::int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < n; ++c) {
      const unsigned kc = mode[static_cast<std::size_t>(c)] & 15;
      const std::uint32_t z = zigzag(coded_value(codes, r, n, c, mode[static_cast<std::size_t>(c)] >> 4));
      const std::uint32_t u = z >> kc;
      if (u < kRiceEscape) {
        w.put(0, u);
        w.put(1, 1);
        w.put(z & ((1u << kc) - 1), kc);
      } else {
        w.put(0, kRiceEscape);
        w.put(z, kRiceRawBits);
      }
    }
  w.finish();
}

std::size_t tile_bytes(const std::int16_t* codes, std::int64_t rows, int n) {
  std::vector<std::uint8_t> mode;
  choose_modes(codes, rows, n, mode);
  std::uint64_t bits = 5 * static_cast<std::uint64_t>(n);
  for (std::int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < n; ++c)
      bits += rice_bits(zigzag(coded_value(codes, r, n, c, mode[static_cast<std::size_t>(c)] >> 4)), mode[static_cast<std::size_t>(c)] & 15);
  return static_cast<std::size_t>((bits + 7) / 8);
}

std::size_t decode_tile(const std::uint8_t* in, std::int64_t rows, int n, std::int16_t* codes) {
  std::uint64_t pos = 0;
  auto peek = [&]() {
    std::uint64_t v;
    std::memcpy(&v, in + (pos >> 3), 8);
    return v >> (pos & 7);  // >= 57 valid bits
  };
  thread_local std::vector<std::uint8_t> mode;
  mode.resize(static_cast<std::size_t>(n));
  for (int c = 0; c < n; ++c) {
    mode[static_cast<std::size_t>(c)] = static_cast<std::uint8_t>(peek() & 31);
    pos += 5;
  }
  for (std::int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < n; ++c) {
      const std::uint64_t v = peek();
      const unsigned u = static_cast<unsigned>(std::countr_zero(v)), m = mode[static_cast<std::size_t>(c)];
      std::uint32_t z;
      if (u < kRiceEscape) {
        const unsigned kc = m & 15;
        z = (static_cast<std::uint32_t>(u) << kc) | static_cast<std::uint32_t>((v >> (u + 1)) & ((1u << kc) - 1));
        pos += u + 1 + kc;
      } else {
        z = static_cast<std::uint32_t>((v >> kRiceEscape) & ((1u << kRiceRawBits) - 1));
        pos += kRiceEscape + kRiceRawBits;
      }
      std::int32_t q = unzigzag(z);
      if ((m >> 4) && r > 0) q += codes[(r - 1) * n + c];
      codes[r * n + c] = static_cast<std::int16_t>(q);
    }
  return static_cast<std::size_t>((pos + 7) / 8);
}

}  // namespace vq::seal
