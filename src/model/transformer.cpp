// llama2.c forward pass over a chunk of tokens; see transformer.hpp for the architecture.
#include "veloxquant/model/transformer.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include <fmt/core.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#endif

#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"

namespace vq {

namespace {

constexpr float kRmsEps = 1e-5f;
constexpr float kRopeTheta = 10000.0f;

std::size_t sz(long long v) { return static_cast<std::size_t>(v); }

int round_up8(int v) { return (v + 7) / 8 * 8; }

// out[t, o] = sum_i in[t, i] * wt[i, o] for t < n, o < out_dim, with wt the TRANSPOSED nn.Linear
// weight [in_dim, ws] (ws >= out_dim: padded row stride); in rows are `is` floats apart, out rows
// `os`. Each output sums its products in order i = 0, 1, ..., starting from 0, exactly as run.c's
// matmul does: vectorising over outputs reassociates nothing. This is the portable version; the
// AVX2 one below computes the same roundings.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
void matmul_ref(float* __restrict out, std::size_t os, const float* __restrict in, std::size_t is, const float* __restrict wt,
                std::size_t ws, int n, int in_dim, int out_dim) {
  const std::size_t O = static_cast<std::size_t>(out_dim);
  for (int t = 0; t < n; ++t) {
    const float* x = in + static_cast<std::size_t>(t) * is;
    float* __restrict y = out + static_cast<std::size_t>(t) * os;
    for (std::size_t o = 0; o < O; ++o) y[o] = 0.0f;
    for (int i = 0; i < in_dim; ++i) {
      const float xi = x[i];
      const float* __restrict w = wt + static_cast<std::size_t>(i) * ws;
      for (std::size_t o = 0; o < O; ++o) y[o] += xi * w[o];
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VQ_AVX2_PATH 1
#define VQ_AVX2 __attribute__((target("avx2")))

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}

// R rows x NV vectors of 8 outputs, accumulated in registers over the whole input: acc = 0, then
// acc = acc + x_i * w_i in order i (a separate multiply and add: no FMA, same roundings as run.c).
template <int R, int NV>
VQ_AVX2 inline void mm_block(float* y, std::size_t ys, const float* x, std::size_t xs, const float* w, std::size_t ws, int in_dim, int o0,
                             int out_dim) {
  __m256 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  const float* wp = w + o0;
  for (int i = 0; i < in_dim; ++i, wp += ws) {
    __m256 b[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) b[r] = _mm256_broadcast_ss(x + static_cast<std::size_t>(r) * xs + i);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const __m256 wv = _mm256_loadu_ps(wp + 8 * v);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][v] = _mm256_add_ps(acc[r][v], _mm256_mul_ps(b[r], wv));
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    const int o = o0 + 8 * v;
    if (o + 8 <= out_dim) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + static_cast<std::size_t>(r) * ys + o, acc[r][v]);
    } else if (o < out_dim) {
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(out_dim - o), lane);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) _mm256_maskstore_ps(y + static_cast<std::size_t>(r) * ys + o, mask, acc[r][v]);
    }
  }
}

// matmul_ref's result, register-blocked. ws must be a multiple of 8 with zero padding past out_dim.
VQ_AVX2 void matmul_avx2(float* out, std::size_t os, const float* in, std::size_t is, const float* wt, std::size_t ws, int n, int in_dim,
                         int out_dim) {
  const int op = static_cast<int>(ws);
  int t = 0;
  for (; t + 4 <= n; t += 4) {
    float* y = out + static_cast<std::size_t>(t) * os;
    const float* x = in + static_cast<std::size_t>(t) * is;
    int o = 0;
    for (; o + 16 <= op && o < out_dim; o += 16) mm_block<4, 2>(y, os, x, is, wt, ws, in_dim, o, out_dim);
    for (; o < out_dim; o += 8) mm_block<4, 1>(y, os, x, is, wt, ws, in_dim, o, out_dim);
  }
  for (; t < n; ++t) {
    float* y = out + static_cast<std::size_t>(t) * os;
    const float* x = in + static_cast<std::size_t>(t) * is;
    int o = 0;
    for (; o + 64 <= op && o < out_dim; o += 64) mm_block<1, 8>(y, os, x, is, wt, ws, in_dim, o, out_dim);
    // The rest in one block: as many independent accumulators as possible.
    if (o >= out_dim) continue;
    switch ((std::min(op, out_dim + 7) - o) / 8) {
      case 1: mm_block<1, 1>(y, os, x, is, wt, ws, in_dim, o, out_dim); break;
      case 2: mm_block<1, 2>(y, os, x, is, wt, ws, in_dim, o, out_dim); break;
      case 3: mm_block<1, 3>(y, os, x, is, wt, ws, in_dim, o, out_dim); break;
      case 4: mm_block<1, 4>(y, os, x, is, wt, ws, in_dim, o, out_dim); break;
      case 5: mm_block<1, 5>(y, os, x, is, wt, ws, in_dim, o, out_dim); break;
      case 6: mm_block<1, 6>(y, os, x, is, wt, ws, in_dim, o, out_dim); break;
      default: mm_block<1, 7>(y, os, x, is, wt, ws, in_dim, o, out_dim); break;
    }
  }
}
#endif

