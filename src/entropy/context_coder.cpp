// The context coder (context_coder.hpp): model (histogram, greedy class merge, tables), rows and
// units, the derived pair tables, framing, and the scalar kernels. The AVX2 kernels are in
// context_avx2.cpp; both give the same bytes and codes.
#include "veloxquant/entropy/context_coder.hpp"

#include <emmintrin.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "byte_io.hpp"
#include "context_kernels.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/core/uninit_vector.hpp"

namespace vq {

using namespace context_detail;

namespace {

constexpr std::uint32_t kL = kRansStateLow;
using Histogram = std::array<std::uint64_t, 1 << kContextMaxBits>;
using RawHistograms = std::array<Histogram, kContextMaxContexts>;

void check_layout(const ContextLayout& l) {
  require(l.bits >= 1 && l.bits <= kContextMaxBits,
          "context coder: bits " + std::to_string(l.bits) + " is outside 1.." + std::to_string(kContextMaxBits));
  require(l.group_start.size() == l.tokens, "context coder: group_start must hold one flag per token");
  require(l.tokens == 0 || l.group_start[0] != 0, "context coder: a group must start at token 0");
  require(l.dim == 0 || l.slices == 0 || l.tokens <= (std::size_t{1} << 40) / l.dim / l.slices, "context coder: stream too large");
}

template <typename Span>
void check_slices(std::span<const Span> codes, const ContextLayout& l, const char* what) {
  require(codes.size() == l.slices, std::string("context coder: ") + what + " has " + std::to_string(codes.size()) +
                                        " slices, the layout " + std::to_string(l.slices));
  for (const auto& s : codes)
    require(s.size() == l.tokens * l.dim, std::string("context coder: a slice of ") + what + " holds " + std::to_string(s.size()) +
                                              " codes, the layout needs " + std::to_string(l.tokens * l.dim));
}

// One span per slice of a flat [slice][token][dim] buffer (codes in, or the output).
template <typename T>
std::vector<std::span<T>> split(std::span<T> flat, const ContextLayout& l) {
  require(flat.size() == l.size(), std::string("context coder: ") + (std::is_const_v<T> ? "code count " : "output size ") +
                                       std::to_string(flat.size()) + " disagrees with the layout (" + std::to_string(l.size()) + ")");
  std::vector<std::span<T>> s(l.slices);
  for (std::size_t i = 0; i < l.slices; ++i) s[i] = flat.subspan(i * l.tokens * l.dim, l.tokens * l.dim);
  return s;
}

// ---- the model ----

// Counts of (raw context, code): one byte histogram of prev | cur << 4 over the tokens that do
// not start a group (runs of consecutive codes: prev is D codes back), and the codes at group
// starts. Four partial histograms break the increment chains; they are folded into 64-bit totals
// at least every 2^24 codes.
RawHistograms raw_histograms(ContextSlices codes, const ContextLayout& l) {
  const std::size_t D = l.dim, T = l.tokens;
  std::array<std::uint64_t, 256> pairs{};
  std::array<std::uint64_t, 256> starts{};
  std::uint32_t part[4][256] = {};
  std::size_t pending = 0;
  std::uint32_t any = 0;  // OR of every code: a code >= 2^bits is refused after counting (indices are masked)
  const auto fold = [&] {
    for (int k = 0; k < 4; ++k)
      for (int v = 0; v < 256; ++v) pairs[static_cast<std::size_t>(v)] += part[k][v], part[k][v] = 0;
    pending = 0;
  };
  for (const auto& slice : codes) {
    const std::uint8_t* c = slice.data();
    for (std::size_t t = 0; t < T;) {
      for (std::size_t d = 0; d < D; ++d) any |= c[t * D + d], ++starts[c[t * D + d]];  // token t starts a group
      std::size_t e = t + 1;
      while (e < T && !l.group_start[e]) ++e;
      // Tokens t + 1 .. e - 1: flat codes [(t + 1) D, e D), each with the code D before it.
      for (std::size_t j = (t + 1) * D, stop = e * D; j < stop;) {
        const std::size_t chunk = std::min<std::size_t>(stop - j, (std::size_t{1} << 24) - pending);
        const std::uint8_t* cur = c + j;
        const std::uint8_t* prev = cur - D;
        // 8 codes at a time: the index bytes prev | cur << 4 of 8 codes in one 64-bit word (a code
        // >= 16 spills into its neighbour's index, still a byte: counted wrong, then refused).
        std::uint64_t o = 0;
        std::size_t k = 0;
        for (; k + 8 <= chunk; k += 8) {
          std::uint64_t pv, cv;
          std::memcpy(&pv, prev + k, 8);
          std::memcpy(&cv, cur + k, 8);
          o |= cv;
          const std::uint64_t ix = pv | cv << 4;
          ++part[0][ix & 255];
          ++part[1][ix >> 8 & 255];
          ++part[2][ix >> 16 & 255];
          ++part[3][ix >> 24 & 255];
          ++part[0][ix >> 32 & 255];
          ++part[1][ix >> 40 & 255];
          ++part[2][ix >> 48 & 255];
          ++part[3][ix >> 56];
        }
        for (; k < chunk; ++k) o |= cur[k], ++part[0][(prev[k] | cur[k] << 4) & 255];
        for (int b = 1; b < 8; ++b) o |= o >> (8 * b);
        any |= static_cast<std::uint32_t>(o & 255);
        j += chunk;
        pending += chunk;
        if (pending >= (std::size_t{1} << 24)) fold();
      }
      t = e;
    }
  }
  require(any < (1u << l.bits), "context coder: a code is outside 0.." + std::to_string((1 << l.bits) - 1));
  fold();
  RawHistograms raw{};
  for (int p = 0; p < 16; ++p)
    for (int v = 0; v < 16; ++v) raw[static_cast<std::size_t>(p)][static_cast<std::size_t>(v)] = pairs[static_cast<std::size_t>(p | v << 4)];
  for (int v = 0; v < 16; ++v) raw[static_cast<std::size_t>(1 << l.bits)][static_cast<std::size_t>(v)] = starts[static_cast<std::size_t>(v)];
  return raw;
}

// The greedy merge's cost estimates, on float copies of the counts (the decoder never sees them;
// float's 24-bit counts and a polynomial log2 with error < 3e-5 decide merges worth bytes).
using FloatHistogram = std::array<float, 1 << kContextMaxBits>;

// log2 of 4 floats >= 1 without libm: exponent plus a degree-5 polynomial of the mantissa.
inline __m128 log2_ps(__m128 x) {
  const __m128i b = _mm_castps_si128(x);
  const __m128 e = _mm_cvtepi32_ps(_mm_sub_epi32(_mm_srli_epi32(b, 23), _mm_set1_epi32(127)));
  const __m128 t = _mm_sub_ps(_mm_castsi128_ps(_mm_or_si128(_mm_and_si128(b, _mm_set1_epi32(0x7fffff)), _mm_set1_epi32(0x3f800000))),
                              _mm_set1_ps(1.0f));  // mantissa - 1, in [0, 1)
  __m128 p = _mm_set1_ps(0.04587075f);
  p = _mm_add_ps(_mm_mul_ps(p, t), _mm_set1_ps(-0.19439043f));
  p = _mm_add_ps(_mm_mul_ps(p, t), _mm_set1_ps(0.41539777f));
  p = _mm_add_ps(_mm_mul_ps(p, t), _mm_set1_ps(-0.70867494f));
  p = _mm_add_ps(_mm_mul_ps(p, t), _mm_set1_ps(1.44182512f));
  return _mm_add_ps(e, _mm_mul_ps(p, t));
}

// Estimated bytes of a class: its order-0 entropy plus its table as FrequencyTable serialises it
// (alphabet varint and precision byte, one varint per present symbol: two bytes from a frequency
// of 128 up, two bytes per run of absent symbols). The greedy merge evaluates it a few hundred
// times per stream; counts past the alphabet are 0.
double class_cost(const FloatHistogram& h, int A, int scale_bits) {
  __m128 sum = _mm_setzero_ps(), clogc = _mm_setzero_ps();
  for (int q = 0; q < 4; ++q) {
    const __m128 c = _mm_loadu_ps(h.data() + 4 * q);
    sum = _mm_add_ps(sum, c);
    clogc = _mm_add_ps(clogc, _mm_mul_ps(c, log2_ps(_mm_max_ps(c, _mm_set1_ps(1.0f)))));  // 0 * log2(1) for absent codes
  }
  alignas(16) float s4[4], l4[4];
  _mm_store_ps(s4, sum);
  _mm_store_ps(l4, clogc);
  const float n = (s4[0] + s4[1]) + (s4[2] + s4[3]);
  if (n == 0.0f) return 0.0;
  // Bit v of each mask: code v absent / at or above the two-byte frequency.
  const __m128 two_byte = _mm_set1_ps(127.5f * n / static_cast<float>(1u << scale_bits));  // c * 2^s / n >= 127.5
  unsigned zero = 0, two = 0;
  for (int q = 0; q < 4; ++q) {
    const __m128 c = _mm_loadu_ps(h.data() + 4 * q);
    zero |= static_cast<unsigned>(_mm_movemask_ps(_mm_cmpeq_ps(c, _mm_setzero_ps()))) << (4 * q);
    two |= static_cast<unsigned>(_mm_movemask_ps(_mm_cmpge_ps(c, two_byte))) << (4 * q);
  }
  const unsigned all = (1u << A) - 1;
  zero &= all;
  const unsigned present = all & ~zero, run_starts = zero & ~(zero << 1);
  const int table = 2 + std::popcount(present) + std::popcount(two & present) + 2 * std::popcount(run_starts);
  alignas(16) float ln[4];
  _mm_store_ps(ln, log2_ps(_mm_set1_ps(n)));
  return (static_cast<double>(n) * ln[0] - ((static_cast<double>(l4[0]) + l4[1]) + (static_cast<double>(l4[2]) + l4[3]))) / 8.0 + table;
}

FloatHistogram merged(const FloatHistogram& a, const FloatHistogram& b) {
  FloatHistogram m;
  for (std::size_t v = 0; v < m.size(); ++v) m[v] = a[v] + b[v];
  return m;
}

// Greedy merging of the raw contexts' histograms into classes; returns the classes' histograms and
// each raw context's class (classes numbered by their smallest raw context).
std::vector<Histogram> choose_classes(const RawHistograms& raw, int A, int scale_bits, std::array<std::uint8_t, kContextMaxContexts>& cls) {
  const int R = A + 1;
  std::vector<Histogram> h;
  std::vector<FloatHistogram> hf;
  std::vector<std::vector<int>> members;
  for (int r = 0; r < R; ++r) {
    std::uint64_t n = 0;
    for (const auto c : raw[static_cast<std::size_t>(r)]) n += c;
    if (n == 0) continue;
    h.push_back(raw[static_cast<std::size_t>(r)]);
    FloatHistogram f;
    for (std::size_t v = 0; v < f.size(); ++v) f[v] = static_cast<float>(raw[static_cast<std::size_t>(r)][v]);
    hf.push_back(f);
    members.push_back({r});
  }
  const std::size_t K0 = h.size();
  std::vector<double> cost(K0);
  for (std::size_t i = 0; i < K0; ++i) cost[i] = class_cost(hf[i], A, scale_bits);
  std::vector<double> gain(K0 * K0, 0.0);  // cost change of merging i and j (i < j)
  auto pair_gain = [&](std::size_t i, std::size_t j) { return class_cost(merged(hf[i], hf[j]), A, scale_bits) - cost[i] - cost[j]; };
  for (std::size_t i = 0; i < K0; ++i)
    for (std::size_t j = i + 1; j < K0; ++j) gain[i * K0 + j] = pair_gain(i, j);
  std::vector<std::uint8_t> alive(K0, 1);
  for (;;) {
    double best = -1e-9;
    std::size_t bi = 0, bj = 0;
    for (std::size_t i = 0; i < K0; ++i)
      for (std::size_t j = i + 1; j < K0 && alive[i]; ++j)
        if (alive[j] && gain[i * K0 + j] < best) best = gain[i * K0 + j], bi = i, bj = j;
    if (best >= -1e-9) break;
    for (std::size_t v = 0; v < h[bi].size(); ++v) h[bi][v] += h[bj][v];
    hf[bi] = merged(hf[bi], hf[bj]);
    cost[bi] = class_cost(hf[bi], A, scale_bits);
    members[bi].insert(members[bi].end(), members[bj].begin(), members[bj].end());
    alive[bj] = 0;
    for (std::size_t k = 0; k < K0; ++k)
      if (alive[k] && k != bi) gain[std::min(k, bi) * K0 + std::max(k, bi)] = pair_gain(std::min(k, bi), std::max(k, bi));
  }
  cls.fill(0);  // raw contexts that never occur: class 0
  std::vector<Histogram> out;
  for (std::size_t i = 0; i < K0; ++i) {
    if (!alive[i]) continue;
    for (const int r : members[i]) cls[static_cast<std::size_t>(r)] = static_cast<std::uint8_t>(out.size());
    out.push_back(h[i]);
  }
  if (out.empty()) out.push_back(Histogram{});  // no codes at all: one (all-zero) class
  return out;
}

int map_bits(int K) { return K <= 1 ? 0 : std::bit_width(static_cast<unsigned>(K - 1)); }

// ---- rows and units ----

struct Rows {
  std::vector<std::uint8_t> kind;  // kSingleRow | kStartRow bits
  std::vector<std::size_t> token;  // first token of the row
};

Rows rows_of(const ContextLayout& l) {
  Rows r;
  r.kind.reserve(l.tokens);
  r.token.reserve(l.tokens);
  for (std::size_t t = 0; t < l.tokens;) {
    const bool pair = t + 1 < l.tokens && !l.group_start[t + 1];
    r.kind.push_back(static_cast<std::uint8_t>((pair ? 0 : kSingleRow) | (l.group_start[t] ? kStartRow : 0)));
    r.token.push_back(t);
    t += pair ? 2 : 1;
  }
  return r;
}

// Units from codes and back, 8 codes at a time in a 64-bit word (codes are < 16: a | b << 4 never
// carries into the next byte).
inline std::uint64_t load8(const std::uint8_t* p) {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline void store8(std::uint8_t* p, std::uint64_t v) { std::memcpy(p, &v, 8); }
constexpr std::uint64_t kLowNibbles = 0x0f0f0f0f0f0f0f0full;

// Returns the OR of every code read (the caller refuses codes >= 2^bits; units are garbage then).
// Slice by slice, rows in order: a pair row reads two tokens' rows of codes, a single row one.
std::uint8_t to_units(ContextSlices codes, const ContextLayout& l, const Rows& rows, std::uint8_t* units) {
  const std::size_t D = l.dim, C = l.slices * D;
  std::uint64_t any = 0;
  for (std::size_t s = 0; s < l.slices; ++s) {
    const std::uint8_t* a = codes[s].data();
    std::uint8_t* o = units + s * D;
    for (std::size_t r = 0; r < rows.kind.size(); ++r, o += C) {
      const bool single = rows.kind[r] & kSingleRow;
      const std::uint8_t* b = single ? a : a + D;
      std::size_t d = 0;
      for (; d + 8 <= D; d += 8) {
        const std::uint64_t va = load8(a + d), vb = load8(b + d);
        any |= va | vb;
        store8(o + d, va | vb << 4);
      }
      for (; d < D; ++d) {
        any |= a[d] | b[d];
        o[d] = static_cast<std::uint8_t>(a[d] | b[d] << 4);
      }
      a = b + D;
    }
  }
  for (int k = 1; k < 8; ++k) any |= any >> (8 * k);
  return static_cast<std::uint8_t>(any);
}

void from_units(const std::uint8_t* units, const ContextLayout& l, const Rows& rows, ContextSlicesOut codes) {
  const std::size_t D = l.dim, C = l.slices * D;
  for (std::size_t s = 0; s < l.slices; ++s) {
    std::uint8_t* a = codes[s].data();
    const std::uint8_t* u = units + s * D;
    for (std::size_t r = 0; r < rows.kind.size(); ++r, u += C) {
      const bool pair = !(rows.kind[r] & kSingleRow);
      std::size_t d = 0;
      for (; d + 8 <= D; d += 8) {
        const std::uint64_t v = load8(u + d);
        store8(a + d, v & kLowNibbles);
        if (pair) store8(a + D + d, v >> 4 & kLowNibbles);
      }
      for (; d < D; ++d) {
        a[d] = u[d] & 15;
        if (pair) a[D + d] = u[d] >> 4;
      }
      a += pair ? 2 * D : D;
    }
  }
}

// Bits back: the last 32 m units ride in the lanes' start states (state = 2^15 + v, v < 2^16);
// lane j holds units n' + 32 q + j, q < m, at increasing bit offsets. Only when every lane codes at
// least one unit besides (its state is stored only then).
std::size_t tail_units_per_lane(int bits, std::size_t total) {
  const std::size_t m = static_cast<std::size_t>(16 / (2 * bits));
  return total >= kLanes * (m + 1) ? m : 0;
}

// A stream's rows and units: C per row, in all; per lane in the tail; rANS-coded (n').
struct Plan {
  Rows rows;
  std::size_t C = 0, total = 0, tail = 0, coded = 0;
};
Plan plan_of(const ContextLayout& l, Rows rows) {
  Plan p;
  p.rows = std::move(rows);
  const Rows& r = p.rows;
  p.C = l.slices * l.dim;
  p.total = p.C == 0 ? 0 : r.kind.size() * p.C;
  p.tail = tail_units_per_lane(l.bits, p.total);
  p.coded = p.total - kLanes * p.tail;
  return p;
}

// The tail value of unit u (of row kind kd) and its width in bits.
inline std::uint32_t tail_value(std::uint8_t unit, std::uint8_t kd, int bits, int& width) {
  if (kd & kSingleRow) {
    width = bits;
    return unit & 15u;
  }
  width = 2 * bits;
  return (unit & 15u) | static_cast<std::uint32_t>(unit >> 4) << bits;
}

// The layout, checked, and that its codes have the model's width.
const ContextLayout& checked_layout(const ContextLayout& l, const ContextModel& m) {
  check_layout(l);
  require(l.bits == m.bits(), "context coder: the layout's codes have " + std::to_string(l.bits) + " bits, the model's " + std::to_string(m.bits()));
  return l;
}

void fill_kernel_tables(KernelTables& k, const ContextModel& m, std::size_t C, const std::uint8_t* kind) {
  k.C = C;
  k.kind = kind;
  const int A = 1 << m.bits();
  for (int c = 0; c < 16; ++c) k.cls[c] = static_cast<std::uint8_t>(c < A ? m.class_of(c) : 0);
  k.start_class = static_cast<std::uint8_t>(m.class_of(A));
}

}  // namespace

std::vector<std::uint8_t> group_starts(std::span<const std::int64_t> piece_tokens, int group_size) {
  require(group_size >= 1, "context coder: group size must be >= 1");
  std::vector<std::uint8_t> g;
  std::int64_t total = 0;
  for (const std::int64_t n : piece_tokens) total += std::max<std::int64_t>(n, 0);
  g.reserve(static_cast<std::size_t>(total));
  for (const std::int64_t n : piece_tokens) {
    require(n >= 0, "context coder: negative piece length");
    for (std::int64_t t = 0, k = 0; t < n; ++t, k = k + 1 == group_size ? 0 : k + 1) g.push_back(k == 0 ? 1 : 0);
  }
  return g;
}

// ---- ContextModel ----

ContextModel ContextModel::build(ContextSlices codes, const ContextLayout& layout) {
  check_layout(layout);
  check_slices(codes, layout, "the codes");
  const int A = 1 << layout.bits;
  const int scale_bits = table_scale_bits(A);
  const RawHistograms raw = raw_histograms(codes, layout);
  ContextModel m;
  m.bits_ = layout.bits;
  const std::vector<Histogram> classes = choose_classes(raw, A, scale_bits, m.cls_);
  for (const Histogram& h : classes) {
    // Counts above 2^32 (streams of > 4 G codes) are scaled down, present symbols kept present.
    std::uint64_t top = 0;
    for (int v = 0; v < A; ++v) top = std::max(top, h[static_cast<std::size_t>(v)]);
    const std::uint64_t div = top >> 31 ? (top >> 31) + 1 : 1;
    std::vector<std::uint32_t> counts(static_cast<std::size_t>(A));
    for (int v = 0; v < A; ++v) {
      const std::uint64_t c = h[static_cast<std::size_t>(v)];
      counts[static_cast<std::size_t>(v)] = static_cast<std::uint32_t>(c ? std::max<std::uint64_t>(1, c / div) : 0);
    }
    m.tables_.push_back(FrequencyTable::from_histogram(counts, scale_bits));
  }
  return m;
}

ContextModel ContextModel::build(std::span<const std::uint8_t> codes, const ContextLayout& layout) {
  check_layout(layout);
  const auto s = split(codes, layout);
  return build(ContextSlices(s), layout);
}

void ContextModel::serialize_to(std::vector<std::uint8_t>& out) const {
  const int K = classes(), A = 1 << bits_;
  out.push_back(static_cast<std::uint8_t>(K));
  if (const int w = map_bits(K); w > 0) {
    std::uint32_t acc = 0;
    int have = 0;
    for (int r = 0; r <= A; ++r) {
      acc |= static_cast<std::uint32_t>(cls_[static_cast<std::size_t>(r)]) << have;
      for (have += w; have >= 8; have -= 8, acc >>= 8) out.push_back(static_cast<std::uint8_t>(acc));
    }
    if (have > 0) out.push_back(static_cast<std::uint8_t>(acc));
  }
  for (const auto& t : tables_) t.serialize_to(out);
}

std::size_t ContextModel::serialized_size() const {
  const int A = 1 << bits_;
  std::size_t n = 1 + (static_cast<std::size_t>(map_bits(classes())) * static_cast<std::size_t>(A + 1) + 7) / 8;
  for (const auto& t : tables_) n += t.serialized_size();
  return n;
}

ContextModel ContextModel::deserialize(std::span<const std::uint8_t> bytes, int bits, std::size_t* consumed) {
  require(bits >= 1 && bits <= kContextMaxBits, "context coder: bits " + std::to_string(bits) + " is outside 1.." + std::to_string(kContextMaxBits));
  entropy_detail::ByteReader r(bytes, "context model");
  const int A = 1 << bits;
  ContextModel m;
  m.bits_ = bits;
  const int K = r.u8();
  if (K < 1 || K > A + 1) r.fail("class count " + std::to_string(K) + " is outside 1.." + std::to_string(A + 1));
  if (const int w = map_bits(K); w > 0) {
    std::uint32_t acc = 0;
    int have = 0;
    for (int ctx = 0; ctx <= A; ++ctx) {
      if (have < w) acc |= static_cast<std::uint32_t>(r.u8()) << have, have += 8;
      const int k = static_cast<int>(acc & ((1u << w) - 1));
      acc >>= w;
      have -= w;
      if (k >= K) r.fail("the class map names class " + std::to_string(k) + " of " + std::to_string(K));
      m.cls_[static_cast<std::size_t>(ctx)] = static_cast<std::uint8_t>(k);
    }
    if (acc != 0) r.fail("nonzero padding after the class map");
  }
  const int scale_bits = table_scale_bits(A);
  for (int k = 0; k < K; ++k) {
    std::size_t used = 0;
    FrequencyTable t = FrequencyTable::deserialize(r.rest(), &used);
    r.skip(used);
    if (t.alphabet_size() != A || t.scale_bits() != scale_bits)
      r.fail("table " + std::to_string(k) + " has alphabet " + std::to_string(t.alphabet_size()) + " at " + std::to_string(t.scale_bits()) +
             " bits, expected " + std::to_string(A) + " at " + std::to_string(scale_bits));
    m.tables_.push_back(std::move(t));
  }
  if (consumed) *consumed = r.pos();
  return m;
}

// ---- pair tables ----

namespace {

// F[a | b << 4] of class k's pair table (total 2^12). Row a (f = freq_k(a) > 0) gets exactly
// 4 f units, spread over the codes b of a's class table g in proportion (rounded, >= 1 for every
// code g can code); the rounding error of the row goes +-1 to its b in order of descending g (ties:
// lower b first), cycling. A row with fewer units than codes to cover (f < 4 and more than 4 f
// codes in g) gives each code 1 and borrows the difference from the largest entries of the table.
// Each class table's codes in order of descending frequency (ties: lower code first), present ones.
struct CodeOrders {
  std::array<std::array<std::uint8_t, 16>, kContextMaxContexts> order{};
  std::array<int, kContextMaxContexts> n{};
  explicit CodeOrders(const ContextModel& m) {
    const int A = 1 << m.bits();
    for (int c = 0; c < m.classes(); ++c) {
      const FrequencyTable& g = m.table(c);
      auto& o = order[static_cast<std::size_t>(c)];
      int k = 0;
      for (int b = 0; b < A; ++b)
        if (g.freq(b)) {  // insertion into the sorted prefix: stable, at most 16 codes
          int q = k++;
          for (; q > 0 && g.freq(o[static_cast<std::size_t>(q - 1)]) < g.freq(b); --q) o[static_cast<std::size_t>(q)] = o[static_cast<std::size_t>(q - 1)];
          o[static_cast<std::size_t>(q)] = static_cast<std::uint8_t>(b);
        }
      n[static_cast<std::size_t>(c)] = k;
    }
  }
};

std::array<std::uint32_t, 256> pair_freqs(const ContextModel& m, const CodeOrders& orders, int k) {
  const int A = 1 << m.bits();
  constexpr int kShift = kPairScaleBits - kSingleScaleBits;  // 2
  std::array<std::uint32_t, 256> F{};
  const FrequencyTable& tk = m.table(k);
  std::int64_t deficit = 0;
  for (int a = 0; a < A; ++a) {
    const std::uint32_t f = tk.freq(a);
    if (f == 0) continue;
    const int ga = m.class_of(a);
    const FrequencyTable& g = m.table(ga);
    const auto& ord = orders.order[static_cast<std::size_t>(ga)];
    const int np = orders.n[static_cast<std::size_t>(ga)];
    const std::int64_t B = static_cast<std::int64_t>(f) << kShift;
    if (B < np) {
      for (int q = 0; q < np; ++q) F[static_cast<std::size_t>(a | ord[static_cast<std::size_t>(q)] << 4)] = 1;
      deficit += np - B;
      continue;
    }
    std::int64_t d = B;
    for (int q = 0; q < np; ++q) {
      const int b = ord[static_cast<std::size_t>(q)];
      const std::uint32_t v = std::max<std::uint32_t>(1, static_cast<std::uint32_t>((static_cast<std::int64_t>(g.freq(b)) * B + 512) >> kSingleScaleBits));
      F[static_cast<std::size_t>(a | b << 4)] = v;
      d -= v;
    }
    for (int q = 0; d > 0; q = (q + 1) % np, --d) ++F[static_cast<std::size_t>(a | ord[static_cast<std::size_t>(q)] << 4)];
    // d < 0: some entry is > 1 (they sum to more than B >= np), so this ends.
    for (int q = 0; d < 0; q = (q + 1) % np) {
      std::uint32_t& v = F[static_cast<std::size_t>(a | ord[static_cast<std::size_t>(q)] << 4)];
      if (v > 1) --v, ++d;
    }
  }
  while (deficit-- > 0) {  // the largest entry holds >= 4096 / 256 = 16 units
    std::size_t big = 0;
    for (std::size_t v = 1; v < F.size(); ++v)
      if (F[v] > F[big]) big = v;
    --F[big];
  }
  return F;
}

// A decoder slot table (fill_table_avx2's contract), scalar: in blocks of 4.
void fill_table(std::uint32_t* e, const std::uint32_t* freq, const std::uint32_t* code, std::size_t n, int s) {
  if (rans_avx2_available()) return fill_table_avx2(e, freq, code, n, s);
  for (std::size_t u = 0; u < n; ++u) {
    const std::uint32_t f = freq[u];
    if (f == 0) continue;
    const std::uint32_t base = (f - 1) | code[u] << (2 * s);
    for (std::uint32_t k = 0; k < f; k += 4) {
      e[k] = base | k << s;
      e[k + 1] = base | (k + 1) << s;
      e[k + 2] = base | (k + 2) << s;
      e[k + 3] = base | (k + 3) << s;
    }
    e += f;
  }
}

}  // namespace

FrequencyTable pair_frequency_table(const ContextModel& model, int k) {
  require(k >= 0 && k < model.classes(), "pair_frequency_table: class " + std::to_string(k) + " is outside 0.." + std::to_string(model.classes() - 1));
  const auto F = pair_freqs(model, CodeOrders(model), k);
  return FrequencyTable::from_frequencies(F, kPairScaleBits);
}

// ---- encoder ----

namespace context_detail {

struct EncoderTables {
  ContextModel model;
  RansKernel kernel = RansKernel::Auto;
  std::vector<std::uint64_t> pair, single;        // [K][256], [K][16]: packed EncSym (context_kernels.hpp)
  std::vector<std::uint32_t> pair_freq, pair_cum;  // [K][256]: the reference kernel's f and cum
  mutable UninitVector<std::uint8_t> units;
  mutable UninitVector<std::uint16_t> words;
};

struct DecoderTables {
  ContextModel model;
  RansKernel kernel = RansKernel::Auto;
  mutable std::vector<std::uint32_t> table[2];  // pair, single: built on first use
  mutable UninitVector<std::uint8_t> units;
  void ensure(int t) const {
    if (!table[t].empty()) return;
    const int s = kTableShift[t], K = model.classes();
    std::vector<std::uint32_t>& tab = table[t];
    tab.resize((static_cast<std::size_t>(K) << s) + 8);
    const CodeOrders orders(model);
    for (int k = 0; k < K; ++k) {
      std::uint32_t* base = tab.data() + (static_cast<std::size_t>(k) << s);
      std::array<std::uint32_t, 256> code;
      if (t == 0) {
        const auto F = pair_freqs(model, orders, k);
        for (std::uint32_t u = 0; u < 256; ++u) code[u] = u;
        fill_table(base, F.data(), code.data(), 256, s);
      } else {
        const FrequencyTable& g = model.table(k);
        for (int a = 0; a < g.alphabet_size(); ++a) code[static_cast<std::size_t>(a)] = static_cast<std::uint32_t>(a | a << 4);
        fill_table(base, g.freqs().data(), code.data(), static_cast<std::size_t>(g.alphabet_size()), s);
      }
    }
  }
};

}  // namespace context_detail

namespace {

bool use_avx2(RansKernel k) {
  if (k == RansKernel::Scalar) return false;
  if (k == RansKernel::Avx2) require(rans_avx2_available(), "context coder: the AVX2 kernel was requested but this CPU has no AVX2");
  if (k == RansKernel::Avx512)  // no 16-lane kernel here: the AVX2 one
    require(rans_avx512_available(), "context coder: the AVX-512 kernel was requested but this CPU has no AVX-512");
  return rans_avx2_available();
}

[[noreturn]] void throw_uncodable(std::size_t i) {
  throw InvalidArgument("context coder: unit " + std::to_string(i) + " holds a code the model gives frequency 0 (build the model from these codes)");
}

// Encoder, backwards over units [0, n): `reference` divides (the textbook step), else reciprocal
// constants (EncSym), as the AVX2 kernel. Words go below ptr.
std::uint16_t* encode_scalar(std::uint32_t* x, const std::uint8_t* units, std::size_t n, const EncoderTables& T, const KernelTables& kt,
                             bool reference, std::uint16_t* ptr) {
  if (n == 0) return ptr;
  const std::size_t C = kt.C;
  std::size_t r = (n - 1) / C, ch = (n - 1) % C;
  for (std::size_t i = n; i-- > 0;) {
    const std::uint8_t kd = kt.kind[r];
    const int k = kd & kStartRow ? kt.start_class : kt.cls[units[i - C] >> 4];
    const bool single = kd & kSingleRow;
    const std::uint8_t u = units[i];
    std::uint32_t& xi = x[i & (kLanes - 1)];
    if (reference) {
      const int s = kTableShift[single];
      std::uint32_t f, c;
      if (single) {
        const FrequencyTable& g = T.model.table(k);
        f = g.freq(u & 15), c = g.cum(u & 15);
      } else {
        f = T.pair_freq[static_cast<std::size_t>(k) * 256 + u], c = T.pair_cum[static_cast<std::size_t>(k) * 256 + u];
      }
      if (f == 0) throw_uncodable(i);
      if (xi >= f << (31 - s)) {
        *--ptr = static_cast<std::uint16_t>(xi);
        xi >>= 16;
      }
      xi = ((xi / f) << s) + xi % f + c;
    } else {
      const std::uint64_t e = single ? T.single[static_cast<std::size_t>(k) * 16 + (u & 15)] : T.pair[static_cast<std::size_t>(k) * 256 + u];
      const auto rcp = static_cast<std::uint32_t>(e), hw = static_cast<std::uint32_t>(e >> 32);
      if (rcp == 0) throw_uncodable(i);
      const std::uint32_t cmpl = hw >> 13 & 0x1fff, x_max = ((1u << kTableShift[single]) - cmpl) << (31 - kTableShift[single]);
      const std::uint32_t renorm = xi >= x_max;
      ptr[-1] = static_cast<std::uint16_t>(xi);
      ptr -= renorm;
      xi >>= renorm << 4;
      const std::uint32_t q = static_cast<std::uint32_t>((static_cast<std::uint64_t>(xi) * rcp) >> 32) >> (hw >> 26);
      xi = xi + (hw & 0x1fff) + q * cmpl;
    }
    if (ch-- == 0) ch = C - 1, --r;  // (wraps once after unit 0, unused then)
  }
  return ptr;
}

// Decoder over units [i, n): the reference, and the tail of the AVX2 kernel.
const std::uint8_t* decode_scalar(std::uint32_t* x, std::uint8_t* units, std::size_t i, std::size_t n, const DecodeKernelTables& t,
                                  const std::uint8_t* p, const std::uint8_t* end) {
  if (i >= n) return p;
  const std::size_t C = t.C;
  for (std::size_t r = i / C, ch = i % C; i < n; ++i) {
    const std::uint8_t kd = t.kind[r];
    const int k = kd & kStartRow ? t.start_class : t.cls[units[i - C] >> 4];
    const int single = kd & kSingleRow, s = kTableShift[single];
    const std::uint32_t mask = (1u << s) - 1;
    std::uint32_t& xi = x[i & (kLanes - 1)];
    const std::uint32_t e = t.table[single][(static_cast<std::size_t>(k) << s) + (xi & mask)];
    units[i] = static_cast<std::uint8_t>(e >> (2 * s));
    xi = ((e & mask) + 1) * (xi >> s) + ((e >> s) & mask);
    if (xi < kL) {
      if (end - p < 2) throw FormatError("context coder: payload truncated (ran out of renormalisation words)");
      xi = xi << 16 | static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8;
      p += 2;
    }
    if (++ch == C) ch = 0, ++r;
  }
  return p;
}

}  // namespace

ContextEncoder::ContextEncoder(const ContextModel& model, RansKernel kernel) : t_(std::make_unique<EncoderTables>()) {
  t_->model = model;
  t_->kernel = kernel;
  const int K = model.classes();
  t_->pair.assign(static_cast<std::size_t>(K) * 256, 0);
  t_->pair_freq.assign(static_cast<std::size_t>(K) * 256, 0);
  t_->pair_cum.assign(static_cast<std::size_t>(K) * 256, 0);
  t_->single.assign(static_cast<std::size_t>(K) * 16, 0);
  const CodeOrders orders(model);
  for (int k = 0; k < K; ++k) {
    const auto F = pair_freqs(model, orders, k);
    std::uint32_t cum = 0;
    for (std::size_t u = 0; u < 256; ++u) {
      const std::size_t at = static_cast<std::size_t>(k) * 256 + u;
      t_->pair_freq[at] = F[u];
      t_->pair_cum[at] = cum;
      t_->pair[at] = F[u] ? pack_enc(rans_detail::make_enc_sym(F[u], cum, kPairScaleBits)) : 0;
      cum += F[u];
    }
    const FrequencyTable& g = model.table(k);
    for (int a = 0; a < g.alphabet_size(); ++a)
      t_->single[static_cast<std::size_t>(k) * 16 + static_cast<std::size_t>(a)] =
          g.freq(a) ? pack_enc(rans_detail::make_enc_sym(g.freq(a), g.cum(a), kSingleScaleBits)) : 0;
  }
}
ContextEncoder::~ContextEncoder() = default;
ContextEncoder::ContextEncoder(ContextEncoder&&) noexcept = default;
ContextEncoder& ContextEncoder::operator=(ContextEncoder&&) noexcept = default;

void ContextEncoder::encode(ContextSlices codes, const ContextLayout& l, std::vector<std::uint8_t>& out) const {
  check_slices(codes, checked_layout(l, t_->model), "the codes");
  const Plan pl = plan_of(l, rows_of(l));
  const Rows& rows = pl.rows;
  const std::size_t C = pl.C, total = pl.total, L = kLanes, m = pl.tail, coded = pl.coded;
  auto& units = t_->units;
  units.resize(total);
  if (total) {
    const std::uint8_t any = to_units(codes, l, rows, units.data());
    require(any < (1 << l.bits), "context coder: a code is outside 0.." + std::to_string((1 << l.bits) - 1));
  }
  EncodeKernelTables kt;
  fill_kernel_tables(kt, t_->model, C, rows.kind.data());
  kt.pair = t_->pair.data();
  kt.single = t_->single.data();

  // Start states: 2^15 + the tail (bits back).
  std::uint32_t x[kLanes];
  for (std::size_t j = 0; j < L; ++j) {
    std::uint32_t v = 0;
    int off = 0;
    for (std::size_t q = 0; q < m; ++q) {
      const std::size_t u = coded + L * q + j;
      int w = 0;
      v |= tail_value(units[u], rows.kind[u / C], l.bits, w) << off;
      off += w;
    }
    x[j] = kL + v;
  }
  auto& words = t_->words;
  words.resize(coded + rans_detail::kEncodeSlackWords);
  std::uint16_t* const wend = words.data() + words.size();
  std::uint16_t* ptr = wend;
  if (coded > 0) {
    if (use_avx2(t_->kernel) && C % L == 0) {
      ptr = encode_avx2(x, units.data(), coded, kt, ptr);
      if (!ptr) throw InvalidArgument("context coder: a code the model gives frequency 0 (build the model from these codes)");
    } else {
      ptr = encode_scalar(x, units.data(), coded, *t_, kt, t_->kernel == RansKernel::Scalar, ptr);
    }
  }
  entropy_detail::put_varint(out, coded);
  const std::size_t n_states = std::min<std::size_t>(coded, L);
  const std::size_t n_words = static_cast<std::size_t>(wend - ptr);
  const std::size_t at = out.size();
  out.resize(at + 4 * n_states + 2 * n_words);
  std::uint8_t* o = out.data() + at;
  for (std::size_t j = 0; j < n_states; ++j, o += 4)
    for (int b = 0; b < 4; ++b) o[b] = static_cast<std::uint8_t>(x[j] >> (8 * b));
  if (n_words) std::memcpy(o, ptr, 2 * n_words);  // little-endian words (rans.cpp asserts the platform)
}

void ContextEncoder::encode(std::span<const std::uint8_t> codes, const ContextLayout& l, std::vector<std::uint8_t>& out) const {
  check_layout(l);
  const auto s = split(codes, l);
  encode(ContextSlices(s), l, out);
}

// ---- decoder ----

ContextDecoder::ContextDecoder(const ContextModel& model, RansKernel kernel) : t_(std::make_unique<DecoderTables>()) {
  t_->model = model;
  t_->kernel = kernel;
}
ContextDecoder::~ContextDecoder() = default;
ContextDecoder::ContextDecoder(ContextDecoder&&) noexcept = default;
ContextDecoder& ContextDecoder::operator=(ContextDecoder&&) noexcept = default;

void ContextDecoder::decode(std::span<const std::uint8_t> payload, const ContextLayout& l, ContextSlicesOut codes) const {
  check_slices(codes, checked_layout(l, t_->model), "the output");
  const Plan pl = plan_of(l, rows_of(l));
  const Rows& rows = pl.rows;
  const std::size_t C = pl.C, total = pl.total, L = kLanes, m = pl.tail, coded = pl.coded;
  entropy_detail::ByteReader r(payload, "context coder");
  if (r.varint(total, "unit count") != coded) r.fail("the rANS stream holds the wrong number of units (expected " + std::to_string(coded) + ")");
  std::uint32_t x[kLanes];
  for (std::size_t j = 0; j < L; ++j) {
    x[j] = kL;
    if (j < coded) {
      x[j] = r.u32le();
      if (x[j] < kL || x[j] >= (kL << 16)) r.fail("lane " + std::to_string(j) + " state is outside [2^15, 2^31)");
    }
  }
  if (r.remaining() % 2) r.fail("payload has an odd number of bytes");
  const std::uint8_t* p = r.rest().data();
  const std::uint8_t* const end = p + r.remaining();
  if (total == 0) {
    if (p != end) r.fail("bytes after an empty payload");
    return;
  }
  bool has[2] = {false, false};
  for (const auto kd : rows.kind) has[kd & kSingleRow] = true;
  for (int t = 0; t < 2; ++t)
    if (has[t]) t_->ensure(t);
  DecodeKernelTables kt;
  fill_kernel_tables(kt, t_->model, C, rows.kind.data());
  kt.table[0] = t_->table[0].data();
  kt.table[1] = t_->table[1].data();
  auto& units = t_->units;
  units.resize(total);
  std::size_t i = 0;
  if (use_avx2(t_->kernel) && C % L == 0) p = decode_avx2(x, units.data(), i, coded, kt, p, end);
  p = decode_scalar(x, units.data(), i, coded, kt, p, end);
  if (p != end) throw FormatError("context coder: " + std::to_string((end - p) / 2) + " renormalisation words left over (corrupt)");
  for (std::size_t j = 0; j < L; ++j) {
    std::uint32_t v = x[j] - kL;
    for (std::size_t q = 0; q < m; ++q) {
      const std::size_t u = coded + L * q + j;
      const std::uint8_t kd = rows.kind[u / C];
      const int w = kd & kSingleRow ? l.bits : 2 * l.bits;
      const std::uint32_t a = v & ((1u << l.bits) - 1), b = kd & kSingleRow ? a : (v >> l.bits) & ((1u << l.bits) - 1);
      units[u] = static_cast<std::uint8_t>(a | b << 4);
      v >>= w;
    }
    if (v != 0) throw FormatError("context coder: lane " + std::to_string(j) + " ends in a state that holds no tail (corrupt input)");
  }
  from_units(units.data(), l, rows, codes);
}

void ContextDecoder::decode(std::span<const std::uint8_t> payload, const ContextLayout& l, std::span<std::uint8_t> codes) const {
  check_layout(l);
  const auto s = split(codes, l);
  decode(payload, l, ContextSlicesOut(s));
}

std::uint64_t context_payload_units(std::span<const std::uint8_t> payload) {
  entropy_detail::ByteReader r(payload, "context coder");
  return r.varint(~0ull, "unit count");
}

std::uint64_t context_coded_units(const ContextLayout& l) {
  check_layout(l);
  return plan_of(l, rows_of(l)).coded;
}

// ---- one block ----

std::vector<std::uint8_t> context_encode(ContextSlices codes, const ContextLayout& layout, ContextCodedSize* size, RansKernel kernel) {
  const ContextModel model = ContextModel::build(codes, layout);
  std::vector<std::uint8_t> out;
  model.serialize_to(out);
  const std::size_t model_bytes = out.size();
  ContextEncoder(model, kernel).encode(codes, layout, out);
  if (size) {
    const std::size_t tables = [&] {
      std::size_t n = 0;
      for (int k = 0; k < model.classes(); ++k) n += model.table(k).serialized_size();
      return n;
    }();
    *size = {model_bytes - tables, tables, out.size() - model_bytes, static_cast<std::size_t>(model.classes())};
  }
  return out;
}

std::vector<std::uint8_t> context_encode(std::span<const std::uint8_t> codes, const ContextLayout& layout, ContextCodedSize* size,
                                         RansKernel kernel) {
  check_layout(layout);
  const auto s = split(codes, layout);
  return context_encode(ContextSlices(s), layout, size, kernel);
}

void context_decode(std::span<const std::uint8_t> bytes, const ContextLayout& layout, ContextSlicesOut codes, RansKernel kernel) {
  check_layout(layout);
  std::size_t used = 0;
  const ContextModel model = ContextModel::deserialize(bytes, layout.bits, &used);
  ContextDecoder(model, kernel).decode(bytes.subspan(used), layout, codes);
}

void context_decode(std::span<const std::uint8_t> bytes, const ContextLayout& layout, std::span<std::uint8_t> codes, RansKernel kernel) {
  check_layout(layout);
  const auto s = split(codes, layout);
  context_decode(bytes, layout, ContextSlicesOut(s), kernel);
}

}  // namespace vq
