// llama.cpp's q8_0 / q4_0 / q4_1 blocks: hand-computed blocks, rounding edge cases, error budgets,
// and the block cache built on them.
#include "veloxquant/peers/ggml_blocks.hpp"

#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/peers/ggml_block_cache.hpp"
#include "../support/test_util.hpp"

namespace {

using namespace vq::ggml;
using Block32 = std::array<float, QK>;

int nibble(const std::uint8_t* qs, int j) { return j < QK / 2 ? qs[j] & 0x0F : qs[j - QK / 2] >> 4; }

TEST(GgmlQ8_0, HandComputedBlockRoundsHalfAwayFromZero) {
  Block32 x{};
  x[0] = 127.0f;  // amax 127: d = 1, id = 1, q = roundf(x)
  x[1] = 2.5f;    // tie: roundf -> 3 (half to even would give 2)
  x[2] = -2.5f;   // -> -3
  x[3] = 0.5f;    // -> 1
  x[4] = -0.5f;   // -> -1
  x[5] = 1.49f;   // -> 1
  x[6] = -126.6f; // -> -127
  block_q8_0 b{};
  quantize_block_q8_0_ref(x.data(), b);
  EXPECT_EQ(b.d, 0x3C00);  // float16 1.0
  const int expect[] = {127, 3, -3, 1, -1, 1, -127};
  for (int j = 0; j < 7; ++j) EXPECT_EQ(b.qs[j], expect[j]) << j;
  for (int j = 7; j < QK; ++j) EXPECT_EQ(b.qs[j], 0);
  Block32 y{};
  dequantize_block_q8_0_ref(b, y.data());
  for (int j = 0; j < 7; ++j) EXPECT_EQ(y[j], static_cast<float>(expect[j]));
}

TEST(GgmlQ8_0, NegativeMaximumAndScaleRoundedToHalf) {
  Block32 x{};
  x[9] = -1.0f;  // amax 1: d = 1/127, stored as float16; codes from the float32 id
  x[10] = 0.25f; // 31.75 -> 32
  block_q8_0 b{};
  quantize_block_q8_0_ref(x.data(), b);
  EXPECT_EQ(b.d, vq::f32_to_f16(1.0f / 127.0f));
  EXPECT_EQ(b.qs[9], -127);
  EXPECT_EQ(b.qs[10], 32);
  Block32 y{};
  dequantize_block_q8_0_ref(b, y.data());
  EXPECT_EQ(y[9], -127.0f * vq::f16_to_f32(b.d));
}

TEST(GgmlQ8_0, AllZeroBlock) {
  Block32 x{};
  block_q8_0 b{};
  b.d = 0xFFFF;
  quantize_block_q8_0_ref(x.data(), b);
  EXPECT_EQ(b.d, 0);
  for (int j = 0; j < QK; ++j) EXPECT_EQ(b.qs[j], 0);
}

TEST(GgmlQ4_0, HandComputedBlockNegativeMaximum) {
  Block32 x{};
  x[5] = -8.0f;   // largest magnitude, negative: d = -8 / -8 = 1, id = 1, q = min(15, trunc(x + 8.5))
  x[0] = 7.0f;    // 15.5 -> 15
  x[1] = 0.5f;    // 9.0 -> 9
  x[2] = -0.5f;   // 8.0 -> 8
  x[3] = 1.4f;    // 9.9 -> 9 (truncation)
  x[16] = -7.6f;  // 0.9 -> 0 (high nibble of byte 0)
  x[17] = 3.0f;   // 11.5 -> 11 (high nibble of byte 1)
  block_q4_0 b{};
  quantize_block_q4_0_ref(x.data(), b);
  EXPECT_EQ(b.d, 0x3C00);
  EXPECT_EQ(b.qs[0], 15 | (0 << 4));
  EXPECT_EQ(b.qs[1], 9 | (11 << 4));
  EXPECT_EQ(b.qs[2], 8 | (8 << 4));
  EXPECT_EQ(b.qs[3], 9 | (8 << 4));
  EXPECT_EQ(b.qs[5], 0 | (8 << 4));
  Block32 y{};
  dequantize_block_q4_0_ref(b, y.data());
  EXPECT_EQ(y[5], -8.0f);
  EXPECT_EQ(y[0], 7.0f);
  EXPECT_EQ(y[1], 1.0f);
  EXPECT_EQ(y[16], -8.0f);
  EXPECT_EQ(y[17], 3.0f);
  EXPECT_EQ(y[31], 0.0f);
}

TEST(GgmlQ4_0, PositiveMaximumClampsItsOpposite) {
  Block32 x{};
  x[0] = 8.0f;   // d = 8 / -8 = -1, id = -1: q = trunc(-x + 8.5)
  x[1] = -8.0f;  // 16.5 -> 16 -> clamped to 15: reconstructs as -7 (the one element off by |d|)
  x[2] = 2.0f;   // 6.5 -> 6 -> (6-8)*-1 = 2
  block_q4_0 b{};
  quantize_block_q4_0_ref(x.data(), b);
  EXPECT_EQ(vq::f16_to_f32(b.d), -1.0f);
  EXPECT_EQ(nibble(b.qs, 0), 0);
  EXPECT_EQ(nibble(b.qs, 1), 15);
  EXPECT_EQ(nibble(b.qs, 2), 6);
  Block32 y{};
  dequantize_block_q4_0_ref(b, y.data());
  EXPECT_EQ(y[0], 8.0f);
  EXPECT_EQ(y[1], -7.0f);
  EXPECT_EQ(y[2], 2.0f);
}

TEST(GgmlQ4_0, MagnitudeTieKeepsTheFirst) {
  Block32 x{};
  x[3] = -4.0f;
  x[7] = 4.0f;
  block_q4_0 b{};
  quantize_block_q4_0_ref(x.data(), b);
  EXPECT_EQ(vq::f16_to_f32(b.d), 0.5f);  // -4 / -8
  x[3] = 4.0f;
  x[7] = -4.0f;
  quantize_block_q4_0_ref(x.data(), b);
  EXPECT_EQ(vq::f16_to_f32(b.d), -0.5f);
}

TEST(GgmlQ4_0, AllZeroBlockCodesTheZeroPoint) {
  Block32 x{};
  block_q4_0 b{};
  quantize_block_q4_0_ref(x.data(), b);
  EXPECT_EQ(b.d, 0x8000);  // d = 0 / -8 = -0.0, as in ggml
  for (int j = 0; j < QK / 2; ++j) EXPECT_EQ(b.qs[j], 0x88);
  Block32 y{};
  y.fill(7.0f);
  dequantize_block_q4_0_ref(b, y.data());
  for (float v : y) EXPECT_EQ(v, 0.0f);
}

TEST(GgmlQ4_1, HandComputedBlockRoundsHalfUp) {
  Block32 x{};
  x.fill(0.0f);
  x[0] = -1.0f;   // min: d = (14 - -1) / 15 = 1, m = -1; q = min(15, trunc(x + 1 + 0.5))
  x[1] = 14.0f;   // 15.5 -> 15
  x[2] = 0.5f;    // 2.0 -> 2 (tie 1.5 goes up)
  x[3] = 1.5f;    // 3.0 -> 3 (tie 2.5 goes up)
  x[4] = 1.4f;    // 2.9 -> 2
  // x[5..31] = 0: 1.5 -> 1
  block_q4_1 b{};
  quantize_block_q4_1_ref(x.data(), b);
  EXPECT_EQ(vq::f16_to_f32(b.d), 1.0f);
  EXPECT_EQ(vq::f16_to_f32(b.m), -1.0f);
  const int expect[] = {0, 15, 2, 3, 2, 1};
  for (int j = 0; j < 6; ++j) EXPECT_EQ(nibble(b.qs, j), expect[j]) << j;
  for (int j = 6; j < QK; ++j) EXPECT_EQ(nibble(b.qs, j), 1) << j;
  Block32 y{};
  dequantize_block_q4_1_ref(b, y.data());
  EXPECT_EQ(y[0], -1.0f);
  EXPECT_EQ(y[1], 14.0f);
  EXPECT_EQ(y[2], 1.0f);
  EXPECT_EQ(y[3], 2.0f);
  EXPECT_EQ(y[31], 0.0f);
}

TEST(GgmlQ4_1, ConstantBlock) {
  Block32 x{};
  x.fill(3.0f);
  block_q4_1 b{};
  quantize_block_q4_1_ref(x.data(), b);
  EXPECT_EQ(b.d, 0);
  EXPECT_EQ(vq::f16_to_f32(b.m), 3.0f);
  for (int j = 0; j < QK / 2; ++j) EXPECT_EQ(b.qs[j], 0);
  Block32 y{};
  dequantize_block_q4_1_ref(b, y.data());
  for (float v : y) EXPECT_EQ(v, 3.0f);
}

// Random blocks: every element within its named budget. q8_0: d/2 plus the float16 rounding of d
// (the codes come from d32, the reconstruction uses d16: |q| <= 127, relative error <= 2^-11).
// q4_0: |d|/2 (+ rounding of d), except the one clamped element at the opposite extreme (|d|).
// q4_1: d/2 (+ rounding of d and of m).
TEST(GgmlBlocks, RandomBlocksWithinErrorBudgets) {
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int trial = 0; trial < 2000; ++trial) {
    Block32 x{}, y{};
    const float scale = std::ldexp(1.0f, trial % 12 - 6);
    for (auto& v : x) v = n(rng) * scale;
    float amax = 0.0f, mn = x[0], mx = x[0];
    for (float v : x) amax = std::max(amax, std::fabs(v)), mn = std::min(mn, v), mx = std::max(mx, v);
    const float rel16 = 1.0f / 2048.0f;

    block_q8_0 b8{};
    quantize_block_q8_0_ref(x.data(), b8);
    dequantize_block_q8_0_ref(b8, y.data());
    const float d8 = amax / 127.0f;
    for (int j = 0; j < QK; ++j) EXPECT_LE(std::fabs(x[j] - y[j]), d8 * (0.5f + 127.0f * rel16) * 1.001f) << trial;

    block_q4_0 b40{};
    quantize_block_q4_0_ref(x.data(), b40);
    dequantize_block_q4_0_ref(b40, y.data());
    const float d40 = amax / 8.0f;
    for (int j = 0; j < QK; ++j) EXPECT_LE(std::fabs(x[j] - y[j]), d40 * (1.0f + 8.0f * rel16) * 1.001f) << trial;

    block_q4_1 b41{};
    quantize_block_q4_1_ref(x.data(), b41);
    dequantize_block_q4_1_ref(b41, y.data());
    const float d41 = (mx - mn) / 15.0f;
    for (int j = 0; j < QK; ++j)
      EXPECT_LE(std::fabs(x[j] - y[j]), d41 * (0.5f + 15.0f * rel16) * 1.001f + std::fabs(mn) * rel16) << trial;
  }
}

