// rANS framing, the scalar reference kernels and kernel dispatch. See rans.hpp for the format.
#include "veloxquant/entropy/rans.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>
#include <string>

#include "byte_io.hpp"
#include "rans_kernels.hpp"
#include "veloxquant/core/error.hpp"

static_assert(sizeof(vq::rans_detail::EncSym) == 16, "the AVX2 encoder gathers EncSym fields at a 16-byte stride");
static_assert(std::endian::native == std::endian::little, "the rANS word buffer is copied as little-endian");

namespace vq {
namespace rans_detail {

void throw_truncated() { throw FormatError("rANS stream: payload truncated (ran out of renormalisation words)"); }

// The decoder's renormalisation: a state below kL takes the next 16-bit word (little-endian).
inline void renormalise(std::uint32_t& xi, const std::uint8_t*& p, const std::uint8_t* end) {
  if (xi < kL) {
    if (end - p < 2) throw_truncated();
    xi = xi << 16 | static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8;
    p += 2;
  }
}

namespace {
// ceil(2^(shift+31) / f) with shift = ceil(log2 f), for f >= 2.
struct Reciprocal {
  std::uint32_t rcp;
  std::uint16_t shift;
};
Reciprocal reciprocal(std::uint32_t f) {
  std::uint32_t shift = 0;
  while (f > (1u << shift)) ++shift;
  return {static_cast<std::uint32_t>(((1ull << (shift + 31)) + f - 1) / f), static_cast<std::uint16_t>(shift - 1)};
}
constexpr std::uint32_t kCachedReciprocals = 1u << 12;
const Reciprocal* reciprocal_table() {
  static const std::vector<Reciprocal> t = [] {
    std::vector<Reciprocal> r(kCachedReciprocals + 1);
    for (std::uint32_t f = 2; f <= kCachedReciprocals; ++f) r[f] = reciprocal(f);
    return r;
  }();
  return t.data();
}
}  // namespace

EncSym make_enc_sym(std::uint32_t f, std::uint32_t c, int s) {
  const std::uint32_t M = 1u << s;
  EncSym e;
  e.x_max = f << (31 - s);  // <= 2^31: fits
  e.cmpl_freq = static_cast<std::uint16_t>(M - f);
  if (f == 1) {
    // q = x * (2^32 - 1) >> 32 = x - 1 for 1 <= x < 2^32; x + (c + M - 1) + (x - 1)(M - 1) = x*M + c.
    e.rcp_freq = ~0u;
    e.rcp_shift = 0;
    e.bias = c + M - 1;
  } else {
    const Reciprocal r = f <= kCachedReciprocals ? reciprocal_table()[f] : reciprocal(f);
    e.rcp_freq = r.rcp;
    e.rcp_shift = r.shift;
    e.bias = c;
  }
  return e;
}

std::vector<EncSym> make_enc_syms(const FrequencyTable& t) {
  std::vector<EncSym> es(static_cast<std::size_t>(t.alphabet_size()));
  for (int i = 0; i < t.alphabet_size(); ++i)
    if (t.freq(i) != 0) es[static_cast<std::size_t>(i)] = make_enc_sym(t.freq(i), t.cum(i), t.scale_bits());
  return es;
}

void DecTables::build(const FrequencyTable& t, bool need_sym) {
  const std::uint32_t M = t.total();
  const int sb = t.scale_bits();
  const bool pack = 2 * sb + std::bit_width(static_cast<unsigned>(t.alphabet_size() - 1)) <= 32;
  // Building costs 2^scale_bits writes per table, as much as decoding a few thousand symbols:
  // fill only what the kernels read (sym for the scalar kernel or without packed; packed, or else
  // entry, for AVX2).
  const bool with_sym = need_sym || !pack;
  entry.resize(pack || need_sym ? 0 : M);
  packed.resize(pack && !need_sym ? M + 4 : 0);  // +4: the fill below writes in blocks of 4
  sym.resize(with_sym ? M + 2 : 0);
  if (with_sym) sym[M] = sym[M + 1] = 0;
  for (int s = 0; s < t.alphabet_size(); ++s) {
    const std::uint32_t f = t.freq(s), c = t.cum(s);
    if (with_sym) std::fill_n(sym.data() + c, f, static_cast<std::uint16_t>(s));
    if (!packed.empty()) {
      const std::uint32_t e0 = (f - 1) | static_cast<std::uint32_t>(s) << (2 * sb);
      // Blocks of 4 (one SSE store): the overrun lands on the next symbols' entries, written after.
      std::uint32_t* e = packed.data() + c;
      for (std::uint32_t k = 0; k < f; k += 4) {
        e[k] = e0 | k << sb;
        e[k + 1] = e0 | (k + 1) << sb;
        e[k + 2] = e0 | (k + 2) << sb;
        e[k + 3] = e0 | (k + 3) << sb;
      }
    } else if (!entry.empty()) {
      std::uint32_t* e = entry.data() + c;
      for (std::uint32_t k = 0; k < f; ++k) e[k] = f << 16 | k;
    }
  }
}

// Reference encoder: the textbook step x' = (x / f) * M + x % f + cum, with a real division.
std::uint16_t* encode_scalar(std::uint32_t* x, const std::uint16_t* sym, std::size_t n, std::size_t base,
                             const FrequencyTable& t, std::uint16_t* ptr) {
  const int s = t.scale_bits();
  std::size_t lane = (base + n - 1) & kLaneMask;
  for (std::size_t i = n; i-- > 0;) {
    const std::uint32_t f = t.freq(sym[i]), c = t.cum(sym[i]);
    std::uint32_t xi = x[lane];
    if (xi >= (f << (31 - s))) {
      *--ptr = static_cast<std::uint16_t>(xi);
      xi >>= 16;
    }
    x[lane] = ((xi / f) << s) + xi % f + c;
    lane = (lane - 1) & kLaneMask;
  }
  return ptr;
}

// Fast encoder: reciprocal multiply instead of division, branch-free renormalisation (the word is
// always stored at ptr[-1]; the pointer only moves when it was needed, so a stray store lands
// below the data and is overwritten later or falls into the slack).
std::uint16_t* encode_fast(std::uint32_t* x, const std::uint16_t* sym, std::size_t n, std::size_t base,
                           const EncSym* es, std::uint16_t* ptr) {
  std::size_t lane = (base + n - 1) & kLaneMask;
  for (std::size_t i = n; i-- > 0;) {
    const EncSym& e = es[sym[i]];
    std::uint32_t xi = x[lane];
    const std::uint32_t c = xi >= e.x_max;
    ptr[-1] = static_cast<std::uint16_t>(xi);
    ptr -= c;
    xi >>= c << 4;
    const std::uint32_t q =
        static_cast<std::uint32_t>((static_cast<std::uint64_t>(xi) * e.rcp_freq) >> 32) >> e.rcp_shift;
    x[lane] = xi + e.bias + q * e.cmpl_freq;
    lane = (lane - 1) & kLaneMask;
  }
  return ptr;
}

const std::uint8_t* decode_scalar(std::uint32_t* x, std::uint16_t* out, std::size_t n, std::size_t base,
                                  const FrequencyTable& t, const std::uint16_t* slot_sym, const std::uint8_t* p,
                                  const std::uint8_t* end) {
  const int s = t.scale_bits();
  const std::uint32_t mask = t.total() - 1;
  std::size_t lane = base & kLaneMask;
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t xi = x[lane];
    const std::uint32_t slot = xi & mask;
    const std::uint16_t sy = slot_sym[slot];
    xi = t.freq(sy) * (xi >> s) + slot - t.cum(sy);
    renormalise(xi, p, end);
    x[lane] = xi;
    out[i] = sy;
    lane = (lane + 1) & kLaneMask;
  }
  return p;
}

const std::uint8_t* decode_scalar_packed(std::uint32_t* x, std::uint16_t* out, std::size_t n, std::size_t base,
                                         const FrequencyTable& t, const std::uint32_t* packed, const std::uint8_t* p,
                                         const std::uint8_t* end) {
  const int s = t.scale_bits();
  const std::uint32_t mask = t.total() - 1;
  std::size_t lane = base & kLaneMask;
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t xi = x[lane];
    const std::uint32_t e = packed[xi & mask];
    xi = ((e & mask) + 1) * (xi >> s) + ((e >> s) & mask);
    renormalise(xi, p, end);
    x[lane] = xi;
    out[i] = static_cast<std::uint16_t>(e >> (2 * s));
    lane = (lane + 1) & kLaneMask;
  }
  return p;
}

