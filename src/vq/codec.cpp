#include "veloxquant/vq/codec.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/entropy/rans.hpp"
#include "../entropy/byte_io.hpp"

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

// hi = floor(q / 2^shift): the part of a code the parametric model codes.
int hi_of(int q, int shift) { return q >= 0 ? q >> shift : -((-q + (1 << shift) - 1) >> shift); }

struct CoefModel {
  int amax = 0;  // of the hi parts
  std::uint8_t param = 0;
};

// amax and the best parameter of coefficient c of a side.
CoefModel model_of(const VqSideCodes& s, std::int64_t rows, int c) {
  const int shift = s.shift.empty() ? 0 : s.shift[sz(c)];
  CoefModel m;
  for (std::int64_t r = 0; r < rows; ++r) m.amax = std::max(m.amax, std::abs(hi_of(s.codes[sz(r) * sz(s.n) + sz(c)], shift)));
  if (m.amax == 0) return m;
  std::vector<std::uint32_t> hist(sz(2 * m.amax + 1), 0);
  for (std::int64_t r = 0; r < rows; ++r) ++hist[sz(hi_of(s.codes[sz(r) * sz(s.n) + sz(c)], shift) + m.amax)];
  m.param = vq_best_param(hist, m.amax);
  return m;
}

void check_side(const VqSideCodes& s, std::int64_t rows, const char* name) {
  require(s.n >= 1 && s.n <= 65536 && s.offset.size() == sz(s.n) && s.codes.size() == sz(rows) * sz(s.n) &&
              (s.shift.empty() || s.shift.size() == sz(s.n)),
          "vq_encode: {} side has inconsistent sizes (n {}, {} offsets, {} shifts, {} codes for {} rows)", name, s.n,
                      s.offset.size(), s.shift.size(), s.codes.size(), rows);
  require(std::isfinite(s.step) && s.step > 0.0f, "vq_encode: {} step must be finite and > 0", name);
  for (const auto m : s.offset)
    require(m >= -kVqMaxOffset && m <= kVqMaxOffset, "vq_encode: {} offset {} is outside +-{}", name, m, kVqMaxOffset);
  for (int c = 0; c < s.n; ++c) {
    const int shift = s.shift.empty() ? 0 : s.shift[sz(c)];
    require(shift <= kVqMaxShift, "vq_encode: {} shift {} exceeds {}", name, shift, kVqMaxShift);
    for (std::int64_t r = 0; r < rows; ++r) {
      const int q = s.codes[sz(r) * sz(s.n) + sz(c)];
      require(std::abs(hi_of(q, shift)) <= kVqMaxCode,
              "vq_encode: {} code {} of coefficient {} is outside -{}..{} (shift {})", name, q, c, kVqMaxCode << shift,
                          ((kVqMaxCode + 1) << shift) - 1, shift);
    }
  }
}

// The shifts of a side, the cheaper of two layouts (most caches have none or a few):
//   u8 0                       none
//   u8 1, varint k, k x (varint gap, u8 shift)   sparse: gap = index - previous index - 1
//   u8 2, ceil(n / 2) bytes    dense nibbles, coefficient 2i in the low nibble of byte i
void write_shifts(std::vector<std::uint8_t>& out, const VqSideCodes& s) {
  std::vector<std::uint8_t> sparse;
  std::size_t k = 0;
  int prev = -1;
  for (int c = 0; c < static_cast<int>(s.shift.size()); ++c) {
    if (s.shift[sz(c)] == 0) continue;
    put_varint(sparse, static_cast<std::uint64_t>(c - prev - 1));
    sparse.push_back(s.shift[sz(c)]);
    prev = c;
    ++k;
  }
  if (k == 0) {
    out.push_back(0);
    return;
  }
  std::vector<std::uint8_t> head;
  put_varint(head, k);
  if (head.size() + sparse.size() <= sz(s.n + 1) / 2) {
    out.push_back(1);
    out.insert(out.end(), head.begin(), head.end());
    out.insert(out.end(), sparse.begin(), sparse.end());
    return;
  }
  out.push_back(2);
  for (int c = 0; c < s.n; c += 2)
    out.push_back(static_cast<std::uint8_t>(s.shift[sz(c)] | (c + 1 < s.n ? s.shift[sz(c + 1)] << 4 : 0)));
}

