// Tiled reconstruction kernels (reconstruct_kernels.hpp): same operations, same order as the
// per-token path, many tokens per pass over F^-1's columns.
#include "reconstruct_kernels.hpp"

#include <algorithm>
#include <cmath>
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
      // The per-token path's expressions (vq_cache.cpp's rotate_out).
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

}  // namespace vq
