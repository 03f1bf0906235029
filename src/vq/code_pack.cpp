// Packing codes into a vq side's packed rows and back (code_pack.hpp).
#include "code_pack.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>

#if defined(__x86_64__)
#include <immintrin.h>
#define VQ_CODE_PACK_X86 1
#endif

namespace vq::code_pack {

namespace {
inline std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

// Each row's escapes by coefficient (a row's codes are visited in field order, not coefficient order).
void sort_row_escapes(std::vector<Escape>& esc, std::size_t from) {
  if (esc.size() - from > 1)
    std::sort(esc.begin() + static_cast<std::ptrdiff_t>(from), esc.end(), [](const Escape& a, const Escape& b) { return a.c < b.c; });
}

// One 16-bit group (fields of 2 bytes, little-endian), both directions: the reference's way.
inline void pack_group16(const std::int16_t* q, const std::int32_t* o, int m, std::int32_t t, std::uint8_t* at, std::vector<Escape>& esc) {
  constexpr std::int32_t bias = 1 << 15;
  for (int i = 0; i < m; ++i) {
    const std::int32_t v = q[o[i]];
    const auto f = static_cast<std::uint16_t>(v < bias && v > -bias ? v + bias : 0);
    if (!f) esc.push_back({t, o[i], v});
    std::memcpy(at + 2 * i, &f, 2);
  }
}
inline void unpack_group16(const std::uint8_t* at, const std::int32_t* o, int m, std::int16_t* out) {
  for (int i = 0; i < m; ++i) {
    std::uint16_t f;
    std::memcpy(&f, at + 2 * i, 2);
    out[o[i]] = static_cast<std::int16_t>(static_cast<std::int32_t>(f) - (1 << 15));
  }
}

std::atomic<bool> g_fast{true};

#ifdef VQ_CODE_PACK_X86
bool cpu_has_bmi2() {
  static const bool has = __builtin_cpu_supports("bmi2");
  return has;
}

// The low w bits of each of 8 bytes: pext gathers them into fields i*w, pdep spreads them back.
constexpr std::uint64_t kByteMask[9] = {0,
                                        0x0101010101010101ull,
                                        0x0303030303030303ull,
                                        0x0707070707070707ull,
                                        0x0f0f0f0f0f0f0f0full,
                                        0x1f1f1f1f1f1f1f1full,
                                        0x3f3f3f3f3f3f3f3full,
                                        0x7f7f7f7f7f7f7f7full,
                                        0xffffffffffffffffull};

// Per group of w <= 8: the 8 codes gathered (lanes >= m are 0), f = q + 2^(w-1) in 16-bit lanes,
// kept where 0 < f < 2^w (|q| < 2^(w-1): no lane overflows, |q| <= 32640), narrowed to bytes and
// packed with one pext. The 8-byte store puts zeros past the group's bytes: the next group (or row)
// overwrites them, the last row's land in the slack.
__attribute__((target("bmi2"))) void pack_rows_bmi2(const Layout& lay, const std::int16_t* codes, std::int64_t rows, std::int64_t t_first,
                                                    std::uint8_t* buf, std::vector<Escape>& esc) {
  const int n = lay.n, d = n / lay.heads;
  const std::uint32_t row_bytes = lay.row_bytes();
  const __m128i zero = _mm_setzero_si128();
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int16_t* q = codes + sz(r) * sz(n);
    std::uint8_t* row = buf + sz(t_first + r) * row_bytes;
    const auto t = static_cast<std::int32_t>(t_first + r);
    const std::size_t esc0 = esc.size();
    std::size_t g = 0;
    for (int h = 0; h < lay.heads; ++h)
      for (int p = 0; p < d; p += 8, ++g) {
        const std::int32_t* o = lay.order + sz(h) * sz(d) + sz(p);
        const int m = std::min(8, d - p);
        const unsigned w = lay.group_width[g];
        std::uint8_t* at = row + lay.group_byte[g];
        if (w > 8) {
          pack_group16(q, o, m, t, at, esc);
          continue;
        }
        __m128i v;
        if (m == 8) {
          v = _mm_setr_epi16(q[o[0]], q[o[1]], q[o[2]], q[o[3]], q[o[4]], q[o[5]], q[o[6]], q[o[7]]);
        } else {
          alignas(16) std::int16_t tmp[8] = {};
          for (int i = 0; i < m; ++i) tmp[i] = q[o[i]];
          v = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
        }
        const auto bias = static_cast<short>(1 << (w - 1));
        const __m128i f = _mm_add_epi16(v, _mm_set1_epi16(bias));
        const __m128i ok = _mm_and_si128(_mm_cmpgt_epi16(f, zero), _mm_cmpgt_epi16(_mm_set1_epi16(static_cast<short>(2 * bias)), f));
        const __m128i bytes = _mm_packus_epi16(_mm_and_si128(f, ok), zero);
        const std::uint64_t lanes = m == 8 ? ~std::uint64_t{0} : (std::uint64_t{1} << (8 * m)) - 1;
        const std::uint64_t packed = _pext_u64(static_cast<std::uint64_t>(_mm_cvtsi128_si64(bytes)) & lanes, kByteMask[w]);
        std::memcpy(at, &packed, 8);
        unsigned bad = ~static_cast<unsigned>(_mm_movemask_epi8(ok)) & 0xffffu & ((1u << (2 * m)) - 1);
        while (bad) {
          const int i = __builtin_ctz(bad) / 2;
          esc.push_back({t, o[i], q[o[i]]});
          bad &= ~(3u << (2 * i));
        }
      }
    sort_row_escapes(esc, esc0);
  }
}

// Heads of d = 64 or 128 fields (the 7B shape's 128) with AVX-512 VBMI, a row at a time:
// 1. in coefficient order, 32 codes per step: f = q + 2^(w_c-1), kept where 0 < f < 2^w_c (16-bit
//    coefficients always: their groups take the reference's path, which escapes them), narrowed
//    to bytes; the codes not kept are the row's escapes, found in coefficient order;
// 2. per head, the d field bytes permuted into field order (one or two vpermi2b);
// 3. per group of w <= 8, its 8 bytes packed with one pext and stored with one 8-byte write.
// No gather of single codes: ~1 instruction per code instead of ~6.
struct VbmiTables {
  std::vector<std::int16_t> bias, lo, hi;  // [n]: the bias (0 for 16-bit fields), and f must lie in (lo, hi)
  std::vector<std::uint8_t> perm;          // [n]: order[h*d + p] - h*d
};
VbmiTables vbmi_tables(const Layout& lay) {
  const int n = lay.n, d = n / lay.heads;
  VbmiTables t;
  t.bias.resize(sz(n)), t.lo.resize(sz(n)), t.hi.resize(sz(n)), t.perm.resize(sz(n));
  for (int c = 0; c < n; ++c) {
    const unsigned w = lay.width[c];
    t.bias[sz(c)] = static_cast<std::int16_t>(w > 8 ? 0 : 1 << (w - 1));
    t.lo[sz(c)] = 0;
    t.hi[sz(c)] = static_cast<std::int16_t>(w > 8 ? 0 : 1 << w);
    t.perm[sz(c)] = static_cast<std::uint8_t>(lay.order[c] - c / d * d);
  }
  return t;
}

// (g++ 12 warns of the undefined pass-through operand inside the narrowing and permuting
// intrinsics' own definitions: not our code's, and the values are all defined.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
__attribute__((target("avx512f,avx512bw,avx512vbmi,bmi2"))) void pack_rows_vbmi(const Layout& lay, const std::int16_t* codes,
                                                                                  std::int64_t rows, std::int64_t t_first,
                                                                                  std::uint8_t* buf, std::vector<Escape>& esc) {
  const int n = lay.n, d = n / lay.heads;
  const std::uint32_t row_bytes = lay.row_bytes();
  const VbmiTables tab = vbmi_tables(lay);
  std::vector<std::uint8_t> fields(sz(n) + 64), ordered(sz(n) + 64);
  const int groups = lay.heads * ((d + 7) / 8);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int16_t* q = codes + sz(r) * sz(n);
    std::uint8_t* row = buf + sz(t_first + r) * row_bytes;
    const auto t = static_cast<std::int32_t>(t_first + r);
    const std::size_t esc0 = esc.size();
    for (int c = 0; c < n; c += 32) {  // n is a multiple of 64
      const __m512i v = _mm512_loadu_si512(q + c);
      const __m512i bias = _mm512_loadu_si512(tab.bias.data() + c);
      const __m512i f = _mm512_add_epi16(v, bias);
      const __mmask32 ok = (_mm512_cmpgt_epi16_mask(f, _mm512_loadu_si512(tab.lo.data() + c)) &
                            _mm512_cmplt_epi16_mask(f, _mm512_loadu_si512(tab.hi.data() + c))) |
                           _mm512_cmpeq_epi16_mask(bias, _mm512_setzero_si512());  // bias 0: a 16-bit field
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(fields.data() + c), _mm512_cvtepi16_epi8(_mm512_maskz_mov_epi16(ok, f)));
      for (std::uint32_t bad = ~static_cast<std::uint32_t>(ok); bad; bad &= bad - 1) {
        const int i = c + __builtin_ctz(bad);
        esc.push_back({t, i, q[i]});
      }
    }
    for (int h = 0; h < lay.heads; ++h) {
      const std::uint8_t* in = fields.data() + sz(h) * sz(d);
      std::uint8_t* out = ordered.data() + sz(h) * sz(d);
      const __m512i a = _mm512_loadu_si512(in);
      if (d == 64) {
        _mm512_storeu_si512(out, _mm512_permutexvar_epi8(_mm512_loadu_si512(tab.perm.data() + sz(h) * 64), a));
      } else {
        const __m512i b = _mm512_loadu_si512(in + 64);
        _mm512_storeu_si512(out, _mm512_permutex2var_epi8(a, _mm512_loadu_si512(tab.perm.data() + sz(h) * 128), b));
        _mm512_storeu_si512(out + 64, _mm512_permutex2var_epi8(a, _mm512_loadu_si512(tab.perm.data() + sz(h) * 128 + 64), b));
      }
    }
    for (int g = 0; g < groups; ++g) {
      const unsigned w = lay.group_width[g];
      std::uint8_t* at = row + lay.group_byte[g];
      if (w > 8) {
        pack_group16(q, lay.order + sz(g) * 8, 8, t, at, esc);
        continue;
      }
      std::uint64_t x;
      std::memcpy(&x, ordered.data() + sz(g) * 8, 8);
      const std::uint64_t packed = _pext_u64(x, kByteMask[w]);
      std::memcpy(at, &packed, 8);
    }
    sort_row_escapes(esc, esc0);
  }
}

