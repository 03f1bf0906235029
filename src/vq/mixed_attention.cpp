// VqKVCache::attend_own: attention on the codes of a cache whose transform mixes its heads (our
// `vq` with the weight basis on rows of <= kVqMaxCrossHead values: stories260K's 4 KV heads x 8),
// every head at once.
//
// What a reader must know first:
// - The cache holds y_t = F x_t per token and side (x: the row of all heads, keys un-rotated; F
//   mixes heads). The tile loop (read_rows) rebuilt every head's rows from y for every tile read,
//   keys and values, in the exact arithmetic of state(). Here, once per tile for all heads:
//   - values stay in coefficient space: sum_t p_t v_t = F^-1_h (sum_t p_t y_t), so each query row
//     accumulates the dequantized codes y_t (n values) and takes F^-1_h once at the end;
//   - keys without RoPE likewise go to the query side: q . k_t = (F^-1_h^T q) . y_t;
//   - keys with RoPE cannot (R_t F^-1 y differs per position): each token's key row is rebuilt
//     once for every head, x_t = F^-1 y_t, and rotated per head pair at position t; the query row
//     is q in head h's place. (A key basis that commutes with RoPE would move them to the query
//     side as well: measured in docs/benchmarks.md, not kept: it costs 3x the KL.)
// - A tile of kTile tokens is decoded once (codes -> y: an AVX-512 VBMI cut of the packed fields
//   where the layout allows, code_pack::unpack_rows otherwise; resident=coded's sealed tiles
//   through sealed_row, one Rice decode per tile and side: kTile is kSealTokens), scored against every query row of
//   every head (attention_kernels.hpp's score kernel over rows of n), run through the online
//   softmax (softmax_step; the scale is folded into the query rows) and accumulated (accumulate
//   kernel).
// - Exact tokens (sinks, the tail) join the same loop: rebuilt keys are their rows as held; the
//   other sides are taken into coefficient space with F (F then F^-1 in float32 gives the rows
//   back within float32 rounding).
// - Values are dequantized as fma(code, step, mean) on every path and for escapes alike, and summed
//   in coefficient order, so they never depend on the packed widths: a loaded cache (packed at
//   widths chosen again) attends bit for bit as the saved one did.
// - The result equals attention over state()'s rows within float32 rounding (tests:
//   tests/vq/mixed_attention_test.cpp), not bit for bit: the sums run in another order.
// - Declines (the tile loop runs) where this does not apply: transforms per head (the identity,
//   wider rows), float16 input (state() rounds rows through float16, which coefficient space
//   cannot), calls of more than kAttentionSplitMaxQueries query
//   tokens (a prefill: the tile loop's per-head rows cost less there), or nothing quantized yet.
#include <algorithm>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif
#include <cmath>
#include <limits>
#include <vector>

#include "code_pack.hpp"
#include "reconstruct_kernels.hpp"
#include "veloxquant/cache/attention.hpp"
#include "veloxquant/cache/attention_kernels.hpp"
#include "veloxquant/vq/vq_cache.hpp"