// --- the block cache -------------------------------------------------------------------------

TEST(GgmlBlockCache, StoresPackedBlocksAndReturnsTheirDequantization) {
  const vq::Tensor k = vqtest::random_walk({1, 4, 10, 8}, 1), v = vqtest::random_walk({1, 4, 10, 8}, 2);
  vq::Q4_0KVCache c;
  auto [fk, fv] = c.update_and_fetch(k, v);
  ASSERT_EQ(c.key_blocks().size(), 10u);  // one 32-value row (4 heads x 8) per token
  EXPECT_EQ(c.stored_bytes().fixed_bytes, 2 * 10 * 18.0);
  EXPECT_EQ(c.stored_bytes().estimated_bytes, 2 * 10 * 18.0);
  // Token 3's row, gathered across heads, is block 3.
  Block32 x{}, y{};
  for (int h = 0; h < 4; ++h)
    for (int d = 0; d < 8; ++d) x[static_cast<std::size_t>(h * 8 + d)] = k.at(0, h, 3, d);
  block_q4_0 b{};
  quantize_block_q4_0_ref(x.data(), b);
  EXPECT_EQ(std::memcmp(&b, &c.key_blocks()[3], sizeof b), 0);
  dequantize_block_q4_0_ref(b, y.data());
  for (int h = 0; h < 4; ++h)
    for (int d = 0; d < 8; ++d) EXPECT_EQ(fk.at(0, h, 3, d), y[static_cast<std::size_t>(h * 8 + d)]);
  // Resident: the blocks are all it holds (no dense copy beside them).
  EXPECT_EQ(c.nbytes(), (c.key_blocks().size() + c.value_blocks().size()) * 18u);  // on the heap: exactly one call's blocks
  EXPECT_LT(c.nbytes(), fk.nbytes());
}