// Heads of d = 64 or 128 fields, no 16-bit group, with AVX-512 VBMI2: step 1 and 2 as above, then
// 8 groups at a time in one register instead of one pext per group: per 64-bit lane (a group of 8
// field bytes f_i < 2^w, w <= 7) vpmaddubsw (f_0 + f_1 2^w per 16 bits), vpmaddwd (per 32 bits),
// a variable shift (per 64 bits: sum f_i 2^(i w), pext's result); a group of w = 8 keeps its bytes;
// then vpcompressb keeps each lane's w low bytes, back to back: the row's bytes, stored masked.
struct Vbmi2Tables {
  std::vector<std::uint8_t> mul8;    // [groups * 8]: 1, 2^w, 1, 2^w, ... (unsigned bytes)
  std::vector<std::int16_t> mul16;   // [groups * 4]: 1, 2^(2w), 1, 2^(2w)
  std::vector<std::uint64_t> shift;  // [groups]: 4w
  std::vector<std::uint64_t> keep;   // per 8 groups: the low w bytes of each 64-bit lane
  std::vector<std::uint8_t> is8;     // per 8 groups: the lanes of w = 8
  std::vector<std::uint32_t> bytes;  // per 8 groups: their bytes (sum of w)
};
Vbmi2Tables vbmi2_tables(const Layout& lay) {
  const int groups = lay.n / 8;
  Vbmi2Tables t;
  t.mul8.resize(sz(groups) * 8), t.mul16.resize(sz(groups) * 4), t.shift.resize(sz(groups));
  t.keep.assign(sz(groups) / 8, 0), t.is8.assign(sz(groups) / 8, 0), t.bytes.assign(sz(groups) / 8, 0);
  for (int g = 0; g < groups; ++g) {
    const unsigned w = lay.group_width[g];
    for (int i = 0; i < 8; ++i) t.mul8[sz(g) * 8 + sz(i)] = static_cast<std::uint8_t>(i % 2 == 0 || w > 7 ? 1 : 1u << w);
    for (int i = 0; i < 4; ++i) t.mul16[sz(g) * 4 + sz(i)] = static_cast<std::int16_t>(i % 2 == 0 || w > 7 ? 1 : 1 << (2 * w));
    t.shift[sz(g)] = 4 * w;
    const int v = g / 8, lane = g % 8;
    t.keep[sz(v)] |= (w >= 8 ? std::uint64_t{0xff} : (std::uint64_t{1} << w) - 1) << (8 * lane);
    if (w == 8) t.is8[sz(v)] = static_cast<std::uint8_t>(t.is8[sz(v)] | 1u << lane);
    t.bytes[sz(v)] += w;
  }
  return t;
}
// 32 codes biased, checked (escapes out of their field's range, pushed in coefficient order) and
// narrowed to 32 field bytes (no 16-bit fields).
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vbmi2"))) inline __m256i narrow32(const VbmiTables& tab, const std::int16_t* q, int c,
                                                                                            std::int32_t t, std::vector<Escape>& esc) {
  const __m512i v = _mm512_loadu_si512(q + c);
  const __m512i f = _mm512_add_epi16(v, _mm512_loadu_si512(tab.bias.data() + c));
  const __mmask32 ok = _mm512_cmpgt_epi16_mask(f, _mm512_setzero_si512()) & _mm512_cmplt_epi16_mask(f, _mm512_loadu_si512(tab.hi.data() + c));
  for (std::uint32_t bad = ~static_cast<std::uint32_t>(ok); bad; bad &= bad - 1) {
    const int i = c + __builtin_ctz(bad);
    esc.push_back({t, i, q[i]});
  }
  return _mm512_cvtepi16_epi8(_mm512_maskz_mov_epi16(ok, f));
}
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vbmi2"))) void pack_rows_vbmi2(const Layout& lay, const std::int16_t* codes,
                                                                                          std::int64_t rows, std::int64_t t_first,
                                                                                          std::uint8_t* buf, std::vector<Escape>& esc) {
  const int n = lay.n, d = n / lay.heads;
  const std::uint32_t row_bytes = lay.row_bytes();
  const VbmiTables tab = vbmi_tables(lay);
  const Vbmi2Tables t2 = vbmi2_tables(lay);
  const __m512i lo32 = _mm512_set1_epi64(0xffffffffll);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int16_t* q = codes + sz(r) * sz(n);
    std::uint8_t* at = buf + sz(t_first + r) * row_bytes;
    const auto t = static_cast<std::int32_t>(t_first + r);
    for (int h = 0; h < lay.heads; ++h) {
      // The head's field bytes in registers (a: its first 64, b: the next 64), not through a
      // buffer: a 512-bit load of two 256-bit stores just made cannot be forwarded and stalled the
      // loop (~30 % of its samples).
      // (Each narrow32() in its own statement: escapes are pushed in coefficient order.)
      const int c0 = h * d;
      const __m256i f0 = narrow32(tab, q, c0, t, esc);
      const __m256i f1 = narrow32(tab, q, c0 + 32, t, esc);
      const __m512i a = _mm512_inserti64x4(_mm512_castsi256_si512(f0), f1, 1);
      __m512i b = a;
      if (d == 128) {
        const __m256i f2 = narrow32(tab, q, c0 + 64, t, esc);
        const __m256i f3 = narrow32(tab, q, c0 + 96, t, esc);
        b = _mm512_inserti64x4(_mm512_castsi256_si512(f2), f3, 1);
      }
      for (int k = 0; k < d / 64; ++k) {  // 8 groups (64 field positions) per step, in field order
        const int g0 = (h * d + k * 64) / 8;
        const __m512i perm = _mm512_loadu_si512(tab.perm.data() + sz(h) * sz(d) + sz(k) * 64);
        const __m512i x = d == 64 ? _mm512_permutexvar_epi8(perm, a) : _mm512_permutex2var_epi8(a, perm, b);
        const __m512i p16 = _mm512_maddubs_epi16(_mm512_loadu_si512(t2.mul8.data() + sz(g0) * 8), x);
        const __m512i p32 = _mm512_madd_epi16(p16, _mm512_loadu_si512(t2.mul16.data() + sz(g0) * 4));
        __m512i p64 = _mm512_or_si512(_mm512_and_si512(p32, lo32),
                                      _mm512_sllv_epi64(_mm512_srli_epi64(p32, 32), _mm512_loadu_si512(t2.shift.data() + g0)));
        p64 = _mm512_mask_mov_epi64(p64, t2.is8[sz(g0) / 8], x);
        const std::uint32_t nb = t2.bytes[sz(g0) / 8];
        _mm512_mask_storeu_epi8(at, nb >= 64 ? ~__mmask64{0} : (__mmask64{1} << nb) - 1, _mm512_maskz_compress_epi8(t2.keep[sz(g0) / 8], p64));
        at += nb;
      }
    }
  }
}