void matmul_t(float* out, std::size_t os, const float* in, std::size_t is, const float* wt, std::size_t ws, int n, int in_dim, int out_dim) {
#ifdef VQ_AVX2_PATH
  if (cpu_has_avx2() && ws % 8 == 0) return matmul_avx2(out, os, in, is, wt, ws, n, in_dim, out_dim);
#endif
  matmul_ref(out, os, in, is, wt, ws, n, in_dim, out_dim);
}

// Per layer, [rows, cols] -> [cols, rows_pad], zero-filled past rows.
std::vector<float> transpose_layers(const std::vector<float>& w, int layers, int rows, int cols, int rows_pad) {
  const std::size_t R = static_cast<std::size_t>(rows), C = static_cast<std::size_t>(cols), RP = static_cast<std::size_t>(rows_pad);
  std::vector<float> t(static_cast<std::size_t>(layers) * C * RP, 0.0f);
  for (std::size_t l = 0; l < static_cast<std::size_t>(layers); ++l)
    for (std::size_t r = 0; r < R; ++r)
      for (std::size_t c = 0; c < C; ++c) t[l * RP * C + c * RP + r] = w[l * R * C + r * C + c];
  return t;
}

// Per layer, matrices [in_dim, widths[m]] -> one [in_dim, sum of widths], side by side.
std::vector<float> side_by_side(const std::vector<std::vector<float>>& ms, const std::vector<int>& widths, int layers, int in_dim) {
  std::size_t total = 0;
  for (int w : widths) total += static_cast<std::size_t>(w);
  const std::size_t I = static_cast<std::size_t>(in_dim);
  std::vector<float> out(static_cast<std::size_t>(layers) * I * total);
  for (std::size_t l = 0; l < static_cast<std::size_t>(layers); ++l)
    for (std::size_t i = 0; i < I; ++i) {
      float* dst = out.data() + (l * I + i) * total;
      for (std::size_t m = 0; m < ms.size(); ++m) {
        const std::size_t w = static_cast<std::size_t>(widths[m]);
        std::copy_n(ms[m].data() + (l * I + i) * w, w, dst);
        dst += w;
      }
    }
  return out;
}

// run.c's rmsnorm: sequential sum of squares, o = w * (x / rms).
void rmsnorm(float* o, const float* x, const float* w, int size) {
  float ss = 0.0f;
  for (int j = 0; j < size; ++j) ss += x[j] * x[j];
  ss /= static_cast<float>(size);
  ss += kRmsEps;
  ss = 1.0f / std::sqrt(ss);
  for (int j = 0; j < size; ++j) o[j] = w[j] * (ss * x[j]);
}

