// AVX2 rANS kernels. Decoder: 32 lanes as 4 vectors of 8; for alphabets <= 16 no slot table (the
// symbol is counted with 16-bit compares against cum, freq/cum come from pshufb tables), otherwise
// one gather per vector (packed slot entry) or two (entry, symbol); refills through a
// lane-compaction permutation. Encoder: reciprocal multiply, symbol constants from registers
// (alphabets <= 16) or three gathers, branch-free renormalisation. Both produce exactly the scalar
// reference's bytes and symbols and consume words in the same order: all 32 decode steps of a group
// are independent, and the refills run in ascending lane order, as in the scalar loop.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>

#include "rans_avx2_steps.hpp"
#include "rans_kernels.hpp"

namespace vq {

bool rans_avx2_available() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
  return ok;
}

bool rans_avx512_available() {
  static const bool ok = rans_avx2_available() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl");
  return ok;
}

namespace rans_detail {
namespace {

using namespace avx2;

VQ_AVX2 __m256i dec_step(__m256i x, __m256i& sym, const std::uint32_t* entry, const std::uint16_t* slot_sym,
                         __m256i mask_m, __m256i lo16, __m128i shift) {
  const __m256i slot = _mm256_and_si256(x, mask_m);
  const __m256i e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(entry), slot, 4);
  sym = _mm256_and_si256(_mm256_i32gather_epi32(reinterpret_cast<const int*>(slot_sym), slot, 2), lo16);
  return _mm256_add_epi32(_mm256_mullo_epi32(_mm256_srli_epi32(e, 16), _mm256_srl_epi32(x, shift)),
                          _mm256_and_si256(e, lo16));
}

// One gather: e = (freq - 1) | bias << s | sym << 2s.
VQ_AVX2 __m256i dec_step_packed(__m256i x, __m256i& sym, const std::uint32_t* packed, __m256i mask_m,
                                __m128i shift, __m128i shift2, __m256i one) {
  const __m256i e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(packed), _mm256_and_si256(x, mask_m), 4);
  sym = _mm256_srl_epi32(e, shift2);
  const __m256i freq = _mm256_add_epi32(_mm256_and_si256(e, mask_m), one);
  const __m256i bias = _mm256_and_si256(_mm256_srl_epi32(e, shift), mask_m);
  return _mm256_add_epi32(_mm256_mullo_epi32(freq, _mm256_srl_epi32(x, shift)), bias);
}

// Any alphabet: three gathers per 8 symbols (x_max follows from cmpl_freq: (M - cmpl) << (31 - s)).
VQ_AVX2 __m256i enc_step(__m256i x, const std::uint16_t* sym, const EncSym* es, __m256i total, __m128i xshift,
                         std::uint16_t*& ptr) {
  const __m256i idx = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sym))), 2);
  const int* base = reinterpret_cast<const int*>(es);
  const __m256i rcp = _mm256_i32gather_epi32(base + 1, idx, 4);
  const __m256i bias = _mm256_i32gather_epi32(base + 2, idx, 4);
  const __m256i cs = _mm256_i32gather_epi32(base + 3, idx, 4);  // cmpl_freq | rcp_shift << 16
  const __m256i freq = _mm256_sub_epi32(total, _mm256_and_si256(cs, _mm256_set1_epi32(0xffff)));
  const __m256i x_max_m1 = _mm256_sub_epi32(_mm256_sll_epi32(freq, xshift), _mm256_set1_epi32(1));
  return enc_core(x, x_max_m1, rcp, bias, cs, ptr);
}

// Alphabets <= 16: the four constants of each symbol come from registers (two vpermd and a blend).
struct SmallEnc {
  __m256i lo[4], hi[4];  // x_max - 1, rcp, bias, cmpl | shift << 16 for symbols 0..7 / 8..15
};
VQ_AVX2 __m256i pick16(__m256i lo, __m256i hi, __m256i idx, __m256i sel) {
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(_mm256_permutevar8x32_epi32(lo, idx)),
                                              _mm256_castsi256_ps(_mm256_permutevar8x32_epi32(hi, idx)),
                                              _mm256_castsi256_ps(sel)));
}
VQ_AVX2 __m256i enc_step_small(__m256i x, const std::uint16_t* sym, const SmallEnc& t, std::uint16_t*& ptr) {
  const __m256i idx = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sym)));
  const __m256i sel = _mm256_slli_epi32(idx, 28);  // bit 3 of the symbol in the sign bit
  return enc_core(x, pick16(t.lo[0], t.hi[0], idx, sel), pick16(t.lo[1], t.hi[1], idx, sel),
                  pick16(t.lo[2], t.hi[2], idx, sel), pick16(t.lo[3], t.hi[3], idx, sel), ptr);
}