namespace vq {

namespace {

constexpr std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

// Tokens decoded and scored at a time: a sealed tile (resident=coded) is decoded once per side.
constexpr std::int64_t kTile = VqKVCache::kSealTokens;

// What the fast decode needs of a side: the multishift controls and masks that cut a packed row's
// fields (field position p holds coefficient order[p]: vq_cache.hpp, "Packed layout"), the byte
// gather from the row, each field's code bias 2^(w-1), the permutation back to coefficient order,
// the means, and for keys each channel's cos/sin index and sign. Everything after the cut is in
// coefficient order and reads codes, not fields.
struct FieldPlan {
  alignas(64) std::uint8_t gather[64];   // zmm byte k <- row byte gather[k] (group k / 8's bytes)
  alignas(64) std::uint8_t shift[64];    // bit of field k % 8 within its group's qword
  alignas(64) std::uint8_t mask[64];     // 2^w - 1
  alignas(64) std::int32_t half[32];     // 2^(w-1) per field position: code = field - half
  alignas(64) std::int32_t pos[32];      // field position of coefficient c (c past n: c)
  alignas(64) float mean[32];            // per coefficient (0 past n)
  alignas(64) std::int32_t cos_at[32];   // keys: index of cos(t theta_p) in the position's cos/sin row
  alignas(64) float sign[32];            // keys: -1 (even coefficient: y0' = c y0 - s y1) or +1
};

// y = mean + code * step as one rounding (fma), on every path and for escapes alike.
inline float dequant(float mean, std::int32_t code, float step) { return std::fma(static_cast<float>(code), step, mean); }

// acc[c] += w * row[c], c < n (the portable path's query and output sides; each acc[c] sums its
// terms in the same order whatever the vector width).
void add_scaled(float* __restrict acc, const float* __restrict row, float w, int n) {
  for (int c = 0; c < n; ++c) acc[c] += w * row[c];
}

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12's AVX-512 intrinsics pass an undefined source for their unused masks (as in code_pack.cpp).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#define VQ_MIXED_AVX512 __attribute__((target("avx512f,avx512bw,avx512vbmi,avx512dq")))

bool fast_decode_available() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512dq");
  return has && attn::avx512_enabled();
}

// Tokens' packed rows [rows] (row_bytes apart) -> y [rows][32] floats in coefficient order
// (coefficients past n read finite junk, never used); an escaped field comes out as its field 0
// (code -2^(w-1)): the caller patches it.
VQ_MIXED_AVX512 void decode_rows(const FieldPlan& fp, const std::uint8_t* row, std::uint32_t row_bytes, std::int64_t rows, float step,
                                float* y) {
  const __m512i gather = _mm512_load_si512(fp.gather), shift = _mm512_load_si512(fp.shift), mask = _mm512_load_si512(fp.mask);
  const __m512i h0 = _mm512_load_si512(fp.half), h1 = _mm512_load_si512(fp.half + 16);
  const __m512i p0 = _mm512_load_si512(fp.pos), p1 = _mm512_load_si512(fp.pos + 16);
  const __m512 m0 = _mm512_load_ps(fp.mean), m1 = _mm512_load_ps(fp.mean + 16), st = _mm512_set1_ps(step);
  const __mmask64 load = row_bytes >= 64 ? ~__mmask64{0} : ((__mmask64{1} << row_bytes) - 1);
  for (std::int64_t t = 0; t < rows; ++t, row += row_bytes, y += 32) {
    const __m512i bytes = _mm512_maskz_loadu_epi8(load, row);
    const __m512i fields = _mm512_and_si512(_mm512_multishift_epi64_epi8(shift, _mm512_permutexvar_epi8(gather, bytes)), mask);
    const __m512 f0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(fields)), h0));
    const __m512 f1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(fields, 1)), h1));
    const __m512 c0 = _mm512_permutex2var_ps(f0, p0, f1), c1 = _mm512_permutex2var_ps(f0, p1, f1);
    _mm512_storeu_ps(y, _mm512_fmadd_ps(c0, st, m0));
    _mm512_storeu_ps(y + 16, _mm512_fmadd_ps(c1, st, m1));
  }
}

// y = fma(code, step, mean) for `rows` rows of n <= 32 codes (`stride` apart) into rows of 32 floats.
VQ_MIXED_AVX512 void dequant_rows(const FieldPlan& fp, const std::int16_t* q, std::int64_t stride, int n, std::int64_t rows, float step,
                                  float* y) {
  const __mmask32 m = n >= 32 ? ~__mmask32{0} : ((__mmask32{1} << n) - 1);
  const __m512 m0 = _mm512_load_ps(fp.mean), m1 = _mm512_load_ps(fp.mean + 16), st = _mm512_set1_ps(step);
  for (std::int64_t t = 0; t < rows; ++t, q += stride, y += 32) {
    const __m512i c = _mm512_maskz_loadu_epi16(m, q);
    const __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(c)));
    const __m512 c1 = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(c, 1)));
    _mm512_storeu_ps(y, _mm512_fmadd_ps(c0, st, m0));
    _mm512_storeu_ps(y + 16, _mm512_fmadd_ps(c1, st, m1));
  }
}

