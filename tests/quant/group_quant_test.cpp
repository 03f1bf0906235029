#include "veloxquant/quant/group_quant.hpp"

#include <algorithm>
#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"

namespace {

// The reference, written plainly: pad by repeating the last row, then min/max per group/channel,
// std::nearbyint (half to even) and float32 arithmetic throughout.
struct Ref {
  std::vector<std::uint8_t> codes;
  std::vector<float> recon;
};
Ref reference(const std::vector<float>& x, int n, int d, int bits, int g) {
  const int ng = (n + g - 1) / g;
  std::vector<float> padded(static_cast<std::size_t>(ng * g * d));
  for (int r = 0; r < ng * g; ++r)
    for (int c = 0; c < d; ++c) padded[static_cast<std::size_t>(r * d + c)] = x[static_cast<std::size_t>(std::min(r, n - 1) * d + c)];
  const float levels = static_cast<float>((1 << bits) - 1);
  Ref out;
  out.codes.resize(static_cast<std::size_t>(n * d));
  out.recon.resize(out.codes.size());
  for (int gi = 0; gi < ng; ++gi)
    for (int c = 0; c < d; ++c) {
      float mn = INFINITY, mx = -INFINITY;
      for (int r = gi * g; r < (gi + 1) * g; ++r) {
        mn = std::min(mn, padded[static_cast<std::size_t>(r * d + c)]);
        mx = std::max(mx, padded[static_cast<std::size_t>(r * d + c)]);
      }
      const float scale = std::max((mx - mn) / levels, 1e-8f);
      for (int r = gi * g; r < std::min((gi + 1) * g, n); ++r) {
        const float v = std::clamp(std::nearbyint((padded[static_cast<std::size_t>(r * d + c)] - mn) / scale), 0.0f, levels);
        const auto code = static_cast<std::uint8_t>(v);
        out.codes[static_cast<std::size_t>(r * d + c)] = code;
        volatile float prod = static_cast<float>(code) * scale;  // two roundings, like the reference
        out.recon[static_cast<std::size_t>(r * d + c)] = prod + mn;
      }
    }
  return out;
}

TEST(GroupQuant, HandComputedTwoBitGroup) {
  // One channel, 4 tokens: min 0, max 3, 2 bits -> levels 3, scale 1: codes equal the values.
  std::vector<float> x{0.0f, 1.0f, 2.0f, 3.0f};
  auto q = vq::quantize_to_codes(x, 4, 1, 2, 4);
  EXPECT_EQ(q.codes, (std::vector<std::uint8_t>{0, 1, 2, 3}));
  EXPECT_EQ(q.scale, (std::vector<float>{1.0f}));
  EXPECT_EQ(q.minv, (std::vector<float>{0.0f}));
  std::vector<float> r(4);
  vq::dequant_codes(q, r);
  EXPECT_EQ(r, x);
}

TEST(GroupQuant, RoundsHalfToEven) {
  // levels 3 over [0, 6]: scale 2. 1 -> 0.5 -> 0 (even), 3 -> 1.5 -> 2, 5 -> 2.5 -> 2 (even).
  std::vector<float> x{0.0f, 1.0f, 3.0f, 5.0f, 6.0f};
  auto q = vq::quantize_to_codes(x, 5, 1, 2, 5);
  EXPECT_EQ(q.codes, (std::vector<std::uint8_t>{0, 0, 2, 2, 3}));
}

TEST(GroupQuant, ConstantGroupUsesMinimumScaleAndIsExact) {
  std::vector<float> x(6, 3.25f);
  auto q = vq::quantize_to_codes(x, 3, 2, 4, 32);
  EXPECT_EQ(q.scale, (std::vector<float>{1e-8f, 1e-8f}));
  EXPECT_TRUE(std::all_of(q.codes.begin(), q.codes.end(), [](auto c) { return c == 0; }));
  std::vector<float> r(6);
  vq::dequant_codes(q, r);
  EXPECT_EQ(r, x);
}

TEST(GroupQuant, ShortLastGroupEqualsRepeatedRowPadding) {
  // Hand case: group size 4, 5 tokens: the second group is the single row 9 -> exact.
  std::vector<float> x{0, 1, 2, 3, 9};
  auto q = vq::quantize_to_codes(x, 5, 1, 3, 4);
  EXPECT_EQ(q.n_groups(), 2);
  EXPECT_EQ(q.minv[1], 9.0f);
  EXPECT_EQ(q.scale[1], 1e-8f);
  std::vector<float> r(5);
  vq::dequant_codes(q, r);
  EXPECT_EQ(r[4], 9.0f);
}

TEST(GroupQuant, MatchesPlainReferenceOnRandomSlices) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (int bits = 1; bits <= 8; ++bits)
    for (int n : {1, 31, 32, 33, 100}) {
      const int d = 5, g = 32;
      std::vector<float> x(static_cast<std::size_t>(n * d));
      for (auto& v : x) v = nd(rng);
      auto q = vq::quantize_to_codes(x, n, d, bits, g);
      auto ref = reference(x, n, d, bits, g);
      ASSERT_EQ(q.codes, ref.codes) << "bits " << bits << " n " << n;
      std::vector<float> r(x.size(), -12345.0f);
      vq::dequant_codes(q, r);
      ASSERT_EQ(r, ref.recon) << "bits " << bits << " n " << n;
      for (auto c : q.codes) ASSERT_LE(c, (1 << bits) - 1);
      // Error budget: at most half a step per element (plus float rounding).
      for (std::size_t i = 0; i < x.size(); ++i) {
        const auto gi = (i / static_cast<std::size_t>(d)) / static_cast<std::size_t>(g);
        const float step = q.scale[gi * static_cast<std::size_t>(d) + i % static_cast<std::size_t>(d)];
        ASSERT_LE(std::fabs(r[i] - x[i]), 0.5f * step * 1.0001f + 1e-6f);
      }
    }
}