VQ_AVX2 void store_syms(std::uint16_t* out, __m256i a, __m256i b) {
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed);
}


}  // namespace

__attribute__((target("avx2,popcnt"))) const std::uint8_t* decode_avx2(
    std::uint32_t* x, std::uint16_t* out, std::size_t n, std::size_t base, const FrequencyTable& t,
    const DecTables& d, const std::uint8_t* p, const std::uint8_t* end) {
  // Scalar until the next symbol belongs to lane 0.
  // The scalar steps before and after the groups read whichever table was built.
  const auto scalar = [&](std::size_t from, std::size_t count, const std::uint8_t* q) {
    return d.packed.empty() ? decode_scalar(x, out + from, count, base + from, t, d.sym.data(), q, end)
                            : decode_scalar_packed(x, out + from, count, base + from, t, d.packed.data(), q, end);
  };
  std::size_t i = std::min<std::size_t>((kRansLanes - (base & kLaneMask)) & kLaneMask, n);
  p = scalar(0, i, p);
  if (n - i >= kRansLanes) {
    __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 0));
    __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8));
    __m256i x2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
    __m256i x3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 24));
    const __m256i mask_m = _mm256_set1_epi32(static_cast<int>(t.total() - 1));
    const __m256i lo16 = _mm256_set1_epi32(0xffff);
    const __m256i low = _mm256_set1_epi32(static_cast<int>(kL));
    const __m128i shift = _mm_cvtsi32_si128(t.scale_bits());
    const std::uint32_t* entry = d.entry.data();
    const std::uint16_t* sym = d.sym.data();
    // A group consumes at most 32 words, and the last 16-byte load starts at most 24 words in:
    // 64 bytes left guarantee every load stays inside the payload.
    if (!d.packed.empty()) {
      const __m128i shift2 = _mm_cvtsi32_si128(2 * t.scale_bits());
      const __m256i one = _mm256_set1_epi32(1);
      const std::uint32_t* packed = d.packed.data();
      while (n - i >= kRansLanes && end - p >= 64) {
        __m256i s0, s1, s2, s3;
        x0 = dec_step_packed(x0, s0, packed, mask_m, shift, shift2, one);
        x1 = dec_step_packed(x1, s1, packed, mask_m, shift, shift2, one);
        x2 = dec_step_packed(x2, s2, packed, mask_m, shift, shift2, one);
        x3 = dec_step_packed(x3, s3, packed, mask_m, shift, shift2, one);
        x0 = refill(x0, p, low);
        x1 = refill(x1, p, low);
        x2 = refill(x2, p, low);
        x3 = refill(x3, p, low);
        store_syms(out + i, s0, s1);
        store_syms(out + i + 16, s2, s3);
        i += kRansLanes;
      }
    }
    while (n - i >= kRansLanes && end - p >= 64) {
      __m256i s0, s1, s2, s3;
      x0 = dec_step(x0, s0, entry, sym, mask_m, lo16, shift);
      x1 = dec_step(x1, s1, entry, sym, mask_m, lo16, shift);
      x2 = dec_step(x2, s2, entry, sym, mask_m, lo16, shift);
      x3 = dec_step(x3, s3, entry, sym, mask_m, lo16, shift);
      x0 = refill(x0, p, low);
      x1 = refill(x1, p, low);
      x2 = refill(x2, p, low);
      x3 = refill(x3, p, low);
      store_syms(out + i, s0, s1);
      store_syms(out + i + 16, s2, s3);
      i += kRansLanes;
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 0), x0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 8), x1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 16), x2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 24), x3);
  }
  return scalar(i, n - i, p);
}

