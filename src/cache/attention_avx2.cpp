// AVX2 + FMA + F16C tile kernels over float32 and float16 rows (attention_avx2.hpp), built on the
// shared templates of src/cache/attention_simd.hpp, and the softmax step with an
// eight-lane exp. Compiled with target attributes (no -mavx2 for the file); reached only through
// attention_kernels.cpp when the CPU has the instructions.
#include "attention_avx2.hpp"

#ifdef VQ_ATTN_HAVE_AVX2

#include <algorithm>
#include <cmath>
#include <limits>

#include "attention_simd.hpp"

#define VQ_ATTN_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace vq::attn::avx2 {

namespace {

struct F32Rows {
  const float* p;
  std::int64_t stride;
  VQ_ATTN_INLINE void load16(std::int64_t t, std::int64_t e, __m256& lo, __m256& hi) const {
    lo = _mm256_loadu_ps(p + t * stride + e), hi = _mm256_loadu_ps(p + t * stride + e + 8);
  }
  VQ_ATTN_INLINE __m256 load8(std::int64_t t, std::int64_t e) const { return _mm256_loadu_ps(p + t * stride + e); }
  VQ_ATTN_INLINE float scalar(std::int64_t t, std::int64_t e) const { return p[t * stride + e]; }
};

// Float16 rows converted in registers (vcvtph2ps): no float32 copy of the tile.
struct F16Rows {
  const std::uint16_t* p;
  std::int64_t stride;
  VQ_ATTN_INLINE void load16(std::int64_t t, std::int64_t e, __m256& lo, __m256& hi) const {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + t * stride + e));
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h)), hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
  VQ_ATTN_INLINE __m256 load8(std::int64_t t, std::int64_t e) const {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + t * stride + e)));
  }
  VQ_ATTN_INLINE float scalar(std::int64_t t, std::int64_t e) const { return _cvtsh_ss(p[t * stride + e]); }
};

// exp of eight lanes (Cephes' expf: x = n ln2 + r with ln2 in two parts, a degree-5 polynomial in
// r, then 2^n through the exponent bits): within 2 ulp of std::exp on [-87.3, 88.3]; inputs are
// clamped to that range.
VQ_ATTN_INLINE __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447504019f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

VQ_ATTN_INLINE float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

VQ_ATTN_INLINE float hsum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

}  // namespace

VQ_ATTN_AVX2 void score_f32(const float* k, std::int64_t n, std::int64_t d, std::int64_t stride, const float* q, std::int64_t nq, float* s) {
  simd::score(F32Rows{k, stride}, n, d, q, nq, s);
}

VQ_ATTN_AVX2 void score_f16(const std::uint16_t* k, std::int64_t n, std::int64_t d, std::int64_t stride, const float* q, std::int64_t nq,
                            float* s) {
  simd::score(F16Rows{k, stride}, n, d, q, nq, s);
}

VQ_ATTN_AVX2 void accumulate_f32(const float* v, std::int64_t n, std::int64_t d, std::int64_t stride, const float* w, std::int64_t nq,
                                 float* acc) {
  simd::accumulate(F32Rows{v, stride}, n, d, w, nq, acc);
}

VQ_ATTN_AVX2 void accumulate_f16(const std::uint16_t* v, std::int64_t n, std::int64_t d, std::int64_t stride, const float* w,
                                 std::int64_t nq, float* acc) {
  simd::accumulate(F16Rows{v, stride}, n, d, w, nq, acc);
}

VQ_ATTN_AVX2 void softmax_step(float* s, std::int64_t n, std::int64_t visible, float scale, float& m, float& l, float* acc, std::int64_t dv) {
  const std::int64_t vis = std::clamp<std::int64_t>(visible, 0, n);
  const __m256 sc = _mm256_set1_ps(scale);
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  std::int64_t j = 0;
  for (; j + 8 <= vis; j += 8) {
    const __m256 x = _mm256_mul_ps(sc, _mm256_loadu_ps(s + j));
    _mm256_storeu_ps(s + j, x);
    mv = _mm256_max_ps(mv, x);
  }
  float mx = std::max(m, hmax(mv));
  for (; j < vis; ++j) mx = std::max(mx, s[j] = scale * s[j]);
  if (mx > m) {  // rescale what came before to the new max (exp(-inf) = 0 on the first tile)
    const float c = std::exp(m - mx);
    l *= c;
    const __m256 cv = _mm256_set1_ps(c);
    std::int64_t e = 0;
    for (; e + 8 <= dv; e += 8) _mm256_storeu_ps(acc + e, _mm256_mul_ps(cv, _mm256_loadu_ps(acc + e)));
    for (; e < dv; ++e) acc[e] *= c;
    m = mx;
  }
  const __m256 mxv = _mm256_set1_ps(mx);
  __m256 sv = _mm256_setzero_ps();
  for (j = 0; j + 8 <= vis; j += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mxv));
    _mm256_storeu_ps(s + j, p);
    sv = _mm256_add_ps(sv, p);
  }
  float sum = hsum(sv);
  for (; j < vis; ++j) sum += (s[j] = std::exp(s[j] - mx));
  std::fill(s + vis, s + n, 0.0f);
  l += sum;
}

VQ_ATTN_AVX2 void exp_n(const float* x, float* y, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
  if (i < n) {
    alignas(32) float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::copy(x + i, x + n, t);
    _mm256_store_ps(t, exp8(_mm256_load_ps(t)));
    std::copy(t, t + (n - i), y + i);
  }
}

}  // namespace vq::attn::avx2

#define VQ_ATTN_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12, AVX-512 intrinsics (attention_simd.hpp)
namespace vq::attn::avx512 {

namespace {

struct F32Rows {
  const float* p;
  std::int64_t stride;
  VQ_ATTN512_INLINE void load32(std::int64_t t, std::int64_t e, __m512& lo, __m512& hi) const {
    lo = _mm512_loadu_ps(p + t * stride + e), hi = _mm512_loadu_ps(p + t * stride + e + 16);
  }
};

// Float16 rows converted in registers, 16 values per vcvtph2ps.
struct F16Rows {
  const std::uint16_t* p;
  std::int64_t stride;
  VQ_ATTN512_INLINE void load32(std::int64_t t, std::int64_t e, __m512& lo, __m512& hi) const {
    const std::uint16_t* x = p + t * stride + e;
    lo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    hi = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)));
  }
};

}  // namespace

VQ_ATTN_AVX512 void score_f32(const float* k, std::int64_t n, std::int64_t d, std::int64_t stride, const float* q, std::int64_t nq, float* s) {
  simd512::score(F32Rows{k, stride}, n, d, q, nq, s);
}

VQ_ATTN_AVX512 void score_f16(const std::uint16_t* k, std::int64_t n, std::int64_t d, std::int64_t stride, const float* q, std::int64_t nq,
                              float* s) {
  simd512::score(F16Rows{k, stride}, n, d, q, nq, s);
}

VQ_ATTN_AVX512 void accumulate_f32(const float* v, std::int64_t n, std::int64_t d, std::int64_t stride, const float* w, std::int64_t nq,
                                   float* acc) {
  simd512::accumulate(F32Rows{v, stride}, n, d, w, nq, acc);
}

VQ_ATTN_AVX512 void accumulate_f16(const std::uint16_t* v, std::int64_t n, std::int64_t d, std::int64_t stride, const float* w,
                                   std::int64_t nq, float* acc) {
  simd512::accumulate(F16Rows{v, stride}, n, d, w, nq, acc);
}

}  // namespace vq::attn::avx512
#pragma GCC diagnostic pop

#endif  // VQ_ATTN_HAVE_AVX2
