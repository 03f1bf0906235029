#include "veloxquant/peers/peer_coders.hpp"

#include <random>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/transform/bit_pack.hpp"

namespace {

TEST(BitPack, RoundTripsEveryWidthAndSize) {
  std::mt19937 rng(1);
  for (int bits = 1; bits <= 8; ++bits)
    for (std::size_t n : {0u, 1u, 7u, 8u, 9u, 31u, 32u, 33u, 64u, 65u, 1000u}) {
      std::vector<std::uint8_t> codes(n);
      for (auto& c : codes) c = static_cast<std::uint8_t>(rng() & ((1u << bits) - 1));
      const auto packed = vq::pack_bits(codes, bits);
      ASSERT_EQ(packed.size(), (n * static_cast<std::size_t>(bits) + 7) / 8);
      ASSERT_EQ(vq::unpack_bits(packed, n, bits), codes);
    }
  // hand case: 3-bit codes 5, 2, 7 -> bits 101 010 111 (LSB first) = 0b11010101, 0b1
  EXPECT_EQ(vq::pack_bits(std::vector<std::uint8_t>{5, 2, 7}, 3), (std::vector<std::uint8_t>{0xd5, 0x01}));
  EXPECT_THROW(vq::pack_bits(std::vector<std::uint8_t>{8}, 3), vq::InvalidArgument);
  // 4 bits (the SIMD path, 32 codes per step): byte j = code 2j | code 2j + 1 << 4, and a code that
  // does not fit is refused wherever it is.
  std::vector<std::uint8_t> c4(70);
  for (std::size_t i = 0; i < c4.size(); ++i) c4[i] = static_cast<std::uint8_t>((i * 7) % 16);
  const auto p4 = vq::pack_bits(c4, 4);
  for (std::size_t j = 0; j < p4.size(); ++j) ASSERT_EQ(p4[j], c4[2 * j] | c4[2 * j + 1] << 4) << j;
  for (const std::size_t at : {3u, 40u, 69u}) {
    auto bad = c4;
    bad[at] = 16;
    EXPECT_THROW(vq::pack_bits(bad, 4), vq::InvalidArgument) << at;
  }
  EXPECT_THROW(vq::unpack_bits(std::vector<std::uint8_t>{1}, 3, 3), vq::FormatError);
}

TEST(PeerCoders, AllRoundTripAndRejectGarbage) {
  std::mt19937 rng(2);
  std::vector<std::uint8_t> codes(20000);
  int x = 8;
  for (auto& c : codes) {
    x = std::clamp(x + static_cast<int>(rng() % 3) - 1, 0, 15);
    c = static_cast<std::uint8_t>(x);
  }
  for (const auto& coder : vq::peer_coders(4)) {
    const auto comp = coder.encode(codes);
    EXPECT_LT(comp.size(), codes.size() * 55 / 100) << coder.name;  // ~4 bits per code or better
    EXPECT_EQ(coder.decode(comp, codes.size()), codes) << coder.name;
    std::vector<std::uint8_t> junk(comp.size() / 2, 0xab);
    EXPECT_THROW(coder.decode(junk, codes.size()), vq::FormatError) << coder.name;
  }
  EXPECT_EQ(vq::peer_coders(4).size(), 6u);
  EXPECT_THROW(vq::peer_coders(9), vq::InvalidArgument);
}

}  // namespace
