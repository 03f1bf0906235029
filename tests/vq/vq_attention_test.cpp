// Attention straight on VqKVCache's packed codes (vq/vq_attention_kernels.hpp): the packed
// layout's invariants (vq_cache.hpp, "Packed layout"), and attend() on codes equal to dense
// attention over state() and to the float-tile path (SIMD off), for float32 and float16 input,
// escapes, sinks and exact tails inside a tile, grouped queries, Sq > 1, B > 1 and head dims that
// are and are not multiples of 8.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>

#include <gtest/gtest.h>

#include "veloxquant/cache/attention.hpp"
#include "veloxquant/cache/attention_kernels.hpp"
#include "veloxquant/vq/vq_cache.hpp"
#include "../support/test_util.hpp"

namespace {

using vq::Tensor;

// Data whose channels have very different spreads (so widths differ within a head and the field
// order is not the identity), with rare large outliers (escapes).
Tensor spread_data(const vq::Shape4& s, std::uint64_t seed, vq::DType dtype, bool outliers) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(s[0] * s[1] * s[2] * s[3]));
  for (std::size_t i = 0; i < v.size(); ++i) {
    const std::int64_t ch = static_cast<std::int64_t>(i) % s[3];
    const float sigma = 0.05f * static_cast<float>(1 + (ch * 7) % 11) * static_cast<float>(1 + (ch % 3) * 4);
    v[i] = 0.3f * static_cast<float>(ch % 5) + sigma * nd(rng);
    if (outliers && u(rng) < 0.004f) v[i] += 25.0f * sigma * (u(rng) < 0.5f ? -1.0f : 1.0f);
  }
  return Tensor::from_f32(s, v).to(dtype);
}

struct Case {
  std::int64_t B, H, Hq, D, T, Sq;
  vq::DType dtype;
  int sinks, residual;
  double tol = 1;  // tolerance factor: float32 sums over thousands of tokens drift further from attend_ref's double
};

void expect_codes_attend_matches(const Case& c) {
  SCOPED_TRACE(::testing::Message() << "B=" << c.B << " H=" << c.H << " Hq=" << c.Hq << " D=" << c.D << " T=" << c.T << " Sq=" << c.Sq
                                    << (c.dtype == vq::DType::F16 ? " f16" : " f32") << " sinks=" << c.sinks << " residual=" << c.residual);
  vq::VqConfig cfg;
  cfg.bits = 2;
  cfg.calib = 32;
  cfg.sinks = c.sinks;
  cfg.residual = c.residual;
  vq::VqKVCache cache(cfg);
  const Tensor k = spread_data({c.B, c.H, c.T, c.D}, 11, c.dtype, true), v = spread_data({c.B, c.H, c.T, c.D}, 12, c.dtype, true);
  cache.update(k.slice(2, 0, c.T - c.Sq), v.slice(2, 0, c.T - c.Sq));
  cache.update(k.slice(2, c.T - c.Sq, c.T), v.slice(2, c.T - c.Sq, c.T));
  ASSERT_GT(cache.quantized_tokens(), 0);
  EXPECT_GT(cache.escapes(), 0u);
  const Tensor q = vqtest::random_uniform({c.B, c.Hq, c.Sq, c.D}, 13);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
  const Tensor ref = vq::attend_ref(cache, q, scale);
  const Tensor on_codes = cache.attend(q, scale);
  const bool was = vq::attn::set_simd_enabled(false);
  const Tensor on_tiles = cache.attend(q, scale);
  vq::attn::set_simd_enabled(was);
  double mag = 0;
  const double codes_vs_ref = vqtest::max_abs_diff(on_codes, ref, mag);
  EXPECT_GT(mag, 0.1);
  EXPECT_LE(codes_vs_ref, c.tol * 2e-6 * (1.0 + mag));
  const double tiles_vs_ref = vqtest::max_abs_diff(on_tiles, ref, mag);
  EXPECT_LE(tiles_vs_ref, c.tol * 2e-6 * (1.0 + mag));
  const double codes_vs_tiles = vqtest::max_abs_diff(on_codes, on_tiles, mag);
  EXPECT_LE(codes_vs_tiles, c.tol * 4e-6 * (1.0 + mag));
}