// Keys: x'_c = cos x_c + sign sin x_(c xor 1) at each token's position (rows of 32, in place).
VQ_MIXED_AVX512 void rotate_rows(const FieldPlan& fp, const VqRopeTable& rope, std::int64_t pos0, std::int64_t rows, float* y) {
  const __m512i swap = _mm512_xor_si512(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(1));
  const __m512i ci0 = _mm512_load_si512(fp.cos_at), ci1 = _mm512_load_si512(fp.cos_at + 16);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i si0 = _mm512_add_epi32(ci0, one), si1 = _mm512_add_epi32(ci1, one);
  const __m512 sg0 = _mm512_load_ps(fp.sign), sg1 = _mm512_load_ps(fp.sign + 16);
  const int nd = 2 * static_cast<int>(rope.freq.size());  // <= 16 doubles: cos/sin of one position
  const __mmask8 dm = static_cast<__mmask8>((1u << std::min(nd, 8)) - 1), dh = static_cast<__mmask8>(nd > 8 ? (1u << (nd - 8)) - 1 : 0);
  for (std::int64_t t = 0; t < rows; ++t, y += 32) {
    const double* cs = rope.at(pos0 + t);
    const __m256 lo = _mm512_cvtpd_ps(_mm512_maskz_loadu_pd(dm, cs));
    const __m256 hi = nd > 8 ? _mm512_cvtpd_ps(_mm512_maskz_loadu_pd(dh, cs + 8)) : _mm256_setzero_ps();
    const __m512 cs16 = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
    const __m512 y0 = _mm512_loadu_ps(y), y1 = _mm512_loadu_ps(y + 16);
    const __m512 q0 = _mm512_permutexvar_ps(swap, y0), q1 = _mm512_permutexvar_ps(swap, y1);
    const __m512 c0 = _mm512_permutexvar_ps(ci0, cs16), c1 = _mm512_permutexvar_ps(ci1, cs16);
    const __m512 s0 = _mm512_mul_ps(_mm512_permutexvar_ps(si0, cs16), sg0), s1 = _mm512_mul_ps(_mm512_permutexvar_ps(si1, cs16), sg1);
    _mm512_storeu_ps(y, _mm512_fmadd_ps(c0, y0, _mm512_mul_ps(s0, q0)));
    _mm512_storeu_ps(y + 16, _mm512_fmadd_ps(c1, y1, _mm512_mul_ps(s1, q1)));
  }
}

// Keys rebuilt in place: x = F^-1 y for `rows` token rows of 32 floats (y in coefficient order;
// inv_t = F^-1 transposed, n <= 32 columns of n floats). Four tokens at a time (eight independent
// sums of fused multiply-adds).
VQ_MIXED_AVX512 void rebuild_rows(const float* inv_t, int n, std::int64_t rows, float* y) {
  const __mmask16 m0 = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
  const __mmask16 m1 = static_cast<__mmask16>(n >= 32 ? 0xFFFF : n > 16 ? (1u << (n - 16)) - 1 : 0);
  std::int64_t t = 0;
  for (; t + 4 <= rows; t += 4, y += 4 * 32) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
    const float* col = inv_t;
    for (int j = 0; j < n; ++j, col += n) {
      const __m512 lo = _mm512_maskz_loadu_ps(m0, col), hi = _mm512_maskz_loadu_ps(m1, col + 16);
      const __m512 ya = _mm512_set1_ps(y[j]), yb = _mm512_set1_ps(y[32 + j]), yc = _mm512_set1_ps(y[64 + j]), yd = _mm512_set1_ps(y[96 + j]);
      a0 = _mm512_fmadd_ps(ya, lo, a0), a1 = _mm512_fmadd_ps(ya, hi, a1);
      b0 = _mm512_fmadd_ps(yb, lo, b0), b1 = _mm512_fmadd_ps(yb, hi, b1);
      c0 = _mm512_fmadd_ps(yc, lo, c0), c1 = _mm512_fmadd_ps(yc, hi, c1);
      d0 = _mm512_fmadd_ps(yd, lo, d0), d1 = _mm512_fmadd_ps(yd, hi, d1);
    }
    _mm512_storeu_ps(y, a0), _mm512_storeu_ps(y + 16, a1);
    _mm512_storeu_ps(y + 32, b0), _mm512_storeu_ps(y + 48, b1);
    _mm512_storeu_ps(y + 64, c0), _mm512_storeu_ps(y + 80, c1);
    _mm512_storeu_ps(y + 96, d0), _mm512_storeu_ps(y + 112, d1);
  }
  for (; t < rows; ++t, y += 32) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    const float* col = inv_t;
    for (int j = 0; j < n; ++j, col += n) {
      const __m512 yj = _mm512_set1_ps(y[j]);
      a0 = _mm512_fmadd_ps(yj, _mm512_maskz_loadu_ps(m0, col), a0), a1 = _mm512_fmadd_ps(yj, _mm512_maskz_loadu_ps(m1, col + 16), a1);
    }
    _mm512_storeu_ps(y, a0), _mm512_storeu_ps(y + 16, a1);
  }
}

