// AVX2 kernels of the context coder (context_kernels.hpp). A group of 32 units lies in one row
// (C % 32 == 0): its classes come from the previous row's units (>> 4, then a byte shuffle through
// the class map) or, at a group start, are all the start class; one gather per 8 lanes from the
// row kind's slot tables (decoder) or three from its encoder constants (encoder). Same units and
// words as the scalar loops in context_codec.cpp: the 32 steps of a group are independent, and the
// words of a group are read (written) in ascending (descending) lane order.
#include <immintrin.h>

#include "context_kernels.hpp"
#include "rans_avx2_steps.hpp"

namespace vq::context_detail {

namespace {

using namespace rans_detail::avx2;

// The four 8-lane vectors of 32 bytes, widened to 32-bit lanes.
struct Lanes {
  __m256i v[4];
};
VQ_AVX2 Lanes widen(__m256i b) {
  const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
  return {{_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)), _mm256_cvtepu8_epi32(hi),
           _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))}};
}

// Classes of the 32 units at u: the previous row's last codes (u - C, high nibbles) through the
// class map, or the start class.
VQ_AVX2 __m256i classes(const std::uint8_t* u, std::size_t C, bool start, __m256i cls, std::uint8_t start_class) {
  if (start) return _mm256_set1_epi8(static_cast<char>(start_class));
  const __m256i prev = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u - C));
  return _mm256_shuffle_epi8(cls, _mm256_and_si256(_mm256_srli_epi16(prev, 4), _mm256_set1_epi8(15)));
}

VQ_AVX2 __m256i dec_step(__m256i x, __m256i& unit, const std::uint32_t* table, __m256i off, __m256i mask_m, __m128i sh, __m128i sh2) {
  const __m256i e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(table), _mm256_add_epi32(_mm256_and_si256(x, mask_m), off), 4);
  unit = _mm256_srl_epi32(e, sh2);
  const __m256i freq = _mm256_add_epi32(_mm256_and_si256(e, mask_m), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_and_si256(_mm256_srl_epi32(e, sh), mask_m);
  return _mm256_add_epi32(_mm256_mullo_epi32(freq, _mm256_srl_epi32(x, sh)), bias);
}