#pragma GCC diagnostic pop

bool cpu_has_vbmi2() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi") &&
                          __builtin_cpu_supports("avx512vbmi2");
  return has;
}
bool no16(const Layout& lay) {
  const int groups = lay.n / 8;
  for (int g = 0; g < groups; ++g)
    if (lay.group_width[g] > 8) return false;
  return true;
}

bool cpu_has_vbmi() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi");
  return has;
}

// Per group of w <= 8: 8 bytes from the group's first (the slack keeps the read inside), spread
// with one pdep into bytes, widened to 16 bits, less the bias, each lane < m to its coefficient.
__attribute__((target("bmi2"))) void unpack_rows_bmi2(const Layout& lay, const std::uint8_t* buf, std::int64_t rows, std::int16_t* codes) {
  const int n = lay.n, d = n / lay.heads;
  const std::uint32_t row_bytes = lay.row_bytes();
  const __m128i zero = _mm_setzero_si128();
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::uint8_t* row = buf + sz(r) * row_bytes;
    std::int16_t* out = codes + sz(r) * sz(n);
    std::size_t g = 0;
    for (int h = 0; h < lay.heads; ++h)
      for (int p = 0; p < d; p += 8, ++g) {
        const std::int32_t* o = lay.order + sz(h) * sz(d) + sz(p);
        const int m = std::min(8, d - p);
        const unsigned w = lay.group_width[g];
        const std::uint8_t* at = row + lay.group_byte[g];
        if (w > 8) {
          unpack_group16(at, o, m, out);
          continue;
        }
        std::uint64_t x;
        std::memcpy(&x, at, 8);
        const __m128i bytes = _mm_cvtsi64_si128(static_cast<long long>(_pdep_u64(x, kByteMask[w])));
        const __m128i v = _mm_sub_epi16(_mm_unpacklo_epi8(bytes, zero), _mm_set1_epi16(static_cast<short>(1 << (w - 1))));
        alignas(16) std::int16_t tmp[8];
        _mm_store_si128(reinterpret_cast<__m128i*>(tmp), v);
        for (int i = 0; i < m; ++i) out[o[i]] = tmp[i];
      }
  }
}
#endif
}  // namespace