// a (32 floats, coefficient order) = scale * sum_e q[e] * row e of F^-1 for head h (d rows of
// n <= 32 floats, n apart); a[c] = 0 past n.
VQ_MIXED_AVX512 void query_side(const float* inv, int n, int d, const float* q, float scale, float* a) {
  const __mmask16 m0 = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
  const __mmask16 m1 = static_cast<__mmask16>(n >= 32 ? 0xFFFF : n > 16 ? (1u << (n - 16)) - 1 : 0);
  __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
  for (int e = 0; e < d; ++e, inv += n) {
    const __m512 w = _mm512_set1_ps(q[e] * scale);
    lo = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m0, inv), lo);
    hi = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m1, inv + 16), hi);
  }
  _mm512_storeu_ps(a, lo);
  _mm512_storeu_ps(a + 16, hi);
}

// out[e] = scale * (row e of head h's F^-1) . u (32 floats, coefficient order).
VQ_MIXED_AVX512 void output_side(const float* inv, int n, int d, const float* u, float scale, float* out) {
  const __mmask16 m0 = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
  const __mmask16 m1 = static_cast<__mmask16>(n >= 32 ? 0xFFFF : n > 16 ? (1u << (n - 16)) - 1 : 0);
  const __m512 u0 = _mm512_loadu_ps(u), u1 = _mm512_loadu_ps(u + 16);
  for (int e = 0; e < d; ++e, inv += n) {
    const __m512 p = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m1, inv + 16), u1, _mm512_mul_ps(_mm512_maskz_loadu_ps(m0, inv), u0));
    out[e] = _mm512_reduce_add_ps(p) * scale;
  }
}
#pragma GCC diagnostic pop
#else
bool fast_decode_available() { return false; }
void decode_rows(const FieldPlan&, const std::uint8_t*, std::uint32_t, std::int64_t, float, float*) {}
void rotate_rows(const FieldPlan&, const VqRopeTable&, std::int64_t, std::int64_t, float*) {}
void query_side(const float*, int, int, const float*, float, float*) {}
void rebuild_rows(const float*, int, std::int64_t, float*) {}
void dequant_rows(const FieldPlan&, const std::int16_t*, std::int64_t, int, std::int64_t, float, float*) {}
void output_side(const float*, int, int, const float*, float, float*) {}
#endif

}  // namespace