// exp(x) for x <= 0 (softmax inputs after subtracting the max), written so the compiler vectorises
// a loop over it: Cody-Waite range reduction x = n ln2 + r and Cephes' degree-6 expf polynomial,
// within 2 ulp of std::exp on [-87, 0]; below -87 it returns 2^-126-ish instead of a denormal,
// which is invisible next to the softmax maximum's exp(0) = 1.
inline float exp_nonpositive(float x) {
  // Clamp at -87 on the bits: for x <= 0 a larger magnitude has larger unsigned bits. (A float
  // compare would keep the loop scalar: GCC will not if-convert it under -ftrapping-math.)
  const std::uint32_t lim = std::bit_cast<std::uint32_t>(-87.0f);
  const std::uint32_t b = std::bit_cast<std::uint32_t>(x);
  x = std::bit_cast<float>(b > lim ? lim : b);
  const float rounder = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer, half to even
  const float n = (x * 1.44269504088896341f + rounder) - rounder;
  float r = x - n * 0.693359375f;  // ln2 split in a part exact in float and the rest
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // 2^n from the rounder trick's bits: n + 127 is in [0, 127] here, so it fits the exponent field.
  const std::int32_t e = (static_cast<std::int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(e);
}

// x[i] = exp(x[i] - m). Kept out of line so the compiler does not fuse it with the (sequential,
// unvectorisable) sum that follows, which would block vectorising the exps.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
__attribute__((noinline)) void exp_shifted(float* __restrict x, int size, float m) {
  for (int i = 0; i < size; ++i) x[i] = exp_nonpositive(x[i] - m);
}

void softmax(float* x, int size) {
  float max_val = x[0];
  for (int i = 1; i < size; ++i) max_val = std::max(max_val, x[i]);
  exp_shifted(x, size, max_val);
  float sum = 0.0f;
  for (int i = 0; i < size; ++i) sum += x[i];
  for (int i = 0; i < size; ++i) x[i] /= sum;
}

// Attention scores q . k_t / sqrt(head_size) for t < len, keys contiguous [len, HS]; the sum runs in order
// d = 0..HS-1 as run.c's, and the loop over t vectorises for a compile-time head size.
template <int HS>
void scores_fixed(const float* __restrict q, const float* __restrict k, int len, float sqrt_hs, float* __restrict out) {
  for (int t = 0; t < len; ++t) {
    float s = 0.0f;
    for (int d = 0; d < HS; ++d) s += q[d] * k[t * HS + d];
    out[t] = s / sqrt_hs;
  }
}

void scores_any(const float* q, const float* k, std::int64_t stride, int hs, int len, float sqrt_hs, float* out) {
  for (int t = 0; t < len; ++t) {
    const float* kt = k + static_cast<std::size_t>(t) * static_cast<std::size_t>(stride);
    float s = 0.0f;
    for (int d = 0; d < hs; ++d) s += q[d] * kt[d];
    out[t] = s / sqrt_hs;
  }
}

#ifdef VQ_AVX2_PATH
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

// One query position's attention for head_size 8 and NKV * G == 8 query heads, with the same
// roundings as the portable path (scores_fixed<8> + softmax + the value sum): every dot product,
// softmax sum and value sum runs in its original order; the vectors run across cache positions
// (scores, exps, division) or across heads (softmax sums, via a transpose) or head dims (values).
// q: [8 heads][8]; kp/vp[kh]: row 0 of KV head kh, rows ks/vs[kh] floats apart; att: [8][ld]
// scratch; out: [8 heads][8].
template <int NKV, int G>
VQ_AVX2 void attention_hs8(const float* q, const float* const* kp, const std::int64_t* ks, const float* const* vp, const std::int64_t* vs,
                           int len, float sqrt_hs, float* att, std::size_t ld, float* out) {
  static_assert(NKV * G == 8);
  constexpr int H = 8;
  const __m256 vsqrt = _mm256_set1_ps(sqrt_hs);
  // Scores q . k_t / sqrt(8), 8 positions at a time from a transposed 8x8 block of keys.
  for (int kh = 0; kh < NKV; ++kh) {
    const float* k = kp[kh];
    const std::size_t stride = static_cast<std::size_t>(ks[kh]);
    int t = 0;
    for (; t + 8 <= len; t += 8) {
      __m256 r[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(k + static_cast<std::size_t>(t + j) * stride);
      transpose8(r);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const float* qh = q + (kh * G + g) * 8;
        __m256 s = _mm256_add_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(qh[0]), r[0]));
#pragma GCC unroll 8
        for (int d = 1; d < 8; ++d) s = _mm256_add_ps(s, _mm256_mul_ps(_mm256_set1_ps(qh[d]), r[d]));
        _mm256_storeu_ps(att + static_cast<std::size_t>(kh * G + g) * ld + static_cast<std::size_t>(t), _mm256_div_ps(s, vsqrt));
      }
    }
    for (; t < len; ++t) {
      const float* kt = k + static_cast<std::size_t>(t) * stride;
      for (int g = 0; g < G; ++g) {
        const float* qh = q + (kh * G + g) * 8;
        float s = 0.0f;
        for (int d = 0; d < 8; ++d) s += qh[d] * kt[d];
        att[static_cast<std::size_t>(kh * G + g) * ld + static_cast<std::size_t>(t)] = s / sqrt_hs;
      }
    }
  }
  // Softmax per head: the max (exact in any order), then the exps.
  for (int h = 0; h < H; ++h) {
    float* a = att + static_cast<std::size_t>(h) * ld;
    float m = a[0];
    int t = 0;
    if (len >= 8) {
      __m256 mv = _mm256_loadu_ps(a);
      for (t = 8; t + 8 <= len; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(a + t));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mv);
      m = lanes[0];
      for (int j = 1; j < 8; ++j) m = std::max(m, lanes[j]);
    }
    for (; t < len; ++t) m = std::max(m, a[t]);
    exp_shifted(a, len, m);
  }
  // Sums, each head's in position order: lane h of `sum` adds head h's 8 positions one by one.
  alignas(32) float sums[8];
  {
    __m256 sum = _mm256_setzero_ps();
    int t = 0;
    for (; t + 8 <= len; t += 8) {
      __m256 r[8];
#pragma GCC unroll 8
      for (int h = 0; h < H; ++h) r[h] = _mm256_loadu_ps(att + static_cast<std::size_t>(h) * ld + static_cast<std::size_t>(t));
      transpose8(r);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) sum = _mm256_add_ps(sum, r[j]);
    }
    _mm256_store_ps(sums, sum);
    for (; t < len; ++t)
      for (int h = 0; h < H; ++h) sums[h] += att[static_cast<std::size_t>(h) * ld + static_cast<std::size_t>(t)];
  }
  for (int h = 0; h < H; ++h) {
    float* a = att + static_cast<std::size_t>(h) * ld;
    const float sh = sums[h];
    const __m256 sv = _mm256_set1_ps(sh);
    int t = 0;
    for (; t + 8 <= len; t += 8) _mm256_storeu_ps(a + t, _mm256_div_ps(_mm256_loadu_ps(a + t), sv));
    for (; t < len; ++t) a[t] /= sh;
  }
  // out_h = sum_t a_h[t] * v_t, in position order; all 8 heads' sums interleaved.
  __m256 acc[H];
