// The small-head-dim step of the attention loop; see attention_small_d.hpp.
#include "attention_small_d.hpp"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cmath>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#include <immintrin.h>
#define VQ_SMALL_D_AVX2 1
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which -Wmaybe-uninitialized
// reports wherever they are inlined (a false positive; as in src/vq/codec_avx512.cpp).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "exp_nonpositive.hpp"
#include "veloxquant/core/kernel_clones.hpp"

namespace vq::detail {

namespace {

constexpr std::int64_t kMaxSmallD = 16;

std::int64_t round_up8(std::int64_t v) { return (v + 7) / 8 * 8; }

// x[j] = exp(x[j] - mx) for j < n. Out of line so that it stays a loop of its own (and vectorises)
// rather than merging with the sequential sums around it.
VQ_KERNEL __attribute__((noinline)) void exp_shifted(float* __restrict x, std::int64_t n, float mx) {
  for (std::int64_t j = 0; j < n; ++j) x[j] = exp_nonpositive(x[j] - mx);
}

template <int D>
VQ_KERNEL void small_d_tile(const SmallDTile& a) {
  const std::int64_t n = a.n, ld = round_up8(n);
  float* __restrict kt = a.scratch;       // [D, ld]: the tile's keys, token-minor
  float* __restrict s = a.scratch + D * ld;  // [ld]: one row's scores, then its weights
  for (std::int64_t j = 0; j < n; ++j)
    for (int d = 0; d < D; ++d) kt[d * ld + j] = a.K[j * D + d];
  for (int d = 0; d < D; ++d)
    for (std::int64_t j = n; j < ld; ++j) kt[d * ld + j] = 0.0f;
  for (std::int64_t r = 0; r < a.rows; ++r) {
    const std::int64_t i = r % a.Sq, last = a.T - a.Sq + i;  // the last token query i sees
    const std::int64_t visible = std::min(n, last - a.t0 + 1);
    if (visible <= 0) continue;
    const float* __restrict q = a.q + r * D;
    float qd[D];
    for (int d = 0; d < D; ++d) qd[d] = q[d];
    // Scores of whole groups of 8 tokens (the padding past n scores 0 and is never read).
    const std::int64_t vis8 = round_up8(visible);
    for (std::int64_t j = 0; j < vis8; ++j) {
      float t = qd[0] * kt[j];
      for (int d = 1; d < D; ++d) t += qd[d] * kt[d * ld + j];
      s[j] = a.scale * t;
    }
    // The max in eight independent lanes (exact in any order).
    float mx8[8];
    for (int k = 0; k < 8; ++k) mx8[k] = a.m[r];
    std::int64_t j = 0;
    for (; j + 8 <= visible; j += 8)
      for (int k = 0; k < 8; ++k) mx8[k] = std::max(mx8[k], s[j + k]);
    float mx = mx8[0];
    for (int k = 1; k < 8; ++k) mx = std::max(mx, mx8[k]);
    for (; j < visible; ++j) mx = std::max(mx, s[j]);
    float* __restrict acc = a.acc + r * D;
    if (mx > a.m[r]) {  // rescale what came before to the new max (exp(-inf) = 0 on the first tile)
      const float c = std::exp(a.m[r] - mx);
      a.l[r] *= c;
      for (int d = 0; d < D; ++d) acc[d] *= c;
      a.m[r] = mx;
    }
    exp_shifted(s, visible, mx);
    // The sum in eight lanes; the value update one D-wide vector per token.
    float sum8[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    j = 0;
    for (; j + 8 <= visible; j += 8)
      for (int k = 0; k < 8; ++k) sum8[k] += s[j + k];
    float sum = ((sum8[0] + sum8[4]) + (sum8[1] + sum8[5])) + ((sum8[2] + sum8[6]) + (sum8[3] + sum8[7]));
    for (; j < visible; ++j) sum += s[j];
    a.l[r] += sum;
    float o[D];
    for (int d = 0; d < D; ++d) o[d] = acc[d];
    const float* __restrict v = a.V;
    for (j = 0; j < visible; ++j) {
      const float p = s[j];
      for (int d = 0; d < D; ++d) o[d] += p * v[j * D + d];
    }
    for (int d = 0; d < D; ++d) acc[d] = o[d];
  }
}


#ifdef VQ_SMALL_D_AVX2
#define VQ_AVX2 __attribute__((target("avx2")))

// In-place 8x8 transpose: afterwards r[j] holds column j of the rows r[0..7].
VQ_AVX2 inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)), u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)), u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0)), u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0)), u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