void pack_rows_ref(const Layout& lay, const std::int16_t* codes, std::int64_t rows, std::int64_t t_first, std::uint8_t* buf,
                   std::vector<Escape>& esc) {
  const int n = lay.n, d = n / lay.heads;
  const std::uint32_t row_bytes = lay.row_bytes();
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int16_t* q = codes + sz(r) * sz(n);
    std::uint8_t* row = buf + sz(t_first + r) * row_bytes;
    const auto t = static_cast<std::int32_t>(t_first + r);
    const std::size_t esc0 = esc.size();
    std::size_t g = 0;
    for (int h = 0; h < lay.heads; ++h)
      for (int p = 0; p < d; p += 8, ++g) {
        const std::int32_t* o = lay.order + sz(h) * sz(d) + sz(p);
        const int m = std::min(8, d - p);
        const unsigned w = lay.group_width[g];
        std::uint8_t* at = row + lay.group_byte[g];
        if (w > 8) {
          pack_group16(q, o, m, t, at, esc);
          continue;
        }
        const std::int32_t bias = std::int32_t{1} << (w - 1);
        std::uint64_t acc = 0;
        for (int i = 0; i < m; ++i) {
          const std::int32_t v = q[o[i]];
          if (v < bias && v > -bias) acc |= static_cast<std::uint64_t>(v + bias) << (static_cast<unsigned>(i) * w);
          else esc.push_back({t, o[i], v});
        }
        std::memcpy(at, &acc, (static_cast<unsigned>(m) * w + 7) / 8);
      }
    sort_row_escapes(esc, esc0);
  }
}

