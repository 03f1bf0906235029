#include "seal_coder.hpp"

#include <bit>
#include <cstring>

namespace vq::seal {
namespace {

inline std::uint32_t zigzag(std::int32_t q) { return (static_cast<std::uint32_t>(q) << 1) ^ static_cast<std::uint32_t>(q >> 31); }
inline std::int32_t unzigzag(std::uint32_t z) { return static_cast<std::int32_t>(z >> 1) ^ -static_cast<std::int32_t>(z & 1); }

inline unsigned rice_bits(std::uint32_t z, unsigned k) {
  const std::uint32_t u = z >> k;
  return u < kRiceEscape ? u + 1 + k : kRiceEscape + 17;
}

// Per coefficient the k in 0..15 with the fewest bits over the tile.
void choose_k(const std::int16_t* codes, std::int64_t rows, int n, std::vector<std::uint8_t>& k) {
  k.assign(static_cast<std::size_t>(n), 0);
  for (int c = 0; c < n; ++c) {
    std::uint64_t best = ~std::uint64_t{0};
    for (unsigned kk = 0; kk < 16; ++kk) {
      std::uint64_t bits = 0;
      for (std::int64_t r = 0; r < rows; ++r) bits += rice_bits(zigzag(codes[r * n + c]), kk);
      if (bits < best) best = bits, k[static_cast<std::size_t>(c)] = static_cast<std::uint8_t>(kk);
    }
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
  std::vector<std::uint8_t> k;
  choose_k(codes, rows, n, k);
  BitWriter w{out};
  for (int c = 0; c < n; ++c) w.put(k[static_cast<std::size_t>(c)], 4);
  for (std::int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < n; ++c) {
      const std::uint32_t z = zigzag(codes[r * n + c]);
      const unsigned kc = k[static_cast<std::size_t>(c)];
      const std::uint32_t u = z >> kc;
      if (u < kRiceEscape) {
        w.put(0, u);
        w.put(1, 1);
        w.put(z & ((1u << kc) - 1), kc);
      } else {
        w.put(0, kRiceEscape);
        w.put(z, 17);
      }
    }
  w.finish();
}

std::size_t tile_bytes(const std::int16_t* codes, std::int64_t rows, int n) {
  std::vector<std::uint8_t> k;
  choose_k(codes, rows, n, k);
  std::uint64_t bits = 4 * static_cast<std::uint64_t>(n);
  for (std::int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < n; ++c) bits += rice_bits(zigzag(codes[r * n + c]), k[static_cast<std::size_t>(c)]);
  return static_cast<std::size_t>((bits + 7) / 8);
}

std::size_t decode_tile(const std::uint8_t* in, std::int64_t rows, int n, std::int16_t* codes) {
  std::uint64_t pos = 0;
  auto peek = [&]() {
    std::uint64_t v;
    std::memcpy(&v, in + (pos >> 3), 8);
    return v >> (pos & 7);  // >= 57 valid bits
  };
  std::uint8_t kbuf[4096];
  std::vector<std::uint8_t> kheap;
  std::uint8_t* k = kbuf;
  if (n > 4096) kheap.resize(static_cast<std::size_t>(n)), k = kheap.data();
  for (int c = 0; c < n; ++c) {
    k[c] = static_cast<std::uint8_t>(peek() & 15);
    pos += 4;
  }
  for (std::int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < n; ++c) {
      const std::uint64_t v = peek();
      const unsigned u = static_cast<unsigned>(std::countr_zero(v));
      std::uint32_t z;
      if (u < kRiceEscape) {
        const unsigned kc = k[c];
        z = (static_cast<std::uint32_t>(u) << kc) | static_cast<std::uint32_t>((v >> (u + 1)) & ((1u << kc) - 1));
        pos += u + 1 + kc;
      } else {
        z = static_cast<std::uint32_t>((v >> kRiceEscape) & ((1u << 17) - 1));
        pos += kRiceEscape + 17;
      }
      codes[r * n + c] = static_cast<std::int16_t>(unzigzag(z));
    }
  return static_cast<std::size_t>((pos + 7) / 8);
}

}  // namespace vq::seal