// NV = 4 vectors of 8 lanes.
template <int NV>
__attribute__((target("avx2,popcnt"))) const std::uint8_t* decode_groups(std::uint32_t* x, std::uint8_t* units, std::size_t& i, std::size_t n,
                                                                         const DecodeKernelTables& t, const std::uint8_t* p,
                                                                         const std::uint8_t* end) {
  constexpr std::size_t L = 8 * NV;
  __m256i X[NV];
  for (int v = 0; v < NV; ++v) X[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8 * v));
  const __m256i low = _mm256_set1_epi32(static_cast<int>(rans_detail::kL));
  const __m256i cls = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t.cls)));
  const std::size_t C = t.C;
  std::size_t r = i / C, off = i % C;
  // A group consumes at most L words; 2 L bytes left keep every 16-byte word load inside.
  while (n - i >= L && static_cast<std::size_t>(end - p) >= 2 * L) {
    const std::uint8_t kd = t.kind[r];
    const int single = kd & kSingleRow, s = kTableShift[single];
    const __m128i sh = _mm_cvtsi32_si128(s), sh2 = _mm_cvtsi32_si128(2 * s);
    const __m256i mask_m = _mm256_set1_epi32((1 << s) - 1);
    const std::uint32_t* table = t.table[single];
    __m256i U[NV];
    for (int h = 0; h < NV / 4; ++h) {
      const Lanes k = widen(classes(units + i + 32 * h, C, kd & kStartRow, cls, t.start_class));
      for (int q = 0; q < 4; ++q) X[4 * h + q] = dec_step(X[4 * h + q], U[4 * h + q], table, _mm256_sll_epi32(k.v[q], sh), mask_m, sh, sh2);
    }
    for (int v = 0; v < NV; ++v) X[v] = refill(X[v], p, low);
    for (int h = 0; h < NV / 4; ++h) {
      const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(U[4 * h], U[4 * h + 1]), _mm256_packus_epi32(U[4 * h + 2], U[4 * h + 3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(units + i + 32 * h), _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
    i += L;
    if ((off += L) == C) off = 0, ++r;
  }
  for (int v = 0; v < NV; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 8 * v), X[v]);
  return p;
}

template <int NV>
__attribute__((target("avx2,popcnt"))) std::uint16_t* encode_groups(std::uint32_t* x, const std::uint8_t* units, std::size_t n,
                                                                    const EncodeKernelTables& t, std::uint16_t* ptr) {
  constexpr std::size_t L = 8 * NV;
  __m256i X[NV];
  for (int v = 0; v < NV; ++v) X[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8 * v));
  const __m256i cls = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t.cls)));
  const std::size_t C = t.C;
  std::size_t r = (n - L) / C, off = (n - L) % C;
  __m256i bad = _mm256_setzero_si256();
  for (std::size_t g = n; g > 0; g -= L) {
    const std::uint8_t* u = units + g - L;
    const std::uint8_t kd = t.kind[r];
    const int single = kd & kSingleRow, s = kTableShift[single];
    const std::uint64_t* es = single ? t.single : t.pair;
    const __m256i total = _mm256_set1_epi32(1 << s);
    const __m128i xshift = _mm_cvtsi32_si128(31 - s);
    __m256i idx[NV];
    for (int h = 0; h < NV / 4; ++h) {
      const Lanes k = widen(classes(u + 32 * h, C, kd & kStartRow, cls, t.start_class));
      const Lanes v = widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 32 * h)));
      for (int q = 0; q < 4; ++q)
        idx[4 * h + q] = single ? _mm256_or_si256(_mm256_slli_epi32(k.v[q], 4), _mm256_and_si256(v.v[q], _mm256_set1_epi32(15)))
                                : _mm256_or_si256(_mm256_slli_epi32(k.v[q], 8), v.v[q]);
    }
    // The highest lanes first: their words lie above those of the lanes below.
    for (int v = NV - 1; v >= 0; --v) X[v] = enc_step_packed(X[v], idx[v], es, total, xshift, bad, ptr);
    if (off == 0) {
      off = C - L;
      --r;  // (wraps once after the first group, unused then)
    } else {
      off -= L;
    }
  }
  for (int v = 0; v < NV; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 8 * v), X[v]);
  return _mm256_testz_si256(bad, bad) ? ptr : nullptr;
}

}  // namespace

const std::uint8_t* decode_avx2(std::uint32_t* x, std::uint8_t* units, std::size_t& i, std::size_t n, const DecodeKernelTables& t,
                                const std::uint8_t* p, const std::uint8_t* end) {
  return decode_groups<kLanes / 8>(x, units, i, n, t, p, end);
}

std::uint16_t* encode_avx2(std::uint32_t* x, const std::uint8_t* units, std::size_t n, const EncodeKernelTables& t, std::uint16_t* ptr) {
  if (n == 0) return ptr;
  return encode_groups<kLanes / 8>(x, units, n, t, ptr);
}

__attribute__((target("avx2"))) void fill_table_avx2(std::uint32_t* e, const std::uint32_t* freq, const std::uint32_t* code, std::size_t n,
                                                      int s) {
  const __m128i sh = _mm_cvtsi32_si128(s);
  const __m256i ramp = _mm256_sll_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), sh);
  const __m256i step = _mm256_set1_epi32(8 << s);
  for (std::size_t u = 0; u < n; ++u) {
    const std::uint32_t f = freq[u];
    if (f == 0) continue;
    __m256i v = _mm256_or_si256(_mm256_set1_epi32(static_cast<int>((f - 1) | code[u] << (2 * s))), ramp);
    for (std::uint32_t k = 0; k < f; k += 8, v = _mm256_add_epi32(v, step)) _mm256_storeu_si256(reinterpret_cast<__m256i*>(e + k), v);
    e += f;
  }
}

}  // namespace vq::context_detail