VQ_AVX2 inline float hmax(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

VQ_AVX2 inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

// exp_nonpositive (exp_nonpositive.hpp) on eight lanes: the same operations in the same order
// (separate multiplies and adds: a fused multiply-add rounds once where they round twice), so the
// same floats as the scalar function and as exp_shifted's vectorised loop.
VQ_AVX2 inline __m256 exp8_nonpositive(__m256 x) {
  const __m256i lim = _mm256_set1_epi32(static_cast<int>(std::bit_cast<std::uint32_t>(-87.0f)));
  x = _mm256_castsi256_ps(_mm256_min_epu32(_mm256_castps_si256(x), lim));
  const __m256 rounder = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), rounder), rounder);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// The value update of up to kGroup rows at once: row k adds s_k[j] V[j] for j < vis[k] to acc_k,
// even tokens into one sum and odd ones into another, added at the end (o0 + o1), exactly as
// one row alone does; the rows' chains interleave, so the adds no longer wait on each other's
// latency, and each value row loaded serves every row of the group.
constexpr int kGroup = 4;

VQ_AVX2 inline void value_row_tail(const float* s, const float* V, std::int64_t j, std::int64_t visible, __m256& o0, __m256& o1) {
  for (; j + 2 <= visible; j += 2) {
    o0 = _mm256_add_ps(o0, _mm256_mul_ps(_mm256_broadcast_ss(s + j), _mm256_loadu_ps(V + j * 8)));
    o1 = _mm256_add_ps(o1, _mm256_mul_ps(_mm256_broadcast_ss(s + j + 1), _mm256_loadu_ps(V + (j + 1) * 8)));
  }
  if (j < visible) o0 = _mm256_add_ps(o0, _mm256_mul_ps(_mm256_broadcast_ss(s + j), _mm256_loadu_ps(V + j * 8)));
}

VQ_AVX2 void value_group(int g, float* const* s, const std::int64_t* vis, float* const* acc, const float* V) {
  __m256 o0[kGroup], o1[kGroup];
  std::int64_t common = vis[0];
  for (int k = 0; k < g; ++k) {
    o0[k] = _mm256_loadu_ps(acc[k]);
    o1[k] = _mm256_setzero_ps();
    common = std::min(common, vis[k]);
  }
  std::int64_t j = 0;
  if (g == kGroup) {
    for (; j + 2 <= common; j += 2) {
      const __m256 v0 = _mm256_loadu_ps(V + j * 8), v1 = _mm256_loadu_ps(V + (j + 1) * 8);
#pragma GCC unroll 4
      for (int k = 0; k < kGroup; ++k) {
        o0[k] = _mm256_add_ps(o0[k], _mm256_mul_ps(_mm256_broadcast_ss(s[k] + j), v0));
        o1[k] = _mm256_add_ps(o1[k], _mm256_mul_ps(_mm256_broadcast_ss(s[k] + j + 1), v1));
      }
    }
  }
  for (int k = 0; k < g; ++k) {
    __m256 a0 = o0[k], a1 = o1[k];  // locals: kept in registers through the row's tail
    value_row_tail(s[k], V, j, vis[k], a0, a1);
    _mm256_storeu_ps(acc[k], _mm256_add_ps(a0, a1));
  }
}

