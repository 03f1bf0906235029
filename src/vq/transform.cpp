#include "transform.hpp"

#include "veloxquant/core/kernel_clones.hpp"

#include <algorithm>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace vq::vq_transform {

namespace {

std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

#if defined(__x86_64__) && defined(__GNUC__)
// forward() for a transform that mixes every head, from F transposed (fwd_t): eight rows per zmm
// of doubles, up to 32 rows side by side; each row's terms are the scalar loop's (double(f) * x_j,
// a product and then an add, from 0 in j order), so the codes are the same bits.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's _mm512_cvtps_pd passes an undefined source for its unused mask
__attribute__((target("avx512f"))) void forward_t_avx512(const float* fwd_t, int n, const double* x, double* y) {
  for (int i0 = 0; i0 < n; i0 += 32) {
    const int blocks = std::min(32, n - i0) / 8;
    __m512d acc[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd()};
    for (int j = 0; j < n; ++j) {
      const __m512d xj = _mm512_set1_pd(x[j]);
      const float* col = fwd_t + sz(j) * sz(n) + sz(i0);
      for (int k = 0; k < blocks; ++k) acc[k] = _mm512_add_pd(acc[k], _mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(col + 8 * k)), xj));
    }
    for (int k = 0; k < blocks; ++k) _mm512_storeu_pd(y + i0 + 8 * k, acc[k]);
  }
}
#pragma GCC diagnostic pop
bool forward_avx512_ok() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}
#endif

// The decoder's rows of head h (d values) from a row's y_hat (n floats): x_hat = F^-1 y_hat in
// float, each output accumulated over j in order (j outer, so the d outputs advance together and
// vectorise without reordering any sum; F^-1 is the layer model's own row-major matrix, nothing
// copied per cache), then keys re-rotated in double. Shared by the cache's tiles, state() and
// vq_reconstruct so all produce the same bits.
// Keys re-rotated (freq), or copied, from x to out.
inline void rotate_out(const float* __restrict x, int d, const std::vector<double>* freq, std::int64_t pos, float* __restrict out) {
  if (freq && !freq->empty()) {
    for (std::size_t p = 0; p < freq->size(); ++p) {
      const double ang = static_cast<double>(pos) * (*freq)[p], c = std::cos(ang), s = std::sin(ang);
      const double v0 = x[2 * p], v1 = x[2 * p + 1];
      out[2 * p] = static_cast<float>(v0 * c - v1 * s);
      out[2 * p + 1] = static_cast<float>(v0 * s + v1 * c);
    }
  } else {
    for (int i = 0; i < d; ++i) out[i] = x[i];
  }
}


}  // namespace

// Undo RoPE on each (2i, 2i+1) pair of every head, angle = pos * freq_i, in double, with cos / sin
// from the position's VqRopeTable row (pairs {cos, sin}, the table's expressions).
void vq_unrope(double* x, int heads, int d, const double* cs, std::size_t pairs) {
  for (std::size_t p = 0; p < pairs; ++p) {
    const double c = cs[2 * p], s = -cs[2 * p + 1];
    for (int h = 0; h < heads; ++h) {
      double* v = x + sz(h) * sz(d) + 2 * p;
      const double v0 = v[0], v1 = v[1];
      v[0] = v0 * c - v1 * s;
      v[1] = v0 * s + v1 * c;
    }
  }
}

void vq_forward(const VqSideTransform& t, const double* x, double* y) {
#if defined(__x86_64__) && defined(__GNUC__)
  const int n = t.n;
  if (!t.identity() && t.fwd_t.size() == sz(n) * sz(n) && n % 8 == 0 && forward_avx512_ok()) return forward_t_avx512(t.fwd_t.data(), n, x, y);
#endif
  vq_forward_ref(t, x, y);
}

void vq_forward_ref(const VqSideTransform& t, const double* x, double* y) {
  const int n = t.n;
  if (t.identity()) {
    std::copy_n(x, n, y);
    return;
  }
  // With per-head blocks (col_span = d < n) row i's nonzero columns are its head's: the terms
  // skipped are exact zeros (acc never holds -0, so adding them changes no bit). Four rows at once
  // give four independent sums, each in the same order as one row alone.
  const int span = t.col_span > 0 && t.col_span < n && n % t.col_span == 0 ? t.col_span : n;
  int i = 0;
  if (span % 4 == 0)
    for (; i + 4 <= n; i += 4) {
      const int j0 = span == n ? 0 : i / span * span;
      const float* r0 = t.fwd.data() + sz(i) * sz(n);
      const float *r1 = r0 + n, *r2 = r1 + n, *r3 = r2 + n;
      double a0 = 0, a1 = 0, a2 = 0, a3 = 0;
      for (int j = j0; j < j0 + span; ++j) {
        const double xj = x[j];
        a0 += static_cast<double>(r0[j]) * xj;
        a1 += static_cast<double>(r1[j]) * xj;
        a2 += static_cast<double>(r2[j]) * xj;
        a3 += static_cast<double>(r3[j]) * xj;
      }
      y[i] = a0;
      y[i + 1] = a1;
      y[i + 2] = a2;
      y[i + 3] = a3;
    }
  for (; i < n; ++i) {
    const int j0 = span == n ? 0 : i / span * span;
    double acc = 0;
    const float* row = t.fwd.data() + sz(i) * sz(n);
    for (int j = j0; j < j0 + span; ++j) acc += static_cast<double>(row[j]) * x[j];
    y[i] = acc;
  }
}

VQ_KERNEL
void reconstruct_head(const float* __restrict inv, int n, const float* __restrict yhat, int h, int d,
                      const std::vector<double>* freq, std::int64_t pos, float* __restrict acc, float* __restrict out) {
  const float* x = yhat + sz(h) * sz(d);
  if (inv) {
    for (int i = 0; i < d; ++i) acc[i] = 0.0f;
    const float* __restrict rows = inv + sz(h) * sz(d) * sz(n);
    for (int j = 0; j < n; ++j) {
      const float y = yhat[j];
      for (int i = 0; i < d; ++i) acc[i] += rows[sz(i) * sz(n) + sz(j)] * y;
    }
    x = acc;
  }
  rotate_out(x, d, freq, pos, out);
}

// The same rows from the transform's column blocks (VqSideTransform::inv_cols): `cols` is head h's
// block (span columns of d), `y` its span y_hat values. Every term reconstruct_head adds and this
// skips is an exact zero times a finite value, and the rest are added in the same order, so the
// result is the same bits; the columns are read contiguously (the d outputs vectorise).
VQ_KERNEL
void reconstruct_head_cols(const float* __restrict cols, int span, const float* __restrict y, int d,
                           const std::vector<double>* freq, std::int64_t pos, float* __restrict acc, float* __restrict out) {
  for (int i = 0; i < d; ++i) acc[i] = 0.0f;
  for (int j = 0; j < span; ++j) {
    const float yj = y[j];
    const float* __restrict col = cols + sz(j) * sz(d);
    for (int i = 0; i < d; ++i) acc[i] += col[i] * yj;
  }
  rotate_out(acc, d, freq, pos, out);
}

}  // namespace vq::vq_transform