#pragma GCC unroll 8
  for (int h = 0; h < H; ++h) acc[h] = _mm256_setzero_ps();
  for (int t = 0; t < len; ++t) {
#pragma GCC unroll 8
    for (int kh = 0; kh < NKV; ++kh) {
      const __m256 v = _mm256_loadu_ps(vp[kh] + static_cast<std::size_t>(t) * static_cast<std::size_t>(vs[kh]));
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const int h = kh * G + g;
        acc[h] = _mm256_add_ps(acc[h], _mm256_mul_ps(_mm256_broadcast_ss(att + static_cast<std::size_t>(h) * ld + static_cast<std::size_t>(t)), v));
      }
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < H; ++h) _mm256_storeu_ps(out + h * 8, acc[h]);
}

using AttentionHs8 = void (*)(const float*, const float* const*, const std::int64_t*, const float* const*, const std::int64_t*, int, float, float*,
                              std::size_t, float*);

// The AVX2 attention for this head layout, or null where the portable path must run.
AttentionHs8 pick_attention_hs8(int head_size, int n_heads, int n_kv_heads) {
  if (!cpu_has_avx2() || head_size != 8 || n_heads != 8) return nullptr;
  switch (n_kv_heads) {
    case 8: return &attention_hs8<8, 1>;
    case 4: return &attention_hs8<4, 2>;
    case 2: return &attention_hs8<2, 4>;
    case 1: return &attention_hs8<1, 8>;
    default: return nullptr;
  }
}
#endif

}  // namespace