// small_d_tile<8> with explicit AVX2: keys transposed in 8x8 blocks, scores of 8 tokens per
// vector, the max, exp and sum in vectors, one 8-wide multiply-add per token for the values, for
// kGroup rows at a time (value_group). The same operations per row as small_d_tile<8>'s
// vectorised form, so the same floats.
VQ_AVX2 void small_d8_avx2(const SmallDTile& a) {
  const std::int64_t n = a.n, ld = round_up8(n);
  float* kt = a.scratch;           // [8, ld]
  float* sbase = a.scratch + 8 * ld;  // [kGroup, ld]: the group's rows' scores, then weights
  for (std::int64_t j = 0; j < ld; j += 8) {
    __m256 r[8];
    if (j + 8 <= n) {
      for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(a.K + (j + k) * 8);
    } else {
      for (int k = 0; k < 8; ++k) r[k] = j + k < n ? _mm256_loadu_ps(a.K + (j + k) * 8) : _mm256_setzero_ps();
    }
    transpose8(r);
    for (int d = 0; d < 8; ++d) _mm256_storeu_ps(kt + d * ld + j, r[d]);
  }
  const __m256 vscale = _mm256_set1_ps(a.scale);
  float* gs[kGroup];
  float* gacc[kGroup];
  std::int64_t gvis[kGroup];
  int g = 0;
  for (std::int64_t row = 0; row < a.rows; ++row) {
    const std::int64_t i = row % a.Sq, last = a.T - a.Sq + i;
    const std::int64_t visible = std::min(n, last - a.t0 + 1);
    if (visible <= 0) continue;
    float* s = sbase + g * ld;
    const float* q = a.q + row * 8;
    __m256 qd[8];
    for (int d = 0; d < 8; ++d) qd[d] = _mm256_set1_ps(q[d]);
    const std::int64_t full = visible / 8 * 8;
    __m256 mv = _mm256_set1_ps(a.m[row]);
    for (std::int64_t j = 0; j < visible; j += 8) {
      __m256 t = _mm256_mul_ps(qd[0], _mm256_loadu_ps(kt + j));
      for (int d = 1; d < 8; ++d) t = _mm256_add_ps(t, _mm256_mul_ps(qd[d], _mm256_loadu_ps(kt + d * ld + j)));
      t = _mm256_mul_ps(vscale, t);
      _mm256_storeu_ps(s + j, t);
      if (j < full) mv = _mm256_max_ps(mv, t);
    }
    float mx = hmax(mv);
    for (std::int64_t j = full; j < visible; ++j) mx = std::max(mx, s[j]);
    float* acc = a.acc + row * 8;
    if (mx > a.m[row]) {
      const float c = std::exp(a.m[row] - mx);
      a.l[row] *= c;
      for (int d = 0; d < 8; ++d) acc[d] *= c;
      a.m[row] = mx;
    }
    // Weights exp(s - mx) (the lanes of the last group past `visible` are computed and never
    // read), the sum of the whole groups in eight lanes, then the rest in order.
    // (Two loops: summing in the exp loop runs out of registers, and the sum, kept in memory, then
    // makes every step wait for the previous one's store.)
    const __m256 vmx = _mm256_set1_ps(mx);
    for (std::int64_t j = 0; j < visible; j += 8)
      _mm256_storeu_ps(s + j, exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx)));
    __m256 sv = _mm256_setzero_ps();
    for (std::int64_t j = 0; j < full; j += 8) sv = _mm256_add_ps(sv, _mm256_loadu_ps(s + j));
    float sum = hsum(sv);
    for (std::int64_t j = full; j < visible; ++j) sum += s[j];
    a.l[row] += sum;
    gs[g] = s;
    gacc[g] = acc;
    gvis[g] = visible;
    if (++g == kGroup) {
      value_group(g, gs, gvis, gacc, a.V);
      g = 0;
    }
  }
  if (g > 0) value_group(g, gs, gvis, gacc, a.V);
}

#define VQ_AVX512 __attribute__((target("avx512f,avx512dq,avx512vl,avx2")))

std::int64_t round_up16(std::int64_t v) { return (v + 15) / 16 * 16; }

// exp8_nonpositive on sixteen lanes: the same operations in the same order, so the same floats.
VQ_AVX512 inline __m512 exp16_nonpositive(__m512 x) {
  const __m512i lim = _mm512_set1_epi32(static_cast<int>(std::bit_cast<std::uint32_t>(-87.0f)));
  x = _mm512_castsi512_ps(_mm512_min_epu32(_mm512_castps_si512(x), lim));
  const __m512 rounder = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), rounder), rounder);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}


constexpr int kGroup512 = 8;

// The sums of the weights of up to kGroup512 rows (small_d8_avx2's: whole groups of 8 tokens
// into eight lanes in token order, folded by hsum, then the rest in order), added to l. The rows'
// chains of adds interleave, so no row waits on its own adds' latency.
VQ_AVX512 void sum_group512(int g, float* const* s, const std::int64_t* vis, float* const* l) {
  __m256 sv[kGroup512];
  std::int64_t common = vis[0];
  for (int k = 0; k < g; ++k) {
    sv[k] = _mm256_setzero_ps();
    common = std::min(common, vis[k]);
  }
  const std::int64_t common_full = common / 8 * 8;
  std::int64_t j = 0;
  if (g == kGroup512)
    for (; j < common_full; j += 8)
#pragma GCC unroll 8
      for (int k = 0; k < kGroup512; ++k) sv[k] = _mm256_add_ps(sv[k], _mm256_loadu_ps(s[k] + j));
  for (int k = 0; k < g; ++k) {
    const std::int64_t full = vis[k] / 8 * 8;
    __m256 v = sv[k];
    for (std::int64_t jj = j; jj < full; jj += 8) v = _mm256_add_ps(v, _mm256_loadu_ps(s[k] + jj));
    float sum = hsum(v);
    for (std::int64_t jj = full; jj < vis[k]; ++jj) sum += s[k][jj];
    *l[k] += sum;
  }
}