TEST(GroupQuant, TiesAtExactHalvesOnManyValues) {
  // Values placed exactly on k + 0.5 steps: the fast rint must match nearbyint (half to even).
  const int bits = 8, n = 256;
  std::vector<float> x(n);
  for (int i = 0; i < n; ++i) x[static_cast<std::size_t>(i)] = static_cast<float>(i) * 0.5f;
  x.back() = 255.0f;  // range [0, 255]: scale 1
  auto q = vq::quantize_to_codes(x, n, 1, bits, n);
  ASSERT_EQ(q.scale[0], 1.0f);
  for (int i = 0; i < n - 1; ++i) ASSERT_EQ(q.codes[static_cast<std::size_t>(i)], std::nearbyint(i * 0.5f)) << i;
}

TEST(GroupQuant, RejectsBadInput) {
  std::vector<float> x(8, 1.0f);
  EXPECT_THROW(vq::quantize_to_codes(x, 4, 2, 0, 32), vq::InvalidArgument);
  EXPECT_THROW(vq::quantize_to_codes(x, 4, 2, 9, 32), vq::InvalidArgument);
  EXPECT_THROW(vq::quantize_to_codes(x, 4, 2, 4, 0), vq::InvalidArgument);
  EXPECT_THROW(vq::quantize_to_codes(x, 3, 2, 4, 32), vq::InvalidArgument);
  x[3] = std::nanf("");
  EXPECT_THROW(vq::quantize_to_codes(x, 4, 2, 4, 32), vq::InvalidArgument);
  x[3] = INFINITY;
  EXPECT_THROW(vq::quantize_to_codes(x, 4, 2, 4, 32), vq::InvalidArgument);
  std::vector<float> huge{-3e38f, 3e38f};
  EXPECT_THROW(vq::quantize_to_codes(huge, 2, 1, 4, 32), vq::InvalidArgument);
}

TEST(GroupQuant, EmptySlice) {
  auto q = vq::quantize_to_codes({}, 0, 4, 4, 32);
  EXPECT_EQ(q.n_groups(), 0);
  EXPECT_TRUE(q.codes.empty());
}

}  // namespace
