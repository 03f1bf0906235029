// AVX2 attention tile kernels on VqKVCache's packed codes (vq_attention_kernels.hpp): a Source of
// src/cache/attention_simd.hpp that decodes a head's fields 8 at a time.
#include "vq_attention_kernels.hpp"

#include <cstring>
#include <vector>

#include "veloxquant/cache/attention_kernels.hpp"

#ifdef VQ_ATTN_HAVE_AVX2
#include "../cache/attention_simd.hpp"
#endif

namespace vq::vq_attention {

#ifdef VQ_ATTN_HAVE_AVX2

namespace {

// Lane i's shift within its half (fields 0..3 from the low 32 bits, 4..7 from the next 4w bits).
alignas(32) constexpr std::int32_t kShift[9][8] = {
    {0, 0, 0, 0, 0, 0, 0, 0},     {0, 1, 2, 3, 0, 1, 2, 3},     {0, 2, 4, 6, 0, 2, 4, 6},
    {0, 3, 6, 9, 0, 3, 6, 9},     {0, 4, 8, 12, 0, 4, 8, 12},   {0, 5, 10, 15, 0, 5, 10, 15},
    {0, 6, 12, 18, 0, 6, 12, 18}, {0, 7, 14, 21, 0, 7, 14, 21}, {0, 8, 16, 24, 0, 8, 16, 24},
};

// A field read one at a time (the tail of a head whose d is not a multiple of 8).
inline std::uint32_t field_at(const std::uint8_t* group, unsigned i, unsigned w) {
  const std::uint64_t bit = static_cast<std::uint64_t>(i) * w;
  std::uint64_t v;
  std::memcpy(&v, group + (bit >> 3), 8);
  return static_cast<std::uint32_t>((v >> (bit & 7)) & ((std::uint64_t{1} << w) - 1));
}

// Field widths and biases: the 8 fields of group g as int32 lanes.
VQ_ATTN_INLINE __m256i fields8(const HeadFields& f, std::int64_t t, std::int64_t g) {
  const unsigned w = f.group_width[g];
  const std::uint8_t* p = f.rows + static_cast<std::size_t>(f.t0 + t) * f.row_bytes + f.group_byte[g];
  if (w == 16) return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::uint64_t x;
  std::memcpy(&x, p, 8);
  const __m256i v = _mm256_set_m128i(_mm_set1_epi32(static_cast<int>(x >> (4 * w))), _mm_set1_epi32(static_cast<int>(x)));
  return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(kShift[w]))),
                          _mm256_set1_epi32(static_cast<int>((1u << w) - 1)));
}

inline std::uint32_t field_scalar(const HeadFields& f, std::int64_t t, std::int64_t e) {
  const std::int64_t g = e >> 3;
  return field_at(f.rows + static_cast<std::size_t>(f.t0 + t) * f.row_bytes + f.group_byte[g], static_cast<unsigned>(e & 7), f.group_width[g]);
}

inline std::int32_t bias_of(const HeadFields& f, std::int64_t p) { return 1 << (f.group_width[p >> 3] - 1); }

// The codes of group g: f - 2^(w-1), and 0 for an escape (f = 0), so that an escaped field reads
// the coefficient's mean, a value of the data's own size, until its correction is added.
VQ_ATTN_INLINE __m256i codes8(const HeadFields& f, std::int64_t t, std::int64_t g) {
  const __m256i fl = fields8(f, t, g);
  const __m256i code = _mm256_sub_epi32(fl, _mm256_set1_epi32(1 << (f.group_width[g] - 1)));
  return _mm256_andnot_si256(_mm256_cmpeq_epi32(fl, _mm256_setzero_si256()), code);
}

inline std::int32_t code_scalar(const HeadFields& f, std::int64_t t, std::int64_t e) {
  const std::uint32_t fl = field_scalar(f, t, e);
  return fl == 0 ? 0 : static_cast<std::int32_t>(fl) - bias_of(f, e);
}

// float32 input: the codes, as floats (an escape reads 0).
struct Fields {
  HeadFields f;
  VQ_ATTN_INLINE __m256 load8(std::int64_t t, std::int64_t e) const { return _mm256_cvtepi32_ps(codes8(f, t, e >> 3)); }
  VQ_ATTN_INLINE void load16(std::int64_t t, std::int64_t e, __m256& lo, __m256& hi) const {
    lo = load8(t, e);
    hi = load8(t, e + 8);
  }
  VQ_ATTN_INLINE float scalar(std::int64_t t, std::int64_t e) const { return static_cast<float>(code_scalar(f, t, e)); }
};

