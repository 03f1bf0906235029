#include "veloxquant/vq/codec.hpp"
#include "veloxquant/vq/codec_decode_into.hpp"

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
#include "codec_predict.hpp"

namespace vq {

namespace {

using entropy_detail::ByteReader;
using entropy_detail::put_varint;

std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

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

void check_side(const VqSideCodes& s, std::int64_t rows, const char* name) {
  require(s.n >= 1 && s.n <= 65536 && s.offset.size() == sz(s.n) && s.codes.size() == sz(rows) * sz(s.n) &&
              (s.shift.empty() || s.shift.size() == sz(s.n)),
          "vq_encode: {} side has inconsistent sizes (n {}, {} offsets, {} shifts, {} codes for {} rows)", name, s.n,
                      s.offset.size(), s.shift.size(), s.codes.size(), rows);
  require(std::isfinite(s.step) && s.step > 0.0f, "vq_encode: {} step must be finite and > 0", name);
  for (const auto m : s.offset)
    require(m >= -kVqMaxOffset && m <= kVqMaxOffset, "vq_encode: {} offset {} is outside +-{}", name, m, kVqMaxOffset);
  for (int c = 0; c < static_cast<int>(s.shift.size()); ++c)
    require(s.shift[sz(c)] <= kVqMaxShift, "vq_encode: {} shift {} exceeds {}", name, s.shift[sz(c)], kVqMaxShift);
}

// Called when some hi part is outside +-kVqMaxCode: finds the first for the message and throws.
[[noreturn]] void throw_hi_out_of_range(const VqSideCodes& s, const std::int16_t* hi, std::size_t count, const char* name) {
  for (std::size_t i = 0; i < count; ++i) {
    const int c = static_cast<int>(i % sz(s.n)), shift = s.shift.empty() ? 0 : s.shift[sz(c)];
    require(std::abs(hi[i]) <= kVqMaxCode, "vq_encode: {} code {} of coefficient {} is outside -{}..{} (shift {})", name,
            s.codes[i], c, kVqMaxCode << shift, ((kVqMaxCode + 1) << shift) - 1, shift);
  }
  throw_invalid_argument(fmt::format("vq_encode: {} has a code outside the range", name));  // not reached
}

// A nibble per coefficient (the shifts; version 5's predictors, vq_pred_nibble), the cheaper of two
// layouts (most sides have none or a few that are not 0):
//   u8 0                       all 0
//   u8 1, varint k, k x (varint gap, u8 value)   sparse: the values that are not 0, gap = index - previous index - 1
//   u8 2, ceil(n / 2) bytes    dense nibbles, coefficient 2i in the low nibble of byte i
// v: n values (or empty: all 0).
void write_nibbles(std::vector<std::uint8_t>& out, const std::vector<std::uint8_t>& v, int n) {
  std::vector<std::uint8_t> sparse;
  std::size_t k = 0;
  int prev = -1;
  for (int c = 0; c < static_cast<int>(v.size()); ++c) {
    if (v[sz(c)] == 0) continue;
    put_varint(sparse, static_cast<std::uint64_t>(c - prev - 1));
    sparse.push_back(v[sz(c)]);
    prev = c;
    ++k;
  }
  if (k == 0) {
    out.push_back(0);
    return;
  }
  std::vector<std::uint8_t> head;
  put_varint(head, k);
  if (head.size() + sparse.size() <= sz(n + 1) / 2) {
    out.push_back(1);
    out.insert(out.end(), head.begin(), head.end());
    out.insert(out.end(), sparse.begin(), sparse.end());
    return;
  }
  out.push_back(2);
  for (int c = 0; c < n; c += 2) out.push_back(static_cast<std::uint8_t>(v[sz(c)] | (c + 1 < n ? v[sz(c + 1)] << 4 : 0)));
}

// The n nibbles write_nibbles wrote, each <= max (what: the field, for messages).
std::vector<std::uint8_t> read_nibbles(ByteReader& r, int n, int max, const char* what) {
  std::vector<std::uint8_t> v(sz(n), 0);
  const std::uint8_t layout = r.u8();
  if (layout == 0) return v;
  if (layout == 1) {
    const std::uint64_t k = r.varint(static_cast<std::uint64_t>(n), what);
    std::uint64_t at = 0;
    for (std::uint64_t i = 0; i < k; ++i) {
      at += r.varint(static_cast<std::uint64_t>(n), what);
      if (at >= static_cast<std::uint64_t>(n)) r.fail(fmt::format("{} index past the last coefficient", what));
      const std::uint8_t x = r.u8();
      if (x == 0 || x > max) r.fail(fmt::format("sparse {} {} outside 1..{}", what, x, max));
      v[at++] = x;
    }
    return v;
  }
  if (layout != 2) r.fail(fmt::format("unknown {} layout", what));
  for (int c = 0; c < n; c += 2) {
    const std::uint8_t b = r.u8();
    if ((b & 0xf) > max || (b >> 4) > max || (c + 1 == n && (b >> 4) != 0)) r.fail(fmt::format("bad dense {}", what));
    v[sz(c)] = b & 0xf;
    if (c + 1 < n) v[sz(c + 1)] = static_cast<std::uint8_t>(b >> 4);
  }
  return v;
}

// Version 5's row copies of a side (codec_predict.hpp): u8 0 (none); or u8 1, varint k, k x (varint
// gap, varint d - 1): the copied rows in order (gap = row - previous copied row - 1), each the copy of
// row - d (d >= 1).
void write_copies(std::vector<std::uint8_t>& out, const std::vector<std::int32_t>& from) {
  std::size_t k = 0;
  for (const auto f : from) k += f >= 0;
  if (k == 0) {
    out.push_back(0);
    return;
  }
  out.push_back(1);
  put_varint(out, k);
  std::int64_t prev = -1;
  for (std::size_t r = 0; r < from.size(); ++r) {
    if (from[r] < 0) continue;
    put_varint(out, static_cast<std::uint64_t>(static_cast<std::int64_t>(r) - prev - 1));
    put_varint(out, r - static_cast<std::size_t>(from[r]) - 1);
    prev = static_cast<std::int64_t>(r);
  }
}

// Per row -1 or the row it copies; empty when none. Each copied row < rows, each source < its row.
std::vector<std::int32_t> read_copies(ByteReader& r, std::uint64_t rows) {
  const std::uint8_t layout = r.u8();
  if (layout == 0) return {};
  if (layout != 1) r.fail("unknown row copy layout");
  const std::uint64_t k = r.varint(rows, "row copy count");
  std::vector<std::int32_t> from(sz(static_cast<std::int64_t>(rows)), -1);
  std::uint64_t at = 0;
  for (std::uint64_t i = 0; i < k; ++i) {
    at += r.varint(rows, "row copy gap");
    if (at >= rows) r.fail("row copy past the last row");
    const std::uint64_t d = r.varint(rows, "row copy distance") + 1;
    if (d > at) r.fail("row copy before the first row");
    from[sz(static_cast<std::int64_t>(at))] = static_cast<std::int32_t>(at - d);
    ++at;
  }
  return from;
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

// The region kernels of a call (codec_kernels.hpp): null for the scalar reference.
struct RegionKernels {
  decltype(&vq_codec_detail::decode_region_avx2) decode = nullptr;
  decltype(&vq_codec_detail::encode_region_avx2) encode = nullptr;
  bool fast() const { return decode != nullptr; }
};

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

bool has_shifts(const VqSideCodes& s) {
  return std::any_of(s.shift.begin(), s.shift.end(), [](std::uint8_t v) { return v != 0; });
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

struct Model {
  FrequencyTable table;
  std::vector<std::uint32_t> packed;  // the entries while the model is being built, or of a model a call owns
  std::int32_t arena_off = -1;        // a cached model's entries: model_arena() from here on
  const std::uint32_t* entries() const { return arena_off >= 0 ? model_arena() + arena_off : packed.data(); }
};

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

// The distinct (amax, param, scale) models of one encode or decode call.
struct CallTables {
  std::vector<const FrequencyTable*> tables;
  std::vector<const Model*> models;
  std::vector<int> amax;
  std::vector<std::unique_ptr<Model>> own;
  int get(int a, std::uint8_t param, int scale) {
    const std::uint32_t key = static_cast<std::uint32_t>(scale) << 16 | static_cast<std::uint32_t>(a) << 8 | param;
    if (tables.size() * 2 >= keys_.size()) grow();
    std::size_t i = slot(key);
    while (keys_[i] != key && keys_[i] != kFree) i = (i + 1) & (keys_.size() - 1);
    if (keys_[i] == key) return vals_[i];
    keys_[i] = key;
    vals_[i] = static_cast<int>(tables.size());
    std::unique_ptr<Model> mine;
    const Model* md = cached_model(a, param, scale, mine);
    if (mine) own.push_back(std::move(mine));
    models.push_back(md);
    tables.push_back(&md->table);
    amax.push_back(a);
    return vals_[i];
  }

 private:
  // Key -> table index, open addressing (a call looks up one key per coefficient and side, ~2,000;
  // a node-based map made those lookups most of the decoder's SideModel::derive).
  static constexpr std::uint32_t kFree = ~0u;  // no key: scale < 2^15
  std::vector<std::uint32_t> keys_;
  std::vector<int> vals_;
  std::size_t slot(std::uint32_t key) const { return (key * 0x9E3779B1u) >> 7 & (keys_.size() - 1); }
  void grow() {
    std::vector<std::uint32_t> old_keys(std::max<std::size_t>(256, keys_.size() * 2), kFree);
    std::vector<int> old_vals(old_keys.size());
    old_keys.swap(keys_);
    old_vals.swap(vals_);
    for (std::size_t j = 0; j < old_keys.size(); ++j) {
      if (old_keys[j] == kFree) continue;
      std::size_t i = slot(old_keys[j]);
      while (keys_[i] != kFree) i = (i + 1) & (keys_.size() - 1);
      keys_[i] = old_keys[j];
      vals_[i] = old_vals[j];
    }
  }
};

// What the header says of a side: per coefficient amax and param.
struct SideModel {
  std::vector<int> amax;
  std::vector<std::uint8_t> param;
  // Per coefficient its table's precision: vq_coef_scale_bits (version 4), the side's
  // vq_side_scale_bits (version 3), 12 (versions 1 and 2).
  std::vector<int> scale;
  // Version 5: per coefficient its predictor across tokens (codec_predict.hpp); empty when every
  // k_c = 0 (versions 1-4, or no coefficient predicted).
  std::vector<std::int8_t> pred;
  // Version 5: per row -1 or the earlier row it copies (not coded); empty when none. coded_rows:
  // the rows the region holds (those not copied).
  std::vector<std::int32_t> copy_from;
  std::size_t coded_rows = 0;
  // Derived: the coded columns (amax > 0) in order, their call table, amax and scale; the split columns.
  std::vector<int> cols, table, col_amax, col_scale, low_cols;
  void derive(const VqSideCodes& s, CallTables& t) {
    for (int c = 0; c < s.n; ++c) {
      if (amax[sz(c)] > 0) {
        cols.push_back(c);
        table.push_back(t.get(amax[sz(c)], param[sz(c)], scale[sz(c)]));
        col_amax.push_back(amax[sz(c)]);
        col_scale.push_back(scale[sz(c)]);
      }
      if (!s.shift.empty() && s.shift[sz(c)] > 0) low_cols.push_back(c);
    }
  }
  std::size_t m() const { return cols.size(); }
};

// Per-column offsets for j = 0 .. m + 63 (codec_kernels.hpp), from each column's value.
std::vector<std::int32_t> wrapped(const std::vector<std::int32_t>& per_col) {
  std::vector<std::int32_t> w(per_col.size() + 64);
  for (std::size_t j = 0; j < w.size(); ++j) w[j] = per_col[j % per_col.size()];
  return w;
}

// RegionTables::uniform_scale of a region's columns' precisions (m >= 1).
int uniform_scale(const std::vector<int>& col_scale) {
  return std::all_of(col_scale.begin(), col_scale.end(), [&](int v) { return v == col_scale[0]; }) ? col_scale[0] : 0;
}

constexpr std::uint32_t kL = rans_detail::kL;
constexpr std::uint32_t kField = (1u << 12) - 1;  // the packed decoder entry's freq and bias fields

// The reference encoder step (rans.cpp's encode_scalar): x' = (x / f) * M + x % f + c.
inline void enc_put(std::uint32_t& x, std::uint32_t f, std::uint32_t c, int s, std::uint16_t*& ptr) {
  if (x >= (f << (31 - s))) {
    *--ptr = static_cast<std::uint16_t>(x);
    x >>= 16;
  }
  x = ((x / f) << s) + x % f + c;
}

inline void refill(std::uint32_t& x, const std::uint8_t*& p, const std::uint8_t* end) {
  if (x < kL) {
    if (end - p < 2) rans_detail::throw_truncated();
    x = x << 16 | static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8;
    p += 2;
  }
}

// The scalar reference over region symbols [i0, i1), backwards.
std::uint16_t* encode_region_scalar(std::uint32_t* x, const std::int16_t* hi, std::size_t i0, std::size_t i1, std::size_t base,
                                    std::size_t lanes, const SideModel& sm, const CallTables& t, std::uint16_t* ptr) {
  if (i1 <= i0) return ptr;
  const std::size_t m = sm.m();
  std::size_t j = (i1 - 1) % m;
  for (std::size_t i = i1; i-- > i0;) {
    const FrequencyTable& tb = *t.tables[sz(sm.table[j])];
    const int sym = hi[i] + sm.col_amax[j];
    enc_put(x[(base + i) & (lanes - 1)], tb.freq(sym), tb.cum(sym), sm.col_scale[j], ptr);
    j = j == 0 ? m - 1 : j - 1;
  }
  return ptr;
}

// Decoder slot tables of a call: sym[table << 12 | slot] (scalar reference) or the packed entries
// of codec_kernels.hpp (fast kernel; tables with amax <= 127 only), 2^scale entries a table from
// packed_off[table] on. Up to 16 KiB a table, so only up to
// kMaxPoolTables distinct tables (a hostile header names up to 65,280): beyond, the reference
// finds each symbol by a binary search over the cumulative frequencies instead.
constexpr std::size_t kMaxPoolTables = 1024;
struct DecodePools {
  std::vector<std::uint16_t> sym;
  std::vector<std::uint32_t> packed;
  std::vector<std::int32_t> packed_off;
  const std::uint32_t* pool = nullptr;  // the fast kernel's entries (packed_off into it): the model arena, or `packed`
  void build(const CallTables& t, bool fast) {
    if (t.tables.size() > kMaxPoolTables) return;
    const std::size_t M = sz(1) << kVqScaleBits;
    if (fast) {  // a table with amax > 127 has no entries (its side decodes with the reference)
      bool in_arena = true;
      for (std::size_t k = 0; k < t.models.size(); ++k) in_arena = in_arena && (t.amax[k] > 127 || t.models[k]->arena_off >= 0);
      if (in_arena) {  // every model cached: decode from the arena
        for (std::size_t k = 0; k < t.models.size(); ++k) packed_off.push_back(t.amax[k] > 127 ? 0 : t.models[k]->arena_off);
        pool = model_arena();
        return;
      }
      // A model of the call's own: every model's entries one after the other.
      std::size_t total = 0;
      for (const FrequencyTable* tb : t.tables) {
        packed_off.push_back(static_cast<std::int32_t>(total));
        total += tb->total();
      }
      packed.resize(total);
      for (std::size_t k = 0; k < t.tables.size(); ++k)
        if (t.amax[k] <= 127) std::copy_n(t.models[k]->entries(), t.tables[k]->total(), packed.begin() + packed_off[k]);
      pool = packed.data();
      return;
    }
    sym.resize(t.tables.size() * M);
    for (std::size_t k = 0; k < t.tables.size(); ++k) {
      const FrequencyTable& tb = *t.tables[k];
      for (int s = 0; s < tb.alphabet_size(); ++s) std::fill_n(sym.data() + k * M + tb.cum(s), tb.freq(s), static_cast<std::uint16_t>(s));
    }
  }
};

// The symbol whose range holds slot: the last s with cum(s) <= slot.
int find_symbol(const FrequencyTable& t, std::uint32_t slot) {
  int lo = 0, hi = t.alphabet_size() - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.cum(mid) <= slot)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// The scalar reference over region symbols [i0, i1) into hi (codes); sym: DecodePools::sym, or
// null (search).
const std::uint8_t* decode_region_scalar(std::uint32_t* x, std::int16_t* hi, std::size_t i0, std::size_t i1, std::size_t base,
                                         std::size_t lanes, const SideModel& sm, const CallTables& t, const std::uint16_t* sym, const std::uint8_t* p,
                                         const std::uint8_t* end) {
  if (i1 <= i0) return p;
  const std::size_t m = sm.m();
  std::size_t j = i0 % m;
  for (std::size_t i = i0; i < i1; ++i) {
    const std::size_t k = sz(sm.table[j]);
    const FrequencyTable& tb = *t.tables[k];
    std::uint32_t& xi = x[(base + i) & (lanes - 1)];
    const std::uint32_t slot = xi & (tb.total() - 1);
    const int s = sym ? sym[(k << kVqScaleBits) + slot] : find_symbol(tb, slot);
    xi = tb.freq(s) * (xi >> tb.scale_bits()) + slot - tb.cum(s);
    refill(xi, p, end);
    hi[i] = static_cast<std::int16_t>(s - sm.col_amax[j]);
    if (++j == m) j = 0;
  }
  return p;
}

// The fast kernel's scalar steps (heads and tails of a region), from the packed entries.
const std::uint8_t* decode_region_packed(std::uint32_t* x, std::int16_t* hi, std::size_t i0, std::size_t i1, std::size_t base,
                                         const vq_codec_detail::RegionTables& rt, const std::uint8_t* p, const std::uint8_t* end) {
  if (i1 <= i0) return p;
  std::size_t j = i0 % rt.m;
  for (std::size_t i = i0; i < i1; ++i) {
    std::uint32_t& xi = x[(base + i) & (rt.lanes - 1)];
    const int scale = rt.col_scale[j];
    const std::uint32_t e = rt.dec_pool[sz(rt.dec_off[j]) + (xi & ((1u << scale) - 1))];
    xi = (e & kField) * (xi >> scale) + ((e >> 12) & kField);
    refill(xi, p, end);
    hi[i] = static_cast<std::int16_t>(static_cast<std::int32_t>(e) >> 24);
    if (++j == rt.m) j = 0;
  }
  return p;
}

// A buffer of `count` codes: `keep` (a thread's, grown as needed and kept for the next call up to
// 4 Mi codes, 8 MiB: a 7B-shaped side of 4096 tokens) or, beyond, a fresh one owned by temp. The
// encoder's big buffers were allocated and page-faulted afresh in every call (~10 % of an encode).
struct KeptCodes {
  std::unique_ptr<std::int16_t[]> buf;
  std::size_t size = 0;
};
std::int16_t* scratch_codes(KeptCodes& keep, std::size_t count, std::unique_ptr<std::int16_t[]>& temp) {
  if (count <= keep.size) return keep.buf.get();
  if (count <= (sz(1) << 22)) {
    keep.buf.reset(new std::int16_t[count]);
    keep.size = count;
    return keep.buf.get();
  }
  temp.reset(new std::int16_t[count]);
  return temp.get();
}

// Scratch for the encoder's words, kept per thread up to 16 MiB (as rans.cpp's).
std::uint16_t* encode_scratch(std::size_t need, std::unique_ptr<std::uint16_t[]>& temp) {
  thread_local std::unique_ptr<std::uint16_t[]> keep;
  thread_local std::size_t kept = 0;
  if (need <= kept) return keep.get();
  if (need <= (sz(1) << 23)) {
    keep.reset(new std::uint16_t[need]);
    kept = need;
    return keep.get();
  }
  temp.reset(new std::uint16_t[need]);
  return temp.get();
}

// The parsed header of a layer (any version): shape, sides' quantizer and models.
struct ParsedHeader {
  VqLayerCodes lc;
  std::uint64_t rows = 0;
  SideModel k, v;
};

ParsedHeader parse_header(ByteReader& r, int version, std::uint64_t max_codes, CallTables& t) {
  ParsedHeader h;
  VqLayerCodes& lc = h.lc;
  lc.batch = static_cast<std::int64_t>(r.varint(1u << 20, "batch"));
  lc.tokens = static_cast<std::int64_t>(r.varint(1u << 30, "tokens"));
  lc.k.n = static_cast<int>(r.varint(65536, "n_k"));
  lc.v.n = static_cast<int>(r.varint(65536, "n_v"));
  if (lc.k.n == 0 || lc.v.n == 0) r.fail("a side has no coefficients");
  h.rows = static_cast<std::uint64_t>(lc.batch) * static_cast<std::uint64_t>(lc.tokens);
  if (h.rows > max_codes / static_cast<std::uint64_t>(lc.k.n + lc.v.n))
    r.fail(fmt::format("{} rows of {} coefficients exceed the expected {} codes", h.rows, lc.k.n + lc.v.n, max_codes));
  for (auto [s, sm] : {std::pair{&lc.k, &h.k}, std::pair{&lc.v, &h.v}}) {
    const std::uint32_t step_bits = r.u32le();
    std::memcpy(&s->step, &step_bits, 4);
    if (!std::isfinite(s->step) || s->step <= 0.0f) r.fail("step is not a finite positive float32");
    s->shift = read_nibbles(r, s->n, kVqMaxShift, "shift");
    if (version >= 5) {
      const auto nib = read_nibbles(r, s->n, 15, "predictor");
      if (std::any_of(nib.begin(), nib.end(), [](std::uint8_t v) { return v != 0; }))
        for (const std::uint8_t v : nib) sm->pred.push_back(static_cast<std::int8_t>(vq_codec_detail::vq_pred_from_nibble(v)));
      sm->copy_from = read_copies(r, h.rows);
    }
    sm->coded_rows = sz(static_cast<std::int64_t>(h.rows));
    for (const auto f : sm->copy_from) sm->coded_rows -= f >= 0;
    s->offset.resize(sz(s->n));
    sm->amax.assign(sz(s->n), 0);
    sm->param.assign(sz(s->n), 0);
    for (int c = 0; c < s->n; ++c) {
      const std::uint64_t z = r.varint(2 * static_cast<std::uint64_t>(kVqMaxOffset), "offset");
      s->offset[sz(c)] = (z & 1) ? -static_cast<std::int32_t>((z + 1) / 2) : static_cast<std::int32_t>(z / 2);
      sm->amax[sz(c)] = static_cast<int>(r.varint(kVqMaxCode, "amax"));
      if (sm->amax[sz(c)] > 0) sm->param[sz(c)] = r.u8();
    }
    const int side_scale = version == 3 ? vq_side_scale_bits(*std::max_element(sm->amax.begin(), sm->amax.end())) : kVqScaleBits;
    sm->scale.resize(sz(s->n));
    for (int c = 0; c < s->n; ++c) sm->scale[sz(c)] = version >= 4 ? vq_coef_scale_bits(sm->amax[sz(c)]) : side_scale;
    sm->derive(*s, t);
  }
  return h;
}

// Version 1: one rANS segment per coded column (hi parts), each followed by its low parts.
void decode_v1(ByteReader& r, ParsedHeader& h, const CallTables& t, RansKernel kernel) {
  const std::uint64_t rows = h.rows;
  std::vector<FrequencyTable> lows;
  lows.reserve(sz(h.lc.k.n + h.lc.v.n));
  struct Coded {
    VqSideCodes* side;
    int c, amax, shift;
    bool low;  // the segment of the low parts (else of the hi parts)
  };
  std::vector<Coded> coded;  // per segment
  std::vector<const FrequencyTable*> seg_table;
  for (auto [s, sm] : {std::pair{&h.lc.k, &h.k}, std::pair{&h.lc.v, &h.v}}) {
    for (int c = 0; c < s->n; ++c) {
      const int shift = s->shift[sz(c)], amax = sm->amax[sz(c)];
      if (amax > 0) {
        const auto j = static_cast<std::size_t>(std::lower_bound(sm->cols.begin(), sm->cols.end(), c) - sm->cols.begin());
        seg_table.push_back(t.tables[sz(sm->table[j])]);
        coded.push_back({s, c, amax, shift, false});
      }
      if (shift > 0) {
        lows.push_back(low_table(shift));
        seg_table.push_back(&lows.back());
        coded.push_back({s, c, amax, shift, true});
      }
    }
    s->codes.assign(sz(static_cast<std::int64_t>(rows)) * sz(s->n), 0);
  }
  std::vector<std::uint16_t> symbols(coded.size() * rows);
  std::vector<RansDecodeSegment> segments;
  for (std::size_t i = 0; i < coded.size(); ++i) segments.push_back({std::span<std::uint16_t>(symbols).subspan(i * rows, rows), seg_table[i]});
  rans_decode(r.rest(), segments, kernel);  // FormatError on a corrupt, short or long payload
  // q = hi * 2^shift + low; hi segments come before their low segments, so hi is placed first.
  for (std::size_t i = 0; i < coded.size(); ++i) {
    const Coded& k = coded[i];
    for (std::uint64_t row = 0; row < rows; ++row) {
      std::int16_t& q = k.side->codes[row * sz(k.side->n) + sz(k.c)];
      const int sym = symbols[i * rows + row];
      q = static_cast<std::int16_t>(k.low ? q + sym : (sym - k.amax) * (1 << k.shift));
    }
  }
}

// The decoder of one side's region (stream symbols base .. base + coded_rows * m): the lane states,
// the word pointer, and how symbols are decoded (the fast kernel and its packed tables, or the
// scalar reference with sym, DecodePools::sym or null).
struct SideDecoder {
  std::uint32_t* x;
  const SideModel& sm;
  const CallTables& t;
  const std::uint16_t* sym;
  decltype(&vq_codec_detail::decode_region_avx2) kernel;  // null: the scalar reference
  vq_codec_detail::RegionTables rt;
  std::size_t base;
  std::size_t lanes;  // the stream's lanes (32 or 64)
  const std::uint8_t* p;
  const std::uint8_t* end;
  // Region symbols [i0, i1) into out[i - sbase] (sbase % m == 0, so columns follow from out's index).
  void decode(std::int16_t* out, std::size_t i0, std::size_t i1, std::size_t sbase) {
    const std::size_t b = base + sbase;
    std::size_t i = i0 - sbase;
    const std::size_t n = i1 - sbase;
    if (!kernel) {
      p = decode_region_scalar(x, out, i, n, b, lanes, sm, t, sym, p, end);
      return;
    }
    // Whole groups (one symbol per lane) from a stream index divisible by the lanes; the head and
    // the rest one by one.
    const std::size_t head = std::min(n, i + (lanes - (b + i) % lanes) % lanes);
    p = decode_region_packed(x, out, i, head, b, rt, p, end);
    i = head;
    if (n > i) p = kernel(x, out, i, n, i % rt.m, rt, p, end);
    p = decode_region_packed(x, out, i, n, b, rt, p, end);
  }
};

// Region symbols a chunk decodes into the decoder's scratch: 16 KiB of codes (L1), then each row
// is finished into the side's codes.
constexpr std::size_t kDecodeChunk = 8192;

// Decodes a side's region and writes its hi parts into s.codes [rows, n] (every entry): the region's
// rows are decoded a chunk at a time into a small scratch buffer and each row finished from there
// (its coded columns placed, the uncoded ones 0; version 5's prediction undone from the finished
// previous token; copied rows copied), so the codes are written once and never zero-filled. A side
// coded as it is (every column, no prediction, no copies) is decoded straight into s.codes; a
// predicted one with every column coded and no copies, with the AVX-512 kernel, too (the kernel
// finishes each group as it stores it: codec_kernels.hpp's PredictRows).
// False when a rebuilt hi part leaves +-kVqMaxCode (a corrupt stream); FormatError from the rANS steps.
bool decode_side_hi(SideDecoder& d, VqSideCodes& s, std::size_t batch, std::size_t tokens, int simd) {
  const SideModel& sm = d.sm;
  const std::size_t m = sm.m(), n = sz(s.n), R = batch * tokens, N = sm.coded_rows * m;
  if (m == n && sm.pred.empty() && sm.copy_from.empty()) {
    if (N > 0) d.decode(s.codes.data(), 0, N, 0);
    return true;
  }
  std::vector<std::int16_t> k16(n, 0);
  for (std::size_t c = 0; c < sm.pred.size(); ++c) k16[c] = sm.pred[c];
  const bool predicted = !sm.pred.empty();
  // Predicted, every column coded, no copies, rows of whole groups: the AVX-512 kernel finishes each
  // group as it stores it (codec_kernels.hpp's PredictRows); what it leaves is decoded by the
  // reference steps into place and finished row by row.
  if (m == n && predicted && sm.copy_from.empty() && d.kernel == &vq_codec_detail::decode_region_avx512 && n % d.lanes == 0 &&
      d.base % d.lanes == 0 && N > 0) {
    const std::vector<std::int16_t> zero(n, 0);
    vq_codec_detail::PredictRows pr{k16.data(), zero.data(), n, tokens, false};
    std::int16_t* const codes = s.codes.data();
    std::size_t i = 0;
    d.p = vq_codec_detail::decode_region_pred_avx512(d.x, codes, i, N, d.rt, pr, d.p, d.end);
    if (pr.bad) return false;
    const std::size_t done = i;
    d.p = decode_region_packed(d.x, codes, i, N, d.base, d.rt, d.p, d.end);
    for (std::size_t row = done / n; row < R; ++row) {
      const std::size_t c0 = row == done / n ? done % n : 0;
      std::int16_t* out = codes + row * n;
      const std::int16_t* prev = row % tokens != 0 ? out - n + c0 : nullptr;
      if (!vq_codec_detail::vq_unpredict_row(out + c0, out + c0, prev, k16.data() + c0, n - c0, kVqMaxCode, simd)) return false;
    }
    return true;
  }
  std::vector<std::int16_t> wide(m == n ? 0 : n, 0);  // a coded row with its uncoded columns (0)
  std::int16_t* const codes = s.codes.data();
  std::size_t row = 0;  // the next row of the side to finish
  // Finishes rows up to and including the next coded one (res: its m region codes); copied rows
  // before it are copies of earlier finished rows.
  auto finish = [&](const std::int16_t* res) {
    for (; !sm.copy_from.empty() && sm.copy_from[row] >= 0; ++row)
      std::memcpy(codes + row * n, codes + sz(sm.copy_from[row]) * n, 2 * n);
    std::int16_t* out = codes + row * n;
    if (m != n) {
      for (std::size_t j = 0; j < m; ++j) wide[sz(sm.cols[j])] = res[j];
      res = wide.data();
    }
    const std::int16_t* prev = predicted && row % tokens != 0 ? out - n : nullptr;
    ++row;
    return vq_codec_detail::vq_unpredict_row(out, res, prev, k16.data(), n, kVqMaxCode, simd);
  };
  if (m == 0) {
    for (std::size_t k = 0; k < sm.coded_rows; ++k)
      if (!finish(wide.data())) return false;
  } else {
    // Chunks end at stream indices divisible by the lanes (whole groups for the kernel); the scratch
    // holds a partial row carried over plus one chunk.
    std::vector<std::int16_t> scratch(m + kDecodeChunk + 64);
    std::size_t i = 0, sbase = 0;  // next region symbol; region index of scratch[0] (a row start)
    while (i < N) {
      const std::size_t goal = (d.base + i + kDecodeChunk) / d.lanes * d.lanes - d.base;
      const std::size_t i1 = std::min(N, goal);
      d.decode(scratch.data(), i, i1, sbase);
      i = i1;
      const std::size_t full = i / m;  // coded rows complete
      for (std::size_t k = sbase / m; k < full; ++k)
        if (!finish(scratch.data() + (k * m - sbase))) return false;
      const std::size_t carry = i - full * m;
      if (carry) std::memmove(scratch.data(), scratch.data() + (full * m - sbase), 2 * carry);
      sbase = full * m;
    }
  }
  for (; row < R; ++row) std::memcpy(codes + row * n, codes + sz(sm.copy_from[row]) * n, 2 * n);  // trailing copies
  return true;
}

}  // namespace

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

std::vector<std::uint8_t> vq_encode(const VqLayerCodes& lc, RansKernel kernel) {
  const RegionKernels kern = region_kernels(kernel);
  const bool fast = kern.fast();
  const bool simd_prep = kern.encode == &vq_codec_detail::encode_region_avx512;  // the AVX-512 side pass
  require(lc.batch >= 0 && lc.tokens >= 0, "vq_encode: negative batch or token count");
  const std::int64_t rows = lc.rows();
  check_side(lc.k, rows, "K");
  check_side(lc.v, rows, "V");
  const std::size_t R = sz(rows);
  std::vector<std::uint8_t> out;
  out.push_back(6);
  put_varint(out, static_cast<std::uint64_t>(lc.batch));
  put_varint(out, static_cast<std::uint64_t>(lc.tokens));
  put_varint(out, static_cast<std::uint64_t>(lc.k.n));
  put_varint(out, static_cast<std::uint64_t>(lc.v.n));
  CallTables tables;
  struct Side {
    const VqSideCodes* s;
    SideModel sm;
    std::unique_ptr<std::int16_t[]> hi_buf;  // the region's codes when not in a kept buffer (scratch_codes)
    const std::int16_t* hi = nullptr;
    std::vector<std::uint16_t> lows;  // [row][low column]
    std::size_t base = 0;             // stream index of the region's first symbol
  };
  Side sides[2] = {{&lc.k, {}, {}, nullptr, {}, 0}, {&lc.v, {}, {}, nullptr, {}, 0}};
  // Per thread: each side's region (residuals) and the hi parts of a split side.
  thread_local KeptCodes kept_codes[3];
  std::size_t n_total = 0;
  for (Side& sd : sides) {
    const VqSideCodes& s = *sd.s;
    const std::size_t n = sz(s.n);
    const bool shifted = has_shifts(s);
    // The hi parts: the codes themselves, or floor(q / 2^shift) column by column, with the range
    // check in the same pass (every entry written: no zero fill).
    std::unique_ptr<std::int16_t[]> his_temp;
    std::int16_t* const his_buf = shifted ? scratch_codes(kept_codes[2], R * n, his_temp) : nullptr;
    const std::int16_t* his = shifted ? his_buf : s.codes.data();
    std::vector<int> hi_amax;
    side_hi(s, R, simd_prep, his_buf, hi_amax, sd.s == &lc.k ? "K" : "V");
    // Version 5: the region codes each hi part's residual from the previous token's, and not at all
    // the rows that repeat an earlier one (codec_predict.hpp).
    std::int16_t* const res = scratch_codes(kept_codes[&sd - sides], R * n, sd.hi_buf);
    std::vector<int> res_amax;
    const auto pred = vq_codec_detail::vq_predict(his, res, n, sz(lc.batch), sz(lc.tokens), kVqMaxCode, &res_amax);
    std::vector<std::uint8_t> pred_nibbles(n);
    bool predicted = false;
    for (std::size_t c = 0; c < n; ++c) {
      pred_nibbles[c] = vq_codec_detail::vq_pred_nibble(pred[c]);
      predicted |= pred[c] != 0;
    }
    const auto copy_from = vq_codec_detail::vq_find_copies(his, n, R);
    std::size_t rc = 0;  // coded rows, compacted in place
    for (std::size_t r = 0; r < R; ++r)
      if (copy_from[r] < 0) {
        if (rc != r) std::copy_n(res + r * n, n, res + rc * n);
        ++rc;
      }
    sd.sm.coded_rows = rc;
    his = res;
    std::uint32_t step_bits;
    std::memcpy(&step_bits, &s.step, 4);
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::uint8_t>(step_bits >> (8 * i)));
    write_nibbles(out, s.shift, s.n);
    write_nibbles(out, pred_nibbles, s.n);
    write_copies(out, copy_from);
    // amax of what the region codes: the hi parts' when they are coded as they are, else the residuals'.
    // (vq_predict's residual amax covers every row: right when no row is left out.)
    if (!predicted && rc == R)
      sd.sm.amax = std::move(hi_amax);
    else if (rc == R)
      sd.sm.amax = std::move(res_amax);
    else
      column_amax(his, n, rc, sd.sm.amax);
    side_models(his, n, rc, simd_prep, sd.sm.amax, sd.sm.param, sd.sm.scale);
    for (int c = 0; c < s.n; ++c) {
      const std::int64_t off = s.offset[sz(c)];
      put_varint(out, off < 0 ? static_cast<std::uint64_t>(-2 * off - 1) : static_cast<std::uint64_t>(2 * off));  // zigzag
      put_varint(out, static_cast<std::uint64_t>(sd.sm.amax[sz(c)]));
      if (sd.sm.amax[sz(c)] > 0) out.push_back(sd.sm.param[sz(c)]);
    }
    sd.sm.derive(s, tables);
    const std::size_t m = sd.sm.m();
    // The region: the coded columns of the coded rows, compacted in place (entry r m + j comes from
    // r n + cols[j] >= it).
    if (m != n)
      for (std::size_t r = 0; r < rc; ++r)
        for (std::size_t j = 0; j < m; ++j) res[r * m + j] = res[r * n + sz(sd.sm.cols[j])];
    sd.hi = res;
    // The low parts [row][low column], row by row (one pass over the codes).
    const std::size_t L = sd.sm.low_cols.size();
    sd.lows.resize(L * R);
    for (std::size_t r = 0; r < R && L; ++r)
      for (std::size_t k = 0; k < L; ++k) {
        const std::size_t c = sz(sd.sm.low_cols[k]);
        sd.lows[r * L + k] = static_cast<std::uint16_t>(s.codes[r * n + c] & ((1 << s.shift[c]) - 1));
      }
    sd.base = n_total;
    n_total += rc * m + sd.lows.size();
  }
  // The fast kernel's encoder constants: every table's symbols in one pool.
  std::vector<std::uint64_t> enc_pool;
  std::vector<std::int32_t> tbase;
  if (fast) {
    for (const FrequencyTable* tb : tables.tables) {
      tbase.push_back(static_cast<std::int32_t>(enc_pool.size()));
      for (int s = 0; s < tb->alphabet_size(); ++s)
        enc_pool.push_back(rans_detail::pack_enc(rans_detail::make_enc_sym(tb->freq(s), tb->cum(s), tb->scale_bits())));
    }
  }
  std::unique_ptr<std::uint16_t[]> temp;
  const std::size_t need = n_total + rans_detail::kEncodeSlackWords;
  std::uint16_t* const buf = encode_scratch(need, temp);
  std::uint16_t* const end = buf + need;
  std::uint16_t* ptr = end;
  const std::size_t lanes = vq_codec_detail::vq_stream_lanes(6, n_total);
  std::uint32_t x[vq_codec_detail::kVqLanes];
  for (auto& v : x) v = kL;
  for (int k = 1; k >= 0; --k) {  // backwards: V, then K; within a side the low parts, then the region
    const Side& sd = sides[k];
    const std::size_t m = sd.sm.m(), N = sd.sm.coded_rows * m, lbase = sd.base + N, L = sd.sm.low_cols.size();
    for (std::size_t l = L; l-- > 0;) {
      const int shift = sd.s->shift[sz(sd.sm.low_cols[l])];
      for (std::size_t r = R; r-- > 0;) enc_put(x[(lbase + l * R + r) & (lanes - 1)], 1, sd.lows[r * L + l], shift, ptr);
    }
    if (N == 0) continue;
    if (!fast) {
      ptr = encode_region_scalar(x, sd.hi, 0, N, sd.base, lanes, sd.sm, tables, ptr);
      continue;
    }
    std::vector<std::int32_t> per_col(m);
    for (std::size_t j = 0; j < m; ++j) per_col[j] = tbase[sz(sd.sm.table[j])] + sd.sm.col_amax[j];
    const auto enc_off = wrapped(per_col), col_scale = wrapped(std::vector<std::int32_t>(sd.sm.col_scale.begin(), sd.sm.col_scale.end()));
    vq_codec_detail::RegionTables rt;
    rt.m = m;
    rt.lanes = lanes;
    rt.col_scale = col_scale.data();
    rt.uniform_scale = uniform_scale(sd.sm.col_scale);
    rt.enc_off = enc_off.data();
    rt.enc_pool = enc_pool.data();
    // Whole groups (a symbol per lane) start at stream indices divisible by the lanes; the rest goes
    // through the reference.
    const std::size_t g0 = std::min(N, (lanes - sd.base % lanes) % lanes);
    const std::size_t aligned_end = (sd.base + N) / lanes * lanes;
    const std::size_t g1 = aligned_end > sd.base + g0 ? aligned_end - sd.base : g0;
    ptr = encode_region_scalar(x, sd.hi, g1, N, sd.base, lanes, sd.sm, tables, ptr);
    if (g1 > g0) ptr = kern.encode(x, sd.hi, g0, g1, g1 % m, rt, ptr);
    ptr = encode_region_scalar(x, sd.hi, 0, g0, sd.base, lanes, sd.sm, tables, ptr);
  }
  // rans.hpp's stream framing with `lanes` lanes: varint n, min(n, lanes) final states, the words in decoder order.
  const std::size_t words = static_cast<std::size_t>(end - ptr);
  const std::size_t k = std::min<std::size_t>(n_total, lanes);
  put_varint(out, n_total);
  out.resize(out.size() + 4 * k + 2 * words);
  std::uint8_t* o = out.data() + out.size() - 4 * k - 2 * words;
  for (std::size_t j = 0; j < k; ++j, o += 4)
    for (int b = 0; b < 4; ++b) o[b] = static_cast<std::uint8_t>(x[j] >> (8 * b));
  if (words) std::memcpy(o, ptr, 2 * words);
  return out;
}

VqLayerCodes vq_decode(std::span<const std::uint8_t> bytes, std::uint64_t max_codes, RansKernel kernel) {
  VqLayerCodes out;
  vq_decode(bytes, max_codes, out, kernel);
  return out;
}

void vq_decode(std::span<const std::uint8_t> bytes, std::uint64_t max_codes, VqLayerCodes& out, RansKernel kernel) {
  const RegionKernels kern = region_kernels(kernel);
  const bool fast = kern.fast();
  ByteReader r(bytes, "vq layer");
  const std::uint8_t version = r.u8();
  if (version < 1 || version > 6) r.fail(fmt::format("unknown version {} (expected 1 to 6)", version));
  CallTables tables;
  ParsedHeader h = parse_header(r, version, max_codes, tables);
  if (version == 1) {
    decode_v1(r, h, tables, kernel);
    out = std::move(h.lc);
    return;
  }
  // The caller's code buffers: every code is written below, so storage of the right size is
  // reused as it is (no zero fill).
  h.lc.k.codes.swap(out.k.codes);
  h.lc.v.codes.swap(out.v.codes);
  const std::size_t R = sz(static_cast<std::int64_t>(h.rows));
  std::size_t n_total = 0;
  for (const SideModel* sm : {&h.k, &h.v}) n_total += sm->coded_rows * sm->m() + R * sm->low_cols.size();
  // rans.hpp's stream header.
  const std::uint64_t n = r.varint(~0ull, "symbol count");
  if (n != n_total) r.fail(fmt::format("the rANS stream holds {} symbols, the header implies {}", n, n_total));
  const std::size_t lanes = vq_codec_detail::vq_stream_lanes(version, n_total);
  std::uint32_t x[vq_codec_detail::kVqLanes];
  for (auto& v : x) v = kL;
  for (std::size_t j = 0; j < std::min<std::size_t>(n_total, lanes); ++j) {
    x[j] = r.u32le();
    if (x[j] < kL || x[j] >= (kL << 16)) r.fail(fmt::format("state of lane {} = {} is outside [2^15, 2^31)", j, x[j]));
  }
  const auto words = r.rest();
  if (words.size() % 2) r.fail("the rANS payload has an odd number of bytes");
  const std::uint8_t* p = words.data();
  const std::uint8_t* const end = p + words.size();
  DecodePools pools;
  if (R > 0) pools.build(tables, fast);
  std::size_t base = 0;
  const int simd = kern.decode == &vq_codec_detail::decode_region_avx512 ? 2 : fast ? 1 : 0;
  for (auto [s, sm] : {std::pair{&h.lc.k, &h.k}, std::pair{&h.lc.v, &h.v}}) {
    const std::size_t m = sm->m(), n_side = sz(s->n), N = sm->coded_rows * m;
    s->codes.resize(R * n_side);  // every code is written below (no zero fill needed)
    const bool side_fast = fast && pools.pool != nullptr && std::all_of(sm->col_amax.begin(), sm->col_amax.end(), [](int a) { return a <= 127; });
    if (!side_fast && N > 0 && pools.sym.empty()) pools.build(tables, false);  // a fast call's side with amax > 127
    SideDecoder d{x, *sm, tables, pools.sym.empty() ? nullptr : pools.sym.data(), side_fast ? kern.decode : nullptr, {}, base, lanes, p, end};
    std::vector<std::int32_t> per_col, dec_off, col_scale;
    if (side_fast && m > 0) {
      per_col.resize(m);
      for (std::size_t j = 0; j < m; ++j) per_col[j] = pools.packed_off[sz(sm->table[j])];
      dec_off = wrapped(per_col);
      col_scale = wrapped(std::vector<std::int32_t>(sm->col_scale.begin(), sm->col_scale.end()));
      d.rt.m = m;
      d.rt.lanes = lanes;
      d.rt.col_scale = col_scale.data();
      d.rt.uniform_scale = uniform_scale(sm->col_scale);
      d.rt.dec_off = dec_off.data();
      d.rt.dec_pool = pools.pool;
    }
    if (!decode_side_hi(d, *s, sz(h.lc.batch), sz(h.lc.tokens), simd)) r.fail("a predicted hi part leaves +-255 (corrupt stream)");
    p = d.p;
    base += N;
    // The low parts, column after column in the stream: decoded into lows[row][column], then
    // merged row by row (one pass over the codes instead of one strided pass per column).
    const std::size_t L = sm->low_cols.size();
    std::unique_ptr<std::uint16_t[]> lows(L ? new std::uint16_t[L * R] : nullptr);
    for (std::size_t l = 0; l < L; ++l) {
      const int shift = s->shift[sz(sm->low_cols[l])];
      const std::uint32_t lmask = (1u << shift) - 1;
      for (std::size_t row = 0; row < R; ++row, ++base) {
        std::uint32_t& xi = x[base & (lanes - 1)];
        lows[row * L + l] = static_cast<std::uint16_t>(xi & lmask);
        xi >>= shift;  // freq 1, cum = low: x = (x >> shift) + low - low
        refill(xi, p, end);
      }
    }
    // The rows were finished long before (the region comes first in the stream), so their lines
    // are fetched ahead: without, this loop waited on a miss per split column and row (~6 % of a
    // 7B-shaped layer's decode).
    constexpr std::size_t kAhead = 8;
    for (std::size_t row = 0; row < R && L; ++row)
      for (std::size_t l = 0; l < L; ++l) {
        const std::size_t c = sz(sm->low_cols[l]);
        if (row + kAhead < R) __builtin_prefetch(s->codes.data() + (row + kAhead) * n_side + c, 1);
        std::int16_t& q = s->codes[row * n_side + c];
        q = static_cast<std::int16_t>(q * (1 << s->shift[c]) + static_cast<int>(lows[row * L + l]));
      }
  }
  if (p != end) r.fail(fmt::format("{} rANS renormalisation words left over (corrupt)", (end - p) / 2));
  for (std::size_t j = 0; j < lanes; ++j)
    if (x[j] != kL) r.fail(fmt::format("rANS lane {} did not return to its initial state (corrupt stream)", j));
  out = std::move(h.lc);
}

}  // namespace vq
