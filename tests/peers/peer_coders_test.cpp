#include "veloxquant/peers/peer_coders.hpp"

#include <random>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/transform/bit_pack.hpp"

namespace {

TEST(BitPack, RoundTripsEveryWidthAndSize) {
  std::mt19937 rng(1);
  for (int bits = 1; bits <= 8; ++bits)
    for (std::size_t n : {0u, 1u, 7u, 8u, 9u, 1000u}) {
      std::vector<std::uint8_t> codes(n);
      for (auto& c : codes) c = static_cast<std::uint8_t>(rng() & ((1u << bits) - 1));
      const auto packed = vq::pack_bits(codes, bits);
      ASSERT_EQ(packed.size(), (n * static_cast<std::size_t>(bits) + 7) / 8);
      ASSERT_EQ(vq::unpack_bits(packed, n, bits), codes);
    }
  // hand case: 3-bit codes 5, 2, 7 -> bits 101 010 111 (LSB first) = 0b11010101, 0b1
  EXPECT_EQ(vq::pack_bits(std::vector<std::uint8_t>{5, 2, 7}, 3), (std::vector<std::uint8_t>{0xd5, 0x01}));
  EXPECT_THROW(vq::pack_bits(std::vector<std::uint8_t>{8}, 3), vq::InvalidArgument);
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
