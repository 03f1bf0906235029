// KIVI: per-channel keys, per-token values, the full-precision window step by step, chunking.
#include "veloxquant/peers/kivi_cache.hpp"

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"
#include "../support/test_util.hpp"

namespace {

vq::Tensor tokens_of(const vq::Tensor& t, std::int64_t s, std::int64_t e) { return t.slice(2, s, e); }

bool token_equal(const vq::Tensor& a, const vq::Tensor& b, std::int64_t s) {
  for (std::int64_t h = 0; h < a.dim(1); ++h)
    for (std::int64_t d = 0; d < a.dim(3); ++d)
      if (a.at(0, h, s, d) != b.at(0, h, s, d)) return false;
  return true;
}

TEST(Kivi, ResidualWindowStepByStep) {
  // bits 2, groups of 4, residual 4; keys D = 2, values D = 4 (one value group per token).
  vq::KiviKVCache c({2, 4, 4});
  std::vector<float> kv(9 * 2), vv(9 * 4);
  // keys tokens 0..3: channel 0 = 0, 0.5, 2.5, 3 (scale 1, zero 0; ties to even: 0, 0, 2, 3);
  //                   channel 1 = 1, 1.5, 1.2, 4 (scale 1, zero 1: 1, 1, 1, 4)
  const float k0[4][2] = {{0.0f, 1.0f}, {0.5f, 1.5f}, {2.5f, 1.2f}, {3.0f, 4.0f}};
  for (int s = 0; s < 4; ++s) kv[s * 2] = k0[s][0], kv[s * 2 + 1] = k0[s][1];
  for (int s = 4; s < 9; ++s) kv[s * 2] = 0.3f * static_cast<float>(s), kv[s * 2 + 1] = -0.7f * static_cast<float>(s * s % 5);
  // value token 0: 0, 0.5, 1.5, 3 -> scale 1, zero 0 -> 0, 0, 2, 3
  const float v0[4] = {0.0f, 0.5f, 1.5f, 3.0f};
  for (int d = 0; d < 4; ++d) vv[d] = v0[d];
  for (int i = 4; i < 9 * 4; ++i) vv[i] = 0.1f * static_cast<float>(i % 7) - 0.25f;
  const vq::Tensor K = vq::Tensor::from_f32({1, 1, 9, 2}, kv), V = vq::Tensor::from_f32({1, 1, 9, 4}, vv);

  const std::int64_t expect_kq[] = {0, 0, 0, 4, 4, 4, 4, 8, 8};
  const std::int64_t expect_vq[] = {0, 0, 0, 0, 1, 2, 3, 4, 5};
  for (std::int64_t n = 1; n <= 9; ++n) {
    auto [fk, fv] = c.update_and_fetch(tokens_of(K, n - 1, n), tokens_of(V, n - 1, n));
    ASSERT_EQ(c.quantized_keys(), expect_kq[n - 1]) << n;
    ASSERT_EQ(c.quantized_values(), expect_vq[n - 1]) << n;
    for (std::int64_t s = c.quantized_keys(); s < n; ++s) EXPECT_TRUE(token_equal(fk, K, s)) << "key " << s << " exact at n=" << n;
    for (std::int64_t s = c.quantized_values(); s < n; ++s) EXPECT_TRUE(token_equal(fv, V, s)) << "value " << s << " exact at n=" << n;
    if (n >= 4) {
      const float want[4][2] = {{0, 1}, {0, 1}, {2, 1}, {3, 4}};
      for (int s = 0; s < 4; ++s)
        for (int d = 0; d < 2; ++d) EXPECT_EQ(fk.at(0, 0, s, d), want[s][d]) << "n=" << n << " s=" << s << " d=" << d;
    }
    if (n >= 5) {
      const float want[4] = {0, 0, 2, 3};
      for (int d = 0; d < 4; ++d) EXPECT_EQ(fv.at(0, 0, 0, d), want[d]);
    }
  }
  // 8 quantized keys: 8*2 codes at 2 bits + 2 groups * 2 channels * 4 bytes + 1 residual token * 2 ch * 2 bytes
  // 5 quantized values: 5*4 codes at 2 bits + 5 groups * 4 bytes + 4 residual tokens * 4 ch * 2 bytes
  EXPECT_DOUBLE_EQ(c.stored_bytes().fixed_bytes, (4.0 + 16.0 + 4.0) + (5.0 + 20.0 + 32.0));
}

TEST(Kivi, ChunkingDoesNotMatter) {
  const vq::Tensor K = vqtest::random_walk({2, 3, 300, 16}, 11), V = vqtest::random_walk({2, 3, 300, 64}, 12);
  for (int bits : {2, 4}) {
    const vq::KiviConfig cfg{bits, 32, 128};
    vq::KiviKVCache one(cfg), steps(cfg), sevens(cfg);
    auto [k1, v1] = one.update_and_fetch(K, V);
    for (std::int64_t s = 0; s < 300; ++s) steps.update_and_fetch(tokens_of(K, s, s + 1), tokens_of(V, s, s + 1));
    for (std::int64_t s = 0; s < 300; s += 7) sevens.update_and_fetch(tokens_of(K, s, std::min<std::int64_t>(300, s + 7)),
                                                                       tokens_of(V, s, std::min<std::int64_t>(300, s + 7)));
    EXPECT_EQ(one.quantized_keys(), 256);
    EXPECT_EQ(one.quantized_values(), 172);
    for (auto* c : {&steps, &sevens}) {
      EXPECT_TRUE(c->state().keys.contiguous().bit_equal(k1.contiguous())) << bits;
      EXPECT_TRUE(c->state().values.contiguous().bit_equal(v1.contiguous())) << bits;
      EXPECT_EQ(c->stored_bytes().fixed_bytes, one.stored_bytes().fixed_bytes);
    }
  }
}

TEST(Kivi, ErrorWithinHalfAStep) {
  const vq::Tensor K = vqtest::random_uniform({1, 2, 256, 32}, 13), V = vqtest::random_uniform({1, 2, 256, 32}, 14);
  vq::KiviKVCache c({4, 32, 128});
  auto [fk, fv] = c.update_and_fetch(K, V);
  // |x| < 1: range < 2, step < 2/15 (+ float16 rounding of scale and zero)
  double max_err_k = 0, max_err_v = 0;
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t s = 0; s < 256; ++s)
      for (std::int64_t d = 0; d < 32; ++d) {
        max_err_k = std::max(max_err_k, static_cast<double>(std::fabs(fk.at(0, h, s, d) - K.at(0, h, s, d))));
        max_err_v = std::max(max_err_v, static_cast<double>(std::fabs(fv.at(0, h, s, d) - V.at(0, h, s, d))));
      }
  EXPECT_LE(max_err_k, 2.0 / 15.0 / 2.0 + 0.01);
  EXPECT_LE(max_err_v, 2.0 / 15.0 / 2.0 + 0.01);
  EXPECT_GT(max_err_k, 0.0);
}