Transformer::Transformer(Checkpoint checkpoint) : ck_(std::move(checkpoint)) {
  const ModelConfig& c = ck_.config;
  validate_model_config(c, "model");
  const int half = c.head_size() / 2;
  rope_cos_.resize(sz(c.seq_len) * sz(half));
  rope_sin_.resize(rope_cos_.size());
  for (int pos = 0; pos < c.seq_len; ++pos)
    for (int j = 0; j < half; ++j) {
      // Exactly run.c's float arithmetic: freq = 1 / theta^(head_dim / head_size), head_dim = 2j.
      const float freq = 1.0f / std::pow(kRopeTheta, static_cast<float>(2 * j) / static_cast<float>(c.head_size()));
      const float val = static_cast<float>(pos) * freq;
      rope_cos_[sz(pos) * sz(half) + sz(j)] = std::cos(val);
      rope_sin_[sz(pos) * sz(half) + sz(j)] = std::sin(val);
    }
  scores_ld_ = sz(round_up8(c.seq_len));
  scores_.resize(sz(c.n_heads) * scores_ld_);
  kp_.resize(sz(c.n_kv_heads));
  vp_.resize(sz(c.n_kv_heads));
  ks_.resize(sz(c.n_kv_heads));
  vs_.resize(sz(c.n_kv_heads));
  const int L = c.n_layers;
  dim_pad_ = round_up8(c.dim);
  q_pad_ = round_up8(c.q_dim());
  kv_pad_ = round_up8(c.kv_dim());
  hidden_pad_ = round_up8(c.hidden_dim);
  vocab_pad_ = round_up8(c.vocab_size);
  wqkv_t_ = side_by_side({transpose_layers(ck_.wq, L, c.q_dim(), c.dim, q_pad_), transpose_layers(ck_.wk, L, c.kv_dim(), c.dim, kv_pad_),
                          transpose_layers(ck_.wv, L, c.kv_dim(), c.dim, kv_pad_)},
                         {q_pad_, kv_pad_, kv_pad_}, L, c.dim);
  wo_t_ = transpose_layers(ck_.wo, L, c.dim, c.q_dim(), dim_pad_);
  w13_t_ = side_by_side({transpose_layers(ck_.w1, L, c.hidden_dim, c.dim, hidden_pad_), transpose_layers(ck_.w3, L, c.hidden_dim, c.dim, hidden_pad_)},
                        {hidden_pad_, hidden_pad_}, L, c.dim);
  w2_t_ = transpose_layers(ck_.w2, L, c.dim, c.hidden_dim, dim_pad_);
  const std::vector<float> cls(ck_.classifier(), ck_.classifier() + sz(c.vocab_size) * sz(c.dim));
  wcls_t_ = transpose_layers(cls, 1, c.vocab_size, c.dim, vocab_pad_);
}

ModelDescription Transformer::description() const { return ModelDescription::uniform(config().n_layers, config().head_size()); }

void Transformer::ensure_capacity(int n) {
  if (n <= capacity_) return;
  const ModelConfig& c = config();
  const std::size_t N = sz(n);
  x_.resize(N * sz(c.dim));
  xb_.resize(N * sz(c.dim));
  att_out_.resize(N * sz(c.q_dim()));
  qkv_.resize(N * sz(q_pad_ + 2 * kv_pad_));
  kbuf_.resize(N * sz(c.kv_dim()));
  vbuf_.resize(N * sz(c.kv_dim()));
  hb_.resize(N * 2 * sz(hidden_pad_));
  capacity_ = n;
  wrapped_n_ = 0;  // kbuf_/vbuf_ may have moved
}