// Same bytes as encode_fast: scalar for the unaligned ends, then whole groups of 32 from the back,
// lanes 24..31 first (their words lie above those of lanes 16..23, and so on).
__attribute__((target("avx2,popcnt"))) std::uint16_t* encode_avx2(std::uint32_t* x, const std::uint16_t* sym,
                                                                  std::size_t n, std::size_t base,
                                                                  const FrequencyTable& t, const EncSym* es,
                                                                  std::uint16_t* ptr) {
  const std::size_t head = std::min<std::size_t>((kRansLanes - (base & kLaneMask)) & kLaneMask, n);
  const std::size_t tail = std::min<std::size_t>((base + n) & kLaneMask, n - head);
  const std::size_t a1 = n - tail;
  ptr = encode_fast(x, sym + a1, tail, base + a1, es, ptr);
  if (a1 - head >= kRansLanes) {
    __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 0));
    __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8));
    __m256i x2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
    __m256i x3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 24));
    if (t.alphabet_size() <= kRansSmallAlphabet) {
      alignas(32) std::uint32_t f[4][16] = {};
      for (int i = 0; i < t.alphabet_size(); ++i) {
        f[0][i] = es[i].x_max - 1;  // x_max = 0 (frequency 0, never coded) wraps: harmless
        f[1][i] = es[i].rcp_freq;
        f[2][i] = es[i].bias;
        f[3][i] = es[i].cmpl_freq | static_cast<std::uint32_t>(es[i].rcp_shift) << 16;
      }
      SmallEnc st;
      for (int k = 0; k < 4; ++k) {
        st.lo[k] = _mm256_load_si256(reinterpret_cast<const __m256i*>(f[k]));
        st.hi[k] = _mm256_load_si256(reinterpret_cast<const __m256i*>(f[k] + 8));
      }
      for (std::size_t g = a1; g > head; g -= kRansLanes) {
        const std::uint16_t* s = sym + g - kRansLanes;
        x3 = enc_step_small(x3, s + 24, st, ptr);
        x2 = enc_step_small(x2, s + 16, st, ptr);
        x1 = enc_step_small(x1, s + 8, st, ptr);
        x0 = enc_step_small(x0, s + 0, st, ptr);
      }
    } else {
      const __m256i total = _mm256_set1_epi32(static_cast<int>(t.total()));
      const __m128i xshift = _mm_cvtsi32_si128(31 - t.scale_bits());
      for (std::size_t g = a1; g > head; g -= kRansLanes) {
        const std::uint16_t* s = sym + g - kRansLanes;
        x3 = enc_step(x3, s + 24, es, total, xshift, ptr);
        x2 = enc_step(x2, s + 16, es, total, xshift, ptr);
        x1 = enc_step(x1, s + 8, es, total, xshift, ptr);
        x0 = enc_step(x0, s + 0, es, total, xshift, ptr);
      }
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 0), x0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 8), x1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 16), x2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 24), x3);
  }
  return encode_fast(x, sym, head, base, es, ptr);
}

// Small alphabets (<= 16 symbols), no slot table. kCmp = compares per symbol (alphabet - 1 rounded
// up to 3, 7 or 15). Two 8-lane states are handled as one vector of 16 slots in 16-bit lanes:
// packus(a, b) = [a0..3 b0..3 | a4..7 b4..7]; unpacklo/hi with zero give a and b back in order.
template <int kCmp>
struct SmallDec {
  __m256i cm1[kCmp];  // cum(k) - 1 for k = 1..kCmp in every 16-bit lane (cum(k) = M past the alphabet)
  __m256i flo, fhi, clo, chi;  // bytes of freq(s) and cum(s), s = 0..15, in both 128-bit halves
};