TEST(Kivi, ConfigAndInputErrors) {
  EXPECT_THROW(vq::KiviKVCache({3, 32, 128}), vq::InvalidArgument);
  try {
    vq::KiviKVCache({2, 32, 100});
    FAIL();
  } catch (const vq::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("residual=100 must be a positive multiple of group=32"), std::string::npos) << e.what();
  }
  vq::KiviKVCache c({2, 32, 128});
  EXPECT_THROW(c.update_and_fetch(vq::Tensor::zeros({1, 1, 1, 8}, vq::DType::F32), vq::Tensor::zeros({1, 1, 1, 48}, vq::DType::F32)),
               vq::InvalidArgument);  // value head dim 48 is not a multiple of 32
  vq::Tensor big = vq::Tensor::zeros({1, 1, 1, 8}, vq::DType::F32);
  big.set(0, 0, 0, 0, 1e6f);
  EXPECT_THROW(c.update_and_fetch(big, big), vq::InvalidArgument);
  EXPECT_EQ(c.offset(), 0);
  c.update_and_fetch(vq::Tensor::zeros({1, 1, 1, 8}, vq::DType::F32), vq::Tensor::zeros({1, 1, 1, 8}, vq::DType::F32));
  EXPECT_FALSE(c.is_trimmable());
  EXPECT_EQ(c.trim(0), 0);
  EXPECT_THROW(c.trim(1), vq::InvalidArgument);
}

}  // namespace
