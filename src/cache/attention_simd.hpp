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

// --- AVX-512 forms (F, BW, DQ, VL; full-width on the CPUs that have them) ---------------------------
// The same two steps over a Source that decodes 32 values at a time into two zmm:
//   void load32(std::int64_t t, std::int64_t e, __m512& lo, __m512& hi) const;  // values e .. e+31 (e % 32 == 0)
// and, optionally (the llama.cpp blocks have it),
//   void prefetch(std::int64_t t) const;  // fetch what load32 will read of a token some way past t
// which score calls for each group of 4 tokens and accumulate for each token before decoding;
// so callers use them only for d % 32 == 0 (every head dim the decode benchmark and the llama.cpp
// blocks have); other dims take the AVX2 forms above.
// Scoring keeps sixteen accumulators in flight: R <= 4 query rows x 4 tokens, each 32 decoded values
// of a token feeding R x 2 fused multiply-adds, and one transposing reduction (hsum16) turns the
// sixteen vectors into the four tokens' scores of each row. Accumulation keeps R rows x 64 values
// of acc (4 zmm a row) in registers while it walks the tile's tokens: two passes over the tile at
// d = 128 instead of AVX2's eight.
#define VQ_ATTN512_INLINE __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"), always_inline)) inline

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*, which -Wextra reports as
// maybe-uninitialized wherever they are inlined (a false positive; as in vq_attention_kernels.cpp).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace vq::attn::simd512 {

// Lane i = the sum of v[i]'s sixteen lanes.
VQ_ATTN512_INLINE __m512 hsum16(const __m512* v) {
  __m512 u[8], w[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: v[2k]'s partials at 0, 2 and v[2k+1]'s at 1, 3
    u[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane L: lane L's sums of v[4k .. 4k+3]
    const __m512d a = _mm512_castps_pd(u[2 * k]), b = _mm512_castps_pd(u[2 * k + 1]);
    w[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // The four 128-bit lanes of each w[k] summed into lane k of the result.
  const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
  const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88), _mm512_shuffle_f32x4(y01, y23, 0xDD));
}

// Scores of R query rows (q, d apart) against tokens j .. j+3: s[r * n + j + t].
template <int R, class Src>
VQ_ATTN512_INLINE void score_tokens4(const Src& src, std::int64_t j, std::int64_t n, std::int64_t d, const float* q, float* s) {
  static_assert(R >= 1 && R <= 4);
  __m512 acc[16];  // acc[r * 4 + t]; rows >= R stay zero
  for (auto& a : acc) a = _mm512_setzero_ps();
  if constexpr (requires { src.prefetch(j); })
    for (int t = 0; t < 4; ++t) src.prefetch(j + t);
  for (std::int64_t e = 0; e < d; e += 32) {
    __m512 x[4][2];
    for (int t = 0; t < 4; ++t) src.load32(j + t, e, x[t][0], x[t][1]);
    for (int r = 0; r < R; ++r) {
      const __m512 q0 = _mm512_loadu_ps(q + r * d + e), q1 = _mm512_loadu_ps(q + r * d + e + 16);
      for (int t = 0; t < 4; ++t) acc[r * 4 + t] = _mm512_fmadd_ps(q1, x[t][1], _mm512_fmadd_ps(q0, x[t][0], acc[r * 4 + t]));
    }
  }
  const __m512 sums = hsum16(acc);  // 128-bit lane r: row r's four scores
  _mm_storeu_ps(s + j, _mm512_castps512_ps128(sums));
  if (R > 1) _mm_storeu_ps(s + n + j, _mm512_extractf32x4_ps(sums, 1));
  if (R > 2) _mm_storeu_ps(s + 2 * n + j, _mm512_extractf32x4_ps(sums, 2));
  if (R > 3) _mm_storeu_ps(s + 3 * n + j, _mm512_extractf32x4_ps(sums, 3));
}

template <int R, class Src>
VQ_ATTN512_INLINE void score_token1(const Src& src, std::int64_t j, std::int64_t n, std::int64_t d, const float* q, float* s) {
  __m512 acc[R];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (std::int64_t e = 0; e < d; e += 32) {
    __m512 x0, x1;
    src.load32(j, e, x0, x1);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * d + e + 16), x1, _mm512_fmadd_ps(_mm512_loadu_ps(q + r * d + e), x0, acc[r]));
  }
  for (int r = 0; r < R; ++r) s[r * n + j] = _mm512_reduce_add_ps(acc[r]);
}

