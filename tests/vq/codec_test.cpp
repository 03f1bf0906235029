// Our method's coder (vq/codec.hpp): bit-exact round trips, the parametric tables, hostile input.
#include "veloxquant/vq/codec.hpp"

#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"

namespace {

// Random codes: Gaussian of `sigma` code steps per coefficient, some coefficients all zero, some
// split (shift > 0) with codes up to their bound.
vq::VqLayerCodes random_codes(std::int64_t batch, std::int64_t tokens, int nk, int nv, std::uint64_t seed, bool shifts) {
  std::mt19937_64 rng(seed);
  vq::VqLayerCodes lc;
  lc.batch = batch;
  lc.tokens = tokens;
  for (vq::VqSideCodes* s : {&lc.k, &lc.v}) {
    s->n = s == &lc.k ? nk : nv;
    s->step = 0.37f;
    for (int c = 0; c < s->n; ++c) {
      s->offset.push_back(static_cast<std::int32_t>(rng() % 2001) - 1000);
      s->shift.push_back(shifts && c % 3 == 1 ? static_cast<std::uint8_t>(1 + c % vq::kVqMaxShift) : 0);
    }
    s->codes.resize(static_cast<std::size_t>(lc.rows() * s->n));
    for (std::int64_t r = 0; r < lc.rows(); ++r)
      for (int c = 0; c < s->n; ++c) {
        const int lim = vq::vq_max_code(s->shift[static_cast<std::size_t>(c)]);
        const double sigma = c % 4 == 0 ? 0.0 : (c % 4 == 1 ? 0.3 : (c % 4 == 2 ? 3.0 : 40.0)) * (1 << s->shift[static_cast<std::size_t>(c)]);
        std::normal_distribution<double> g(0.0, sigma > 0 ? sigma : 1.0);
        const int q = sigma > 0 ? static_cast<int>(std::lround(g(rng))) : 0;
        s->codes[static_cast<std::size_t>(r * s->n + c)] = static_cast<std::int16_t>(std::clamp(q, -lim, lim));
      }
    if (lc.rows() > 0 && s->n > 1) s->codes[1] = static_cast<std::int16_t>(vq::vq_max_code(s->shift[1]));  // the extreme code
  }
  return lc;
}

void expect_equal(const vq::VqLayerCodes& a, const vq::VqLayerCodes& b) {
  EXPECT_EQ(a.batch, b.batch);
  EXPECT_EQ(a.tokens, b.tokens);
  for (auto [x, y] : {std::pair{&a.k, &b.k}, std::pair{&a.v, &b.v}}) {
    EXPECT_EQ(x->n, y->n);
    EXPECT_EQ(x->step, y->step);
    EXPECT_EQ(x->offset, y->offset);
    EXPECT_EQ(x->codes, y->codes);
    for (int c = 0; c < x->n; ++c)
      EXPECT_EQ(x->shift.empty() ? 0 : x->shift[static_cast<std::size_t>(c)], y->shift[static_cast<std::size_t>(c)]);
  }
}

TEST(VqCodec, RoundTripIsBitExact) {
  struct Case {
    std::int64_t batch, tokens;
    int nk, nv;
    bool shifts;
  };
  for (const Case& c : {Case{1, 0, 1, 1, false}, Case{1, 1, 1, 1, false}, Case{1, 1, 32, 32, true}, Case{2, 33, 8, 12, true},
                        Case{1, 256, 32, 32, false}, Case{3, 31, 5, 7, true}}) {
    const auto lc = random_codes(c.batch, c.tokens, c.nk, c.nv, static_cast<std::uint64_t>(c.tokens * 7 + c.nk), c.shifts);
    const auto bytes = vq::vq_encode(lc);
    const auto back = vq::vq_decode(bytes, static_cast<std::uint64_t>(lc.rows() * (c.nk + c.nv)));
    expect_equal(lc, back);
    EXPECT_EQ(vq::vq_encode(back), bytes);  // deterministic
  }
}

TEST(VqCodec, AllZeroSideCostsOnlyItsHeader) {
  vq::VqLayerCodes lc;
  lc.batch = 1;
  lc.tokens = 100;
  for (vq::VqSideCodes* s : {&lc.k, &lc.v}) {
    s->n = 4;
    s->offset.assign(4, 0);
    s->codes.assign(400, 0);
  }
  // version, 4 varints, per side: step 4 + flag 1 + 4 x (offset 1 + amax 1); an empty rANS stream (1).
  EXPECT_EQ(vq::vq_encode(lc).size(), 1u + 4u + 2u * (4u + 1u + 8u) + 1u);
  expect_equal(lc, vq::vq_decode(vq::vq_encode(lc), 800));
}

TEST(VqCodec, TablesAreValidSymmetricAndDeterministic) {
  for (int amax : {1, 2, 7, 40, 255})
    for (int param : {0, 1, 30, 48, 64, 100, 127, 128, 160, 176, 255}) {
      const auto t = vq::vq_table(amax, static_cast<std::uint8_t>(param));
      ASSERT_EQ(t.alphabet_size(), 2 * amax + 1);
      ASSERT_EQ(t.scale_bits(), vq::kVqScaleBits);
      std::uint32_t sum = 0;
      for (int s = 0; s < t.alphabet_size(); ++s) {
        EXPECT_GE(t.freq(s), 1u) << amax << " " << param;
        sum += t.freq(s);
      }
      EXPECT_EQ(sum, 1u << vq::kVqScaleBits);
      for (int k = 1; k <= amax; ++k) EXPECT_EQ(t.freq(amax + k), t.freq(amax - k));
      EXPECT_TRUE(t == vq::vq_table(amax, static_cast<std::uint8_t>(param)));
    }
  EXPECT_EQ(vq::vq_table(0, 0).alphabet_size(), 1);
  EXPECT_THROW(vq::vq_table(256, 0), vq::InvalidArgument);
}

TEST(VqCodec, BestParameterCodesCloseToTheEntropy) {
  // Gaussian codes of sigma 2.5 steps: the chosen table must code within 2% of the empirical
  // entropy (plus the table's floor of one slot per symbol).
  std::mt19937_64 rng(3);
  std::normal_distribution<double> g(0.0, 2.5);
  std::vector<int> q(20000);
  int amax = 0;
  for (auto& v : q) v = static_cast<int>(std::lround(g(rng))), amax = std::max(amax, std::abs(v));
  std::vector<std::uint32_t> hist(static_cast<std::size_t>(2 * amax + 1), 0);
  for (int v : q) ++hist[static_cast<std::size_t>(v + amax)];
  double entropy = 0;
  for (auto h : hist)
    if (h) entropy -= h * std::log2(static_cast<double>(h) / static_cast<double>(q.size()));
  const auto param = vq::vq_best_param(hist, amax);
  EXPECT_EQ(param & 0x80, 0) << "a Gaussian histogram should pick the Gaussian family";
  EXPECT_LT(vq::vq_table(amax, param).cost_bits(hist), entropy * 1.02);
}

TEST(VqCodec, EncodeRejectsInconsistentInput) {
  auto lc = random_codes(1, 10, 4, 4, 1, false);
  lc.k.codes[0] = 256;  // beyond +-255 without a shift
  EXPECT_THROW(vq::vq_encode(lc), vq::InvalidArgument);
  lc = random_codes(1, 10, 4, 4, 1, false);
  lc.v.codes.pop_back();
  EXPECT_THROW(vq::vq_encode(lc), vq::InvalidArgument);
  lc = random_codes(1, 10, 4, 4, 1, false);
  lc.k.step = 0.0f;
  EXPECT_THROW(vq::vq_encode(lc), vq::InvalidArgument);
  lc = random_codes(1, 10, 4, 4, 1, false);
  lc.k.shift.assign(4, vq::kVqMaxShift + 1);
  EXPECT_THROW(vq::vq_encode(lc), vq::InvalidArgument);
}

TEST(VqCodec, DecodeRejectsEveryTruncationCorruptionAndTrailingByte) {
  const auto lc = random_codes(1, 40, 6, 6, 9, true);
  const auto bytes = vq::vq_encode(lc);
  const std::uint64_t max = static_cast<std::uint64_t>(lc.rows() * 12);
  for (std::size_t n = 0; n < bytes.size(); ++n)
    EXPECT_THROW(vq::vq_decode(std::span(bytes).first(n), max), vq::FormatError) << "prefix " << n;
  auto longer = bytes;
  longer.push_back(0);
  EXPECT_THROW(vq::vq_decode(longer, max), vq::FormatError);
  EXPECT_THROW(vq::vq_decode(bytes, max - 1), vq::FormatError);  // more codes than the caller expects
  auto bad = bytes;
  bad[0] = 2;  // version
  EXPECT_THROW(vq::vq_decode(bad, max), vq::FormatError);
  // Any single flipped bit either fails cleanly or decodes to something (never crashes).
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    auto b = bytes;
    b[i] ^= 0x10;
    try {
      (void)vq::vq_decode(b, max);
    } catch (const vq::FormatError&) {
    }
  }
}

}  // namespace
