// The quantizer stage of `vq` (src/vq/quantizer.hpp): the water-filled step meets the nominal rate,
// calibration places the grid on the data and picks widths that rarely escape, and widths from
// codes alone minimise rows x width + escape bits (checked against every width).
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "../../src/vq/quantizer.hpp"
#include "veloxquant/vq/codec.hpp"

namespace {

using namespace vq::vq_quant;

// The mean rate over the coefficients that vary (a constant one codes to nothing at any step).
double rate_at(const std::vector<double>& sigma, double step) {
  double r = 0;
  int live = 0;
  for (double s : sigma)
    if (s > 0) r += std::max(0.0, std::log2(4.132731354122493 * s / step)), ++live;
  return r / live;
}

TEST(VqQuantizer, WaterFilledStepMeetsTheRate) {
  std::mt19937 g(1);
  std::lognormal_distribution<double> ln(0.0, 1.5);
  std::vector<double> sigma(64);
  for (auto& s : sigma) s = ln(g);
  sigma[3] = 0;  // a constant coefficient costs nothing
  for (const double bits : {0.25, 1.0, 2.0, 4.5, 8.0}) EXPECT_NEAR(rate_at(sigma, water_fill_step(sigma, bits)), bits, 1e-6) << bits;
  // Constant coefficients leave the step as it is: a --pad-head GGUF's 56 zero channels beside 8
  // real ones get the real ones' step, not 8x their share of the bits.
  std::vector<double> padded = sigma;
  padded.resize(8 * sigma.size(), 0.0);
  for (const double bits : {0.5, 2.0}) EXPECT_FLOAT_EQ(water_fill_step(padded, bits), water_fill_step(sigma, bits)) << bits;
  EXPECT_EQ(water_fill_step(std::vector<double>(8, 0.0), 2.0), 1.0f);  // constant data: every code is 0
}

TEST(VqQuantizer, CalibrationPlacesTheGridOnTheData) {
  const int n = 16, rows = 512;
  std::mt19937 g(2);
  std::vector<double> mean(n), sigma(n), y(static_cast<std::size_t>(rows * n));
  for (int c = 0; c < n; ++c) mean[static_cast<std::size_t>(c)] = 3.0 * std::sin(c), sigma[static_cast<std::size_t>(c)] = 0.1 + 0.2 * c;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < n; ++c) {
      std::normal_distribution<double> nd(mean[static_cast<std::size_t>(c)], sigma[static_cast<std::size_t>(c)]);
      y[static_cast<std::size_t>(r * n + c)] = nd(g);
    }
  float step = 0;
  std::vector<std::int32_t> offset;
  std::vector<float> mean_f;
  std::vector<std::uint8_t> shift, width;
  calibrate_side(y, n, 3.0, step, offset, mean_f, shift, width);
  ASSERT_GT(step, 0.0f);
  ASSERT_EQ(width.size(), static_cast<std::size_t>(n));
  std::int64_t escapes = 0;
  for (int c = 0; c < n; ++c) {
    const auto C = static_cast<std::size_t>(c);
    EXPECT_EQ(mean_f[C], vq::vq_offset(offset[C], step));
    // The offset's grid is step / 4: the mean sits within half a grid step of the sample mean (which
    // is within 4 standard errors of the true one).
    EXPECT_LE(std::fabs(mean_f[C] - mean[C]), step / 8 + 4 * sigma[C] / std::sqrt(rows)) << c;
    EXPECT_GE(width[C], 1);
    EXPECT_LE(width[C], 16);
    for (int r = 0; r < rows; ++r) {
      const double q = std::nearbyint((y[static_cast<std::size_t>(r * n + c)] - mean_f[C]) / step);
      escapes += std::fabs(q) > (1 << (width[C] - 1)) - 1;
    }
  }
  // Widths trade a bit per row against kEscapeBits per escape: few codes escape.
  EXPECT_LT(static_cast<double>(escapes) / (rows * n), 0.02);
}

// Issue 36: 64 identical rows (constant data whose E[v^2] - mean^2 is rounding noise) gave a step
// fitted to that noise, and the rows themselves sat millions of steps from their grid. Now every
// calibration row codes to 0 within the reach of its split, whatever the magnitude.
TEST(VqQuantizer, IdenticalRowsCodeThemselves) {
  const int n = 8, rows = 64;
  for (const double scale : {1e-3, 1.0, 1e3, 1e7}) {
    std::vector<double> y(static_cast<std::size_t>(rows * n));
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < n; ++c) y[static_cast<std::size_t>(r * n + c)] = scale * (0.1 + 1.7 * std::sin(3.0 * c + 0.3));
    float step = 0;
    std::vector<std::int32_t> offset;
    std::vector<float> mean_f;
    std::vector<std::uint8_t> shift, width;
    calibrate_side(y, n, 2.0, step, offset, mean_f, shift, width);
    ASSERT_GT(step, 0.0f) << scale;
    for (int c = 0; c < n; ++c) {
      const double q = std::fabs(std::nearbyint((y[static_cast<std::size_t>(c)] - mean_f[static_cast<std::size_t>(c)]) / step));
      EXPECT_LE(q, vq::vq_max_code(shift[static_cast<std::size_t>(c)])) << "scale " << scale << " coefficient " << c;
    }
  }
}

TEST(VqQuantizer, WidthsFromCodesMinimiseRowsTimesWidthPlusEscapes) {
  const int n = 7;
  for (const std::int64_t rows : {std::int64_t{1}, std::int64_t{300}, std::int64_t{70000}}) {
    std::mt19937 g(static_cast<unsigned>(rows));
    std::vector<std::int16_t> codes(static_cast<std::size_t>(rows * n));
    for (std::int64_t r = 0; r < rows; ++r)
      for (int c = 0; c < n; ++c) {
        // Coefficient c: mostly within +-2^c, now and then a far outlier.
        const int span = 1 << c;
        int v = static_cast<int>(g() % static_cast<unsigned>(2 * span + 1)) - span;
        if (g() % 500 == 0) v = (g() % 2 ? 1 : -1) * static_cast<int>(g() % 30000);
        codes[static_cast<std::size_t>(r * n + c)] = static_cast<std::int16_t>(v);
      }
    std::vector<std::uint8_t> width;
    widths_from_codes(codes.data(), rows, n, width);
    ASSERT_EQ(width.size(), static_cast<std::size_t>(n));
    for (int c = 0; c < n; ++c) {
      auto cost = [&](int w) {
        double esc = 0;
        for (std::int64_t r = 0; r < rows; ++r) esc += std::abs(codes[static_cast<std::size_t>(r * n + c)]) > (1 << (w - 1)) - 1;
        return static_cast<double>(w) * static_cast<double>(rows) + kEscapeBits * esc;
      };
      double best = INFINITY;
      for (int w = 1; w <= 16; ++w) best = std::min(best, cost(w));
      EXPECT_EQ(cost(width[static_cast<std::size_t>(c)]), best) << "rows " << rows << " coefficient " << c;
    }
  }
  const std::int16_t some[] = {3, -40, 7, 12};
  EXPECT_EQ(code_range(some, 4), (std::pair<int, int>{-40, 12}));
  EXPECT_EQ(code_range(some, 0), (std::pair<int, int>{0, 0}));
}

}  // namespace
