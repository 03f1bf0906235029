// Private: AVX2 building blocks shared by the rANS kernels (rans_avx2.cpp) and the context
// coder's kernels (context_avx2.cpp): the decoder's refill through a lane-compaction permutation
// and the encoder's reciprocal step with branch-free renormalisation. Every function is compiled
// for AVX2 where it is inlined (target attribute), so including this header does not require
// -mavx2.
#pragma once
#include <immintrin.h>

#include <array>
#include <cstdint>

#include "rans_kernels.hpp"

#define VQ_AVX2 __attribute__((target("avx2,popcnt"), always_inline)) inline

namespace vq::rans_detail::avx2 {

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
alignas(64) inline constexpr auto kPerm = make_perm();

VQ_AVX2 __m256i refill(__m256i x, const std::uint8_t*& p, __m256i low) {
  // x < 2^15 iff x - 2^15 is negative (states are < 2^31): its sign bits are the mask, for
  // movemask and blendv alike.
  const __m256 need = _mm256_castsi256_ps(_mm256_sub_epi32(x, low));
  const unsigned m = static_cast<unsigned>(_mm256_movemask_ps(need));
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i perm = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(kPerm[m].data())));
  w = _mm256_permutevar8x32_epi32(w, perm);
  p += 2 * static_cast<unsigned>(__builtin_popcount(m));
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(x),
                                               _mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(x, 16), w)), need));
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
alignas(64) inline constexpr auto kPermEnc = make_perm_enc();

// Encoder step for 8 lanes given each lane's symbol constants: renormalise (emit words, always
// storing 8 words below ptr and moving ptr by the number needed: no branch to mispredict), then
// x = x + bias + (mulhi(x, rcp) >> shift) * cmpl.
VQ_AVX2 __m256i enc_core(__m256i x, __m256i x_max_m1, __m256i rcp, __m256i bias, __m256i cs, std::uint16_t*& ptr) {
  // x >= x_max as x > x_max - 1: x_max may be 2^31, which a signed compare would misread.
  const __m256i need = _mm256_cmpgt_epi32(x, x_max_m1);
  const unsigned m = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(need)));
  const __m256i perm = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(kPermEnc[m].data())));
  const __m256i lo = _mm256_permutevar8x32_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0xffff)), perm);
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, lo), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(ptr - 8), _mm256_castsi256_si128(w));
  ptr -= __builtin_popcount(m);
  x = _mm256_blendv_epi8(x, _mm256_srli_epi32(x, 16), need);
  const __m256i even = _mm256_srli_epi64(_mm256_mul_epu32(x, rcp), 32);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), _mm256_srli_epi64(rcp, 32));
  const __m256i q = _mm256_srlv_epi32(_mm256_blend_epi32(even, odd, 0xAA), _mm256_srli_epi32(cs, 16));
  const __m256i cmpl = _mm256_and_si256(cs, _mm256_set1_epi32(0xffff));
  return _mm256_add_epi32(_mm256_add_epi32(x, bias), _mm256_mullo_epi32(q, cmpl));
}

// The packed encoder constants of 8 lanes: two 4-lane 64-bit gathers, split into the reciprocals
// and the fields of the high words (bias, complement of the frequency, cmpl | shift << 16 for
// enc_core). `bad` collects lanes of frequency 0 (reciprocal 0).
struct EncEntries {
  __m256i rcp, bias, cmpl, cs;
};
VQ_AVX2 EncEntries gather_enc_entries(__m256i idx, const std::uint64_t* es, __m256i& bad) {
  const auto* base = reinterpret_cast<const long long*>(es);
  const __m256i lo4 = _mm256_i32gather_epi64(base, _mm256_castsi256_si128(idx), 8);       // lanes 0..3
  const __m256i hi4 = _mm256_i32gather_epi64(base, _mm256_extracti128_si256(idx, 1), 8);  // lanes 4..7
  // Low (high) dwords of both, in lane order: shuffle gives [0 1 4 5 | 2 3 6 7], the permute fixes it.
  const __m256i rcp = _mm256_permute4x64_epi64(
      _mm256_castps_si256(_mm256_shuffle_ps(_mm256_castsi256_ps(lo4), _mm256_castsi256_ps(hi4), 0x88)), 0xD8);
  const __m256i hw = _mm256_permute4x64_epi64(
      _mm256_castps_si256(_mm256_shuffle_ps(_mm256_castsi256_ps(lo4), _mm256_castsi256_ps(hi4), 0xDD)), 0xD8);
  bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(rcp, _mm256_setzero_si256()));
  const __m256i bias = _mm256_and_si256(hw, _mm256_set1_epi32(0x1fff));
  const __m256i cmpl = _mm256_and_si256(_mm256_srli_epi32(hw, 13), _mm256_set1_epi32(0x1fff));
  const __m256i cs = _mm256_or_si256(cmpl, _mm256_slli_epi32(_mm256_srli_epi32(hw, 26), 16));  // cmpl | shift << 16
  return {rcp, bias, cmpl, cs};
}

// Encoder step of 8 lanes whose packed constants (pack_enc, rans_kernels.hpp) are es[idx].
VQ_AVX2 __m256i enc_step_packed(__m256i x, __m256i idx, const std::uint64_t* es, __m256i total, __m128i xshift, __m256i& bad,
                         std::uint16_t*& ptr) {
  const EncEntries e = gather_enc_entries(idx, es, bad);
  const __m256i x_max_m1 = _mm256_sub_epi32(_mm256_sll_epi32(_mm256_sub_epi32(total, e.cmpl), xshift), _mm256_set1_epi32(1));
  return enc_core(x, x_max_m1, e.rcp, e.bias, e.cs, ptr);
}

}  // namespace vq::rans_detail::avx2
