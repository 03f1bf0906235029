// The scalar tile kernels and the run-time choice between them and the AVX2 forms
// (attention_avx2.cpp). See include/veloxquant/cache/attention_kernels.hpp.
#include "veloxquant/cache/attention_kernels.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>

#include "attention_avx2.hpp"
#include "veloxquant/core/cpu_features.hpp"
#include "veloxquant/core/dtype.hpp"

namespace vq::attn {

namespace {

std::atomic<bool> g_simd_on{true};
std::atomic<bool> g_avx512_on{true};

bool cpu_has_avx2_fma_f16c() {
#if defined(__x86_64__)
  static const bool has = cpu_has_f16c_avx() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(__x86_64__)
  static const bool has = cpu_has_avx2_fma_f16c() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return has;
#else
  return false;
#endif
}

// The AVX-512 forms take rows of d % 32 == 0.
inline bool wide(std::int64_t d) { return d % 32 == 0 && avx512_enabled(); }

// Eight partial sums, the order the loop has always used.
inline float dot(const float* a, const float* b, std::int64_t n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += a[i + j] * b[i + j];
  float r = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

// Rows of either dtype through a float32 row buffer.
template <class T>
void row_f32(const T* src, std::int64_t d, float* out) {
  if constexpr (std::is_same_v<T, float>)
    std::copy(src, src + d, out);
  else
    for (std::int64_t e = 0; e < d; ++e) out[e] = f16_to_f32(src[e]);
}

template <class T>
void score_scalar(const T* k, std::int64_t n, std::int64_t d, std::int64_t stride, const float* q, std::int64_t nq, float* s) {
  float row[512];
  for (std::int64_t j = 0; j < n; ++j) {
    const float* kr;
    if constexpr (std::is_same_v<T, float>) {
      kr = k + j * stride;
    } else {
      if (d > 512) {  // long rows: per element (the kernels' callers use d <= kMaxHeadDim)
        for (std::int64_t r = 0; r < nq; ++r) {
          float v = 0;
          for (std::int64_t e = 0; e < d; ++e) v += q[r * d + e] * f16_to_f32(k[j * stride + e]);
          s[r * n + j] = v;
        }
        continue;
      }
      row_f32(k + j * stride, d, row);
      kr = row;
    }
    for (std::int64_t r = 0; r < nq; ++r) s[r * n + j] = dot(q + r * d, kr, d);
  }
}

template <class T>
void accumulate_scalar(const T* v, std::int64_t n, std::int64_t d, std::int64_t stride, const float* w, std::int64_t nq, float* acc) {
  for (std::int64_t j = 0; j < n; ++j) {
    const T* vj = v + j * stride;
    for (std::int64_t r = 0; r < nq; ++r) {
      const float p = w[r * n + j];
      float* a = acc + r * d;
      if constexpr (std::is_same_v<T, float>)
        for (std::int64_t e = 0; e < d; ++e) a[e] += p * vj[e];
      else
        for (std::int64_t e = 0; e < d; ++e) a[e] += p * f16_to_f32(vj[e]);
    }
  }
}

void softmax_step_scalar(float* s, std::int64_t n, std::int64_t visible, float scale, float& m, float& l, float* acc, std::int64_t dv) {
  const std::int64_t vis = std::clamp<std::int64_t>(visible, 0, n);
  float mx = m;
  for (std::int64_t j = 0; j < vis; ++j) mx = std::max(mx, s[j] = scale * s[j]);
  if (mx > m) {  // rescale what came before to the new max (exp(-inf) = 0 on the first tile)
    const float c = std::exp(m - mx);
    l *= c;
    for (std::int64_t e = 0; e < dv; ++e) acc[e] *= c;
    m = mx;
  }
  float sum = 0.0f;
  for (std::int64_t j = 0; j < vis; ++j) sum += (s[j] = std::exp(s[j] - mx));
  std::fill(s + vis, s + n, 0.0f);
  l += sum;
}

}  // namespace

bool simd_enabled() { return cpu_has_avx2_fma_f16c() && g_simd_on.load(std::memory_order_relaxed); }

bool set_simd_enabled(bool on) { return g_simd_on.exchange(on); }

bool avx512_enabled() { return simd_enabled() && cpu_has_avx512() && g_avx512_on.load(std::memory_order_relaxed); }

bool set_avx512_enabled(bool on) { return g_avx512_on.exchange(on); }

void score_f32(const float* k, std::int64_t n, std::int64_t d, std::int64_t stride, const float* q, std::int64_t nq, float* s) {
#ifdef VQ_ATTN_HAVE_AVX2
  if (wide(d)) return avx512::score_f32(k, n, d, stride, q, nq, s);
  if (simd_enabled()) return avx2::score_f32(k, n, d, stride, q, nq, s);
#endif
  score_scalar(k, n, d, stride, q, nq, s);
}

void score_f16(const std::uint16_t* k, std::int64_t n, std::int64_t d, std::int64_t stride, const float* q, std::int64_t nq, float* s) {
#ifdef VQ_ATTN_HAVE_AVX2
  if (wide(d)) return avx512::score_f16(k, n, d, stride, q, nq, s);
  if (simd_enabled()) return avx2::score_f16(k, n, d, stride, q, nq, s);
#endif
  score_scalar(k, n, d, stride, q, nq, s);
}

void accumulate_f32(const float* v, std::int64_t n, std::int64_t d, std::int64_t stride, const float* w, std::int64_t nq, float* acc) {
#ifdef VQ_ATTN_HAVE_AVX2
  if (wide(d)) return avx512::accumulate_f32(v, n, d, stride, w, nq, acc);
  if (simd_enabled()) return avx2::accumulate_f32(v, n, d, stride, w, nq, acc);
#endif
  accumulate_scalar(v, n, d, stride, w, nq, acc);
}

void accumulate_f16(const std::uint16_t* v, std::int64_t n, std::int64_t d, std::int64_t stride, const float* w, std::int64_t nq,
                    float* acc) {
#ifdef VQ_ATTN_HAVE_AVX2
  if (wide(d)) return avx512::accumulate_f16(v, n, d, stride, w, nq, acc);
  if (simd_enabled()) return avx2::accumulate_f16(v, n, d, stride, w, nq, acc);
#endif
  accumulate_scalar(v, n, d, stride, w, nq, acc);
}

void softmax_step(float* s, std::int64_t n, std::int64_t visible, float scale, float& m, float& l, float* acc, std::int64_t dv) {
#ifdef VQ_ATTN_HAVE_AVX2
  if (simd_enabled()) return avx2::softmax_step(s, n, visible, scale, m, l, acc, dv);
#endif
  softmax_step_scalar(s, n, visible, scale, m, l, acc, dv);
}

void exp_simd(const float* x, float* y, std::int64_t n) {
#ifdef VQ_ATTN_HAVE_AVX2
  if (cpu_has_avx2_fma_f16c()) return avx2::exp_n(x, y, n);
#endif
  for (std::int64_t i = 0; i < n; ++i) y[i] = std::exp(x[i]);
}

}  // namespace vq::attn
