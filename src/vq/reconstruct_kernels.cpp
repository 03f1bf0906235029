// Tiled reconstruction kernels (reconstruct_kernels.hpp): same operations, same order as the
// per-token path, many tokens per pass over F^-1's columns.
#include "reconstruct_kernels.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace vq {

namespace {

std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

// Keys re-rotated from acc (d floats) into out, with the table's cos / sin; or copied.
inline void rotate_row(const float* __restrict acc, int d, const double* cs, float* __restrict out) {
  if (cs) {
    for (int p = 0; p < d / 2; ++p) {
      const double c = cs[2 * p], s = cs[2 * p + 1];
      const double v0 = acc[2 * p], v1 = acc[2 * p + 1];
      out[2 * p] = static_cast<float>(v0 * c - v1 * s);
      out[2 * p + 1] = static_cast<float>(v0 * s + v1 * c);
    }
  } else {
    std::copy_n(acc, d, out);
  }
}

// Outputs [i0, i1) of one token, scalar: acc_i = sum_j cols[j][i] * y_j, j ascending, from 0.
inline void scalar_outputs(const float* __restrict cols, int span, int d, const float* __restrict y, int i0, int i1,
                           float* __restrict acc) {
  for (int i = i0; i < i1; ++i) acc[i] = 0.0f;
  for (int j = 0; j < span; ++j) {
    const float yj = y[j];
    const float* __restrict col = cols + sz(j) * sz(d);
    for (int i = i0; i < i1; ++i) acc[i] += col[i] * yj;
  }
}

#if defined(__x86_64__)
// TT tokens x 16 outputs per pass: 2 * TT accumulators in registers, each column pair of F^-1 loaded
// once for the TT tokens. _mm256_mul_ps then _mm256_add_ps: the scalar path's two roundings.
template <int TT>
__attribute__((target("avx2"))) inline void tile_avx2(const float* __restrict cols, int span, int d, const float* __restrict y,
                                                      std::size_t y_stride, int i0, float* __restrict acc /* [TT][d] */) {
  __m256 a0[TT], a1[TT];
  for (int t = 0; t < TT; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
  for (int j = 0; j < span; ++j) {
    const float* col = cols + sz(j) * sz(d) + sz(i0);
    const __m256 c0 = _mm256_loadu_ps(col), c1 = _mm256_loadu_ps(col + 8);
    for (int t = 0; t < TT; ++t) {
      const __m256 yb = _mm256_broadcast_ss(y + sz(t) * y_stride + sz(j));
      a0[t] = _mm256_add_ps(a0[t], _mm256_mul_ps(c0, yb));
      a1[t] = _mm256_add_ps(a1[t], _mm256_mul_ps(c1, yb));
    }
  }
  for (int t = 0; t < TT; ++t) {
    _mm256_storeu_ps(acc + sz(t) * sz(d) + sz(i0), a0[t]);
    _mm256_storeu_ps(acc + sz(t) * sz(d) + sz(i0) + 8, a1[t]);
  }
}

template <int TT>
__attribute__((target("avx2"))) void tokens_avx2(const float* cols, int span, int d, const float* y, std::size_t y_stride,
                                                 float* acc) {
  const int vec_end = d / 16 * 16;
  for (int i0 = 0; i0 < vec_end; i0 += 16) tile_avx2<TT>(cols, span, d, y, y_stride, i0, acc);
  if (vec_end < d)
    for (int t = 0; t < TT; ++t) scalar_outputs(cols, span, d, y + sz(t) * y_stride, vec_end, d, acc + sz(t) * sz(d));
}

bool have_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#else
bool have_avx2() { return false; }
#endif

constexpr int kTile = 6;  // tokens per pass (12 accumulators + 2 columns + 1 broadcast of 16 ymm registers)

#if defined(__x86_64__)
// TT tokens x NB blocks of 16 outputs per pass on AVX-512, each of w's rows loaded once for the TT
// tokens: acc[t * a_stride + i] = sum_j w[j * w_stride + i] * y[t * y_stride + j], i in [i0, i0 + 16 NB),
// j ascending from 0 below span. Product then add (_mm512_mul_ps, _mm512_add_ps): the scalar path's
// roundings. The all-heads product (vq_all_head_rows: w_stride = y_stride = a_stride = span = n) and
// one head's (vq_head_rows: w = the head's columns [span][d], strides d).
template <int TT, int NB>
__attribute__((target("avx512f"))) inline void tile_avx512(const float* __restrict w, int span, std::size_t w_stride,
                                                          const float* __restrict y, std::size_t y_stride, int i0,
                                                          float* __restrict acc, std::size_t a_stride) {
  __m512 a[TT][NB];
  for (int t = 0; t < TT; ++t)
    for (int k = 0; k < NB; ++k) a[t][k] = _mm512_setzero_ps();
  for (int j = 0; j < span; ++j) {
    __m512 c[NB];
    for (int k = 0; k < NB; ++k) c[k] = _mm512_loadu_ps(w + sz(j) * w_stride + sz(i0 + 16 * k));
    for (int t = 0; t < TT; ++t) {
      const __m512 yb = _mm512_set1_ps(y[sz(t) * y_stride + sz(j)]);
      for (int k = 0; k < NB; ++k) a[t][k] = _mm512_add_ps(a[t][k], _mm512_mul_ps(c[k], yb));
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int k = 0; k < NB; ++k) _mm512_storeu_ps(acc + sz(t) * a_stride + sz(i0 + 16 * k), a[t][k]);
}

// TT tokens, all `outputs` outputs: blocks of 32, then of 16, then the rest scalar.
template <int TT>
__attribute__((target("avx512f"))) void tokens_avx512(const float* w, int span, std::size_t w_stride, int outputs, const float* y,
                                                     std::size_t y_stride, float* acc, std::size_t a_stride) {
  int i0 = 0;
  for (; i0 + 32 <= outputs; i0 += 32) tile_avx512<TT, 2>(w, span, w_stride, y, y_stride, i0, acc, a_stride);
  for (; i0 + 16 <= outputs; i0 += 16) tile_avx512<TT, 1>(w, span, w_stride, y, y_stride, i0, acc, a_stride);
  if (i0 < outputs)
    for (int t = 0; t < TT; ++t)
      scalar_outputs(w, span, static_cast<int>(w_stride), y + sz(t) * y_stride, i0, outputs, acc + sz(t) * a_stride);
}

constexpr int kTile512 = 12;  // 24 accumulators + 2 rows of w + 1 broadcast of 32 zmm registers

template <int TT>
void tokens_avx512_upto(const float* w, int span, std::size_t w_stride, int outputs, const float* y, std::size_t y_stride,
                        std::int64_t tokens, float* acc, std::size_t a_stride) {
  if constexpr (TT > 0) {
    if (tokens == TT) return tokens_avx512<TT>(w, span, w_stride, outputs, y, y_stride, acc, a_stride);
    tokens_avx512_upto<TT - 1>(w, span, w_stride, outputs, y, y_stride, tokens, acc, a_stride);
  }
}

// `tokens` tokens, 12 per pass, then the rest: acc[t * a_stride + i] for every output i below
// `outputs` (tokens_avx512's sums).
void rows_avx512(const float* w, int span, std::size_t w_stride, int outputs, const float* y, std::size_t y_stride, std::int64_t tokens,
                 float* acc, std::size_t a_stride) {
  std::int64_t t = 0;
  for (; t + kTile512 <= tokens; t += kTile512)
    tokens_avx512<kTile512>(w, span, w_stride, outputs, y + sz(t) * y_stride, y_stride, acc + sz(t) * a_stride, a_stride);
  if (t < tokens)
    tokens_avx512_upto<kTile512 - 1>(w, span, w_stride, outputs, y + sz(t) * y_stride, y_stride, tokens - t, acc + sz(t) * a_stride, a_stride);
}

// Keys re-rotated 4 pairs (8 values) at a time in double, from acc rows (stride n, head h at h * d)
// into head-major out: x * (c, c) + swap(x) * (-s, s), i.e. (v0 c - v1 s, v1 c + v0 s): the same
// products, and a + (-b) = a - b, b + a = a + b exactly, so the same bits as rotate_row.
// (g++ 12 warns of the undefined pass-through operand inside the double-precision permute and
// convert intrinsics' own definitions, as in code_pack.cpp: not our code's.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
__attribute__((target("avx512f"))) void rotate_all_avx512(const float* acc, int n, int heads, int d, std::int64_t tokens,
                                                          const VqRopeTable& rope, std::int64_t pos0, float* out) {
  const __m512i even = _mm512_set_epi64(6, 6, 4, 4, 2, 2, 0, 0), odd = _mm512_set_epi64(7, 7, 5, 5, 3, 3, 1, 1);
  const __m512i neg_even = _mm512_set_epi64(0, INT64_MIN, 0, INT64_MIN, 0, INT64_MIN, 0, INT64_MIN);
  for (std::int64_t t = 0; t < tokens; ++t) {
    const double* cs = rope.at(pos0 + t);
    for (int p0 = 0; p0 < d; p0 += 8) {
      const __m512d csv = _mm512_loadu_pd(cs + p0);
      const __m512d c = _mm512_permutexvar_pd(even, csv);
      const __m512d s = _mm512_castsi512_pd(_mm512_xor_si512(_mm512_castpd_si512(_mm512_permutexvar_pd(odd, csv)), neg_even));
      for (int h = 0; h < heads; ++h) {
        const __m512d x = _mm512_cvtps_pd(_mm256_loadu_ps(acc + sz(t) * sz(n) + sz(h * d + p0)));
        const __m512d r = _mm512_add_pd(_mm512_mul_pd(x, c), _mm512_mul_pd(_mm512_permute_pd(x, 0x55), s));
        _mm256_storeu_ps(out + (sz(h) * sz(tokens) + sz(t)) * sz(d) + sz(p0), _mm512_cvtpd_ps(r));
      }
    }
  }
}

#pragma GCC diagnostic pop

bool have_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
  return yes;
}
#else
bool have_avx512() { return false; }
#endif

// acc rows (stride n) to head-major out, keys re-rotated: the scalar rotation.
void rotate_all_scalar(const float* acc, int n, int heads, int d, std::int64_t tokens, const VqRopeTable* rope, std::int64_t pos0,
                       float* out) {
  if (!rope) {  // head-major copies (d = 8: two 16-byte moves, not a library call per row)
    for (int h = 0; h < heads; ++h) {
      float* __restrict o = out + sz(h) * sz(tokens) * sz(d);
      const float* __restrict a = acc + sz(h * d);
      if (d == 8)
        for (std::int64_t t = 0; t < tokens; ++t) std::memcpy(o + sz(t) * 8, a + sz(t) * sz(n), 8 * sizeof(float));
      else
        for (std::int64_t t = 0; t < tokens; ++t) std::memcpy(o + sz(t) * sz(d), a + sz(t) * sz(n), sz(d) * sizeof(float));
    }
    return;
  }
  for (std::int64_t t = 0; t < tokens; ++t)
    for (int h = 0; h < heads; ++h)
      rotate_row(acc + sz(t) * sz(n) + sz(h * d), d, rope ? rope->at(pos0 + t) : nullptr, out + (sz(h) * sz(tokens) + sz(t)) * sz(d));
}

}  // namespace

std::shared_ptr<const VqRopeTable> vq_rope_table(const std::vector<double>& freq, std::int64_t positions) {
  if (freq.empty()) return nullptr;
  static std::mutex mu;
  static std::vector<std::shared_ptr<const VqRopeTable>> tables;
  std::lock_guard<std::mutex> lock(mu);
  auto it = std::find_if(tables.begin(), tables.end(), [&](const auto& t) { return t->freq == freq; });
  if (it != tables.end() && (*it)->positions >= positions) return *it;
  // Grow to at least twice the old length (few rebuilds as contexts lengthen); 256 at least.
  const std::int64_t n = std::max<std::int64_t>({positions, 256, it != tables.end() ? 2 * (*it)->positions : 0});
  auto t = std::make_shared<VqRopeTable>();
  t->freq = freq;
  t->positions = n;
  t->cs.resize(sz(n) * freq.size() * 2);
  for (std::int64_t pos = 0; pos < n; ++pos)
    for (std::size_t p = 0; p < freq.size(); ++p) {
      // The per-token path's expressions (transform.cpp's rotate_out).
      const double ang = static_cast<double>(pos) * freq[p], c = std::cos(ang), s = std::sin(ang);
      t->cs[(sz(pos) * freq.size() + p) * 2] = c;
      t->cs[(sz(pos) * freq.size() + p) * 2 + 1] = s;
    }
  if (it != tables.end()) *it = t;
  else tables.push_back(t);
  return t;
}

void vq_head_rows_scalar(const float* cols, int span, int d, const float* y, std::size_t y_stride, std::int64_t tokens,
                         const VqRopeTable* rope, std::int64_t pos0, float* out) {
  std::vector<float> acc(sz(d));
  for (std::int64_t t = 0; t < tokens; ++t) {
    scalar_outputs(cols, span, d, y + sz(t) * y_stride, 0, d, acc.data());
    rotate_row(acc.data(), d, rope ? rope->at(pos0 + t) : nullptr, out + sz(t) * sz(d));
  }
}

bool vq_head_rows_avx2() { return have_avx2(); }

void vq_head_rows(const float* cols, int span, int d, const float* y, std::size_t y_stride, std::int64_t tokens, const VqRopeTable* rope,
                  std::int64_t pos0, float* out) {
  if (!have_avx2() || d < 16) {
    vq_head_rows_scalar(cols, span, d, y, y_stride, tokens, rope, pos0, out);
    return;
  }
#if defined(__x86_64__)
  if (have_avx512() && (!rope || d % 8 == 0)) {
    // 12 tokens per pass into `out` itself (its rows are d apart, as the tiles write them), then
    // the keys re-rotated in place: rotate_all_avx512 with one head reads a row before it writes it.
    rows_avx512(cols, span, sz(d), d, y, y_stride, tokens, out, sz(d));
    if (rope) rotate_all_avx512(out, d, 1, d, tokens, *rope, pos0, out);
    return;
  }
  std::vector<float> acc(sz(kTile) * sz(d));
  std::int64_t t = 0;
  const auto finish = [&](int count) {
    for (int k = 0; k < count; ++k)
      rotate_row(acc.data() + sz(k) * sz(d), d, rope ? rope->at(pos0 + t + k) : nullptr, out + sz(t + k) * sz(d));
    t += count;
  };
  for (; t + kTile <= tokens;) {
    tokens_avx2<kTile>(cols, span, d, y + sz(t) * y_stride, y_stride, acc.data());
    finish(kTile);
  }
  switch (tokens - t) {
    case 5: tokens_avx2<5>(cols, span, d, y + sz(t) * y_stride, y_stride, acc.data()); finish(5); break;
    case 4: tokens_avx2<4>(cols, span, d, y + sz(t) * y_stride, y_stride, acc.data()); finish(4); break;
    case 3: tokens_avx2<3>(cols, span, d, y + sz(t) * y_stride, y_stride, acc.data()); finish(3); break;
    case 2: tokens_avx2<2>(cols, span, d, y + sz(t) * y_stride, y_stride, acc.data()); finish(2); break;
    case 1: tokens_avx2<1>(cols, span, d, y + sz(t) * y_stride, y_stride, acc.data()); finish(1); break;
    default: break;
  }
#endif
}

void vq_whole_row_matrix(const float* inv_cols, int n, int heads, float* w) {
  const int d = n / heads;
  for (int j = 0; j < n; ++j)
    for (int h = 0; h < heads; ++h) std::copy_n(inv_cols + (sz(h) * sz(n) + sz(j)) * sz(d), d, w + sz(j) * sz(n) + sz(h * d));
}

bool vq_all_head_rows_avx512() { return have_avx512(); }

void vq_all_head_rows_scalar(const float* w, int n, int heads, const float* y, std::int64_t tokens, const VqRopeTable* rope,
                             std::int64_t pos0, float* acc, float* out) {
  for (std::int64_t t = 0; t < tokens; ++t) scalar_outputs(w, n, n, y + sz(t) * sz(n), 0, n, acc + sz(t) * sz(n));
  rotate_all_scalar(acc, n, heads, n / heads, tokens, rope, pos0, out);
}

void vq_all_head_rows(const float* w, int n, int heads, const float* y, std::int64_t tokens, const VqRopeTable* rope, std::int64_t pos0,
                      float* acc, float* out) {
  const int d = n / heads;
#if defined(__x86_64__)
  if (have_avx512() && n >= 16) {
    rows_avx512(w, n, sz(n), n, y, sz(n), tokens, acc, sz(n));
    if (rope && d % 8 == 0) return rotate_all_avx512(acc, n, heads, d, tokens, *rope, pos0, out);
    return rotate_all_scalar(acc, n, heads, d, tokens, rope, pos0, out);
  }
#endif
  // vq_head_rows' tiles over all n outputs at once (no rotation), then the rotation.
  vq_head_rows(w, n, n, y, sz(n), tokens, nullptr, 0, acc);
  rotate_all_scalar(acc, n, heads, d, tokens, rope, pos0, out);
}

}  // namespace vq