void read_shifts(ByteReader& r, VqSideCodes& s) {
  s.shift.assign(sz(s.n), 0);
  const std::uint8_t layout = r.u8();
  if (layout == 0) return;
  if (layout == 1) {
    const std::uint64_t k = r.varint(static_cast<std::uint64_t>(s.n), "shift count");
    std::uint64_t at = 0;
    for (std::uint64_t i = 0; i < k; ++i) {
      at += r.varint(static_cast<std::uint64_t>(s.n), "shift gap");
      if (at >= static_cast<std::uint64_t>(s.n)) r.fail("shift index past the last coefficient");
      const std::uint8_t v = r.u8();
      if (v == 0 || v > kVqMaxShift) r.fail(fmt::format("sparse shift {} outside 1..{}", v, kVqMaxShift));
      s.shift[at++] = v;
    }
    return;
  }
  if (layout != 2) r.fail("unknown shift layout");
  for (int c = 0; c < s.n; c += 2) {
    const std::uint8_t b = r.u8();
    if ((b & 0xf) > kVqMaxShift || (b >> 4) > kVqMaxShift || (c + 1 == s.n && (b >> 4) != 0)) r.fail("bad dense shifts");
    s.shift[sz(c)] = b & 0xf;
    if (c + 1 < s.n) s.shift[sz(c + 1)] = static_cast<std::uint8_t>(b >> 4);
  }
}

// The table of a shift's low parts: 2^shift equally likely symbols.
FrequencyTable low_table(int shift) {
  return FrequencyTable::from_frequencies(std::vector<std::uint32_t>(sz(1) << shift, 1u), shift);
}

}  // namespace

FrequencyTable vq_table(int amax, std::uint8_t param) {
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
  const std::uint32_t total = 1u << kVqScaleBits;
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
  return FrequencyTable::from_frequencies(f, kVqScaleBits);
}

std::uint8_t vq_best_param(std::span<const std::uint32_t> hist, int amax) {
  require(hist.size() == sz(2 * amax + 1), "vq_best_param: histogram size must be 2 * amax + 1");
  double n = 0, m2 = 0;
  for (int i = 0; i < static_cast<int>(hist.size()); ++i) {
    n += hist[sz(i)];
    m2 += static_cast<double>(hist[sz(i)]) * (i - amax) * (i - amax);
  }
  const double sigma = n > 0 ? std::sqrt(std::max(m2 / n, 1e-4)) : 1.0;
  const int i0 = static_cast<int>(std::lround(8.0 * std::log2(sigma))) + 48;
  std::uint8_t best = 0;
  double best_cost = INFINITY;
  for (int family = 0; family < 2; ++family)
    for (int i = std::max(0, i0 - 3); i <= std::min(127, i0 + 3); ++i) {
      const auto param = static_cast<std::uint8_t>(family << 7 | i);
      const double cost = vq_table(amax, param).cost_bits(hist);
      if (cost < best_cost) best_cost = cost, best = param;
    }
  return best;
}

std::vector<std::uint8_t> vq_encode(const VqLayerCodes& lc) {
  require(lc.batch >= 0 && lc.tokens >= 0, "vq_encode: negative batch or token count");
  const std::int64_t rows = lc.rows();
  check_side(lc.k, rows, "K");
  check_side(lc.v, rows, "V");
  std::vector<std::uint8_t> out;
  out.push_back(1);
  put_varint(out, static_cast<std::uint64_t>(lc.batch));
  put_varint(out, static_cast<std::uint64_t>(lc.tokens));
  put_varint(out, static_cast<std::uint64_t>(lc.k.n));
  put_varint(out, static_cast<std::uint64_t>(lc.v.n));
  std::vector<FrequencyTable> tables;
  tables.reserve(2 * sz(lc.k.n + lc.v.n));  // the segments point into it: no reallocation
  std::vector<std::uint16_t> symbols;
  symbols.reserve(2 * sz(rows) * sz(lc.k.n + lc.v.n));
  std::vector<std::pair<std::size_t, std::size_t>> spans;  // (start, table index) per segment
  for (const VqSideCodes* s : {&lc.k, &lc.v}) {
    std::uint32_t step_bits;
    std::memcpy(&step_bits, &s->step, 4);
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::uint8_t>(step_bits >> (8 * i)));
    write_shifts(out, *s);
    for (int c = 0; c < s->n; ++c) {
      const int shift = s->shift.empty() ? 0 : s->shift[sz(c)];
      const std::int64_t off = s->offset[sz(c)];
      put_varint(out, off < 0 ? static_cast<std::uint64_t>(-2 * off - 1) : static_cast<std::uint64_t>(2 * off));  // zigzag
      const CoefModel m = model_of(*s, rows, c);
      put_varint(out, static_cast<std::uint64_t>(m.amax));
      if (m.amax > 0) {
        out.push_back(m.param);
        spans.emplace_back(symbols.size(), tables.size());
        tables.push_back(vq_table(m.amax, m.param));
        for (std::int64_t r = 0; r < rows; ++r)
          symbols.push_back(static_cast<std::uint16_t>(hi_of(s->codes[sz(r) * sz(s->n) + sz(c)], shift) + m.amax));
      }
      if (shift > 0) {
        spans.emplace_back(symbols.size(), tables.size());
        tables.push_back(low_table(shift));
        for (std::int64_t r = 0; r < rows; ++r) {
          const int q = s->codes[sz(r) * sz(s->n) + sz(c)];
          symbols.push_back(static_cast<std::uint16_t>(q - hi_of(q, shift) * (1 << shift)));
        }
      }
    }
  }
  std::vector<RansEncodeSegment> segments;
  for (const auto& [start, t] : spans)
    segments.push_back({std::span<const std::uint16_t>(symbols).subspan(start, sz(rows)), &tables[t]});
  rans_encode_append(out, segments);
  return out;
}