TEST(GgmlBlockCache, ChunkingDoesNotMatterAndTrimDropsBlocks) {
  const vq::Tensor k = vqtest::random_walk({2, 2, 37, 32}, 3), v = vqtest::random_walk({2, 2, 37, 64}, 4);
  vq::Q4_1KVCache one, steps;
  auto [k1, v1] = one.update_and_fetch(k, v);
  for (std::int64_t s = 0; s < 37; s += 5) {
    const std::int64_t e = std::min<std::int64_t>(37, s + 5);
    steps.update_and_fetch(k.slice(2, s, e), v.slice(2, s, e));
  }
  EXPECT_TRUE(steps.state().keys.contiguous().bit_equal(k1.contiguous()));
  EXPECT_TRUE(steps.state().values.contiguous().bit_equal(v1.contiguous()));
  EXPECT_EQ(steps.stored_bytes().fixed_bytes, 37 * 2 * (2 * 32 / 32 + 2 * 64 / 32) * 20.0);
  EXPECT_EQ(steps.trim(7), 7);
  EXPECT_EQ(steps.stored_bytes().fixed_bytes, 30 * 2 * (2 + 4) * 20.0);
  auto [k2, v2] = steps.update_and_fetch(k.slice(2, 30, 37), v.slice(2, 30, 37));
  EXPECT_TRUE(k2.contiguous().bit_equal(k1.contiguous()));
  EXPECT_TRUE(v2.contiguous().bit_equal(v1.contiguous()));
}

