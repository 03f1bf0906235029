// The vq codec's prediction across tokens (src/vq/codec_predict.hpp): the choice of k per
// coefficient, exact inversion in both kernels, the residual-range fallback, hostile residuals.
#include "../../src/vq/codec_predict.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "veloxquant/entropy/rans.hpp"

namespace {

using vq::vq_codec_detail::vq_find_copies;
using vq::vq_codec_detail::vq_predict;
using vq::vq_codec_detail::vq_unpredict;

// [batch * tokens, n] hi parts, coefficient c an AR(1) process of correlation rho[c % rho.size()]
// and innovation sigma, clamped to +-255.
std::vector<std::int16_t> ar1(std::size_t n, std::size_t batch, std::size_t tokens, const std::vector<double>& rho, double sigma,
                              std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> g(0.0, sigma);
  std::vector<std::int16_t> hi(n * batch * tokens);
  for (std::size_t c = 0; c < n; ++c)
    for (std::size_t b = 0; b < batch; ++b) {
      double x = 0.0;
      for (std::size_t t = 0; t < tokens; ++t) {
        x = rho[c % rho.size()] * x + g(rng);
        hi[(b * tokens + t) * n + c] = static_cast<std::int16_t>(std::clamp<long>(std::lround(x), -255, 255));
      }
    }
  return hi;
}

TEST(VqCodecPredict, ChoosesTheLeastSquaresEighthsAndOnlyWhenItPays) {
  // rho 0.9 -> k = 7; rho 0.98 -> 8; rho -0.7 -> -6 (-5.6 rounded); rho 0.2 lowers the energy by ~4 %
  // (< 10 %) and iid codes not at all -> 0.
  const std::size_t n = 5, B = 2, T = 3000;
  const auto hi = ar1(n, B, T, {0.9, 0.98, -0.7, 0.2, 0.0}, 3.0, 1);
  std::vector<std::int16_t> res(hi.size(), 12345);
  const auto k = vq_predict(hi.data(), res.data(), n, B, T, 255);
  ASSERT_EQ(k.size(), n);
  EXPECT_EQ(k[0], 7);
  EXPECT_EQ(k[1], 8);
  EXPECT_EQ(k[2], -6);
  EXPECT_EQ(k[3], 0);
  EXPECT_EQ(k[4], 0);
  // The residuals as the header defines them, token 0 of each batch predicted as 0.
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t c = 0; c < n; ++c) {
        const std::size_t i = (b * T + t) * n + c;
        const int pred = t == 0 ? 0 : (k[c] * hi[i - n] + 4) >> 3;
        ASSERT_EQ(res[i], hi[i] - pred) << b << " " << t << " " << c;
      }
}

TEST(VqCodecPredict, ResidualsOutsideTheAlphabetFallBackToNoPrediction) {
  // Strongly correlated (k = 8) but for one jump from +200 to -200: that residual (-400) would
  // leave +-255, so the coefficient is coded as it is; its neighbour keeps its predictor.
  const std::size_t n = 2, T = 100;
  std::vector<std::int16_t> hi(n * T);
  for (std::size_t t = 0; t < T; ++t) {
    hi[t * n] = static_cast<std::int16_t>(t == 50 ? -200 : 200);
    hi[t * n + 1] = static_cast<std::int16_t>(t / 4);
  }
  std::vector<std::int16_t> res(hi.size());
  const auto k = vq_predict(hi.data(), res.data(), n, 1, T, 255);
  EXPECT_EQ(k[0], 0);
  EXPECT_EQ(k[1], 8);
  for (std::size_t t = 0; t < T; ++t) EXPECT_EQ(res[t * n], hi[t * n]);
  // With a wider alphabet the same coefficient is predicted.
  EXPECT_EQ(vq_predict(hi.data(), res.data(), n, 1, T, 511)[0], 8);
}

