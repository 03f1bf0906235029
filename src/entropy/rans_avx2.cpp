// AVX2 rANS decoder: 32 lanes as 4 vectors of 8, two gathers per vector (slot entry, slot symbol),
// refills through a lane-compaction permutation. Produces exactly the scalar reference's symbols
// and consumes words in the same order: all 32 decode steps of a group are independent, and the
// refills run in ascending lane order, as in the scalar loop.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>

#include "rans_kernels.hpp"

namespace vq {

bool rans_avx2_available() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
  return ok;
}

namespace rans_detail {
namespace {

// kPerm[m][i]: for lane i whose bit is set in m, the index of its word among the loaded ones
// (the number of set bits below i); 0 for other lanes (their value is discarded by the blend).
constexpr std::array<std::array<std::uint8_t, 8>, 256> make_perm() {
  std::array<std::array<std::uint8_t, 8>, 256> t{};
  for (unsigned m = 0; m < 256; ++m) {
    std::uint8_t k = 0;
    for (unsigned i = 0; i < 8; ++i)
      if (m >> i & 1) t[m][i] = k++;
  }
  return t;
}
alignas(64) constexpr auto kPerm = make_perm();

#define VQ_AVX2 __attribute__((target("avx2,popcnt"), always_inline)) inline

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

VQ_AVX2 __m256i refill(__m256i x, const std::uint8_t*& p, __m256i low) {
  const __m256i need = _mm256_cmpgt_epi32(low, x);  // x < 2^15 (states are < 2^31: signed compare is fine)
  const unsigned m = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(need)));
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i perm = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(kPerm[m].data())));
  w = _mm256_permutevar8x32_epi32(w, perm);
  p += 2 * static_cast<unsigned>(__builtin_popcount(m));
  return _mm256_blendv_epi8(x, _mm256_or_si256(_mm256_slli_epi32(x, 16), w), need);
}

// kPermEnc[m]: 32-bit lane sources such that the set lanes of m, in ascending order, land in the
// top popcount(m) of the 8 positions (the encoder stores 8 words ending at its old pointer).
constexpr std::array<std::array<std::uint8_t, 8>, 256> make_perm_enc() {
  std::array<std::array<std::uint8_t, 8>, 256> t{};
  for (unsigned m = 0; m < 256; ++m) {
    unsigned cnt = 0;
    for (unsigned i = 0; i < 8; ++i) cnt += m >> i & 1;
    unsigned pos = 8 - cnt;
    for (unsigned i = 0; i < 8; ++i)
      if (m >> i & 1) t[m][pos++] = static_cast<std::uint8_t>(i);
  }
  return t;
}
alignas(64) constexpr auto kPermEnc = make_perm_enc();

// One encoder step for 8 lanes: renormalise (emit words), then x = x + bias + mulhi(x, rcp) >> shift * cmpl.
VQ_AVX2 __m256i enc_step(__m256i x, const std::uint16_t* sym, const EncSym* es, std::uint16_t*& ptr) {
  const __m256i idx = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sym))), 2);
  const int* base = reinterpret_cast<const int*>(es);
  const __m256i x_max = _mm256_i32gather_epi32(base + 0, idx, 4);
  const __m256i rcp = _mm256_i32gather_epi32(base + 1, idx, 4);
  const __m256i bias = _mm256_i32gather_epi32(base + 2, idx, 4);
  const __m256i cs = _mm256_i32gather_epi32(base + 3, idx, 4);  // cmpl_freq | rcp_shift << 16
  // x >= x_max as x > x_max - 1: x_max may be 2^31, which a signed compare would misread.
  const __m256i need = _mm256_cmpgt_epi32(x, _mm256_sub_epi32(x_max, _mm256_set1_epi32(1)));
  const unsigned m = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(need)));
  if (m) {
    const __m256i perm = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(kPermEnc[m].data())));
    const __m256i lo = _mm256_permutevar8x32_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0xffff)), perm);
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, lo), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(ptr - 8), _mm256_castsi256_si128(w));
    ptr -= __builtin_popcount(m);
    x = _mm256_blendv_epi8(x, _mm256_srli_epi32(x, 16), need);
  }
  const __m256i even = _mm256_srli_epi64(_mm256_mul_epu32(x, rcp), 32);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), _mm256_srli_epi64(rcp, 32));
  const __m256i q = _mm256_srlv_epi32(_mm256_blend_epi32(even, odd, 0xAA), _mm256_srli_epi32(cs, 16));
  const __m256i cmpl = _mm256_and_si256(cs, _mm256_set1_epi32(0xffff));
  return _mm256_add_epi32(_mm256_add_epi32(x, bias), _mm256_mullo_epi32(q, cmpl));
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
  std::size_t i = std::min<std::size_t>((kRansLanes - (base & kLaneMask)) & kLaneMask, n);
  p = decode_scalar(x, out, i, base, t, d.sym.data(), p, end);
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
  return decode_scalar(x, out + i, n - i, base + i, t, d.sym.data(), p, end);
}

// Same bytes as encode_fast: scalar for the unaligned ends, then whole groups of 32 from the back,
// lanes 24..31 first (their words lie above those of lanes 16..23, and so on).
__attribute__((target("avx2,popcnt"))) std::uint16_t* encode_avx2(std::uint32_t* x, const std::uint16_t* sym,
                                                                  std::size_t n, std::size_t base, const EncSym* es,
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
    for (std::size_t g = a1; g > head; g -= kRansLanes) {
      const std::uint16_t* s = sym + g - kRansLanes;
      x3 = enc_step(x3, s + 24, es, ptr);
      x2 = enc_step(x2, s + 16, es, ptr);
      x1 = enc_step(x1, s + 8, es, ptr);
      x0 = enc_step(x0, s + 0, es, ptr);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 0), x0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 8), x1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 16), x2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 24), x3);
  }
  return encode_fast(x, sym, head, base, es, ptr);
}

}  // namespace rans_detail
}  // namespace vq
