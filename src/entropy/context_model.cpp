// The context coder's model (context_coder.hpp): histograms of (context, code), the greedy merge
// of contexts into classes and their tables, serialisation, and the pair tables derived from the
// class tables. The coder that uses it: context_codec.cpp.
#include "veloxquant/entropy/context_coder.hpp"

#include <emmintrin.h>

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
#include "context_shared.hpp"

namespace vq {

using namespace context_detail;

namespace context_detail {

void check_layout(const ContextLayout& l) {
  require(l.bits >= 1 && l.bits <= kContextMaxBits,
          "context coder: bits " + std::to_string(l.bits) + " is outside 1.." + std::to_string(kContextMaxBits));
  require(l.group_start.size() == l.tokens, "context coder: group_start must hold one flag per token");
  require(l.tokens == 0 || l.group_start[0] != 0, "context coder: a group must start at token 0");
  require(l.dim == 0 || l.slices == 0 || l.tokens <= (std::size_t{1} << 40) / l.dim / l.slices, "context coder: stream too large");
}

}  // namespace context_detail

namespace {

constexpr std::uint32_t kL = kRansStateLow;
using Histogram = std::array<std::uint64_t, 1 << kContextMaxBits>;
using RawHistograms = std::array<Histogram, kContextMaxContexts>;

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

namespace context_detail {


// F[a | b << 4] of class k's pair table (total 2^12). Row a (f = freq_k(a) > 0) gets exactly
// 4 f units, spread over the codes b of a's class table g in proportion (rounded, >= 1 for every
// code g can code); the rounding error of the row goes +-1 to its b in order of descending g (ties:
// lower b first), cycling. A row with fewer units than codes to cover (f < 4 and more than 4 f
// codes in g) gives each code 1 and borrows the difference from the largest entries of the table.
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

}  // namespace context_detail

FrequencyTable pair_frequency_table(const ContextModel& model, int k) {
  require(k >= 0 && k < model.classes(), "pair_frequency_table: class " + std::to_string(k) + " is outside 0.." + std::to_string(model.classes() - 1));
  const auto F = pair_freqs(model, CodeOrders(model), k);
  return FrequencyTable::from_frequencies(F, kPairScaleBits);
}

}  // namespace vq