TEST(GgmlBlockCache, HalfInputAndFromState) {
  const vq::Tensor k = vqtest::random_walk({1, 1, 6, 64}, 5, vq::DType::F16);
  vq::Q8_0KVCache c;
  auto [fk, fv] = c.update_and_fetch(k, k);
  EXPECT_EQ(fk.dtype(), vq::DType::F16);
  for (std::int64_t d = 0; d < 64; ++d) EXPECT_NEAR(fk.at(0, 0, 2, d), k.at(0, 0, 2, d), 0.05);
  vq::Q8_0KVCache d;
  d.from_state(c.state());  // re-quantizing a dequantized q8_0 row reproduces it closely
  EXPECT_EQ(d.offset(), 6);
  c.from_state(c.state());  // its own views
  EXPECT_EQ(c.offset(), 6);
  EXPECT_EQ(c.key_blocks().size(), 12u);
}

TEST(GgmlBlockCache, RefusesRowsNotAMultipleOf32AndNonFinite) {
  vq::Q8_0KVCache c;
  try {
    c.update_and_fetch(vq::Tensor::zeros({1, 3, 2, 8}, vq::DType::F32), vq::Tensor::zeros({1, 3, 2, 8}, vq::DType::F32));
    FAIL();
  } catch (const vq::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("not a multiple of the block size 32"), std::string::npos) << e.what();
  }
  vq::Tensor bad = vq::Tensor::zeros({1, 1, 1, 32}, vq::DType::F32);
  bad.set(0, 0, 0, 4, NAN);
  EXPECT_THROW(c.update_and_fetch(bad, bad), vq::InvalidArgument);
  EXPECT_EQ(c.offset(), 0);
  EXPECT_TRUE(c.key_blocks().empty());
}

}  // namespace

namespace {

using namespace vq::ggml;

// The row dequantizers (attention's tiles) give the reference's values, block for block.
TEST(GgmlBlocks, RowDequantizersEqualTheReference) {
  std::mt19937 rng(9);
  std::normal_distribution<float> n(0.0f, 2.0f);
  std::vector<float> x(7 * QK), row(7 * QK), ref(QK);
  for (auto& v : x) v = n(rng);
  block_q8_0 b8[7];
  block_q4_0 b40[7];
  block_q4_1 b41[7];
  for (int i = 0; i < 7; ++i) {
    quantize_block_q8_0_ref(x.data() + i * QK, b8[i]);
    quantize_block_q4_0_ref(x.data() + i * QK, b40[i]);
    quantize_block_q4_1_ref(x.data() + i * QK, b41[i]);
  }
  auto check = [&](auto dequant_ref, const auto* blocks) {
    for (int i = 0; i < 7; ++i) {
      dequant_ref(blocks[i], ref.data());
      for (int j = 0; j < QK; ++j) ASSERT_EQ(row[static_cast<std::size_t>(i * QK + j)], ref[static_cast<std::size_t>(j)]) << i << " " << j;
    }
  };
  dequantize_row_q8_0(b8, 7, row.data());
  check(dequantize_block_q8_0_ref, b8);
  dequantize_row_q4_0(b40, 7, row.data());
  check(dequantize_block_q4_0_ref, b40);
  dequantize_row_q4_1(b41, 7, row.data());
  check(dequantize_block_q4_1_ref, b41);
}

}  // namespace