TEST(VqCodecPredict, UnpredictInvertsBitForBitInBothKernels) {
  // Awkward widths around the 16-lane vector, empty / one-token / B > 1, every k.
  for (std::size_t n : {1u, 15u, 16u, 17u, 40u})
    for (auto [B, T] : {std::pair<std::size_t, std::size_t>{1, 0}, {1, 1}, {1, 2}, {3, 57}, {2, 300}}) {
      SCOPED_TRACE(::testing::Message() << n << " " << B << "x" << T);
      const auto hi = ar1(n, B, T, {0.99, 0.5, -0.9, 0.8, 0.95}, 6.0, n * 31 + T);
      std::vector<std::int16_t> res(hi.size());
      auto k = vq_predict(hi.data(), res.data(), n, B, T, 255);
      for (std::size_t c = 0; c < n; ++c) k[c] = static_cast<std::int8_t>(-7 + static_cast<int>(c % 16));  // every predictor
      for (std::size_t b = 0; b < B; ++b)
        for (std::size_t t = 0; t < T; ++t)
          for (std::size_t c = 0; c < n; ++c) {
            const std::size_t i = (b * T + t) * n + c;
            res[i] = static_cast<std::int16_t>(hi[i] - (t == 0 ? 0 : (k[c] * hi[i - n] + 4) >> 3));
          }
      for (const bool avx2 : {false, true}) {
        if (avx2 && !vq::rans_avx2_available()) continue;
        auto codes = res;
        ASSERT_TRUE(vq_unpredict(codes.data(), n, B, T, k.data(), nullptr, 255, avx2));
        EXPECT_EQ(codes, hi) << "avx2 " << avx2;
      }
    }
}

TEST(VqCodecPredict, GrowingHiPartsAreRefusedInBothKernels) {
  // k = 8 with residuals of 200 each token: 200, 400, ... leaves +-255 at token 1, whether the
  // coefficient sits in a 16-lane vector (c = 3) or in the scalar tail (c = 17).
  for (const std::size_t bad : {3u, 17u})
    for (const bool avx2 : {false, true}) {
      if (avx2 && !vq::rans_avx2_available()) continue;
      const std::size_t n = 18, T = 5;
      std::vector<std::int16_t> codes(n * T, 0);
      std::vector<std::int8_t> k(n, 0);
      k[bad] = 8;
      for (std::size_t t = 0; t < T; ++t) codes[t * n + bad] = 200;
      EXPECT_FALSE(vq_unpredict(codes.data(), n, 1, T, k.data(), nullptr, 255, avx2)) << bad << " " << avx2;
      // Token 0 (predicted as 0) is checked too.
      std::vector<std::int16_t> first(n, 0);
      first[bad] = -256;
      EXPECT_FALSE(vq_unpredict(first.data(), n, 1, 1, k.data(), nullptr, 255, avx2));
    }
}

TEST(VqCodecPredict, RowCopiesNameTheLastEqualRowAndRebuildIt) {
  // Rows drawn from 5 distinct patterns (a token vocabulary) over two batches: each repeat names
  // the last row equal to it, across the batch boundary too; narrow sides are never searched.
  const std::size_t n = 20, B = 2, T = 40;
  std::mt19937_64 rng(9);
  std::vector<std::int16_t> vocab(5 * n);
  for (auto& v : vocab) v = static_cast<std::int16_t>(static_cast<int>(rng() % 21) - 10);
  std::vector<std::int16_t> hi(B * T * n);
  std::vector<int> tok(B * T);
  for (std::size_t r = 0; r < B * T; ++r) {
    tok[r] = r % 7 == 3 ? -1 : static_cast<int>(rng() % 5);  // -1: a row of its own
    for (std::size_t c = 0; c < n; ++c)
      hi[r * n + c] = tok[r] < 0 ? static_cast<std::int16_t>(100 + r) : vocab[static_cast<std::size_t>(tok[r]) * n + c];
  }
  const auto from = vq_find_copies(hi.data(), n, B * T);
  for (std::size_t r = 0; r < B * T; ++r) {
    int last = -1;
    for (std::size_t q = 0; q < r; ++q)
      if (tok[q] >= 0 && tok[q] == tok[r]) last = static_cast<int>(q);
    EXPECT_EQ(from[r], last) << r;
  }
  EXPECT_EQ(vq_find_copies(hi.data(), n - 5, B * T * n / (n - 5)), std::vector<std::int32_t>(B * T * n / (n - 5), -1));
  // The residuals of the rows not copied, then the rebuild: every row as it was, in both kernels.
  std::vector<std::int16_t> res(hi.size());
  const auto k = vq_predict(hi.data(), res.data(), n, B, T, 255);
  for (const bool avx2 : {false, true}) {
    if (avx2 && !vq::rans_avx2_available()) continue;
    auto codes = res;
    for (std::size_t r = 0; r < B * T; ++r)
      if (from[r] >= 0) std::fill_n(codes.begin() + static_cast<std::ptrdiff_t>(r * n), n, std::int16_t{999});  // not coded: junk
    ASSERT_TRUE(vq_unpredict(codes.data(), n, B, T, k.data(), from.data(), 255, avx2));
    EXPECT_EQ(codes, hi) << "avx2 " << avx2;
  }
}

}  // namespace