template <int R, class Src>
VQ_ATTN512_INLINE void score_rows(const Src& src, std::int64_t n, std::int64_t d, const float* q, float* s) {
  std::int64_t j = 0;
  for (; j + 4 <= n; j += 4) score_tokens4<R>(src, j, n, d, q, s);
  for (; j < n; ++j) score_token1<R>(src, j, n, d, q, s);
}

// s[r * n + j] = q_r . k_j for nq query rows (d % 32 == 0).
template <class Src>
VQ_ATTN512_INLINE void score(const Src& src, std::int64_t n, std::int64_t d, const float* q, std::int64_t nq, float* s) {
  std::int64_t r = 0;
  for (; r + 4 <= nq; r += 4) score_rows<4>(src, n, d, q + r * d, s + r * n);
  switch (nq - r) {
    case 3: score_rows<3>(src, n, d, q + r * d, s + r * n); break;
    case 2: score_rows<2>(src, n, d, q + r * d, s + r * n); break;
    case 1: score_rows<1>(src, n, d, q + r * d, s + r * n); break;
    default: break;
  }
}

// acc[r * d + e .. + 32 * P] += sum_j w[r * n + j] * v_j[e ..] for R rows: P pairs of zmm a row.
template <int R, int P, class Src>
VQ_ATTN512_INLINE void accumulate_block(const Src& src, std::int64_t n, std::int64_t d, std::int64_t e, const float* w, float* acc) {
  __m512 a[R][2 * P];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < 2 * P; ++k) a[r][k] = _mm512_loadu_ps(acc + r * d + e + 16 * k);
  for (std::int64_t j = 0; j < n; ++j) {
    if constexpr (requires { src.prefetch(j); }) src.prefetch(j);
    __m512 x[2 * P];
    for (int p = 0; p < P; ++p) src.load32(j, e + 32 * p, x[2 * p], x[2 * p + 1]);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_set1_ps(w[r * n + j]);
      for (int k = 0; k < 2 * P; ++k) a[r][k] = _mm512_fmadd_ps(wv, x[k], a[r][k]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < 2 * P; ++k) _mm512_storeu_ps(acc + r * d + e + 16 * k, a[r][k]);
}

template <int R, class Src>
VQ_ATTN512_INLINE void accumulate_rows(const Src& src, std::int64_t n, std::int64_t d, const float* w, float* acc) {
  std::int64_t e = 0;
  for (; e + 64 <= d; e += 64) accumulate_block<R, 2>(src, n, d, e, w, acc);
  if (e < d) accumulate_block<R, 1>(src, n, d, e, w, acc);
}

// acc[r * d + e] += sum_j w[r * n + j] * v_j[e] (d % 32 == 0).
template <class Src>
VQ_ATTN512_INLINE void accumulate(const Src& src, std::int64_t n, std::int64_t d, const float* w, std::int64_t nq, float* acc) {
  std::int64_t r = 0;
  for (; r + 4 <= nq; r += 4) accumulate_rows<4>(src, n, d, w + r * n, acc + r * d);
  switch (nq - r) {
    case 3: accumulate_rows<3>(src, n, d, w + r * n, acc + r * d); break;
    case 2: accumulate_rows<2>(src, n, d, w + r * n, acc + r * d); break;
    case 1: accumulate_rows<1>(src, n, d, w + r * n, acc + r * d); break;
    default: break;
  }
}

}  // namespace vq::attn::simd512

#pragma GCC diagnostic pop

#endif  // VQ_ATTN_HAVE_AVX2