const std::uint8_t* decode_scalar_search(std::uint32_t* x, std::uint16_t* out, std::size_t n, std::size_t base,
                                         const FrequencyTable& t, const std::uint8_t* p, const std::uint8_t* end) {
  const int s = t.scale_bits(), a = t.alphabet_size();
  const std::uint32_t mask = t.total() - 1;
  std::size_t lane = base & kLaneMask;
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t xi = x[lane];
    const std::uint32_t slot = xi & mask;
    int sy = 0;
    while (sy + 1 < a && t.cum(sy + 1) <= slot) ++sy;  // the last symbol whose range starts at or below slot
    xi = t.freq(sy) * (xi >> s) + slot - t.cum(sy);
    renormalise(xi, p, end);
    x[lane] = xi;
    out[i] = static_cast<std::uint16_t>(sy);
    lane = (lane + 1) & kLaneMask;
  }
  return p;
}

}  // namespace rans_detail

using namespace rans_detail;

namespace {

bool use_avx2(RansKernel k) {
  switch (k) {
    case RansKernel::Scalar:
      return false;
    case RansKernel::Avx2:
      require(rans_avx2_available(), "rANS: the AVX2 kernel was requested but this CPU has no AVX2");
      return true;
    case RansKernel::Avx512:  // no 16-lane kernel here: the AVX2 one
      require(rans_avx512_available(), "rANS: the AVX-512 kernel was requested but this CPU has no AVX-512");
      return true;
    case RansKernel::Auto:
    default:
      return rans_avx2_available();
  }
}

void validate_segment(const RansEncodeSegment& seg) {
  require(seg.table != nullptr, "rANS encode: a segment has no frequency table");
  const FrequencyTable& t = *seg.table;
  const auto a = static_cast<std::uint32_t>(t.alphabet_size());
  std::uint32_t bad = 0;
  if (t.present_symbols() == t.alphabet_size()) {
    // Every symbol of the alphabet is codable: the largest symbol decides (a vectorised max).
    std::uint16_t mx = 0;
    for (auto s : seg.symbols) mx = std::max(mx, s);
    bad = !seg.symbols.empty() && mx >= a;
  } else {
    // bad[v] for v < 512 (>= kMaxAlphabet + 1): branch-free check, one byte lookup per symbol.
    std::uint8_t bad_of[512];
    for (std::uint32_t v = 0; v < 512; ++v) bad_of[v] = v >= a || t.freq(static_cast<int>(v)) == 0;
    for (auto s : seg.symbols) bad |= static_cast<std::uint32_t>(s >> 9) | bad_of[s & 511];
  }
  if (bad) {
    for (auto s : seg.symbols)
      require(s < a && t.freq(s) != 0, "rANS encode: symbol " + std::to_string(s) +
                                           (s < a ? " has frequency 0 in its table" : " is outside the table's alphabet"));
  }
}

struct Header {
  std::uint64_t n = 0;
  std::uint32_t x[kRansLanes];
  std::span<const std::uint8_t> words;
};

Header read_header(std::span<const std::uint8_t> bytes) {
  entropy_detail::ByteReader r(bytes, "rANS stream");
  Header h;
  h.n = r.varint(~0ull, "symbol count");
  const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(h.n, kRansLanes));
  for (std::size_t j = 0; j < kRansLanes; ++j) h.x[j] = kL;
  for (std::size_t j = 0; j < k; ++j) {
    h.x[j] = r.u32le();
    if (h.x[j] < kL || h.x[j] >= (kL << 16))
      r.fail("state of lane " + std::to_string(j) + " = " + std::to_string(h.x[j]) + " is outside [2^15, 2^31)");
  }
  h.words = r.rest();
  if (h.words.size() % 2) r.fail("payload has an odd number of bytes");
  return h;
}

}  // namespace