void unpack_rows_ref(const Layout& lay, const std::uint8_t* buf, std::int64_t rows, std::int16_t* codes) {
  const int n = lay.n;
  const std::uint64_t row_bits = lay.bit_at[n];
  for (std::int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < n; ++c) {
      const std::uint64_t bit = static_cast<std::uint64_t>(r) * row_bits + lay.bit_at[c];
      const unsigned w = lay.width[c];
      std::uint64_t v;
      std::memcpy(&v, buf + (bit >> 3), 8);
      const auto f = static_cast<std::int32_t>((v >> (bit & 7)) & ((std::uint64_t{1} << w) - 1));
      codes[sz(r) * sz(n) + sz(c)] = static_cast<std::int16_t>(f - (std::int32_t{1} << (w - 1)));
    }
}

bool fast() {
#ifdef VQ_CODE_PACK_X86
  return g_fast.load(std::memory_order_relaxed) && cpu_has_bmi2();
#else
  return false;
#endif
}

bool set_fast(bool on) { return g_fast.exchange(on); }

bool has(Form form) {
#ifdef VQ_CODE_PACK_X86
  if (form == Form::Bmi2) return cpu_has_bmi2();
  if (form == Form::Vbmi) return cpu_has_bmi2() && cpu_has_vbmi();
  if (form == Form::Vbmi2) return cpu_has_vbmi2();
#endif
  return form == Form::Reference;
}