bool VqKVCache::attend_own(const Tensor& queries, float scale, Tensor& out) const {
  if (!layer_ || identity_from_data_ || !calibrated_) return false;
  if (keys_buf_.dtype() != DType::F32) return false;
  const VqSideTransform &tk = layer_->k, &tv = layer_->v;
  const int H = layer_->kv_heads, d = layer_->head_dim, n = tk.n;
  if (tk.identity() || tv.identity() || tv.n != n || tk.col_span != n || tv.col_span != n || H * d != n ||
      tv.inv_cols.size() != sz(n) * sz(n) || tk.fwd_t.size() != sz(n) * sz(n) || tv.fwd_t.size() != sz(n) * sz(n) ||
      tk.inv_t.size() != sz(n) * sz(n))
    return false;
  // Keys on the query side (no RoPE: a = F^-1_h^T q against y) or rebuilt (RoPE: x = F^-1 y rotated
  // per head; a = q in head h's place).
  const bool rebuilt = !layer_->rope_freq.empty();
  const std::int64_t sink_end = std::min<std::int64_t>(config_.sinks, offset_), Q = quantized_;
  if (Q <= sink_end) return false;
  // Decode-sized calls only: every query row scores all n coefficients of every token, where the
  // tile loop scores d per head row and rebuilds the tile's rows once for all of them, so with many
  // query tokens (a prefill) the tiles cost less (vq_bench_model's prefill: 4.2 -> 5.7 ms here).
  if (queries.dim(2) > kAttentionSplitMaxQueries) return false;

  const std::int64_t B = queries.dim(0), Hq = queries.dim(1), Sq = queries.dim(2), G = Hq / H, T = offset_, R = Hq * Sq;
  out = Tensor::uninitialized({B, Hq, Sq, d}, DType::F32);
  const auto rope = rebuilt ? vq_rope_table(layer_->rope_freq, T) : nullptr;
  // Quantized tokens [sink_end, sealed_) are in sealed tiles (resident=coded: all of them between
  // updates), the rest in packed rows, read through the packed layout.
  const bool packed = Q > std::max(sealed_, sink_end);
  if (packed && (kq_.bit_at.size() != sz(n) + 1 || vq_.bit_at.size() != sz(n) + 1)) return false;
  code_pack::Layout lay[2];
  if (packed) lay[0] = code_pack::pack_layout(kq_, n, H), lay[1] = code_pack::pack_layout(vq_, n, H);
  const SideQuant* sqs[2] = {&kq_, &vq_};
  const SideStore* sts[2] = {&ks_, &vs_};
  const VqSideTransform* trs[2] = {&tk, &tv};

  // The AVX-512 forms where the CPU has them and rows have <= 32 coefficients and <= 16 cos/sin per
  // position (`fast`); of those, the VBMI cut of the packed fields where a side's groups are whole
  // groups of 8 fields of <= 8 bits in <= 64 bytes (`cut`), code_pack::unpack_rows otherwise. The
  // cut only extracts codes, so which one runs never changes a value: the arithmetic depends on
  // `fast` alone, never on the packed widths (a cache packed at other widths attends bit for bit
  // the same on this CPU).
  thread_local FieldPlan plan[2];
  const bool fast = fast_decode_available() && n <= 32 && d <= 16;
  bool cut[2] = {false, false};
  for (int side = 0; side < 2 && fast && packed; ++side) {
    cut[side] = d % 8 == 0 && lay[side].row_bytes() <= 64;
    for (std::uint8_t w : sqs[side]->group_width) cut[side] = cut[side] && w <= 8;
  }
  if (fast)
    for (int side = 0; side < 2; ++side) {
      const SideQuant& sq = *sqs[side];
      FieldPlan& fp = plan[side];
      std::fill(std::begin(fp.gather), std::end(fp.gather), 0);
      std::fill(std::begin(fp.shift), std::end(fp.shift), 0);
      std::fill(std::begin(fp.mask), std::end(fp.mask), 0);
      for (int p = 0; p < 32; ++p) fp.half[p] = 0, fp.pos[p] = p, fp.mean[p] = 0.0f, fp.cos_at[p] = 0, fp.sign[p] = 0.0f;
      for (int p = 0; p < n && cut[side]; ++p) {
        const int g = p / 8, i = p % 8, w = sq.group_width[sz(g)], c = sq.order[sz(p)];
        fp.gather[p] = static_cast<std::uint8_t>(sq.group_byte[sz(g)] + static_cast<std::uint32_t>(i));
        fp.shift[p] = static_cast<std::uint8_t>(i * w);
        fp.mask[p] = static_cast<std::uint8_t>((1u << w) - 1);
        fp.half[p] = 1 << (w - 1);
        fp.pos[c] = p;
      }
      for (int c = 0; c < n; ++c) {
        fp.mean[c] = sq.mean[sz(c)];
        // Rebuilt keys: channel c is in pair (c % d) / 2 of its head.
        if (side == 0 && rebuilt) fp.cos_at[c] = 2 * ((c % d) / 2), fp.sign[c] = (c % 2 == 0) ? -1.0f : 1.0f;
      }
    }
  const int ns = fast ? 32 : n;  // floats per token of y (coefficients n .. ns - 1 unused)

  // (Coefficients n .. ns - 1 of a are 0, so whatever finite values y holds there score nothing;
  // the tiles are written before they are read, never cleared.)
  thread_local std::vector<float> a, m, l, u, yk, yv, s, x, qrow, orow;
  thread_local std::vector<std::int16_t> codes;
  a.assign(sz(R) * sz(ns), 0.0f);
  m.resize(sz(R)), l.resize(sz(R)), u.resize(sz(R) * sz(ns));
  yk.resize(sz(kTile) * sz(ns)), yv.resize(sz(kTile) * sz(ns));
  s.resize(sz(R) * sz(kTile)), x.resize(sz(n)), codes.resize(sz(kTile) * sz(n)), qrow.resize(sz(d)), orow.resize(sz(d));

  for (std::int64_t b = 0; b < B; ++b) {
    // a_r = scale * F^-1_h^T q_r for row r = hq * Sq + i.
    for (std::int64_t hq = 0; hq < Hq; ++hq)
      for (std::int64_t i = 0; i < Sq; ++i) {
        const std::int64_t h = hq / G;
        to_f32(queries.row(b, hq, i), queries.dtype(), qrow.data(), sz(d));
        float* ar = a.data() + sz(hq * Sq + i) * sz(ns);
        if (rebuilt) {
          std::fill(ar, ar + n, 0.0f);
          for (int e = 0; e < d; ++e) ar[h * d + e] = qrow[sz(e)] * scale;
        } else if (fast) {
          query_side(tk.inv.data() + sz(h * d) * sz(n), n, d, qrow.data(), scale, ar);
        } else {
          std::fill(ar, ar + n, 0.0f);
          for (int e = 0; e < d; ++e) add_scaled(ar, tk.inv.data() + sz(h * d + e) * sz(n), qrow[sz(e)] * scale, n);
        }
      }
    std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
    std::fill(l.begin(), l.end(), 0.0f);
    std::fill(u.begin(), u.end(), 0.0f);

    for (std::int64_t t0 = 0; t0 < T; t0 += kTile) {
      const std::int64_t mt = std::min(kTile, T - t0);
      // Quantized tokens of the tile served from codes: [qa, qb).
      const std::int64_t qa = std::clamp(t0, sink_end, Q), qb = std::clamp(t0 + mt, qa, Q);
      for (int side = 0; side < 2; ++side) {
        const SideQuant& sq = *sqs[side];
        const SideStore& st = *sts[side];
        const VqSideTransform& tr = *trs[side];
        float* y = side == 0 ? yk.data() : yv.data();
        if (qa < qb) {
          float* yq = y + sz(qa - t0) * sz(ns);
          // Sealed tokens [qa, pa): their tile's codes, decoded once per tile and side (sealed_row).
          const std::int64_t pa = std::clamp(sealed_, qa, qb);
          for (std::int64_t t = qa; t < pa; ++t) {
            const std::int16_t* q = sealed_row(side, b, t);
            if (fast) {
              dequant_rows(plan[side], q, n, n, 1, sq.step, yq + sz(t - qa) * sz(ns));
            } else {
              for (int c = 0; c < n; ++c) yq[sz(t - qa) * sz(ns) + sz(c)] = dequant(sq.mean[sz(c)], q[c], sq.step);
            }
          }
          if (pa < qb) {  // packed tokens [pa, qb)
            const std::uint8_t* rows = st.packed[sz(b)].data() + sz(pa - sealed_) * lay[side].row_bytes();
            float* yp = yq + sz(pa - qa) * sz(ns);
            if (cut[side]) {
              decode_rows(plan[side], rows, lay[side].row_bytes(), qb - pa, sq.step, yp);
            } else {
              code_pack::unpack_rows(lay[side], rows, qb - pa, codes.data());
              if (fast) {
                dequant_rows(plan[side], codes.data(), n, n, qb - pa, sq.step, yp);
              } else {
                for (std::int64_t t = 0; t < qb - pa; ++t)
                  for (int c = 0; c < n; ++c) yp[sz(t) * sz(ns) + sz(c)] = dequant(sq.mean[sz(c)], codes[sz(t) * sz(n) + sz(c)], sq.step);
              }
            }
            const auto& e = st.escapes[sz(b)];
            for (auto it = std::lower_bound(e.begin(), e.end(), pa, [](const Escape& x, std::int64_t t) { return x.t < t; });
                 it != e.end() && it->t < qb; ++it)
              yp[sz(it->t - pa) * sz(ns) + sz(it->c)] = dequant(sq.mean[sz(it->c)], it->q, sq.step);
          }
          if (side == 0 && rebuilt) {
            if (fast) {
              rebuild_rows(tk.inv_t.data(), n, qb - qa, yq);
            } else {
              for (std::int64_t t = 0; t < qb - qa; ++t) {
                float* yt = yq + sz(t) * sz(ns);
                std::copy_n(yt, n, x.data());
                std::fill(yt, yt + n, 0.0f);
                for (int j = 0; j < n; ++j) add_scaled(yt, tk.inv_t.data() + sz(j) * sz(n), x[sz(j)], n);
              }
            }
          }
          if (side == 0 && rebuilt && fast) {
            rotate_rows(plan[0], *rope, qa, qb - qa, yq);
          } else if (side == 0 && rebuilt) {
            for (std::int64_t t = qa; t < qb; ++t) {
              const double* cs = rope->at(t);
              float* yt = yq + sz(t - qa) * sz(ns);
              for (int p = 0; p < n / 2; ++p) {
                const int f = (2 * p % d) / 2;
                const float co = static_cast<float>(cs[2 * f]), si = static_cast<float>(cs[2 * f + 1]);
                const float y0 = yt[2 * p], y1 = yt[2 * p + 1];
                yt[2 * p] = co * y0 - si * y1;
                yt[2 * p + 1] = si * y0 + co * y1;
              }
            }
          }
        }
        // Exact tokens of the tile: rebuilt keys are their rows as held (rotated); values, and keys
        // scored on the query side, go into coefficient space, y = F x.
        for (std::int64_t t = t0; t < t0 + mt; ++t) {
          if (t >= qa && t < qb) continue;
          const std::uint8_t* src = t < sink_end ? st.sinks.data() + sz(t * B + b) * sz(n) * 4 : st.tail.data() + sz((t - Q) * B + b) * sz(n) * 4;
          to_f32(src, DType::F32, x.data(), sz(n));
          float* yt = y + sz(t - t0) * sz(ns);
          if (side == 0 && rebuilt) {  // rows as held are what rebuilt keys stand for
            std::copy_n(x.data(), n, yt);
            continue;
          }
          std::fill(yt, yt + n, 0.0f);
          for (int j = 0; j < n; ++j) add_scaled(yt, tr.fwd_t.data() + sz(j) * sz(n), x[sz(j)], n);
        }
      }
      attn::score_f32(yk.data(), mt, ns, ns, a.data(), R, s.data());
      for (std::int64_t r = 0; r < R; ++r) {
        const std::int64_t i = r % Sq, last = T - Sq + i;
        attn::softmax_step(s.data() + r * mt, mt, last - t0 + 1, 1.0f, m[sz(r)], l[sz(r)], u.data() + r * ns, ns);
      }
      attn::accumulate_f32(yv.data(), mt, ns, ns, s.data(), R, u.data());
    }
    // Each row: F^-1_h of its coefficient sum, over l.
    for (std::int64_t hq = 0; hq < Hq; ++hq)
      for (std::int64_t i = 0; i < Sq; ++i) {
        const std::int64_t h = hq / G, r = hq * Sq + i;
        const float* ur = u.data() + r * ns;
        const float inv_l = 1.0f / l[sz(r)];
        float* o = reinterpret_cast<float*>(out.row(b, hq, i));
        if (fast) {
          output_side(tv.inv.data() + sz(h * d) * sz(n), n, d, ur, inv_l, o);
          continue;
        }
        std::fill(orow.begin(), orow.end(), 0.0f);
        // Column c of head h's rows of F^-1: d contiguous floats (VqSideTransform::inv_cols).
        for (int c = 0; c < n; ++c) add_scaled(orow.data(), tv.inv_cols.data() + (sz(h) * sz(n) + sz(c)) * sz(d), ur[c], d);
        for (int e = 0; e < d; ++e) o[e] = orow[sz(e)] * inv_l;
      }
  }
  return true;
}

}  // namespace vq
