// The context coder's encoder and decoder (context_coder.hpp): rows and units, the scalar kernels
// and ContextEncoder / ContextDecoder; the AVX2 kernels are in context_avx2.cpp (same bytes and
// codes). The model they code with: context_model.cpp.
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

namespace {

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

