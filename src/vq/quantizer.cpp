#include "quantizer.hpp"

#include <algorithm>
#include <bit>
#include <cmath>

#include "transform.hpp"
#include "veloxquant/vq/codec.hpp"

namespace vq::vq_quant {

namespace {

std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

// The high-rate code rate of a uniformly quantized Gaussian is log2(sigma * sqrt(2 pi e) / step).
constexpr double kSqrt2PiE = 4.132731354122493;

}  // namespace

// Step by reverse water-filling: the step at which the mean over coefficients of
// max(0, log2(4.13 sigma_c / step)) equals `bits` (bisection on log2 step).
float water_fill_step(const std::vector<double>& sigma, double bits) {
  double smax = 0;
  for (double s : sigma) smax = std::max(smax, s);
  if (!(smax > 0)) return 1.0f;  // constant data: any step; every code is 0
  // The mean is over the coefficients that vary: a constant one codes to nothing whatever the
  // step. Counting them would hand their share of `bits` to the others (a --pad-head 64 GGUF's
  // heads of 8 real channels in 64 got 16 bits per real coefficient at bits=2, and codes beyond
  // reach).
  const double live = static_cast<double>(std::count_if(sigma.begin(), sigma.end(), [&](double s) { return s > 1e-7 * smax; }));
  auto rate = [&](double log_step) {
    double r = 0;
    for (double s : sigma)
      if (s > 1e-7 * smax) r += std::max(0.0, std::log2(kSqrt2PiE * s) - log_step);
    return r / live;
  };
  double lo = std::log2(kSqrt2PiE * smax) - 64, hi = std::log2(kSqrt2PiE * smax);  // rate(hi) = 0 <= bits
  for (int i = 0; i < 100; ++i) {
    const double mid = 0.5 * (lo + hi);
    (rate(mid) > bits ? lo : hi) = mid;
  }
  return static_cast<float>(std::exp2(hi));
}

// Calibration of one side from its first rows y (transformed, [rows][n]): step by water-filling,
// grid offsets, code splits, packed widths.
void calibrate_side(const std::vector<double>& y, int n, double bits, float& step, std::vector<std::int32_t>& offset,
                    std::vector<float>& mean_f, std::vector<std::uint8_t>& shift, std::vector<std::uint8_t>& width) {
  const std::size_t rows = y.size() / sz(n);
  std::vector<double> sum(sz(n), 0.0), sum2(sz(n), 0.0), lo(sz(n), INFINITY), hi(sz(n), -INFINITY);
  for (std::size_t r = 0; r < rows; ++r)
    for (int c = 0; c < n; ++c) {
      const double v = y[r * sz(n) + sz(c)];
      sum[sz(c)] += v, sum2[sz(c)] += v * v;
      lo[sz(c)] = std::min(lo[sz(c)], v), hi[sz(c)] = std::max(hi[sz(c)], v);
    }
  const double cnt = static_cast<double>(rows);
  std::vector<double> sigma(sz(n)), mean(sz(n));
  double mean_max = 0;
  for (int c = 0; c < n; ++c) {
    mean[sz(c)] = sum[sz(c)] / cnt;
    mean_max = std::max(mean_max, std::fabs(mean[sz(c)]));
  }
  // Spread about the mean in a second pass: E[v^2] - mean^2 leaves rounding noise where the rows
  // are (nearly) constant, and a step fitted to that noise put the data itself millions of steps
  // away (issue 36: 64 identical rows refused that very row).
  std::fill(sum2.begin(), sum2.end(), 0.0);
  for (std::size_t r = 0; r < rows; ++r)
    for (int c = 0; c < n; ++c) {
      const double d = y[r * sz(n) + sz(c)] - mean[sz(c)];
      sum2[sz(c)] += d * d;
    }
  for (int c = 0; c < n; ++c) sigma[sz(c)] = std::sqrt(sum2[sz(c)] / cnt);
  step = water_fill_step(sigma, bits);
  // Every mean must sit on the offset grid (quarter steps, +-kVqMaxOffset): a step no finer than that.
  step = std::max(step, static_cast<float>(4.0 * mean_max / static_cast<double>(kVqMaxOffset)));
  offset.resize(sz(n));
  mean_f.resize(sz(n));
  shift.assign(sz(n), 0);
  width.assign(sz(n), 1);
  std::vector<std::int64_t> beyond(17);
  for (int c = 0; c < n; ++c) {
    // Codes beyond +-255 are split (vq/codec.hpp). Reach 32 sigma or 4x the calibration's
    // extremes, so data that drifts after calibration rarely needs a wider split later (which
    // update() makes when it does); a generous split is nearly free.
    const double reach = std::max({32.0 * sigma[sz(c)], 4.0 * (hi[sz(c)] - mean[sz(c)]), 4.0 * (mean[sz(c)] - lo[sz(c)])}) / step;
    while (shift[sz(c)] < kVqMaxShift && reach > vq_max_code(shift[sz(c)])) ++shift[sz(c)];
    const double m = std::nearbyint(mean[sz(c)] / (0.25 * static_cast<double>(step)));
    offset[sz(c)] = static_cast<std::int32_t>(std::clamp(m, -static_cast<double>(kVqMaxOffset), static_cast<double>(kVqMaxOffset)));
    mean_f[sz(c)] = vq_offset(offset[sz(c)], step);
    // Width: the fewest bits + expected escape cost, the escape rate being the larger of the
    // calibration codes' own and a Gaussian tail of the calibration's spread.
    std::fill(beyond.begin(), beyond.end(), 0);
    for (std::size_t r = 0; r < rows; ++r) {
      const double q = std::fabs(vq_transform::round_even((y[r * sz(n) + sz(c)] - mean_f[sz(c)]) / static_cast<double>(step)));
      for (int w = 1; w <= 16; ++w)
        if (q > static_cast<double>((1 << (w - 1)) - 1)) ++beyond[sz(w)];
    }
    double best = INFINITY;
    for (int w = 1; w <= 16 && w < best; ++w) {  // a cost is at least w: no wider field can win (and no erfc is wasted)
      const double lim = static_cast<double>((1 << (w - 1)) - 1) + 0.5;
      const double gauss = sigma[sz(c)] > 0 ? std::erfc(lim * static_cast<double>(step) / (sigma[sz(c)] * std::sqrt(2.0))) : 0.0;
      const double cost = w + kEscapeBits * std::max(gauss, static_cast<double>(beyond[sz(w)]) / cnt);
      if (cost < best) best = cost, width[sz(c)] = static_cast<std::uint8_t>(w);
    }
  }
}

// int16 lanes throughout (pminsw / pmaxsw; an int accumulator made the compiler widen every code
// to 32 bits).
std::pair<int, int> code_range(const std::int16_t* codes, std::size_t count) {
  std::int16_t lo = 0, hi = 0;
  for (std::size_t i = 0; i < count; ++i) lo = std::min(lo, codes[i]), hi = std::max(hi, codes[i]);
  return {lo, hi};
}

// A code needs width w when its bit length (of |code|) is < w, so one count of bit lengths per
// coefficient gives every width's escapes.
void widths_from_codes(const std::int16_t* codes, std::int64_t rows, int n, std::vector<std::uint8_t>& width) {
  // esc[c][w] = codes of c with bit length >= w, i.e. |code| >= 2^(w-1), for w = 1 .. the longest
  // bit length present (none longer): per row one pass over the coefficients per w, counted in
  // 16-bit lanes (flushed every 65535 rows), which the compiler vectorises (a histogram of bit
  // lengths per code did not).
  const auto [lo, hi] = code_range(codes, sz(rows) * sz(n));
  const int longest = std::bit_width(static_cast<unsigned>(std::max(-lo, hi)));
  std::vector<std::int64_t> esc(sz(n) * 17, 0);  // [c][w]
  std::vector<std::uint16_t> cnt(sz(n) * sz(longest + 1), 0);  // [w][c], w = 1 .. longest
  std::vector<std::uint16_t> mag(sz(n));
  for (std::int64_t r0 = 0; r0 < rows; r0 += 65535) {
    const std::int64_t r1 = std::min<std::int64_t>(rows, r0 + 65535);
    for (std::int64_t r = r0; r < r1; ++r) {
      const std::int16_t* q = codes + sz(r) * sz(n);
      for (int c = 0; c < n; ++c) mag[sz(c)] = static_cast<std::uint16_t>(q[c] < 0 ? -q[c] : q[c]);  // -32768 -> 32768
      for (int w = 1; w <= longest; ++w) {
        std::uint16_t* k = cnt.data() + sz(w) * sz(n);
        const unsigned s = static_cast<unsigned>(w - 1);
        for (int c = 0; c < n; ++c) k[c] = static_cast<std::uint16_t>(k[c] + ((mag[sz(c)] >> s) != 0));
      }
    }
    for (int w = 1; w <= longest; ++w)
      for (int c = 0; c < n; ++c) esc[sz(c) * 17 + sz(w)] += cnt[sz(w) * sz(n) + sz(c)], cnt[sz(w) * sz(n) + sz(c)] = 0;
  }
  width.assign(sz(n), 1);
  for (int c = 0; c < n; ++c) {
    double best = INFINITY;
    for (int w = 1; w <= 16; ++w) {
      const double cost = static_cast<double>(w) * static_cast<double>(rows) + kEscapeBits * static_cast<double>(esc[sz(c) * 17 + sz(w)]);
      if (cost < best) best = cost, width[sz(c)] = static_cast<std::uint8_t>(w);
    }
  }
}

}  // namespace vq::vq_quant