std::size_t rans_encode_bound(std::size_t n) {
  return entropy_detail::varint_size(n) + 4 * std::min<std::size_t>(n, kRansLanes) + 2 * n;
}

namespace {
// The encoder writes its words backwards into a scratch buffer, then copies them after the header.
// The scratch is kept per thread between calls (no allocation, no page faults in steady state) up
// to kKeepScratchWords; larger streams get a temporary buffer.
constexpr std::size_t kKeepScratchWords = std::size_t{1} << 23;  // 16 MiB
struct Scratch {
  std::unique_ptr<std::uint16_t[]> buf;
  std::size_t size = 0;
};
}  // namespace

void rans_encode_append(std::vector<std::uint8_t>& out, std::span<const RansEncodeSegment> segments, RansKernel kernel) {
  const bool fast = use_avx2(kernel);
  std::size_t n = 0;
  for (const auto& seg : segments) {
    validate_segment(seg);
    n += seg.symbols.size();
  }
  thread_local Scratch scratch;
  std::unique_ptr<std::uint16_t[]> temp;
  const std::size_t need = n + kEncodeSlackWords;
  std::uint16_t* buf;
  if (need <= scratch.size) {
    buf = scratch.buf.get();
  } else if (need <= kKeepScratchWords) {
    scratch.buf.reset(new std::uint16_t[need]);
    scratch.size = need;
    buf = scratch.buf.get();
  } else {
    temp.reset(new std::uint16_t[need]);
    buf = temp.get();
  }
  std::uint16_t* const end = buf + need;
  std::uint16_t* ptr = end;
  std::uint32_t x[kRansLanes];
  for (auto& v : x) v = kL;
  std::size_t base = n;
  std::vector<EncSym> es;
  const FrequencyTable* built = nullptr;
  for (std::size_t k = segments.size(); k-- > 0;) {
    const auto& seg = segments[k];
    base -= seg.symbols.size();
    if (seg.symbols.empty()) continue;
    if (fast) {
      if (built == nullptr || !(*built == *seg.table)) {
        es = make_enc_syms(*seg.table);
        built = seg.table;
      }
      ptr = encode_avx2(x, seg.symbols.data(), seg.symbols.size(), base, *seg.table, es.data(), ptr);
    } else {
      ptr = encode_scalar(x, seg.symbols.data(), seg.symbols.size(), base, *seg.table, ptr);
    }
  }
  const std::size_t words = static_cast<std::size_t>(end - ptr);
  const std::size_t k = std::min<std::size_t>(n, kRansLanes);
  entropy_detail::put_varint(out, n);
  out.resize(out.size() + 4 * k + 2 * words);
  std::uint8_t* o = out.data() + out.size() - 4 * k - 2 * words;
  for (std::size_t j = 0; j < k; ++j, o += 4) {
    o[0] = static_cast<std::uint8_t>(x[j]);
    o[1] = static_cast<std::uint8_t>(x[j] >> 8);
    o[2] = static_cast<std::uint8_t>(x[j] >> 16);
    o[3] = static_cast<std::uint8_t>(x[j] >> 24);
  }
  if (words) std::memcpy(o, ptr, 2 * words);
}

