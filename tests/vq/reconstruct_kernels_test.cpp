// The tiled reconstruction kernel (src/vq/reconstruct_kernels.hpp) against the per-token scalar
// path, bit for bit: every tile remainder (past whole tiles of 6 on AVX2, of 12 on AVX-512), head
// widths that are and are not multiples of 16 and of 32, spans of one head and of the whole row, with and without RoPE
// at a nonzero start position; and the RoPE table against cos / sin computed on the spot.
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "../../src/vq/reconstruct_kernels.hpp"
#include "../support/test_util.hpp"
#include "../support/vq_random_layer.hpp"
#include "veloxquant/core/dtype.hpp"
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
  for (const int d : {8, 16, 24, 64, 128}) {
    for (const int span : {d, 4 * d}) {
      std::vector<double> freq;
      for (int p = 0; p < d / 2; ++p) freq.push_back(std::pow(10000.0, -2.0 * p / d));
      const auto rope = vq::vq_rope_table(freq, 300);
      for (const std::int64_t tokens : {1, 5, 6, 7, 11, 12, 13, 24, 64, 67}) {
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

// The all-heads kernel (one product with every head's column block side by side, AVX-512 where
// the machine has it) against vq_head_rows run head by head and against its own scalar path, bit
// for bit: head dims 8 (the model's), 16 and 24 (16-wide blocks and a scalar rest), 3 and 4
// heads, token counts around the 12-token pass, with and without RoPE at a nonzero position.
TEST(VqReconstructKernels, AllHeadRowsEqualEachHeadsRowsBitForBit) {
  for (const int d : {8, 16, 24}) {
    for (const int heads : {3, 4}) {
      const int n = heads * d;
      std::vector<double> freq;
      for (int p = 0; p < d / 2; ++p) freq.push_back(std::pow(10000.0, -2.0 * p / d));
      const auto rope = vq::vq_rope_table(freq, 300);
      const auto cols = random_floats(static_cast<std::size_t>(heads * n * d), 3u + static_cast<std::uint32_t>(n), 0.1f);
      std::vector<float> w(static_cast<std::size_t>(n * n));
      vq::vq_whole_row_matrix(cols.data(), n, heads, w.data());
      for (const std::int64_t tokens : {1, 5, 11, 12, 13, 24, 31, 64}) {
        const auto y = random_floats(static_cast<std::size_t>(tokens * n), 9u + static_cast<std::uint32_t>(tokens), 3.0f);
        for (const vq::VqRopeTable* r : {static_cast<const vq::VqRopeTable*>(nullptr), rope.get()}) {
          const std::size_t out_n = static_cast<std::size_t>(tokens * n);
          std::vector<float> acc(out_n), fast(out_n, NAN), scalar(out_n, -NAN), per_head(out_n, NAN);
          vq::vq_all_head_rows(w.data(), n, heads, y.data(), tokens, r, 41, acc.data(), fast.data());
          vq::vq_all_head_rows_scalar(w.data(), n, heads, y.data(), tokens, r, 41, acc.data(), scalar.data());
          for (int h = 0; h < heads; ++h)
            vq::vq_head_rows_scalar(cols.data() + static_cast<std::size_t>(h * n * d), n, d, y.data(), static_cast<std::size_t>(n), tokens, r, 41,
                                    per_head.data() + static_cast<std::size_t>(h) * static_cast<std::size_t>(tokens * d));
          EXPECT_TRUE(same_bits(fast, per_head)) << "d " << d << " heads " << heads << " tokens " << tokens << " rope " << (r != nullptr);
          EXPECT_TRUE(same_bits(scalar, per_head)) << "d " << d << " heads " << heads << " tokens " << tokens << " rope " << (r != nullptr);
        }
      }
    }
  }
}

// A live cache's tiles (read_key_tile / read_value_tile) with a transform across heads are read a
// tile of all heads at a time and kept per thread for the next head: every tile equals state()'s
// rows bit for bit, across sinks, calibration, the exact tail, sealed tiles, float16 input and
// tiles that straddle them, and after a trim and a different continuation (the kept tile must
// not outlive the rows it holds), and with two caches read in turn.
TEST(VqReconstructKernels, WholeRowTilesAreTheStatesRows) {
  const int kv_heads = 4, hd = 8;
  const auto model = std::make_shared<const vq::VqLayerModel>(vqtest::random_weights_layer_model(kv_heads, hd, 32, 77));
  ASSERT_EQ(model->k.col_span, kv_heads * hd);
  // Tiles of 7 and 64 tokens and the whole cache; batch row 1's whole-cache tile, the last one
  // read, is read first too (what a tile kept from before a change would be mistaken for), before
  // state(), whose own reads would replace a kept tile. (Without the renewal of seal_gen_ in
  // trim, "trimmed and refed" fails here.)
  auto check = [&](const vq::VqKVCache& c, const char* what) {
    const std::int64_t T = c.offset();
    std::vector<float> scratch(static_cast<std::size_t>(T * hd));
    std::vector<float> first[2];
    for (int side = 0; side < 2; ++side) {
      const float* got = side == 0 ? c.read_key_tile(1, 3, 0, T, scratch.data()) : c.read_value_tile(1, 3, 0, T, scratch.data());
      first[side].assign(got, got + T * hd);
    }
    const vq::KVState st = c.state();
    for (int side = 0; side < 2; ++side) {
      const vq::Tensor& want = side == 0 ? st.keys : st.values;
      std::vector<float> ref(static_cast<std::size_t>(T * hd));
      vq::to_f32(want.row(1, 3, 0), want.dtype(), ref.data(), ref.size());
      ASSERT_EQ(std::memcmp(first[side].data(), ref.data(), ref.size() * sizeof(float)), 0) << what << " side " << side << ", first read";
    }
    for (const std::int64_t tile : {std::int64_t{7}, std::int64_t{64}, T})
      for (std::int64_t t0 = 0; t0 < T; t0 += tile) {
        const std::int64_t n = std::min(tile, T - t0);
        for (std::int64_t b = 0; b < st.keys.dim(0); ++b)
          for (std::int64_t h = 0; h < kv_heads; ++h)
            for (int side = 0; side < 2; ++side) {
              const vq::Tensor& want = side == 0 ? st.keys : st.values;
              std::vector<float> ref(static_cast<std::size_t>(n * hd));
              vq::to_f32(want.row(b, h, t0), want.dtype(), ref.data(), ref.size());
              const float* got = side == 0 ? c.read_key_tile(b, h, t0, n, scratch.data()) : c.read_value_tile(b, h, t0, n, scratch.data());
              ASSERT_EQ(std::memcmp(got, ref.data(), ref.size() * sizeof(float)), 0)
                  << what << " side " << side << " b " << b << " h " << h << " t0 " << t0 << " n " << n;
            }
      }
  };
  for (const auto dtype : {vq::DType::F32, vq::DType::F16})
    for (const bool coded : {false, true}) {
      vq::VqConfig cfg;
      cfg.bits = 2;
      cfg.calib = 16;
      cfg.residual = 5;
      cfg.sinks = 3;
      cfg.coded = coded;
      vq::VqKVCache c(cfg, model), other(cfg, model);
      const vq::Tensor K = vqtest::random_walk({2, kv_heads, 200, hd}, 61, dtype), V = vqtest::random_walk({2, kv_heads, 200, hd}, 62, dtype);
      c.update(K.slice(2, 0, 10).contiguous(true), V.slice(2, 0, 10).contiguous(true));  // not calibrated yet
      check(c, "uncalibrated");
      c.update(K.slice(2, 10, 150).contiguous(true), V.slice(2, 10, 150).contiguous(true));
      ASSERT_GT(c.quantized_tokens(), 100);
      check(c, "calibrated");
      other.update(V.slice(2, 0, 150).contiguous(true), K.slice(2, 0, 150).contiguous(true));
      check(other, "other cache");
      check(c, "first cache again");
      c.trim(40);  // then other tokens at the same positions
      c.update(V.slice(2, 110, 150).contiguous(true), K.slice(2, 110, 150).contiguous(true));
      check(c, "trimmed and refed");
      c.update(K.slice(2, 150, 200).contiguous(true), V.slice(2, 150, 200).contiguous(true));
      check(c, "grown");
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
