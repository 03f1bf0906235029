// Packing codes into a vq side's packed rows and back (code_pack.hpp).
#include "code_pack.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>

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

void pack_rows(const Layout& lay, const std::int16_t* codes, std::int64_t rows, std::int64_t t_first, std::uint8_t* buf,
               std::vector<Escape>& esc) {
#ifdef VQ_CODE_PACK_X86
  if (fast()) return pack_rows_bmi2(lay, codes, rows, t_first, buf, esc);
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
