// vq/codec.hpp's models: the tables of (amax, param, scale), each coefficient's best parameter,
// the side passes that find amax and the parameters, and the process-wide cache of built models.
#include "veloxquant/vq/codec.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <unordered_map>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/entropy/rans.hpp"
#include "../entropy/byte_io.hpp"
#include "../entropy/rans_kernels.hpp"
#include "codec_kernels.hpp"
#include "codec_models.hpp"
#include "codec_predict.hpp"

namespace vq {

namespace vq_codec_detail {

// exp(x) for x <= 0 from IEEE basic operations only (so tables are bit-identical everywhere):
// x = k ln2 + r, |r| <= ln2 / 2, e^r by its Taylor series to degree 16 (error < 1e-17), times 2^k.
double det_exp(double x) {
  if (x < -700.0) return 0.0;
  constexpr double kInvLn2 = 1.4426950408889634, kLn2Hi = 0.693147180369123816490, kLn2Lo = 1.90821492927058770002e-10;
  const double k = std::floor(x * kInvLn2 + 0.5);
  const double r = (x - k * kLn2Hi) - k * kLn2Lo;
  double sum = 1.0;
  for (int i = 16; i >= 1; --i) sum = 1.0 + sum * r / i;
  return std::ldexp(sum, static_cast<int>(k));
}

// Lower tail P(X <= x) for x <= 0 of a unit-scale model (Gaussian: Numerical Recipes' erfcc,
// fractional error < 1.2e-7; Laplace: exact). sigma is the standard deviation.
double lower_tail(double x, double sigma, bool laplace) {
  if (laplace) return 0.5 * det_exp(x * 1.4142135623730951 / sigma);  // b = sigma / sqrt(2)
  const double z = -x * 0.70710678118654752 / sigma;                   // erfc argument, >= 0
  const double t = 1.0 / (1.0 + 0.5 * z);
  const double poly =
      -z * z - 1.26551223 +
      t * (1.00002368 +
           t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))));
  return 0.5 * t * det_exp(poly);
}

// A split code's hi part, floor(q / 2^shift), is q >> shift (arithmetic), its low part
// q - hi * 2^shift = q & (2^shift - 1).

// Called when some hi part is outside +-kVqMaxCode: finds the first for the message and throws.
[[noreturn]] void throw_hi_out_of_range(const VqSideCodes& s, const std::int16_t* hi, std::size_t count, const char* name) {
  for (std::size_t i = 0; i < count; ++i) {
    const int c = static_cast<int>(i % sz(s.n)), shift = s.shift.empty() ? 0 : s.shift[sz(c)];
    require(std::abs(hi[i]) <= kVqMaxCode, "vq_encode: {} code {} of coefficient {} is outside -{}..{} (shift {})", name,
            s.codes[i], c, kVqMaxCode << shift, ((kVqMaxCode + 1) << shift) - 1, shift);
  }
  throw_invalid_argument(fmt::format("vq_encode: {} has a code outside the range", name));  // not reached
}

// The table of a shift's low parts: 2^shift equally likely symbols.
FrequencyTable low_table(int shift) {
  return FrequencyTable::from_frequencies(std::vector<std::uint32_t>(sz(1) << shift, 1u), shift);
}

