#include "veloxquant/transform/token_delta.hpp"

#include <random>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"

namespace {

TEST(TokenDelta, HandComputed) {
  // [3, 2] codes, channels independent; row 0 kept.
  std::vector<std::uint8_t> codes{5, 0, 7, 3, 2, 3};
  auto d = vq::token_delta(codes, 3, 2);
  EXPECT_EQ(d, (std::vector<std::int16_t>{5, 0, 2, 3, -5, 0}));
  EXPECT_EQ(vq::token_undelta(d, 3, 2), codes);
}

TEST(TokenDelta, RoundTripIsBitExactOnRandomCodes) {
  std::mt19937 rng(5);
  for (int n : {0, 1, 2, 31, 32, 33, 257}) {
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(n) * 7);
    for (auto& c : codes) c = static_cast<std::uint8_t>(rng());
    auto d = vq::token_delta(codes, n, 7);
    for (auto s : d) ASSERT_TRUE(s >= -255 && s <= 255);
    ASSERT_EQ(vq::token_undelta(d, n, 7), codes);
  }
}

TEST(TokenDelta, CorruptDeltasAreRejected) {
  std::vector<std::int16_t> d{200, 100};  // running sum 300 leaves the code range
  EXPECT_THROW(vq::token_undelta(d, 2, 1), vq::FormatError);
  std::vector<std::int16_t> neg{0, -1};
  EXPECT_THROW(vq::token_undelta(neg, 2, 1), vq::FormatError);
  EXPECT_THROW(vq::token_delta(std::vector<std::uint8_t>(5), 2, 2), vq::InvalidArgument);
}

}  // namespace
