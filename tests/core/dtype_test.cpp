#include "veloxquant/core/dtype.hpp"

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "../../src/core/dtype_round.hpp"
#include "veloxquant/core/error.hpp"

namespace {

TEST(DType, SizesAndNames) {
  EXPECT_EQ(vq::dtype_size(vq::DType::F32), 4u);
  EXPECT_EQ(vq::dtype_size(vq::DType::F16), 2u);
  EXPECT_EQ(vq::dtype_size(vq::DType::BF16), 2u);
  EXPECT_EQ(vq::dtype_from_name("bfloat16"), vq::DType::BF16);
  EXPECT_EQ(vq::dtype_name(vq::DType::F16), "float16");
  EXPECT_THROW(vq::dtype_from_name("int8"), vq::InvalidArgument);
}

TEST(DType, F16EveryBitPatternRoundTrips) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float f = vq::f16_to_f32(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(vq::f16_to_f32(vq::f32_to_f16(f))));
      continue;
    }
    ASSERT_EQ(vq::f32_to_f16(f), h) << "f16 bits " << h;
  }
}

TEST(DType, F16KnownValuesAndTiesToEven) {
  EXPECT_EQ(vq::f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(vq::f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(vq::f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(vq::f32_to_f16(65520.0f), 0x7c00);  // halfway to 65536: ties to even = inf
  EXPECT_EQ(vq::f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie, down to even
  EXPECT_EQ(vq::f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie, up to even
  EXPECT_EQ(vq::f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);             // smallest subnormal
  EXPECT_EQ(vq::f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);             // tie to even (0)
  EXPECT_EQ(vq::f32_to_f16(3 * std::ldexp(1.0f, -25)), 0x0002);         // tie to even (2)
  EXPECT_FLOAT_EQ(vq::f16_to_f32(0x3555), 0.333251953125f);
}

TEST(DType, F16RoundingMatchesNearestEven) {
  // For random floats in the normal f16 range, the result must be the nearest f16, ties to even.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-70000.0f, 70000.0f);
  for (int i = 0; i < 200000; ++i) {
    const float f = u(rng) * (i % 3 == 0 ? 1e-4f : 1.0f);
    const std::uint16_t h = vq::f32_to_f16(f);
    const float back = vq::f16_to_f32(h);
    if (std::isinf(back)) {
      ASSERT_GE(std::fabs(f), 65504.0f);
      continue;
    }
    const float up = vq::f16_to_f32(static_cast<std::uint16_t>(h + 1));
    const float dn = vq::f16_to_f32(static_cast<std::uint16_t>(h - 1));
    ASSERT_LE(std::fabs(back - f), std::fabs(up - f)) << f;
    if ((h & 0x7fff) != 0) {
      ASSERT_LE(std::fabs(back - f), std::fabs(dn - f)) << f;
    }
  }
}

TEST(DType, BulkConversionsEqualScalar) {
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.0f, 100.0f);
  std::vector<float> src(1003);
  for (auto& x : src) x = n(rng);
  for (auto dt : {vq::DType::F16, vq::DType::BF16}) {
    std::vector<std::uint16_t> half(src.size(), 0xdead);
    vq::from_f32(src.data(), half.data(), dt, src.size());
    std::vector<float> back(src.size(), -1.0f);
    vq::to_f32(half.data(), dt, back.data(), half.size());
    for (std::size_t i = 0; i < src.size(); ++i) {
      const std::uint16_t h = dt == vq::DType::F16 ? vq::f32_to_f16(src[i]) : vq::f32_to_bf16(src[i]);
      ASSERT_EQ(half[i], h) << i;
      const float f = dt == vq::DType::F16 ? vq::f16_to_f32(h) : vq::bf16_to_f32(h);
      ASSERT_EQ(std::bit_cast<std::uint32_t>(back[i]), std::bit_cast<std::uint32_t>(f)) << i;
    }
  }
}

// round_through (the caches' reconstruction rounding, src/core/dtype_round.hpp): each element is
// the scalar round trip, across the 1024-element blocks it converts in; float32 is left alone.
TEST(DType, RoundThroughEqualsTheScalarRoundTrip) {
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0.0f, 100.0f);
  std::vector<float> src(2 * 1024 + 37);
  for (auto& x : src) x = n(rng);
  for (auto dt : {vq::DType::F16, vq::DType::BF16}) {
    std::vector<float> x = src;
    vq::round_through(x.data(), x.size(), dt);
    for (std::size_t i = 0; i < src.size(); ++i) {
      const float want = dt == vq::DType::F16 ? vq::f16_to_f32(vq::f32_to_f16(src[i])) : vq::bf16_to_f32(vq::f32_to_bf16(src[i]));
      ASSERT_EQ(std::bit_cast<std::uint32_t>(x[i]), std::bit_cast<std::uint32_t>(want)) << i;
    }
    EXPECT_NE(x, src);  // the values do change (not a no-op)
  }
  std::vector<float> x = src;
  vq::round_through(x.data(), x.size(), vq::DType::F32);
  EXPECT_EQ(x, src);
}

TEST(DType, BF16TiesToEvenAndNan) {
  EXPECT_EQ(vq::f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(vq::f32_to_bf16(std::bit_cast<float>(0x3f808000u)), 0x3f80);  // tie -> even
  EXPECT_EQ(vq::f32_to_bf16(std::bit_cast<float>(0x3f818000u)), 0x3f82);  // tie -> even
  EXPECT_TRUE(std::isnan(vq::bf16_to_f32(vq::f32_to_bf16(std::nanf("")))));
}

}  // namespace