// The value state() holds for code q at field p of a float16 cache.
VQ_ATTN_INLINE float value_f16(const HeadFields& f, std::int64_t p, std::int32_t q) {
  float v = static_cast<float>(q) * f.step;
  v = v + f.mean[p];
  return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// float16 input: the values, rebuilt and rounded (an escape reads the value of code 0).
struct Values16 {
  HeadFields f;
  VQ_ATTN_INLINE __m256 load8(std::int64_t t, std::int64_t e) const {
    const __m256i code = codes8(f, t, e >> 3);
    const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(code), _mm256_set1_ps(f.step)), _mm256_loadu_ps(f.mean + e));
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  VQ_ATTN_INLINE void load16(std::int64_t t, std::int64_t e, __m256& lo, __m256& hi) const {
    lo = load8(t, e);
    hi = load8(t, e + 8);
  }
  VQ_ATTN_INLINE float scalar(std::int64_t t, std::int64_t e) const {
    return value_f16(f, e, code_scalar(f, t, e));
  }
};

// What an escape adds to the value the kernels used for it: the true code's less the zero field's.
__attribute__((target("avx2,fma,f16c"))) float escape_delta(const HeadFields& f, const FieldEscape& x) {
  if (f.round_f16) return value_f16(f, x.p, x.code) - value_f16(f, x.p, 0);
  return f.step * static_cast<float>(x.code);
}

}  // namespace

bool available() { return attn::simd_enabled(); }

__attribute__((target("avx2,fma,f16c"))) float dot(const float* a, const float* b, std::int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  std::int64_t p = 0;
  for (; p + 8 <= d; p += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + p), _mm256_loadu_ps(b + p), acc);
  alignas(32) float l[8];
  _mm256_store_ps(l, acc);
  float s = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
  for (; p < d; ++p) s += a[p] * b[p];
  return s;
}

__attribute__((target("avx2,fma,f16c"))) void score(const HeadFields& f, std::int64_t n, const float* q, std::int64_t nq, float* s) {
  const std::int64_t d = f.d;
  if (f.round_f16) {
    attn::simd::score(Values16{f}, n, d, q, nq, s);
  } else {
    attn::simd::score(Fields{f}, n, d, q, nq, s);
    for (std::int64_t r = 0; r < nq; ++r) {
      const float c = dot(q + r * d, f.mean, d);  // sum_p q_p mean_p
      const __m256 cv = _mm256_set1_ps(c), st = _mm256_set1_ps(f.step);
      float* sr = s + r * n;
      std::int64_t j = 0;
      for (; j + 8 <= n; j += 8) _mm256_storeu_ps(sr + j, _mm256_fmadd_ps(st, _mm256_loadu_ps(sr + j), cv));
      for (; j < n; ++j) sr[j] = c + f.step * sr[j];
    }
  }
  for (std::size_t i = 0; i < f.n_escapes; ++i) {
    const FieldEscape& x = f.escapes[i];
    const float delta = escape_delta(f, x);
    for (std::int64_t r = 0; r < nq; ++r) s[r * n + x.t] += q[r * d + x.p] * delta;
  }
}

__attribute__((target("avx2,fma,f16c"))) void accumulate(const HeadFields& f, std::int64_t n, const float* w, std::int64_t nq, float* acc,
                                                         const std::int32_t* order) {
  const std::int64_t d = f.d;
  thread_local std::vector<float> sum;
  sum.assign(static_cast<std::size_t>(nq * d), 0.0f);
  if (f.round_f16) {
    attn::simd::accumulate(Values16{f}, n, d, w, nq, sum.data());
  } else {
    attn::simd::accumulate(Fields{f}, n, d, w, nq, sum.data());
    for (std::int64_t r = 0; r < nq; ++r) {
      float ws = 0;
      for (std::int64_t j = 0; j < n; ++j) ws += w[r * n + j];
      float* sr = sum.data() + r * d;
      const __m256 wv = _mm256_set1_ps(ws), st = _mm256_set1_ps(f.step);
      std::int64_t p = 0;
      for (; p + 8 <= d; p += 8)
        _mm256_storeu_ps(sr + p, _mm256_fmadd_ps(wv, _mm256_loadu_ps(f.mean + p), _mm256_mul_ps(st, _mm256_loadu_ps(sr + p))));
      for (; p < d; ++p) sr[p] = ws * f.mean[p] + f.step * sr[p];
    }
  }
  for (std::size_t i = 0; i < f.n_escapes; ++i) {
    const FieldEscape& x = f.escapes[i];
    const float delta = escape_delta(f, x);
    for (std::int64_t r = 0; r < nq; ++r) sum[static_cast<std::size_t>(r * d + x.p)] += w[r * n + x.t] * delta;
  }
  for (std::int64_t r = 0; r < nq; ++r)
    for (std::int64_t p = 0; p < d; ++p) acc[r * d + order[p]] += sum[static_cast<std::size_t>(r * d + p)];
}

#else

bool available() { return false; }
void score(const HeadFields&, std::int64_t, const float*, std::int64_t, float*) {}
void accumulate(const HeadFields&, std::int64_t, const float*, std::int64_t, float*, const std::int32_t*) {}

#endif

void prefetch(const HeadFields& f, std::int64_t n) {
  const auto* p = reinterpret_cast<const char*>(f.rows + static_cast<std::size_t>(f.t0) * f.row_bytes);
  const std::size_t bytes = static_cast<std::size_t>(n) * f.row_bytes;
  for (std::size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o);
}

}  // namespace vq::vq_attention