std::vector<std::uint8_t> rans_encode(std::span<const RansEncodeSegment> segments, RansKernel kernel) {
  std::vector<std::uint8_t> out;
  rans_encode_append(out, segments, kernel);
  return out;
}

std::vector<std::uint8_t> rans_encode(std::span<const std::uint16_t> symbols, const FrequencyTable& table,
                                      RansKernel kernel) {
  const RansEncodeSegment seg{symbols, &table};
  return rans_encode(std::span<const RansEncodeSegment>(&seg, 1), kernel);
}

std::uint64_t rans_stream_symbols(std::span<const std::uint8_t> bytes) {
  entropy_detail::ByteReader r(bytes, "rANS stream");
  return r.varint(~0ull, "symbol count");
}

void rans_decode(std::span<const std::uint8_t> bytes, std::span<const RansDecodeSegment> segments, RansKernel kernel) {
  const bool fast = use_avx2(kernel);
  std::uint64_t expected = 0;
  for (const auto& seg : segments) {
    require(seg.table != nullptr, "rANS decode: a segment has no frequency table");
    expected += seg.out.size();
  }
  Header h = read_header(bytes);
  if (h.n != expected)
    throw FormatError("rANS stream: holds " + std::to_string(h.n) + " symbols, the caller expects " +
                      std::to_string(expected));
  const std::uint8_t* p = h.words.data();
  const std::uint8_t* const end = p + h.words.size();
  DecTables d;
  const FrequencyTable* built = nullptr;
  std::size_t base = 0;
  for (const auto& seg : segments) {
    if (seg.out.empty()) continue;
    if (fast && seg.table->alphabet_size() <= kRansSmallAlphabet) {
      // No slot table to build: the symbol is found by comparing against cum in registers.
      p = decode_small_avx2(h.x, seg.out.data(), seg.out.size(), base, *seg.table, p, end);
      base += seg.out.size();
      continue;
    }
    if (built == nullptr || !(*built == *seg.table)) {
      d.build(*seg.table, !fast);
      built = seg.table;
    }
    if (fast)
      p = decode_avx2(h.x, seg.out.data(), seg.out.size(), base, *seg.table, d, p, end);
    else
      p = decode_scalar(h.x, seg.out.data(), seg.out.size(), base, *seg.table, d.sym.data(), p, end);
    base += seg.out.size();
  }
  if (p != end)
    throw FormatError("rANS stream: " + std::to_string((end - p) / 2) + " renormalisation words left over (corrupt)");
  for (int j = 0; j < kRansLanes; ++j)
    if (h.x[j] != kL)
      throw FormatError("rANS stream: lane " + std::to_string(j) +
                        " did not return to its initial state (corrupt stream or wrong table)");
}

