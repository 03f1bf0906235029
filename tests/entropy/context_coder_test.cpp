#include "veloxquant/entropy/context_coder.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include <string>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"

namespace {

vq::ContextLayout layout(std::size_t slices, std::size_t tokens, std::size_t dim, int bits, std::vector<std::int64_t> pieces, int group) {
  vq::ContextLayout l{slices, tokens, dim, bits, vq::group_starts(pieces, group)};
  return l;
}

// Codes of the kind a cache makes: per channel a clamped random walk (step 0 or +-1 with
// probability `move`), restarted at a random level at every group start; or iid uniform.
std::vector<std::uint8_t> walk_codes(const vq::ContextLayout& l, double move, unsigned seed, bool iid = false) {
  std::mt19937 rng(seed);
  const int top = (1 << l.bits) - 1;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<std::uint8_t> q(l.size());
  for (std::size_t s = 0; s < l.slices; ++s)
    for (std::size_t c = 0; c < l.dim; ++c) {
      int v = 0;
      for (std::size_t t = 0; t < l.tokens; ++t) {
        if (iid || l.group_start[t]) {
          v = static_cast<int>(rng() % static_cast<unsigned>(top + 1));
        } else if (u(rng) < move) {
          v = std::clamp(v + (rng() % 2 ? 1 : -1), 0, top);
        }
        q[(s * l.tokens + t) * l.dim + c] = static_cast<std::uint8_t>(v);
      }
    }
  return q;
}

std::vector<std::uint8_t> decode(std::span<const std::uint8_t> b, const vq::ContextLayout& l, vq::RansKernel k = vq::RansKernel::Auto) {
  std::vector<std::uint8_t> out(l.size(), 0xee);
  vq::context_decode(b, l, out, k);
  return out;
}

TEST(ContextCoder, GroupStartsFollowThePieces) {
  EXPECT_EQ(vq::group_starts(std::vector<std::int64_t>{5, 3}, 2), (std::vector<std::uint8_t>{1, 0, 1, 0, 1, 1, 0, 1}));
  EXPECT_EQ(vq::group_starts(std::vector<std::int64_t>{4}, 32), (std::vector<std::uint8_t>{1, 0, 0, 0}));
  EXPECT_TRUE(vq::group_starts(std::vector<std::int64_t>{}, 8).empty());
}

TEST(ContextCoder, RoundTripIsExactForEveryShape) {
  unsigned seed = 1;
  for (int bits = 1; bits <= 4; ++bits)
    for (std::size_t slices : {1u, 3u})
      for (std::size_t dim : {1u, 7u, 32u, 40u})
        for (const auto& [pieces, group] : std::vector<std::pair<std::vector<std::int64_t>, int>>{
                 {{1}, 32}, {{5}, 1}, {{100}, 32}, {{5, 3, 40}, 8}, {{33}, 32}})
          for (const double move : {0.0, 0.2, 1.0}) {
            std::size_t tokens = 0;
            for (const auto p : pieces) tokens += static_cast<std::size_t>(p);
            const auto l = layout(slices, tokens, dim, bits, pieces, group);
            const auto q = walk_codes(l, move, seed++, move == 1.0);
            vq::ContextCodedSize size;
            const auto b = vq::context_encode(q, l, &size);
            ASSERT_EQ(size.model + size.tables + size.payload, b.size());
            ASSERT_GE(size.classes, 1u);
            ASSERT_LE(size.classes, static_cast<std::size_t>((1 << bits) + 1));
            ASSERT_EQ(decode(b, l, vq::RansKernel::Scalar), q) << "bits " << bits << " dim " << dim << " tokens " << tokens;
            if (vq::rans_avx2_available()) ASSERT_EQ(decode(b, l, vq::RansKernel::Avx2), q);
          }
}

TEST(ContextCoder, EmptyStreamsRoundTrip) {
  for (const auto& l : {layout(2, 0, 8, 4, {}, 32), layout(0, 5, 8, 4, {5}, 32), layout(1, 4, 0, 2, {4}, 2)}) {
    const auto b = vq::context_encode(std::vector<std::uint8_t>{}, l);
    EXPECT_EQ(b, (std::vector<std::uint8_t>{1}));  // K = 1 and nothing else
    EXPECT_TRUE(decode(b, l).empty());
    EXPECT_THROW(decode(std::vector<std::uint8_t>{1, 0}, l), vq::FormatError);
    EXPECT_THROW(decode(std::vector<std::uint8_t>{}, l), vq::FormatError);
  }
}

// The class count follows the data: iid codes have nothing to gain from contexts and end with one
// pooled table; slowly drifting codes keep several and code well below the pooled order-0 size.
TEST(ContextCoder, ClassesFollowTheData) {
  const auto l = layout(4, 2048, 32, 4, {2048}, 32);
  vq::ContextCodedSize iid, drift;
  const auto qi = walk_codes(l, 1.0, 7, /*iid=*/true);
  vq::context_encode(qi, l, &iid);
  EXPECT_EQ(iid.classes, 1u);
  // 16 equiprobable codes: 4 bits each; one table and the lane states on top.
  EXPECT_LT(static_cast<double>(iid.payload) * 8.0 / static_cast<double>(qi.size()), 4.01);
  const auto qd = walk_codes(l, 0.1, 8);
  vq::context_encode(qd, l, &drift);
  EXPECT_GE(drift.classes, 4u);
  // Pooled order-0 bound of the same codes (no tables counted): the contexts must beat it clearly.
  std::vector<double> h(16, 0.0);
  for (const auto v : qd) h[v] += 1.0;
  double order0 = 0.0;
  for (const double c : h)
    if (c > 0) order0 += c * std::log2(static_cast<double>(qd.size()) / c) / 8.0;
  EXPECT_LT(static_cast<double>(drift.model + drift.tables + drift.payload), 0.5 * order0);
}

TEST(ContextCoder, BadLayoutsAndCodesAreRefused) {
  const auto l = layout(1, 4, 2, 4, {4}, 2);
  const std::vector<std::uint8_t> q(8, 3);
  auto bad = l;
  bad.bits = 5;
  EXPECT_THROW(vq::context_encode(q, bad), vq::InvalidArgument);
  bad = l;
  bad.group_start.pop_back();
  EXPECT_THROW(vq::context_encode(q, bad), vq::InvalidArgument);
  bad = l;
  bad.group_start[0] = 0;
  EXPECT_THROW(vq::context_encode(q, bad), vq::InvalidArgument);
  EXPECT_THROW(vq::context_encode(std::vector<std::uint8_t>(7, 3), l), vq::InvalidArgument);
  auto big = q;
  big[5] = 16;
  EXPECT_THROW(vq::context_encode(big, l), vq::InvalidArgument);
  std::vector<std::uint8_t> out(7);
  EXPECT_THROW(vq::context_decode(vq::context_encode(q, l), l, out), vq::InvalidArgument);
}

// Every truncation and a trailing byte fail with FormatError; so do hand-broken headers. Every
// single-bit flip either fails with FormatError or decodes to some codes (there is no checksum at
// this level: the .vqkv container has them); it never crashes or reads out of bounds (ASan build).
TEST(ContextCoder, CorruptInputFailsClearly) {
  const auto l = layout(2, 70, 12, 4, {40, 30}, 16);
  const auto q = walk_codes(l, 0.3, 11);
  vq::ContextCodedSize size;
  const auto b = vq::context_encode(q, l, &size);
  ASSERT_GT(size.classes, 1u);
  for (std::size_t n = 0; n < b.size(); ++n)
    EXPECT_THROW(decode(std::span(b).first(n), l), vq::FormatError) << "cut at " << n;
  auto longer = b;
  longer.push_back(0);
  EXPECT_THROW(decode(longer, l), vq::FormatError);
  auto k0 = b;
  k0[0] = 0;
  EXPECT_THROW(decode(k0, l), vq::FormatError);
  auto k_big = b;
  k_big[0] = 18;
  EXPECT_THROW(decode(k_big, l), vq::FormatError);
  for (std::size_t i = 0; i < b.size(); ++i)
    for (int bit = 0; bit < 8; ++bit) {
      auto f = b;
      f[i] ^= static_cast<std::uint8_t>(1 << bit);
      try {
        (void)decode(f, l);
      } catch (const vq::FormatError&) {
      }
    }
  // A class map naming a class that does not exist (K = 3 needs 2 bits per context; 3 is invalid).
  const auto l2 = layout(1, 64, 4, 4, {64}, 64);
  const auto q2 = walk_codes(l2, 0.2, 12);
  vq::ContextCodedSize s2;
  auto b2 = vq::context_encode(q2, l2, &s2);
  if (s2.classes == 3) {
    b2[1] |= 0x03;
    EXPECT_THROW(decode(b2, l2), vq::FormatError);
  }
}

}  // namespace
