// The forward pass's SwiGLU activation; see swiglu.hpp.
#include "swiglu.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define VQ_SWIGLU_AVX512 1
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which -Wmaybe-uninitialized
// reports wherever they are inlined (a false positive; as in src/vq/codec_avx512.cpp).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace vq::detail {

namespace {

// h1[j] = (h1[j] * (1 / (1 + e[j]))) * h3[j]: elementwise, so vectorising it changes no rounding.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
void silu_times(float* __restrict h1, const float* __restrict h3, const float* __restrict e, std::size_t n) {
  for (std::size_t j = 0; j < n; ++j) {
    float val = h1[j];
    val *= 1.0f / (1.0f + e[j]);
    h1[j] = val * h3[j];
  }
}

// The exps are library calls, one after the other; the rest is a second, vectorised pass (the
// divide no longer waits behind each call).
void swiglu_ref(float* h1, const float* h3, std::size_t n) {
  constexpr std::size_t kBlock = 256;
  float e[kBlock];
  for (std::size_t j0 = 0; j0 < n; j0 += kBlock) {
    const std::size_t m = std::min(kBlock, n - j0);
    for (std::size_t j = 0; j < m; ++j) e[j] = std::exp(-h1[j0 + j]);
    silu_times(h1 + j0, h3 + j0, e, m);
  }
}

#ifdef VQ_SWIGLU_AVX512
#define VQ_AVX512 __attribute__((target("avx512f,avx512dq")))

// glibc's __exp2f_data for expf: 2^(i/32) with the exponent's bits taken out (i < 32), 32/ln2,
// the rounding shift 1.5 * 2^52 and the polynomial, as the FMA build of e_expf.c uses them.
constexpr std::uint64_t kTab[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b, 0x3fef54873168b9aa,
    0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74,
    0x3feea11473eb0187, 0x3feea589994cce13, 0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540};
constexpr double kInvLn2N = 0x1.71547652b82fep+5;
constexpr double kShift = 0x1.8p+52;
constexpr double kC0 = 0x1.c6af84b912394p-20, kC1 = 0x1.ebfce50fac4f3p-13, kC2 = 0x1.62e42ff0c52d6p-6;

// expf of eight floats widened to double, for |x| < 80 (e_expf.c's fast path):
//   kd = fma(InvLn2N, x, Shift); ki = bits(kd); kd -= Shift; r = fma(InvLn2N, x, -kd);
//   s = bits(T[ki % 32] + (ki << 47)); y = fma(fma(C0, r, C1), r * r, fma(C2, r, 1)) * s.
VQ_AVX512 inline __m256 expf8(__m512d xd, const __m512i t[4]) {
  const __m512d kd_shifted = _mm512_fmadd_pd(_mm512_set1_pd(kInvLn2N), xd, _mm512_set1_pd(kShift));
  const __m512i ki = _mm512_castpd_si512(kd_shifted);
  const __m512d kd = _mm512_sub_pd(kd_shifted, _mm512_set1_pd(kShift));
  const __m512d r = _mm512_fmsub_pd(_mm512_set1_pd(kInvLn2N), xd, kd);
  // T[ki % 32]: the low four bits pick one of 16 in each half, bit 4 the half.
  const __m512i lo = _mm512_permutex2var_epi64(t[0], ki, t[1]);
  const __m512i hi = _mm512_permutex2var_epi64(t[2], ki, t[3]);
  const __mmask8 upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
  const __m512i tb = _mm512_add_epi64(_mm512_mask_blend_epi64(upper, lo, hi), _mm512_slli_epi64(ki, 47));
  const __m512d s = _mm512_castsi512_pd(tb);
  const __m512d z = _mm512_fmadd_pd(_mm512_set1_pd(kC0), r, _mm512_set1_pd(kC1));
  const __m512d r2 = _mm512_mul_pd(r, r);
  __m512d y = _mm512_fmadd_pd(_mm512_set1_pd(kC2), r, _mm512_set1_pd(1.0));
  y = _mm512_fmadd_pd(z, r2, y);
  y = _mm512_mul_pd(y, s);
  return _mm512_cvtpd_ps(y);
}

// 16 lanes of swiglu: e = expf(-h1) (std::exp for lanes of magnitude >= 80 and NaN), then
// silu_times' operations.
VQ_AVX512 inline void swiglu16(float* h1, const float* h3, __mmask16 live, const __m512i t[4]) {
  const __m512 h = _mm512_maskz_loadu_ps(live, h1);
  // -h: a sign flip, as the unary minus of std::exp(-h1[j]).
  const __m512 xneg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(h), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
  const __m256 e_lo = expf8(_mm512_cvtps_pd(_mm512_castps512_ps256(xneg)), t);
  const __m256 e_hi = expf8(_mm512_cvtps_pd(_mm512_extractf32x8_ps(xneg, 1)), t);
  __m512 e = _mm512_insertf32x8(_mm512_castps256_ps512(e_lo), e_hi, 1);
  // e_expf.c's test: abstop(x) = (bits >> 20) & 0x7ff >= abstop(88) = 0x42a (|x| >= 80, Inf, NaN).
  const __m512i top = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(xneg), 20), _mm512_set1_epi32(0x7ff));
  const __mmask16 special = _mm512_mask_cmpge_epu32_mask(live, top, _mm512_set1_epi32(0x42a));
  if (special) {
    alignas(64) float xs[16], es[16];
    _mm512_store_ps(xs, xneg);
    _mm512_store_ps(es, e);
    for (int k = 0; k < 16; ++k)
      if (special >> k & 1) es[k] = std::exp(xs[k]);
    e = _mm512_load_ps(es);
  }
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 val = _mm512_mul_ps(h, _mm512_div_ps(one, _mm512_add_ps(one, e)));
  val = _mm512_mul_ps(val, _mm512_maskz_loadu_ps(live, h3));
  _mm512_mask_storeu_ps(h1, live, val);
}