// The frequencies of (amax, param)'s table (vq_table's, before the cumulative sums).
std::vector<std::uint32_t> vq_frequencies(int amax, std::uint8_t param, int scale) {
  require(amax >= 0 && amax <= kVqMaxCode, "vq_table: amax {} outside 0..{}", amax, kVqMaxCode);
  const bool laplace = (param & 0x80) != 0;
  // sigma = 2^((i - 48) / 8): an exact power of two times 2^(j/8), j = 0..7, from a table of
  // correctly rounded constants (no libm pow, so every platform agrees).
  static constexpr double kEighths[8] = {1.0,
                                         1.0905077326652577,
                                         1.1892071150027210,
                                         1.2968395546510096,
                                         1.4142135623730951,
                                         1.5422108254079407,
                                         1.6817928305074290,
                                         1.8340080864093424};
  const int e = (param & 0x7f) - 48;
  const int q = e >= 0 ? e / 8 : -((-e + 7) / 8);
  const double s = std::ldexp(kEighths[e - 8 * q], q);
  const int m = 2 * amax + 1;
  const std::uint32_t total = 1u << scale;
  std::vector<double> p(sz(m));
  // Symmetric: compute k >= 0 from lower tails (accurate far out), mirror.
  for (int k = 0; k <= amax; ++k) {
    double pk;
    if (k == amax)
      pk = amax == 0 ? 1.0 : lower_tail(-(k - 0.5), s, laplace);
    else if (k == 0)
      pk = 1.0 - 2.0 * lower_tail(-0.5, s, laplace);
    else
      pk = lower_tail(-(k - 0.5), s, laplace) - lower_tail(-(k + 0.5), s, laplace);
    p[sz(amax + k)] = p[sz(amax - k)] = std::max(pk, 0.0);
  }
  // Every symbol keeps frequency >= 1; the rest is shared by probability, the remainder to the mode.
  std::vector<std::uint32_t> f(sz(m));
  const double spare = static_cast<double>(total - static_cast<std::uint32_t>(m));
  std::uint64_t sum = 0;
  for (int i = 0; i < m; ++i) {
    f[sz(i)] = 1u + static_cast<std::uint32_t>(std::floor(std::min(p[sz(i)], 1.0) * spare));
    sum += f[sz(i)];
  }
  while (sum > total) {  // only through rounding of p summing above 1
    auto it = std::max_element(f.begin(), f.end());
    --*it;
    --sum;
  }
  f[sz(amax)] += static_cast<std::uint32_t>(total - sum);
  return f;
}

// log2(total / freq) of each symbol of (amax, param)'s table, what FrequencyTable::cost_bits sums
// (same expression, so the same choices). Built once per (amax, param) per process, shared by all
// threads, never freed: only encoders (valid data, amax <= 255) fill it, a few KiB an entry.
const double* model_costs(int amax, std::uint8_t param, int scale) {
  static std::atomic<const std::vector<double>*> cache[2 * (kVqMaxCode + 1) * 256];
  auto& slot = cache[(scale == kVqScaleBits ? 0 : (kVqMaxCode + 1) * 256) + sz(amax) * 256 + param];
  if (const auto* c = slot.load(std::memory_order_acquire)) return c->data();
  const auto f = vq_frequencies(amax, param, scale);
  auto made = std::make_unique<std::vector<double>>(f.size());
  const double M = static_cast<double>(1u << scale);
  for (std::size_t i = 0; i < f.size(); ++i) (*made)[i] = std::log2(M / static_cast<double>(f[i]));
  const std::vector<double>* expected = nullptr;
  if (slot.compare_exchange_strong(expected, made.get(), std::memory_order_acq_rel)) return made.release()->data();
  return expected->data();
}

// vq_best_param without building tables: the candidates' costs from model_costs.
std::uint8_t best_param(const std::uint32_t* hist, int amax, int scale) {
  const int size = 2 * amax + 1;
  double n = 0, m2 = 0;
  for (int i = 0; i < size; ++i) {
    n += hist[i];
    m2 += static_cast<double>(hist[i]) * (i - amax) * (i - amax);
  }
  const double sigma = n > 0 ? std::sqrt(std::max(m2 / n, 1e-4)) : 1.0;
  const int i0 = static_cast<int>(std::lround(8.0 * std::log2(sigma))) + 48;
  std::uint8_t best = 0;
  double best_cost = INFINITY;
  for (int family = 0; family < 2; ++family)
    for (int i = std::max(0, i0 - 3); i <= std::min(127, i0 + 3); ++i) {
      const auto param = static_cast<std::uint8_t>(family << 7 | i);
      const double* cost = model_costs(amax, param, scale);
      double bits = 0.0;
      for (int k = 0; k < size; ++k)
        if (hist[k]) bits += static_cast<double>(hist[k]) * cost[k];
      if (bits < best_cost) best_cost = bits, best = param;
    }
  return best;
}

RegionKernels region_kernels(RansKernel k) {
  constexpr RegionKernels avx2{vq_codec_detail::decode_region_avx2, vq_codec_detail::encode_region_avx2};
  constexpr RegionKernels avx512{vq_codec_detail::decode_region_avx512, vq_codec_detail::encode_region_avx512};
  switch (k) {
    case RansKernel::Scalar:
      return {};
    case RansKernel::Avx2:
      require(rans_avx2_available(), "vq codec: the AVX2 kernel was requested but this CPU has no AVX2");
      return avx2;
    case RansKernel::Avx512:
      require(rans_avx512_available(), "vq codec: the AVX-512 kernel was requested but this CPU has no AVX-512 (F/BW/VL)");
      return avx512;
    case RansKernel::Auto:
    default:
      return rans_avx512_available() ? avx512 : rans_avx2_available() ? avx2 : RegionKernels{};
  }
}