template <int kCmp>
VQ_AVX2 void dec_pair_small(__m256i& xa, __m256i& xb, std::uint16_t* out, const SmallDec<kCmp>& t, __m256i mask_m,
                            __m128i shift) {
  const __m256i slots = _mm256_packus_epi32(_mm256_and_si256(xa, mask_m), _mm256_and_si256(xb, mask_m));
  // Signed 16-bit compares: slot <= 2^15 - 1 and cum(k) - 1 in [-1, 2^15 - 1].
  // Count the true (0xFFFF) compares with byte subtractions: both bytes of each 16-bit lane then
  // hold the symbol, which is the pshufb index for the low- and the high-byte tables at once.
  __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 16
  for (int k = 0; k < kCmp; ++k) acc[k & 3] = _mm256_sub_epi8(acc[k & 3], _mm256_cmpgt_epi16(slots, t.cm1[k]));
  const __m256i idx = _mm256_add_epi8(_mm256_add_epi8(acc[0], acc[1]), _mm256_add_epi8(acc[2], acc[3]));
  const __m256i hib = _mm256_set1_epi16(static_cast<short>(0xFF00));
  const __m256i f16 = _mm256_blendv_epi8(_mm256_shuffle_epi8(t.flo, idx), _mm256_shuffle_epi8(t.fhi, idx), hib);
  const __m256i c16 = _mm256_blendv_epi8(_mm256_shuffle_epi8(t.clo, idx), _mm256_shuffle_epi8(t.chi, idx), hib);
  const __m256i b16 = _mm256_sub_epi16(slots, c16);
  const __m256i z = _mm256_setzero_si256();
  xa = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_unpacklo_epi16(f16, z), _mm256_srl_epi32(xa, shift)),
                        _mm256_unpacklo_epi16(b16, z));
  xb = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_unpackhi_epi16(f16, z), _mm256_srl_epi32(xb, shift)),
                        _mm256_unpackhi_epi16(b16, z));
  const __m256i sym = _mm256_and_si256(idx, _mm256_set1_epi16(0xFF));  // 0 .. 15
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(sym, 0xD8));
}

template <int kCmp>
__attribute__((target("avx2,popcnt"))) std::size_t decode_small_groups(std::uint32_t* x, std::uint16_t* out,
                                                                       std::size_t n, const FrequencyTable& t,
                                                                       const std::uint8_t*& pp,
                                                                       const std::uint8_t* end) {
  SmallDec<kCmp> st;
  const std::uint32_t M = t.total();
  const int a = t.alphabet_size();
  for (int k = 1; k <= kCmp; ++k)
    st.cm1[k - 1] = _mm256_set1_epi16(static_cast<short>(static_cast<int>(k <= a ? t.cum(k) : M) - 1));
  alignas(16) std::uint8_t b[4][16] = {};
  for (int s = 0; s < a; ++s) {
    b[0][s] = static_cast<std::uint8_t>(t.freq(s));
    b[1][s] = static_cast<std::uint8_t>(t.freq(s) >> 8);
    b[2][s] = static_cast<std::uint8_t>(t.cum(s));
    b[3][s] = static_cast<std::uint8_t>(t.cum(s) >> 8);
  }
  st.flo = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(b[0])));
  st.fhi = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(b[1])));
  st.clo = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(b[2])));
  st.chi = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(b[3])));
  const __m256i mask_m = _mm256_set1_epi32(static_cast<int>(M - 1));
  const __m256i low = _mm256_set1_epi32(static_cast<int>(kL));
  const __m128i shift = _mm_cvtsi32_si128(t.scale_bits());
  __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 0));
  __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8));
  __m256i x2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
  __m256i x3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 24));
  const std::uint8_t* p = pp;
  std::size_t i = 0;
  // 64 bytes left guarantee every word load stays inside the payload (see decode_avx2).
  while (n - i >= kRansLanes && end - p >= 64) {
    dec_pair_small(x0, x1, out + i, st, mask_m, shift);
    dec_pair_small(x2, x3, out + i + 16, st, mask_m, shift);
    x0 = refill(x0, p, low);
    x1 = refill(x1, p, low);
    x2 = refill(x2, p, low);
    x3 = refill(x3, p, low);
    i += kRansLanes;
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 0), x0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 8), x1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 16), x2);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 24), x3);
  pp = p;
  return i;
}

const std::uint8_t* decode_small_avx2(std::uint32_t* x, std::uint16_t* out, std::size_t n, std::size_t base,
                                      const FrequencyTable& t, const std::uint8_t* p, const std::uint8_t* end) {
  std::size_t i = std::min<std::size_t>((kRansLanes - (base & kLaneMask)) & kLaneMask, n);
  p = decode_scalar_search(x, out, i, base, t, p, end);
  if (n - i >= kRansLanes) {
    const int a = t.alphabet_size();
    if (a <= 4)
      i += decode_small_groups<3>(x, out + i, n - i, t, p, end);
    else if (a <= 8)
      i += decode_small_groups<7>(x, out + i, n - i, t, p, end);
    else
      i += decode_small_groups<15>(x, out + i, n - i, t, p, end);
  }
  return decode_scalar_search(x, out + i, n - i, base + i, t, p, end);
}


}  // namespace rans_detail
}  // namespace vq