void rans_decode(std::span<const std::uint8_t> bytes, const FrequencyTable& table, std::span<std::uint16_t> out,
                 RansKernel kernel) {
  const RansDecodeSegment seg{out, &table};
  rans_decode(bytes, std::span<const RansDecodeSegment>(&seg, 1), kernel);
}

std::vector<std::uint8_t> encode_block(std::span<const std::uint16_t> symbols, int alphabet_size,
                                       const RansBlockOptions& options) {
  const auto table = FrequencyTable::from_symbols(symbols, alphabet_size, options.scale_bits);
  std::vector<std::uint8_t> out;
  out.reserve(table.serialized_size() + rans_encode_bound(symbols.size()));
  table.serialize_to(out);
  const RansEncodeSegment seg{symbols, &table};
  rans_encode_append(out, std::span<const RansEncodeSegment>(&seg, 1), options.kernel);
  return out;
}

std::vector<std::uint16_t> decode_block(std::span<const std::uint8_t> bytes, std::size_t max_symbols, RansKernel kernel) {
  std::size_t used = 0;
  const auto table = FrequencyTable::deserialize(bytes, &used);
  const auto stream = bytes.subspan(used);
  const auto n = rans_stream_symbols(stream);
  if (n > max_symbols)
    throw FormatError("rANS block: holds " + std::to_string(n) + " symbols, more than the limit " +
                      std::to_string(max_symbols));
  std::vector<std::uint16_t> out(static_cast<std::size_t>(n));
  rans_decode(stream, table, out, kernel);
  return out;
}

}  // namespace vq