// Per coefficient the largest |v| over rows [0, R) of v [R, n] ; loops the compiler vectorises.
void column_amax(const std::int16_t* v, std::size_t n, std::size_t R, std::vector<int>& amax) {
  std::vector<std::int16_t> lo(n, 0), up(n, 0);
  for (std::size_t r = 0; r < R; ++r)
    for (std::size_t c = 0; c < n; ++c) {
      lo[c] = std::min(lo[c], v[r * n + c]);
      up[c] = std::max(up[c], v[r * n + c]);
    }
  amax.resize(n);
  for (std::size_t c = 0; c < n; ++c) amax[c] = std::max(-static_cast<int>(lo[c]), static_cast<int>(up[c]));
}

// One pass over a side's codes [R, n]: the hi parts (into hi, when the side has shifts; hi is null
// otherwise) and each coefficient's amax = max |hi|; throws when one is outside +-kVqMaxCode.
// simd: codec_kernels.hpp's AVX-512 pass, else the same in plain C++.
void side_hi(const VqSideCodes& s, std::size_t R, bool simd, std::int16_t* hi, std::vector<int>& amax, const char* name) {
  const std::size_t n = sz(s.n);
  amax.resize(n);
  if (simd) {
    std::vector<std::uint16_t> mx(n);
    vq_codec_detail::side_hi_avx512(s.codes.data(), hi ? s.shift.data() : nullptr, R, n, hi, mx.data());
    amax.assign(mx.begin(), mx.end());
  } else {
    // The hi parts (a variable shift per column), then per-column minima and maxima (loops the
    // compiler vectorises for any x86-64).
    if (hi)
      for (std::size_t r = 0; r < R; ++r)
        for (std::size_t c = 0; c < n; ++c) hi[r * n + c] = static_cast<std::int16_t>(s.codes[r * n + c] >> s.shift[c]);
    column_amax(hi ? hi : s.codes.data(), n, R, amax);
  }
  if (*std::max_element(amax.begin(), amax.end()) > kVqMaxCode) [[unlikely]]
    throw_hi_out_of_range(s, hi ? hi : s.codes.data(), R * n, name);
}

// The parameters' histograms count every step-th row of a side, step = max(1, rows / kHistRows)
// (so at least kHistRows rows): a long side's parameter (sigma in eighths of an octave) is found as
// well from a sample, and the histogram pass was ~18 % of an encode. On the 7B-shaped layer
// (4096 tokens, step 4) the coded bytes grow by 0.03 %; sides up to 2047 rows count every row.
constexpr std::size_t kHistRows = 1024;
std::size_t hist_row_step(std::size_t rows) { return std::max<std::size_t>(1, rows / kHistRows); }

// The best parameter and table precision of every coefficient of a side from its hi parts [R, n]
// and amax: one row-major pass for the histograms (all coefficients' in one array, coefficient
// c's centred at hoff[c]; simd: codec_kernels.hpp's AVX-512 counting).
// scale: each coefficient's table precision (vq_coef_scale_bits, version 4).
void side_models(const std::int16_t* hi, std::size_t n, std::size_t R, bool simd, const std::vector<int>& amax, std::vector<std::uint8_t>& param,
                 std::vector<int>& scale) {
  scale.resize(n);
  for (std::size_t c = 0; c < n; ++c) scale[c] = vq_coef_scale_bits(amax[c]);
  param.assign(n, 0);
  std::vector<std::int32_t> hoff(n);
  std::size_t total = 0;
  for (std::size_t c = 0; c < n; ++c) {
    hoff[c] = static_cast<std::int32_t>(total) + amax[c];
    total += sz(2 * amax[c] + 1);
  }
  std::vector<std::uint32_t> hist(total, 0);
  // Every step-th row (hist_row_step): the parameters from a sample of the rows.
  const std::size_t step = hist_row_step(R), rows = (R + step - 1) / step;
  if (simd)
    vq_codec_detail::side_hist_avx512(hi, rows, n, step * n, amax.data(), hoff.data(), hist.data());
  else
    for (std::size_t r = 0; r < R; r += step)
      for (std::size_t c = 0; c < n; ++c) ++hist[static_cast<std::size_t>(hoff[c] + hi[r * n + c])];
  for (std::size_t c = 0; c < n; ++c)
    if (amax[c] > 0) param[c] = best_param(hist.data() + hoff[c] - amax[c], amax[c], scale[c]);
}