VQ_AVX512 void swiglu_avx512(float* h1, const float* h3, std::size_t n) {
  __m512i t[4];
  for (int k = 0; k < 4; ++k) t[k] = _mm512_loadu_si512(kTab + 8 * k);
  std::size_t j = 0;
  for (; j + 16 <= n; j += 16) swiglu16(h1 + j, h3 + j, static_cast<__mmask16>(0xFFFF), t);
  if (j < n) swiglu16(h1 + j, h3 + j, static_cast<__mmask16>((1u << (n - j)) - 1), t);
}

// The AVX-512 path runs where the machine has it and it reproduces this process's std::exp on
// probe arguments across the fast path's range (and the silu around them) bit for bit.
bool avx512_matches_libm() {
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512dq")) return false;
  constexpr std::size_t kProbes = 4096;
  std::vector<float> a(kProbes), b(kProbes), h3(kProbes);
  std::uint32_t state = 0x9e3779b9u;
  for (std::size_t i = 0; i < kProbes; ++i) {
    state = state * 1664525u + 1013904223u;
    // Uniform over [-90, 90] and, every other probe, |x| < 2^-k for small arguments.
    const float u = static_cast<float>(state >> 8) * 0x1p-24f;
    a[i] = i % 2 ? (u * 180.0f - 90.0f) : (u - 0.5f) * std::ldexp(1.0f, -static_cast<int>(i % 40));
    h3[i] = 1.0f;
  }
  b = a;
  swiglu_ref(a.data(), h3.data(), kProbes);
  swiglu_avx512(b.data(), h3.data(), kProbes);
  return std::memcmp(a.data(), b.data(), kProbes * sizeof(float)) == 0;
}
#endif

}  // namespace

bool swiglu_with(SwigluPath path, float* h1, const float* h3, std::size_t n) {
  switch (path) {
    case SwigluPath::Portable: swiglu_ref(h1, h3, n); return true;
    case SwigluPath::Avx512:
#ifdef VQ_SWIGLU_AVX512
    {
      static const bool ok = avx512_matches_libm();
      if (ok) return swiglu_avx512(h1, h3, n), true;
    }
#endif
      return false;
  }
  return false;
}

void swiglu(float* h1, const float* h3, std::size_t n) {
  if (!swiglu_with(SwigluPath::Avx512, h1, h3, n)) swiglu_ref(h1, h3, n);
}

}  // namespace vq::detail
