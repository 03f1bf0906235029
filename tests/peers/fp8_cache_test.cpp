// fp8 e4m3: every code, ties, saturation; the per-head-scale cache.
#include "veloxquant/peers/fp8_cache.hpp"

#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"
#include "../support/test_util.hpp"

namespace {

using vq::fp8::e4m3_from_f32;
using vq::fp8::e4m3_to_f32;

TEST(Fp8E4M3, EveryCodeDecodesExactlyAndReencodesToItself) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<std::uint8_t>(c);
    const float v = e4m3_to_f32(code);
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    // Hand formula: exponent field e, mantissa m; subnormal m * 2^-9, normal (1 + m/8) * 2^(e-7).
    const int e = (c >> 3) & 15, m = c & 7;
    const double want = (e == 0 ? m / 512.0 : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7)) * ((c & 0x80) ? -1 : 1);
    EXPECT_EQ(static_cast<double>(v), want) << c;
    EXPECT_EQ(e4m3_from_f32(v), code) << c;  // -0 (0x80) keeps its sign
  }
  EXPECT_EQ(e4m3_to_f32(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_f32(0x08), 0x1p-6f);
  EXPECT_EQ(e4m3_to_f32(0x01), 0x1p-9f);
}

TEST(Fp8E4M3, TiesGoToEvenAndAnythingAboveAMidpointRoundsUp) {
  for (int c = 0; c < 0x7E; ++c) {
    const float lo = e4m3_to_f32(static_cast<std::uint8_t>(c)), hi = e4m3_to_f32(static_cast<std::uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;  // exact in float32
    EXPECT_EQ(e4m3_from_f32(mid), (c % 2 == 0) ? c : c + 1) << c;
    EXPECT_EQ(e4m3_from_f32(std::nextafter(mid, 1e9f)), c + 1) << c;
    EXPECT_EQ(e4m3_from_f32(std::nextafter(mid, 0.0f)), c) << c;
    EXPECT_EQ(e4m3_from_f32(-mid), ((c % 2 == 0) ? c : c + 1) | 0x80) << c;
  }
  EXPECT_EQ(e4m3_from_f32(1.0625f), 0x38);  // between 1 and 1.125: even mantissa
  EXPECT_EQ(e4m3_from_f32(1.1875f), 0x3A);
  EXPECT_EQ(e4m3_from_f32(0x1p-10f), 0x00);
  EXPECT_EQ(e4m3_from_f32(3 * 0x1p-10f), 0x02);
  EXPECT_EQ(e4m3_from_f32(1e-30f), 0x00);
}

TEST(Fp8E4M3, Saturates) {
  EXPECT_EQ(e4m3_from_f32(448.0f), 0x7E);
  EXPECT_EQ(e4m3_from_f32(460.0f), 0x7E);
  EXPECT_EQ(e4m3_from_f32(1000.0f), 0x7E);
  EXPECT_EQ(e4m3_from_f32(-1e30f), 0xFE);
  EXPECT_EQ(e4m3_from_f32(INFINITY), 0x7E);
  EXPECT_EQ(e4m3_from_f32(-INFINITY), 0xFE);
  EXPECT_EQ(e4m3_from_f32(NAN), 0x7F);
}

TEST(Fp8Cache, ScalePerHeadPerCall) {
  vq::Tensor k = vq::Tensor::zeros({1, 2, 3, 4}, vq::DType::F32);
  k.set(0, 0, 1, 2, -896.0f);  // head 0: amax 896 -> scale 2
  k.set(0, 0, 2, 0, 3.0f);     // 1.5 -> exact in e4m3 -> 3
  k.set(0, 1, 0, 0, 0.5f);     // head 1: amax 0.5 -> scale 0.5/448
  const vq::Tensor v = vq::Tensor::zeros({1, 2, 3, 8}, vq::DType::F32);  // all zero: scale 1
  vq::Fp8KVCache c;
  auto [fk, fv] = c.update_and_fetch(k, v);
  ASSERT_EQ(c.key_scales().size(), 2u);
  EXPECT_EQ(c.key_scales()[0], 2.0f);
  EXPECT_EQ(c.key_scales()[1], 0.5f / 448.0f);
  EXPECT_EQ(c.value_scales()[0], 1.0f);
  EXPECT_EQ(fk.at(0, 0, 1, 2), -896.0f);
  EXPECT_EQ(fk.at(0, 0, 2, 0), 3.0f);
  EXPECT_FLOAT_EQ(fk.at(0, 1, 0, 0), 0.5f);
  EXPECT_EQ(fv.at(0, 1, 2, 7), 0.0f);
  // 1 byte per element + 4 bytes per scale: K 24 + 2*4, V 48 + 2*4
  EXPECT_EQ(c.stored_bytes().fixed_bytes, 24 + 8 + 48 + 8.0);
  c.update_and_fetch(k.slice(2, 0, 1), v.slice(2, 0, 1));  // a second call: its own scales
  EXPECT_EQ(c.key_scales().size(), 4u);
  EXPECT_EQ(c.stored_bytes().fixed_bytes, 32 + 8 + 64 + 8 + 16.0);
  EXPECT_EQ(c.trim(1), 1);  // drops the second call's token and its scales
  EXPECT_EQ(c.stored_bytes().fixed_bytes, 24 + 8 + 48 + 8.0);
  EXPECT_EQ(c.trim(1), 1);  // a call cut in two keeps its scale
  EXPECT_EQ(c.stored_bytes().fixed_bytes, 16 + 8 + 32 + 8.0);
}

TEST(Fp8Cache, RelativeErrorBudgetAndNonFinite) {
  const vq::Tensor k = vqtest::random_walk({1, 4, 64, 8}, 21), v = vqtest::random_walk({1, 4, 64, 8}, 22);
  vq::Fp8KVCache c;
  auto [fk, fv] = c.update_and_fetch(k, v);
  // e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values; the subnormal step is
  // 2^-9 * scale.
  for (std::int64_t h = 0; h < 4; ++h) {
    const float scale = c.key_scales()[static_cast<std::size_t>(h)];
    for (std::int64_t s = 0; s < 64; ++s)
      for (std::int64_t d = 0; d < 8; ++d) {
        const float x = k.at(0, h, s, d);
        EXPECT_LE(std::fabs(fk.at(0, h, s, d) - x), std::max(std::fabs(x) / 16.0f, 0x1p-10f * scale) * 1.0001f);
      }
  }
  vq::Tensor bad = vq::Tensor::zeros({1, 4, 1, 8}, vq::DType::F32);
  bad.set(0, 0, 0, 0, INFINITY);
  EXPECT_THROW(c.update_and_fetch(bad, bad), vq::InvalidArgument);
  EXPECT_EQ(c.offset(), 64);
}

// Resident: tiles are the codes decoded with their call's scale, exactly state()'s rows (float32
// and float16 input, tiles that cross calls); trim and attend agree with a cache of the kept tokens.
TEST(Fp8Cache, ResidentTilesEqualStateAcrossCalls) {
  for (vq::DType dt : {vq::DType::F32, vq::DType::F16}) {
    const vq::Tensor k = vqtest::random_walk({2, 2, 30, 16}, 31, dt), v = vqtest::random_walk({2, 2, 30, 8}, 32, dt);
    vq::Fp8KVCache c;
    c.update_and_fetch(k.slice(2, 0, 7), v.slice(2, 0, 7));
    auto [fk, fv] = c.update_and_fetch(k.slice(2, 7, 30), v.slice(2, 7, 30));
    const vq::KVState s = c.state();
    EXPECT_TRUE(s.keys.bit_equal(fk));
    EXPECT_TRUE(s.values.bit_equal(fv));
    std::vector<float> tile(30 * 16);
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t h = 0; h < 2; ++h) {
        const float* kt = c.read_key_tile(b, h, 3, 20, tile.data());
        for (std::int64_t i = 0; i < 20; ++i)
          for (std::int64_t d = 0; d < 16; ++d) ASSERT_EQ(kt[i * 16 + d], s.keys.at(b, h, 3 + i, d));
        const float* vt = c.read_value_tile(b, h, 3, 20, tile.data());
        for (std::int64_t i = 0; i < 20; ++i)
          for (std::int64_t d = 0; d < 8; ++d) ASSERT_EQ(vt[i * 8 + d], s.values.at(b, h, 3 + i, d));
      }
    EXPECT_LT(c.nbytes(), fk.nbytes());  // no dense copy held
  }
}

}  // namespace