// The weights (s_j, s_j+1) in every pair of lanes: one 64-bit broadcast from memory.
VQ_AVX512 inline __m512 pair_weights(const float* s) {
  double d;
  std::memcpy(&d, s, sizeof d);
  return _mm512_castpd_ps(_mm512_set1_pd(d));
}

// The value update of up to kGroup512 rows, on token pairs: vil holds tokens 2p and 2p + 1 of the
// tile interleaved (lane 2d = V[2p][d], lane 2d + 1 = V[2p + 1][d]), and a row's one accumulator
// holds small_d8_avx2's two, o0 in the even lanes (even tokens) and o1 in the odd (odd tokens):
// each lane adds exactly the products its o0 or o1 lane adds, in the same order, and the last
// even token of an odd count goes to the even lanes only. acc = o0 + o1 at the end, as there.
VQ_AVX512 void value_group512(int g, float* const* s, const std::int64_t* vis, float* const* acc, const float* vil) {
  const __m512i spread = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  __m512 o[kGroup512];
  std::int64_t common = vis[0];
  for (int k = 0; k < g; ++k) {
    o[k] = _mm512_maskz_permutexvar_ps(0x5555, spread, _mm512_castps256_ps512(_mm256_loadu_ps(acc[k])));
    common = std::min(common, vis[k]);
  }
  std::int64_t j = 0;
  if (g == kGroup512) {
    for (; j + 2 <= common; j += 2) {
      const __m512 v = _mm512_loadu_ps(vil + j * 8);
#pragma GCC unroll 8
      for (int k = 0; k < kGroup512; ++k) o[k] = _mm512_add_ps(o[k], _mm512_mul_ps(pair_weights(s[k] + j), v));
    }
  }
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i odds = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int k = 0; k < g; ++k) {
    __m512 a = o[k];
    std::int64_t jj = j;
    for (; jj + 2 <= vis[k]; jj += 2) a = _mm512_add_ps(a, _mm512_mul_ps(pair_weights(s[k] + jj), _mm512_loadu_ps(vil + jj * 8)));
    if (jj < vis[k]) a = _mm512_mask_add_ps(a, 0x5555, a, _mm512_mul_ps(pair_weights(s[k] + jj), _mm512_loadu_ps(vil + jj * 8)));
    const __m256 o0 = _mm512_castps512_ps256(_mm512_permutexvar_ps(evens, a));
    const __m256 o1 = _mm512_castps512_ps256(_mm512_permutexvar_ps(odds, a));
    _mm256_storeu_ps(acc[k], _mm256_add_ps(o0, o1));
  }
}