// One (amax, param, scale) model: its table and the fast decoder's packed slot entries
// (codec_kernels.hpp; amax <= 127 only). Built on first use and kept for the process (shared by all
// calls and threads, never freed) up to kCachedModelBytes in all, so calls with one calibration's
// models (a loader decoding chunk after chunk of a layer) build no table; beyond the bound (a
// hostile header names up to 65,280 models), a call builds and owns its own. The cached models'
// packed entries lie in one arena, so a call whose models are all cached decodes from the arena
// itself (DecodePools): nothing is copied per call.
constexpr std::size_t kCachedModelBytes = std::size_t{32} << 20;
constexpr std::size_t kArenaEntries = kCachedModelBytes / 4;

// Reserved once and never freed, like the cache; the kernel backs its pages as entries are written.
std::uint32_t* model_arena() {
  static std::uint32_t* const arena = new std::uint32_t[kArenaEntries];
  return arena;
}

std::unique_ptr<Model> make_model(int a, std::uint8_t param, int scale) {
  auto md = std::make_unique<Model>();
  md->table = vq_table(a, param, scale);
  if (a <= 127) {
    const FrequencyTable& tb = md->table;
    md->packed.resize(tb.total());
    for (int s = 0; s < tb.alphabet_size(); ++s) {
      const std::uint32_t f = tb.freq(s), c = tb.cum(s);
      const std::uint32_t e0 = f | static_cast<std::uint32_t>(static_cast<std::uint8_t>(s - a)) << 24;
      for (std::uint32_t i = 0; i < f; ++i) md->packed[c + i] = e0 | i << 12;
    }
  }
  return md;
}

const Model* cached_model(int a, std::uint8_t param, int scale, std::unique_ptr<Model>& own) {
  static std::atomic<const Model*> cache[2 * (kVqMaxCode + 1) * 256];
  static std::atomic<std::size_t> bytes{0};
  auto& slot = cache[(scale == kVqScaleBits ? 0 : (kVqMaxCode + 1) * 256) + sz(a) * 256 + param];
  if (const Model* c = slot.load(std::memory_order_acquire)) return c;
  auto made = make_model(a, param, scale);
  const std::size_t b = sizeof(Model) + 8 * sz(made->table.alphabet_size()) + 4 * made->packed.size();
  if (bytes.fetch_add(b) + b > kCachedModelBytes) {
    bytes.fetch_sub(b);
    own = std::move(made);
    return own.get();
  }
  // Its entries into the arena (space a lost race below leaves unused; a full arena leaves them in
  // the model), written before the model is published.
  static std::atomic<std::size_t> arena_used{0};
  if (const std::size_t e = made->packed.size(); e > 0) {
    const std::size_t off = arena_used.fetch_add(e);
    if (off + e <= kArenaEntries) {
      std::copy(made->packed.begin(), made->packed.end(), model_arena() + off);
      made->arena_off = static_cast<std::int32_t>(off);
      std::vector<std::uint32_t>().swap(made->packed);
    }
  }
  const Model* expected = nullptr;
  if (slot.compare_exchange_strong(expected, made.get(), std::memory_order_acq_rel)) return made.release();
  bytes.fetch_sub(b);
  return expected;
}

}  // namespace vq_codec_detail

using namespace vq_codec_detail;

FrequencyTable vq_table(int amax, std::uint8_t param, int scale_bits) {
  require(scale_bits == kVqScaleBits || scale_bits == kVqSmallScaleBits, "vq_table: scale_bits {} is neither {} nor {}", scale_bits,
          kVqScaleBits, kVqSmallScaleBits);
  return FrequencyTable::from_frequencies(vq_frequencies(amax, param, scale_bits), scale_bits);
}

std::uint8_t vq_best_param(std::span<const std::uint32_t> hist, int amax) {
  require(amax >= 1 && amax <= kVqMaxCode && hist.size() == sz(2 * amax + 1),
          "vq_best_param: histogram size must be 2 * amax + 1 with amax in 1..{}", kVqMaxCode);
  return best_param(hist.data(), amax, kVqScaleBits);
}

}  // namespace vq
