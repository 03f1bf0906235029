// Attention on the codes of a vq cache whose transform mixes its heads (VqKVCache::attend_own,
// src/vq/mixed_attention.cpp): attend() equal to dense attention over state() for keys rebuilt
// (RoPE) and keys on the query side (no RoPE), grouped queries, Sq > 1, B > 1, sinks, an exact
// tail, escapes, packed rows and sealed tiles (resident=coded), the fast and the portable decode;
// the cases it declines.
#include <algorithm>
#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "veloxquant/cache/attention.hpp"
#include "veloxquant/cache/attention_kernels.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/vq/vq_cache.hpp"
#include "../support/test_util.hpp"
#include "../support/vq_random_layer.hpp"

namespace {

using vq::Tensor;

// Rows that a transform mixes: Gaussian, with rare outliers (escapes).
Tensor data(const vq::Shape4& s, std::uint64_t seed, vq::DType dtype) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(s[0] * s[1] * s[2] * s[3]));
  for (std::size_t i = 0; i < v.size(); ++i) {
    v[i] = 0.2f * static_cast<float>(static_cast<std::int64_t>(i) % s[3]) + nd(rng);
    if (u(rng) < 0.003f) v[i] += u(rng) < 0.5f ? -30.0f : 30.0f;
  }
  return Tensor::from_f32(s, v).to(dtype);
}

struct Case {
  std::int64_t B, H, Hq, D, T, Sq;
  int sinks = 0, residual = 0;
  bool rope = true;  // the layer model un-rotates keys (so attention rebuilds them)
  vq::DType dtype = vq::DType::F32;
  bool own = true;  // attend_own takes the call
  bool coded = false;  // resident=coded: the quantized tokens in sealed tiles
};

void expect_matches(const Case& c) {
  SCOPED_TRACE(::testing::Message() << "B=" << c.B << " H=" << c.H << " Hq=" << c.Hq << " D=" << c.D << " T=" << c.T << " Sq=" << c.Sq
                                    << " sinks=" << c.sinks << " residual=" << c.residual << (c.dtype == vq::DType::F16 ? " f16" : "")
                                    << (c.rope ? "" : " rope=off") << (c.coded ? " resident=coded" : ""));
  vq::VqConfig cfg;
  cfg.bits = 3;
  cfg.calib = 32;
  cfg.sinks = c.sinks;
  cfg.residual = c.residual;
  cfg.coded = c.coded;
  vq::VqBasisOptions basis;
  basis.rope = c.rope;
  auto model = std::make_shared<const vq::VqLayerModel>(
      vqtest::random_weights_layer_model(static_cast<int>(c.H), static_cast<int>(c.D), 32, 9, basis));
  vq::VqKVCache cache(cfg, model);
  const Tensor k = data({c.B, c.H, c.T, c.D}, 21, c.dtype), v = data({c.B, c.H, c.T, c.D}, 22, c.dtype);
  cache.update(k.slice(2, 0, c.T - c.Sq), v.slice(2, 0, c.T - c.Sq));
  cache.update(k.slice(2, c.T - c.Sq, c.T), v.slice(2, c.T - c.Sq, c.T));
  ASSERT_GT(cache.quantized_tokens(), 0);
  if (c.T >= 150 && !c.coded) {
    EXPECT_GT(cache.escapes(), 0u);
  }
  const Tensor q = vqtest::random_uniform({c.B, c.Hq, c.Sq, c.D}, 23);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
  Tensor own;
  ASSERT_EQ(cache.attend_own(q, scale, own), c.own);
  const Tensor ref = vq::attend_ref(cache, q, scale);
  const Tensor got = cache.attend(q, scale);
  const Tensor tiles = vq::attend_tiled(cache, q, scale);
  double mag = 0;
  // Float32 sums in coefficient space: the transform's conditioning (the noise shaping's scales)
  // costs a few more ulps than the tile loop's.
  EXPECT_LE(vqtest::max_abs_diff(got, ref, mag), 2e-5 * (1.0 + mag));
  EXPECT_GT(mag, 0.1);
  EXPECT_LE(vqtest::max_abs_diff(tiles, ref, mag), 2e-5 * (1.0 + mag));
  // The portable decode gives the same within float32 rounding.
  const bool was = vq::attn::set_avx512_enabled(false);
  const Tensor portable = cache.attend(q, scale);
  vq::attn::set_avx512_enabled(was);
  EXPECT_LE(vqtest::max_abs_diff(portable, ref, mag), 2e-5 * (1.0 + mag));
}