std::vector<float> Transformer::forward(std::span<const int> tokens, std::vector<std::shared_ptr<KVCache>>& caches) {
  const ModelConfig& c = config();
  const int n = static_cast<int>(tokens.size());
  // Checks format their message only on failure: this runs once per decoded token.
  if (caches.size() != sz(c.n_layers))
    throw InvalidArgument(fmt::format("forward needs one cache per layer: the model has {} layers, got {} caches", c.n_layers, caches.size()));
  for (const auto& cache : caches)
    if (!cache) throw InvalidArgument("forward got a null cache");
  const std::int64_t pos0 = caches[0]->offset();
  for (std::size_t l = 1; l < caches.size(); ++l)
    if (caches[l]->offset() != pos0)
      throw InvalidArgument(fmt::format("caches disagree on the position: layer 0 holds {} tokens, layer {} holds {}", pos0, l,
                                        caches[l]->offset()));
  if (pos0 + n > c.seq_len)
    throw InvalidArgument(fmt::format("positions {}..{} exceed the model's context of {} tokens (seq_len)", pos0, pos0 + n - 1, c.seq_len));
  for (int t : tokens)
    if (t < 0 || t >= c.vocab_size) throw InvalidArgument(fmt::format("token id {} is outside the vocabulary 0..{}", t, c.vocab_size - 1));
  if (n == 0) return {};
  ensure_capacity(n);

  const int dim = c.dim, hs = c.head_size(), hidden = c.hidden_dim, half = hs / 2;
  const int n_kv = c.n_kv_heads, group = c.n_heads / c.n_kv_heads;
  const std::size_t D = sz(dim), H = sz(hidden), HS = sz(hs);
  // QP: the q block's width in a qkv row (q_dim rounded up to 8); QD: the attention output's width.
  const std::size_t DP = sz(dim_pad_), QP = sz(q_pad_), QD = sz(c.q_dim()), KVP = sz(kv_pad_), HP = sz(hidden_pad_), QKV = QP + 2 * KVP;
  float* const qkv = qkv_.data();
  const float sqrt_hs = std::sqrt(static_cast<float>(hs));
  const std::int64_t T = pos0 + n;
#ifdef VQ_AVX2_PATH
  const AttentionHs8 attention_fast = pick_attention_hs8(hs, c.n_heads, n_kv);
#endif

  // The cache input: wrapped once per chunk length (Tensor::wrap validates and allocates).
  if (wrapped_n_ != n) {
    const Shape4 shape{1, n_kv, n, hs};
    kin_ = Tensor::wrap(kbuf_.data(), shape, DType::F32);
    vin_ = Tensor::wrap(vbuf_.data(), shape, DType::F32);
    wrapped_n_ = n;
  }

  for (int i = 0; i < n; ++i)
    std::copy_n(ck_.token_embedding.data() + sz(tokens[sz(i)]) * D, D, x_.data() + sz(i) * D);

  for (int l = 0; l < c.n_layers; ++l) {
    const std::size_t L = sz(l);
    for (int i = 0; i < n; ++i) rmsnorm(xb_.data() + sz(i) * D, x_.data() + sz(i) * D, ck_.rms_att.data() + L * D, dim);
    // q, k, v of token i at qkv + i QKV + {0, QP, QP + KVP}.
    matmul_t(qkv, QKV, xb_.data(), D, wqkv_t_.data() + L * QKV * D, QKV, n, dim, static_cast<int>(QKV));

    // RoPE on q and k (interleaved pairs), then K/V into [n_kv, n, hs] for the cache.
    for (int i = 0; i < n; ++i) {
      const float* cs = rope_cos_.data() + sz(pos0 + i) * sz(half);
      const float* sn = rope_sin_.data() + sz(pos0 + i) * sz(half);
      auto rotate = [&](float* vec, int heads) {
        for (int h = 0; h < heads; ++h, vec += hs)
          for (int p = 0; p < half; ++p) {
            const float v0 = vec[2 * p], v1 = vec[2 * p + 1];
            vec[2 * p] = v0 * cs[p] - v1 * sn[p];
            vec[2 * p + 1] = v0 * sn[p] + v1 * cs[p];
          }
      };
      float* row = qkv + sz(i) * QKV;
      rotate(row, c.n_heads);
      rotate(row + QP, n_kv);
      for (int h = 0; h < n_kv; ++h) {
        std::copy_n(row + QP + sz(h * hs), hs, kbuf_.data() + (sz(h) * sz(n) + sz(i)) * HS);
        std::copy_n(row + QP + KVP + sz(h * hs), hs, vbuf_.data() + (sz(h) * sz(n) + sz(i)) * HS);
      }
    }
    auto [kc, vc] = caches[L]->update_and_fetch(kin_, vin_);
    for (const Tensor* t : {&kc, &vc})
      if (t->dim(0) != 1 || t->dim(1) != n_kv || t->dim(2) != T || t->dim(3) != hs)
        throw InvalidArgument(fmt::format("layer {} cache returned {}, expected [1, {}, {}, {}]", l, shape_string(t->shape()), n_kv, T, hs));

    // Row pointers into what the cache returned, converted to float32 when it is not already
    // (into scratch [n_kv, T, hs]; a head whose rows are adjacent converts in one call).
    auto rows = [&](const Tensor& t, std::vector<float>& scratch, std::vector<const float*>& ptr, std::vector<std::int64_t>& stride) {
      if (t.dtype() == DType::F32) {
        for (int h = 0; h < n_kv; ++h) {
          ptr[sz(h)] = reinterpret_cast<const float*>(t.row(0, h, 0));
          stride[sz(h)] = t.strides()[2];
        }
        return;
      }
      if (scratch.size() < sz(n_kv) * sz(T) * HS) scratch.resize(sz(c.n_kv_heads) * sz(c.seq_len) * HS);
      for (int h = 0; h < n_kv; ++h) {
        float* dst = scratch.data() + sz(h) * sz(T) * HS;
        if (t.strides()[2] == hs) {
          to_f32(t.row(0, h, 0), t.dtype(), dst, sz(T) * HS);
        } else {
          for (std::int64_t s = 0; s < T; ++s) to_f32(t.row(0, h, s), t.dtype(), dst + sz(s) * HS, HS);
        }
        ptr[sz(h)] = dst;
        stride[sz(h)] = hs;
      }
    };
    rows(kc, kscratch_, kp_, ks_);
    rows(vc, vscratch_, vp_, vs_);

#ifdef VQ_AVX2_PATH
    if (attention_fast) {
      for (int i = 0; i < n; ++i)
        attention_fast(qkv + sz(i) * QKV, kp_.data(), ks_.data(), vp_.data(), vs_.data(), static_cast<int>(pos0) + i + 1, sqrt_hs,
                       scores_.data(), scores_ld_, att_out_.data() + sz(i) * QD);
    } else
#endif
    {
      for (int kh = 0; kh < n_kv; ++kh) {
        const float* kp = kp_[sz(kh)];
        const float* vp = vp_[sz(kh)];
        const std::int64_t ks = ks_[sz(kh)], vs = vs_[sz(kh)];
        for (int i = 0; i < n; ++i) {
          const int len = static_cast<int>(pos0) + i + 1;  // causal: cache positions 0 .. pos0 + i
          for (int h = kh * group; h < (kh + 1) * group; ++h) {
            const float* q = qkv + sz(i) * QKV + sz(h * hs);
            float* att = scores_.data();
            if (hs == 8 && ks == 8)
              scores_fixed<8>(q, kp, len, sqrt_hs, att);
            else if (hs == 16 && ks == 16)
              scores_fixed<16>(q, kp, len, sqrt_hs, att);
            else
              scores_any(q, kp, ks, hs, len, sqrt_hs, att);
            softmax(att, len);
            float* out = att_out_.data() + sz(i) * QD + sz(h * hs);
            std::fill_n(out, hs, 0.0f);
            for (int t = 0; t < len; ++t) {
              const float* v = vp + sz(t) * sz(vs);
              const float a = att[t];
              for (int d = 0; d < hs; ++d) out[d] += a * v[d];
            }
          }
        }
      }
    }

    matmul_t(xb_.data(), D, att_out_.data(), QD, wo_t_.data() + L * DP * QD, DP, n, c.q_dim(), dim);
    for (std::size_t j = 0; j < sz(n) * D; ++j) x_[j] += xb_[j];

    for (int i = 0; i < n; ++i) rmsnorm(xb_.data() + sz(i) * D, x_.data() + sz(i) * D, ck_.rms_ffn.data() + L * D, dim);
    // w1 x and w3 x of token i at hb_ + i 2HP + {0, HP}; the SwiGLU product replaces w1 x.
    matmul_t(hb_.data(), 2 * HP, xb_.data(), D, w13_t_.data() + L * 2 * HP * D, 2 * HP, n, dim, static_cast<int>(2 * HP));
    for (int i = 0; i < n; ++i) {
      float* h1 = hb_.data() + sz(i) * 2 * HP;
      const float* h3 = h1 + HP;
      for (std::size_t j = 0; j < H; ++j) {
        float val = h1[j];
        val *= 1.0f / (1.0f + std::exp(-val));  // silu
        h1[j] = val * h3[j];
      }
    }
    matmul_t(xb_.data(), D, hb_.data(), 2 * HP, w2_t_.data() + L * DP * H, DP, n, hidden, dim);
    for (std::size_t j = 0; j < sz(n) * D; ++j) x_[j] += xb_[j];
  }

  for (int i = 0; i < n; ++i) rmsnorm(x_.data() + sz(i) * D, x_.data() + sz(i) * D, ck_.rms_final.data(), dim);
  std::vector<float> logits(sz(n) * sz(c.vocab_size));
  matmul_t(logits.data(), sz(c.vocab_size), x_.data(), D, wcls_t_.data(), sz(vocab_pad_), n, dim, c.vocab_size);
  return logits;
}

std::vector<std::shared_ptr<KVCache>> make_fp32_caches(const Transformer& model) {
  std::vector<std::shared_ptr<KVCache>> caches;
  for (int l = 0; l < model.config().n_layers; ++l) caches.push_back(std::make_shared<KVCache>());
  return caches;
}

}  // namespace vq
