// The tiled reconstruction kernel (src/vq/reconstruct_kernels.hpp) against the per-token scalar
// path, bit for bit: every tile remainder (1..5 tokens past whole tiles of 6), head widths that
// are and are not multiples of 16, spans of one head and of the whole row, with and without RoPE
// at a nonzero start position; and the RoPE table against cos / sin computed on the spot.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "../../src/vq/reconstruct_kernels.hpp"
#include "../support/test_util.hpp"
#include "../support/vq_random_layer.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/vq/codec.hpp"
#include "veloxquant/vq/vq_cache.hpp"

namespace {

std::vector<float> random_floats(std::size_t n, std::uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(VqReconstructKernels, TiledRowsEqualThePerTokenPathBitForBit) {
  for (const int d : {8, 16, 24, 128}) {
    for (const int span : {d, 4 * d}) {
      std::vector<double> freq;
      for (int p = 0; p < d / 2; ++p) freq.push_back(std::pow(10000.0, -2.0 * p / d));
      const auto rope = vq::vq_rope_table(freq, 300);
      for (const std::int64_t tokens : {1, 5, 6, 7, 13, 64, 67}) {
        const std::size_t stride = static_cast<std::size_t>(span) + 3;  // rows wider than the block
        const auto cols = random_floats(static_cast<std::size_t>(span) * static_cast<std::size_t>(d), 1u + static_cast<std::uint32_t>(d), 0.1f);
        const auto y = random_floats(static_cast<std::size_t>(tokens) * stride, 7u + static_cast<std::uint32_t>(tokens), 3.0f);
        for (const vq::VqRopeTable* r : {static_cast<const vq::VqRopeTable*>(nullptr), rope.get()}) {
          const std::size_t out_n = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(d);
          std::vector<float> fast(out_n, NAN), slow(out_n, -NAN);
          vq::vq_head_rows(cols.data(), span, d, y.data(), stride, tokens, r, 37, fast.data());
          vq::vq_head_rows_scalar(cols.data(), span, d, y.data(), stride, tokens, r, 37, slow.data());
          EXPECT_TRUE(same_bits(fast, slow)) << "d " << d << " span " << span << " tokens " << tokens << " rope " << (r != nullptr);
        }
      }
    }
  }
}

TEST(VqReconstructKernels, ScalarPathIsTheProductThenTheRotation) {
  // One token, d = 2, span = 2: acc_i = (0 + c0i*y0) + c1i*y1 in float, then the pair rotated in double.
  const std::vector<float> cols = {0.5f, -1.25f, 2.0f, 0.75f};  // [j][i]
  const std::vector<float> y = {3.0f, -2.0f};
  std::vector<double> freq = {0.3};
  const auto rope = vq::vq_rope_table(freq, 10);
  std::vector<float> out(2);
  vq::vq_head_rows_scalar(cols.data(), 2, 2, y.data(), 2, 1, rope.get(), 4, out.data());
  const float a0 = 0.5f * 3.0f + 2.0f * -2.0f, a1 = -1.25f * 3.0f + 0.75f * -2.0f;
  const double ang = 4.0 * 0.3;
  EXPECT_EQ(out[0], static_cast<float>(double{a0} * std::cos(ang) - double{a1} * std::sin(ang)));
  EXPECT_EQ(out[1], static_cast<float>(double{a0} * std::sin(ang) + double{a1} * std::cos(ang)));
  vq::vq_head_rows_scalar(cols.data(), 2, 2, y.data(), 2, 1, nullptr, 4, out.data());
  EXPECT_EQ(out[0], a0);
  EXPECT_EQ(out[1], a1);
}

TEST(VqReconstructKernels, RopeTableHoldsCosAndSinOfEachPositionAndGrows) {
  const std::vector<double> freq = {1.0, 0.01, 1e-4};
  const auto small = vq::vq_rope_table(freq, 10);
  ASSERT_GE(small->positions, 10);
  const auto big = vq::vq_rope_table(freq, 5000);
  ASSERT_GE(big->positions, 5000);
  for (const std::int64_t pos : {0, 1, 9, 4999})
    for (std::size_t p = 0; p < freq.size(); ++p) {
      const double ang = static_cast<double>(pos) * freq[p];
      EXPECT_EQ(big->at(pos)[2 * p], std::cos(ang));
      EXPECT_EQ(big->at(pos)[2 * p + 1], std::sin(ang));
    }
  EXPECT_EQ(vq::vq_rope_table({}, 10), nullptr);
  EXPECT_EQ(vq::vq_rope_table(freq, 20).get(), big.get());  // shared, not rebuilt
}

// The store's decoder (VqkvLoadOptions::dense_states) takes vq_restored_state instead of
// restore(...)->state(): the same bits, the same refusals. Per-head (span 96, the AVX2 path) and
// cross-head (head dim 8, scalar) transforms, float32 and float16 rows, with and without an exact tail,
// and an uncalibrated layer (no codes).
TEST(VqReconstructKernels, RestoredStateIsTheRestoredCachesState) {
  for (const int kv_heads : {2, 3}) {
    const int hd = kv_heads == 2 ? 8 : 96, n = kv_heads * hd;
    const auto model = std::make_shared<const vq::VqLayerModel>(vqtest::random_weights_layer_model(kv_heads, hd, 32, 31 + kv_heads));
    for (const auto dtype : {vq::DType::F32, vq::DType::F16})
      for (const int residual : {0, 5})
        for (const std::int64_t tokens : {40, 10}) {  // 10 < calib: nothing quantized
          vq::VqConfig cfg;
          cfg.bits = 2;
          cfg.calib = 16;
          cfg.residual = residual;
          vq::VqKVCache live(cfg, model);
          const vq::Tensor K = vqtest::random_walk({1, kv_heads, tokens, hd}, 41, dtype);
          const vq::Tensor V = vqtest::random_walk({1, kv_heads, tokens, hd}, 42, dtype);
          live.update(K, V);
          const std::int64_t q = live.quantized_tokens();
          const vq::KVState exact{K.slice(2, q, tokens).contiguous(true), V.slice(2, q, tokens).contiguous(true)};
          const auto restored = vq::VqKVCache::restore(cfg, model, live.codes(), exact);
          const vq::KVState want = restored->state();
          const vq::KVState got = vq::vq_restored_state(cfg, model, live.codes(), exact);
          EXPECT_TRUE(got.keys.bit_equal(want.keys)) << n << " " << q << " " << residual;
          EXPECT_TRUE(got.values.bit_equal(want.values)) << n << " " << q << " " << residual;
          EXPECT_TRUE(got.keys.bit_equal(live.state().keys)) << n << " " << q;  // and what the live cache holds
          // What restore refuses, this refuses: codes claiming more tokens than they hold.
          vq::VqLayerCodes bad = live.codes();
          if (q > 0) {
            bad.tokens += 1;
            EXPECT_THROW(vq::vq_restored_state(cfg, model, bad, exact), vq::InvalidArgument);
            EXPECT_THROW(vq::VqKVCache::restore(cfg, model, bad, exact), vq::InvalidArgument);
          }
        }
  }
}

}  // namespace