void pack_rows_as(Form form, const Layout& lay, const std::int16_t* codes, std::int64_t rows, std::int64_t t_first, std::uint8_t* buf,
                  std::vector<Escape>& esc) {
  const int d = lay.n / lay.heads;
  if (!has(form) || ((form == Form::Vbmi || form == Form::Vbmi2) && d != 64 && d != 128) || (form == Form::Vbmi2 && !no16(lay)))
    throw std::invalid_argument("code_pack: form not available here");
#ifdef VQ_CODE_PACK_X86
  if (form == Form::Vbmi2) return pack_rows_vbmi2(lay, codes, rows, t_first, buf, esc);
  if (form == Form::Vbmi) return pack_rows_vbmi(lay, codes, rows, t_first, buf, esc);
  if (form == Form::Bmi2) return pack_rows_bmi2(lay, codes, rows, t_first, buf, esc);
#endif
  pack_rows_ref(lay, codes, rows, t_first, buf, esc);
}

void pack_rows(const Layout& lay, const std::int16_t* codes, std::int64_t rows, std::int64_t t_first, std::uint8_t* buf,
               std::vector<Escape>& esc) {
#ifdef VQ_CODE_PACK_X86
  if (fast()) {
    const int d = lay.n / lay.heads;
    if ((d == 64 || d == 128) && cpu_has_vbmi2() && no16(lay)) return pack_rows_vbmi2(lay, codes, rows, t_first, buf, esc);
    if ((d == 64 || d == 128) && cpu_has_vbmi()) return pack_rows_vbmi(lay, codes, rows, t_first, buf, esc);
    return pack_rows_bmi2(lay, codes, rows, t_first, buf, esc);
  }
#endif
  pack_rows_ref(lay, codes, rows, t_first, buf, esc);
}

void unpack_rows(const Layout& lay, const std::uint8_t* buf, std::int64_t rows, std::int16_t* codes) {
#ifdef VQ_CODE_PACK_X86
  if (fast()) return unpack_rows_bmi2(lay, buf, rows, codes);
#endif
  unpack_rows_ref(lay, buf, rows, codes);
}

}  // namespace vq::code_pack