// small_d8_avx2 on 512-bit vectors: scores and weights of 16 tokens per vector, the sums and the
// values kGroup512 rows at a time (sum_group512, value_group512; the values on token pairs).
// Every float operation of a row is the one small_d8_avx2 does on the same operands, in the same
// order, so the same bits.
VQ_AVX512 void small_d8_avx512(const SmallDTile& a) {
  const std::int64_t n = a.n, ld = round_up16(n);
  float* kt = a.scratch;                 // [ld / 16, 8, 16]: keys by blocks of 16 tokens, token-minor
  float* vil = a.scratch + 8 * ld;       // [ld / 2, 16]: value pairs, interleaved
  float* sbase = a.scratch + 16 * ld;    // [kGroup512, ld]: the group's rows' scores, then weights
  for (std::int64_t j = 0; j < ld; j += 8) {
    __m256 r[8];
    if (j + 8 <= n) {
      for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(a.K + (j + k) * 8);
    } else {
      for (int k = 0; k < 8; ++k) r[k] = j + k < n ? _mm256_loadu_ps(a.K + (j + k) * 8) : _mm256_setzero_ps();
    }
    transpose8(r);
    float* blk = kt + (j / 16) * 128 + j % 16;
    for (int d = 0; d < 8; ++d) _mm256_storeu_ps(blk + d * 16, r[d]);
  }
  {
    const __m512i inter = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    for (std::int64_t j = 0; j < n; j += 2) {
      const __m512 pair = j + 2 <= n ? _mm512_loadu_ps(a.V + j * 8) : _mm512_maskz_loadu_ps(0x00FF, a.V + j * 8);
      _mm512_storeu_ps(vil + j * 8, _mm512_permutexvar_ps(inter, pair));
    }
  }
  const __m512 vscale = _mm512_set1_ps(a.scale);
  float* gs[kGroup512];
  float* gacc[kGroup512];
  float* gl[kGroup512];
  std::int64_t gvis[kGroup512];
  int g = 0;
  for (std::int64_t row = 0; row < a.rows; ++row) {
    const std::int64_t i = row % a.Sq, last = a.T - a.Sq + i;
    const std::int64_t visible = std::min(n, last - a.t0 + 1);
    if (visible <= 0) continue;
    float* s = sbase + g * ld;
    const float* q = a.q + row * 8;
    __m512 qd[8];
    for (int d = 0; d < 8; ++d) qd[d] = _mm512_set1_ps(q[d]);
    __m512 mv = _mm512_set1_ps(a.m[row]);
    const float* kb = kt;
    for (std::int64_t j = 0; j < visible; j += 16, kb += 128) {
      __m512 t = _mm512_mul_ps(qd[0], _mm512_loadu_ps(kb));
#pragma GCC unroll 8
      for (int d = 1; d < 8; ++d) t = _mm512_add_ps(t, _mm512_mul_ps(qd[d], _mm512_loadu_ps(kb + d * 16)));
      t = _mm512_mul_ps(vscale, t);
      _mm512_storeu_ps(s + j, t);
      const std::int64_t left = visible - j;
      const __mmask16 live = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
      mv = _mm512_mask_max_ps(mv, live, mv, t);
    }
    const float mx = _mm512_reduce_max_ps(mv);  // the max is exact in any order
    float* acc = a.acc + row * 8;
    if (mx > a.m[row]) {
      const float c = std::exp(a.m[row] - mx);
      a.l[row] *= c;
      for (int d = 0; d < 8; ++d) acc[d] *= c;
      a.m[row] = mx;
    }
    // Weights exp(s - mx) (lanes past `visible` computed and never read).
    const __m512 vmx = _mm512_set1_ps(mx);
    for (std::int64_t j = 0; j < visible; j += 16)
      _mm512_storeu_ps(s + j, exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), vmx)));
    gs[g] = s;
    gacc[g] = acc;
    gl[g] = a.l + row;
    gvis[g] = visible;
    if (++g == kGroup512) {
      sum_group512(g, gs, gvis, gl);
      value_group512(g, gs, gvis, gacc, vil);
      g = 0;
    }
  }
  if (g > 0) {
    sum_group512(g, gs, gvis, gl);
    value_group512(g, gs, gvis, gacc, vil);
  }
}
#endif

}  // namespace

SmallDKernel small_d_kernel(SmallDPath path, std::int64_t Dk, std::int64_t Dv) {
  if (Dk != Dv) return nullptr;
  switch (path) {
    case SmallDPath::Portable:
      if (Dk == 8) return &small_d_tile<8>;
      if (Dk == 16) return &small_d_tile<16>;
      return nullptr;
    case SmallDPath::Avx2:
#ifdef VQ_SMALL_D_AVX2
      if (Dk == 8 && __builtin_cpu_supports("avx2")) return &small_d8_avx2;
#endif
      return nullptr;
    case SmallDPath::Avx512:
#ifdef VQ_SMALL_D_AVX2
      if (Dk == 8 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
        return &small_d8_avx512;
#endif
      return nullptr;
  }
  return nullptr;
}

SmallDKernel pick_small_d_kernel(std::int64_t Dk, std::int64_t Dv) {
  for (const SmallDPath path : {SmallDPath::Avx512, SmallDPath::Avx2, SmallDPath::Portable})
    if (const SmallDKernel k = small_d_kernel(path, Dk, Dv)) return k;
  return nullptr;
}

// small_d_tile: (D + 1) rows of round_up8(tile); the AVX-512 kernel: keys, value pairs and
// kGroup512 score rows of round_up16(tile).
std::int64_t small_d_scratch_floats(std::int64_t tile) {
  return std::max((kMaxSmallD + 1) * round_up8(tile), (16 + 8) * ((tile + 15) / 16 * 16));
}

}  // namespace vq::detail