VqLayerCodes vq_decode(std::span<const std::uint8_t> bytes, std::uint64_t max_codes) {
  ByteReader r(bytes, "vq layer");
  if (r.u8() != 1) r.fail("unknown version (expected 1)");
  VqLayerCodes lc;
  lc.batch = static_cast<std::int64_t>(r.varint(1u << 20, "batch"));
  lc.tokens = static_cast<std::int64_t>(r.varint(1u << 30, "tokens"));
  lc.k.n = static_cast<int>(r.varint(65536, "n_k"));
  lc.v.n = static_cast<int>(r.varint(65536, "n_v"));
  if (lc.k.n == 0 || lc.v.n == 0) r.fail("a side has no coefficients");
  const std::uint64_t rows = static_cast<std::uint64_t>(lc.batch) * static_cast<std::uint64_t>(lc.tokens);
  if (rows > max_codes / static_cast<std::uint64_t>(lc.k.n + lc.v.n))
    r.fail(fmt::format("{} rows of {} coefficients exceed the expected {} codes", rows, lc.k.n + lc.v.n, max_codes));
  std::vector<FrequencyTable> tables;
  tables.reserve(2 * sz(lc.k.n + lc.v.n));
  struct Coded {
    VqSideCodes* side;
    int c, amax, shift;
    bool low;  // the segment of the low parts (else of the hi parts)
  };
  std::vector<Coded> coded;  // per segment
  for (VqSideCodes* s : {&lc.k, &lc.v}) {
    const std::uint32_t step_bits = r.u32le();
    std::memcpy(&s->step, &step_bits, 4);
    if (!std::isfinite(s->step) || s->step <= 0.0f) r.fail("step is not a finite positive float32");
    read_shifts(r, *s);
    s->offset.resize(sz(s->n));
    for (int c = 0; c < s->n; ++c) {
      const int shift = s->shift[sz(c)];
      const std::uint64_t z = r.varint(2 * static_cast<std::uint64_t>(kVqMaxOffset), "offset");
      s->offset[sz(c)] = (z & 1) ? -static_cast<std::int32_t>((z + 1) / 2) : static_cast<std::int32_t>(z / 2);
      const int amax = static_cast<int>(r.varint(kVqMaxCode, "amax"));
      if (amax > 0) {
        tables.push_back(vq_table(amax, r.u8()));
        coded.push_back({s, c, amax, shift, false});
      }
      if (shift > 0) {
        tables.push_back(low_table(shift));
        coded.push_back({s, c, amax, shift, true});
      }
    }
    s->codes.assign(sz(static_cast<std::int64_t>(rows)) * sz(s->n), 0);
  }
  std::vector<std::uint16_t> symbols(coded.size() * rows);
  std::vector<RansDecodeSegment> segments;
  for (std::size_t i = 0; i < coded.size(); ++i) segments.push_back({std::span<std::uint16_t>(symbols).subspan(i * rows, rows), &tables[i]});
  rans_decode(r.rest(), segments);  // FormatError on a corrupt, short or long payload
  // q = hi * 2^shift + low; hi segments come before their low segments, so hi is placed first.
  for (std::size_t i = 0; i < coded.size(); ++i) {
    const Coded& k = coded[i];
    for (std::uint64_t row = 0; row < rows; ++row) {
      std::int16_t& q = k.side->codes[row * sz(k.side->n) + sz(k.c)];
      const int sym = symbols[i * rows + row];
      q = static_cast<std::int16_t>(k.low ? q + sym : (sym - k.amax) * (1 << k.shift));
    }
  }
  return lc;
}

}  // namespace vq
