// Private to the attention tile kernels (src/cache/attention_avx2.cpp and the caches' own kernels
// in src/peers/*_attention_avx2.cpp): the AVX2 + FMA templates that score and accumulate a tile
// over any row "source", so that a storage form only has to say how to decode 16 of its values.
// Every function is compiled for AVX2 + FMA + F16C where it is inlined (target attribute), so
// including this header does not require -mavx2; callers run them only when
// attn::simd_enabled() (attention_kernels.hpp).
//
// A Source decodes the token rows of one (batch, KV head) of the tile (tokens 0 .. n-1):
//   void  load16(std::int64_t t, std::int64_t e, __m256& lo, __m256& hi) const;  // values e .. e+15 (e % 16 == 0, e + 16 <= d)
//   __m256 load8(std::int64_t t, std::int64_t e) const;  // values e .. e+7 (e % 16 == 0, e + 8 <= d < e + 16)
//   float scalar(std::int64_t t, std::int64_t e) const;  // value e, for the last d % 8 values
// Block sources (d % 32 == 0) never see load8 or scalar calls.
//
// Scoring keeps eight accumulators in flight: R query rows (<= 4) x T = 8 / R tokens at a time,
// so a decoded K row feeds R fused multiply-adds and every loaded query vector feeds T; one
// horizontal reduction (hsum8) turns the eight into scores. Accumulation keeps R rows x 16 values
// of acc in registers while it walks the tile's tokens.
#pragma once
#include "veloxquant/cache/attention_kernels.hpp"  // VQ_ATTN_HAVE_AVX2

#ifdef VQ_ATTN_HAVE_AVX2
#include <immintrin.h>

#include <cstdint>

#define VQ_ATTN_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline

namespace vq::attn::simd {

// Lane i = the sum of a[i]'s eight lanes.
VQ_ATTN_INLINE __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half: sums of a0..a3 | a4..a7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Scores of R query rows (q, d apart) against tokens j .. j+T-1: s[r * n + j + t].
template <int R, int T, class Src>
VQ_ATTN_INLINE void score_tokens(const Src& src, std::int64_t j, std::int64_t n, std::int64_t d, const float* q, float* s) {
  static_assert(R * T <= 8);
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  std::int64_t e = 0;
  for (; e + 16 <= d; e += 16) {
    __m256 x[T][2];
    for (int t = 0; t < T; ++t) src.load16(j + t, e, x[t][0], x[t][1]);
    for (int r = 0; r < R; ++r) {
      const __m256 q0 = _mm256_loadu_ps(q + r * d + e), q1 = _mm256_loadu_ps(q + r * d + e + 8);
      for (int t = 0; t < T; ++t) acc[t * R + r] = _mm256_fmadd_ps(q1, x[t][1], _mm256_fmadd_ps(q0, x[t][0], acc[t * R + r]));
    }
  }
  if (e + 8 <= d) {
    for (int t = 0; t < T; ++t) {
      const __m256 x = src.load8(j + t, e);
      for (int r = 0; r < R; ++r) acc[t * R + r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * d + e), x, acc[t * R + r]);
    }
    e += 8;
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, hsum8(acc));
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) {
      float v = out[t * R + r];
      for (std::int64_t f = e; f < d; ++f) v += q[r * d + f] * src.scalar(j + t, f);
      s[r * n + j + t] = v;
    }
}

template <int R, class Src>
VQ_ATTN_INLINE void score_rows(const Src& src, std::int64_t n, std::int64_t d, const float* q, float* s) {
  constexpr int T = 8 / R;
  std::int64_t j = 0;
  for (; j + T <= n; j += T) score_tokens<R, T>(src, j, n, d, q, s);
  for (; j < n; ++j) score_tokens<R, 1>(src, j, n, d, q, s);
}

// s[r * n + j] = q_r . k_j for nq query rows.
template <class Src>
VQ_ATTN_INLINE void score(const Src& src, std::int64_t n, std::int64_t d, const float* q, std::int64_t nq, float* s) {
  std::int64_t r = 0;
  for (; r + 4 <= nq; r += 4) score_rows<4>(src, n, d, q + r * d, s + r * n);
  switch (nq - r) {
    case 3: score_rows<3>(src, n, d, q + r * d, s + r * n); break;
    case 2: score_rows<2>(src, n, d, q + r * d, s + r * n); break;
    case 1: score_rows<1>(src, n, d, q + r * d, s + r * n); break;
    default: break;
  }
}

// acc[r * d + e] += sum_j w[r * n + j] * v_j[e] for R rows.
template <int R, class Src>
VQ_ATTN_INLINE void accumulate_rows(const Src& src, std::int64_t n, std::int64_t d, const float* w, float* acc) {
  std::int64_t e = 0;
  for (; e + 16 <= d; e += 16) {
    __m256 a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = _mm256_loadu_ps(acc + r * d + e), a[r][1] = _mm256_loadu_ps(acc + r * d + e + 8);
    for (std::int64_t j = 0; j < n; ++j) {
      __m256 x0, x1;
      src.load16(j, e, x0, x1);
      for (int r = 0; r < R; ++r) {
        const __m256 wv = _mm256_broadcast_ss(w + r * n + j);
        a[r][0] = _mm256_fmadd_ps(wv, x0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(wv, x1, a[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * d + e, a[r][0]), _mm256_storeu_ps(acc + r * d + e + 8, a[r][1]);
  }
  if (e + 8 <= d) {
    __m256 a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm256_loadu_ps(acc + r * d + e);
    for (std::int64_t j = 0; j < n; ++j) {
      const __m256 x = src.load8(j, e);
      for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + r * n + j), x, a[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * d + e, a[r]);
    e += 8;
  }
  for (; e < d; ++e)
    for (int r = 0; r < R; ++r) {
      float a = acc[r * d + e];
      for (std::int64_t j = 0; j < n; ++j) a += w[r * n + j] * src.scalar(j, e);
      acc[r * d + e] = a;
    }
}

template <class Src>
VQ_ATTN_INLINE void accumulate(const Src& src, std::int64_t n, std::int64_t d, const float* w, std::int64_t nq, float* acc) {
  std::int64_t r = 0;
  for (; r + 4 <= nq; r += 4) accumulate_rows<4>(src, n, d, w + r * n, acc + r * d);
  switch (nq - r) {
    case 3: accumulate_rows<3>(src, n, d, w + r * n, acc + r * d); break;
    case 2: accumulate_rows<2>(src, n, d, w + r * n, acc + r * d); break;
    case 1: accumulate_rows<1>(src, n, d, w + r * n, acc + r * d); break;
    default: break;
  }
}

}  // namespace vq::attn::simd

#endif  // VQ_ATTN_HAVE_AVX2