TEST(MixedAttention, EqualsDenseAttentionOverState) {
  for (const bool rope : {true, false}) {
    expect_matches({1, 4, 8, 8, 300, 1, 0, 0, rope});           // stories260K's shape: n = 32, GQA 2:1
    expect_matches({2, 4, 16, 8, 150, 5, 0, 0, rope});          // B > 1, Sq > 1, GQA 4:1
    expect_matches({1, 4, 8, 8, 200, 3, 3, 7, rope});           // sinks and an exact tail
    expect_matches({1, 2, 4, 16, 130, 2, 0, 70, rope});         // n = 32 of two heads of 16; most tokens exact
    expect_matches({1, 3, 6, 4, 100, 1, 0, 0, rope});           // D = 4: the portable decode (D % 8 != 0)
    expect_matches({1, 3, 3, 16, 120, 2, 0, 5, rope});          // n = 48: the portable decode
    expect_matches({1, 4, 8, 8, 100, 1, 0, 0, rope, vq::DType::F16, false});  // float16: declined (state() rounds rows)
    expect_matches({1, 4, 8, 8, 120, 17, 0, 0, rope, vq::DType::F32, false});  // a prefill-sized call: the tile loop
    // resident=coded: sealed tiles, the open one included, with sinks and a tail.
    expect_matches({1, 4, 8, 8, 300, 1, 0, 0, rope, vq::DType::F32, true, true});
    expect_matches({2, 4, 8, 8, 150, 3, 2, 5, rope, vq::DType::F32, true, true});
    expect_matches({1, 3, 3, 16, 120, 2, 0, 5, rope, vq::DType::F32, true, true});
  }
}

TEST(MixedAttention, DeclinesWhereItDoesNotApply) {
  vq::VqConfig cfg;
  cfg.calib = 32;
  auto model = std::make_shared<const vq::VqLayerModel>(vqtest::random_weights_layer_model(4, 8, 32, 9));
  vq::VqKVCache cache(cfg, model);
  cache.update(data({1, 4, 20, 8}, 1, vq::DType::F32), data({1, 4, 20, 8}, 2, vq::DType::F32));
  const Tensor q = vqtest::random_uniform({1, 8, 1, 8}, 3);
  Tensor out;
  EXPECT_FALSE(cache.attend_own(q, 0.3f, out));  // nothing quantized yet
  vq::VqBasisOptions ident;
  ident.basis = vq::VqBasis::Identity;
  vq::VqKVCache plain(cfg, std::make_shared<const vq::VqLayerModel>(vqtest::random_weights_layer_model(4, 8, 32, 9, ident)));
  plain.update(data({1, 4, 40, 8}, 1, vq::DType::F32), data({1, 4, 40, 8}, 2, vq::DType::F32));
  EXPECT_FALSE(plain.attend_own(q, 0.3f, out));  // nothing mixes heads: the per-head tile loop (and its kernels on codes)

  // Bad queries still get the shared checks' errors, the cache unchanged.
  cache.update(data({1, 4, 20, 8}, 4, vq::DType::F32), data({1, 4, 20, 8}, 5, vq::DType::F32));
  EXPECT_THROW(cache.attend(vqtest::random_uniform({1, 6, 1, 8}, 3), 0.3f), vq::InvalidArgument);
  EXPECT_THROW(cache.attend(vqtest::random_uniform({1, 8, 1, 7}, 3), 0.3f), vq::InvalidArgument);
  EXPECT_EQ(cache.offset(), 40);
}

}  // namespace
