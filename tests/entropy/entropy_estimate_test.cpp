#include "veloxquant/entropy/entropy_estimate.hpp"

#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "veloxquant/transform/token_delta.hpp"

namespace {

using Sym = std::vector<std::int16_t>;

TEST(Entropy, ConstantIsZeroCoinIsOneBit) {
  EXPECT_EQ(vq::symbol_entropy_bits(Sym{}), 0.0);
  EXPECT_EQ(vq::symbol_entropy_bits(Sym{4, 4, 4, 4}), 0.0);
  EXPECT_DOUBLE_EQ(vq::symbol_entropy_bits(Sym{0, 1, 0, 1}), 1.0);
  // {0:2, 1:1, 2:1} -> 0.5*1 + 0.25*2 + 0.25*2 = 1.5 bits.
  EXPECT_DOUBLE_EQ(vq::symbol_entropy_bits(Sym{0, 0, 1, 2}), 1.5);
  EXPECT_DOUBLE_EQ(vq::symbol_entropy_bits(Sym{-255, 255}), 1.0);
}

TEST(Entropy, NeverAboveLogOfAlphabet) {
  std::mt19937 rng(1);
  for (int a : {2, 3, 16, 255}) {
    Sym s(5000);
    for (auto& x : s) x = static_cast<std::int16_t>(rng() % static_cast<unsigned>(a));
    EXPECT_LE(vq::symbol_entropy_bits(s), std::log2(a) + 1e-12);
    EXPECT_GT(vq::symbol_entropy_bits(s), std::log2(a) - 0.1);
  }
}

TEST(Entropy, HandComputedBytes) {
  // [4, 2] symbols: channel 0 = {0,0,1,1} (1 bit), channel 1 constant (0 bits).
  Sym s{0, 7, 0, 7, 1, 7, 1, 7};
  EXPECT_DOUBLE_EQ(vq::estimated_code_bits(s, 4, 2, 4, true), 4.0);
  // pooled: {0:2, 1:2, 7:4} -> 1.5 bits * 8 symbols = 12 bits
  EXPECT_DOUBLE_EQ(vq::estimated_code_bits(s, 4, 2, 4, false), 12.0);
  // bytes = ceil(4/8) + n_groups * D * 4 = 1 + 1*2*4
  EXPECT_EQ(vq::entropy_coded_bytes(s, 4, 2, 4, 1, true), 9u);
  EXPECT_EQ(vq::entropy_coded_bytes(s, 4, 2, 4, 1, false), 2u + 8u);
  // the cap: entropy above `bits` is counted at `bits`
  Sym wide{0, 1, 2, 3};  // 2 bits per symbol, capped at 1
  EXPECT_DOUBLE_EQ(vq::estimated_code_bits(wide, 4, 1, 1, true), 4.0);
  // fixed width: ceil(N * D * bits / 8) + n_groups * D * 4
  EXPECT_EQ(vq::fixed_width_bytes(4, 2, 3, 1), 3u + 8u);
  EXPECT_EQ(vq::fixed_width_bytes(33, 128, 4, 2), 33u * 64u + 2u * 128u * 4u);
  EXPECT_EQ(vq::fixed_width_bytes(0, 128, 4, 0), 0u);
}

TEST(Entropy, PerChannelAtMostPooled) {
  std::mt19937 rng(2);
  for (int trial = 0; trial < 20; ++trial) {
    const int n = 64, d = 8;
    Sym s(static_cast<std::size_t>(n * d));
    for (int i = 0; i < n * d; ++i) s[static_cast<std::size_t>(i)] = static_cast<std::int16_t>((i % d) * 3 + static_cast<int>(rng() % 4));
    EXPECT_LE(vq::estimated_code_bits(s, n, d, 8, true), vq::estimated_code_bits(s, n, d, 8, false) + 1e-9);
  }
}

TEST(Entropy, DeltaBeatsRawOnRandomWalk) {
  std::mt19937 rng(3);
  const int n = 512, d = 4;
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(n * d));
  std::vector<int> x(d, 128);
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < d; ++c) {
      x[static_cast<std::size_t>(c)] = std::clamp(x[static_cast<std::size_t>(c)] + static_cast<int>(rng() % 3) - 1, 0, 255);
      codes[static_cast<std::size_t>(r * d + c)] = static_cast<std::uint8_t>(x[static_cast<std::size_t>(c)]);
    }
  Sym raw(codes.begin(), codes.end());
  auto delta = vq::token_delta(codes, n, d);
  EXPECT_LT(vq::symbol_entropy_bits(delta), vq::symbol_entropy_bits(raw));
  EXPECT_LT(vq::estimated_code_bits(delta, n, d, 8, true), vq::estimated_code_bits(raw, n, d, 8, true));
}

}  // namespace