TEST(VqAttention, OnCodesEqualsDenseAttentionOverState) {
  for (const vq::DType dt : {vq::DType::F32, vq::DType::F16}) {
    expect_codes_attend_matches({1, 2, 8, 128, 700, 1, dt, 0, 0});    // GQA 4:1, tiles of 256 and a tail
    expect_codes_attend_matches({2, 2, 4, 64, 300, 5, dt, 0, 0});     // B > 1, Sq > 1
    expect_codes_attend_matches({1, 3, 3, 13, 200, 2, dt, 0, 0});     // D not a multiple of 8: scalar tails, a partial group
    expect_codes_attend_matches({1, 2, 6, 40, 300, 3, dt, 4, 0});     // sinks: exact tokens at the head of the first tile
    expect_codes_attend_matches({2, 2, 4, 128, 290, 2, dt, 3, 37});   // sinks and an exact tail inside the last tile
    expect_codes_attend_matches({1, 2, 4, 64, 2600, 1, dt, 3, 20, 4});   // splits of 2048 tokens (8 tiles of 256) and a tail
  }
}

// Tiles of kCodeTileTokens when both sides are read on their codes; the float tiles' default
// otherwise (before calibration, or with SIMD off, the tiles are float32 rows).
TEST(VqAttention, LongerTilesOnlyOnCodes) {
  vq::VqConfig cfg;
  cfg.calib = 32;
  const std::int64_t D = 128;
  const Tensor k = spread_data({1, 2, 100, D}, 31, vq::DType::F16, false), v = spread_data({1, 2, 100, D}, 32, vq::DType::F16, false);
  vq::VqKVCache cache(cfg);
  cache.update(k.slice(2, 0, 20), v.slice(2, 0, 20));  // not calibrated yet: every token exact
  const std::int64_t float_tile = static_cast<std::int64_t>(vq::kAttentionTileBytes / 4 / D);
  EXPECT_EQ(cache.attention_tile_tokens(), float_tile);
  cache.update(k.slice(2, 20, 100), v.slice(2, 20, 100));
  ASSERT_GT(cache.quantized_tokens(), 0);
  if (!vq::attn::simd_enabled()) GTEST_SKIP() << "no SIMD kernels on codes in this build";
  EXPECT_EQ(cache.attention_tile_tokens(), vq::VqKVCache::kCodeTileTokens);
  const bool was = vq::attn::set_simd_enabled(false);
  EXPECT_EQ(cache.attention_tile_tokens(), float_tile);
  vq::attn::set_simd_enabled(was);
}

// The layout the kernels read: widths 1..8 or 16, one per group of 8 field positions, groups
// byte-aligned and back to back, the order a permutation of each head's coefficients, and every
// field where bit_at says.
TEST(VqAttention, PackedLayoutInvariants) {
  vq::VqConfig cfg;
  cfg.calib = 32;
  vq::VqKVCache cache(cfg);
  const std::int64_t H = 3, D = 20;
  const Tensor k = spread_data({1, H, 100, D}, 21, vq::DType::F32, true), v = spread_data({1, H, 100, D}, 22, vq::DType::F32, false);
  cache.update(k, v);
  for (const auto* widths : {&cache.key_widths(), &cache.value_widths()}) {
    ASSERT_EQ(widths->size(), static_cast<std::size_t>(H * D));
    std::set<int> distinct;
    for (auto w : *widths) {
      EXPECT_TRUE((w >= 1 && w <= 8) || w == 16) << int(w);
      distinct.insert(w);
    }
    // Each head's 20 fields are 3 groups (8, 8, 4): at most 3 distinct widths per head.
    for (std::int64_t h = 0; h < H; ++h) {
      std::set<int> per_head(widths->begin() + h * D, widths->begin() + (h + 1) * D);
      EXPECT_LE(per_head.size(), 3u);
    }
    EXPECT_GT(distinct.size(), 1u);  // the channels' spreads differ: so do the widths
  }
  // The codes read back through the layout are the quantizer's (the packed rows and the escapes
  // hold every code): the reconstruction is within half a step of the input per coefficient.
  const auto codes = cache.codes();
  const vq::KVState st = cache.state();
  const auto x = k.to_f32_vector(), y = st.keys.to_f32_vector();
  for (std::size_t i = 0; i < x.size(); ++i) ASSERT_LE(std::fabs(x[i] - y[i]), 0.5 * codes.k.step * 1.0001 + 1e-5) << i;
}

}  // namespace
