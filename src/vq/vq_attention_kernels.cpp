// AVX2 attention tile kernels on VqKVCache's packed codes (vq_attention_kernels.hpp): a Source of
// src/cache/attention_simd.hpp that decodes a head's fields 8 at a time.
// Why one file of ~800 lines: the kernels are templates over the field width and the query rows,
// instantiated only by the width dispatchers at the end, and the AVX-512 ones are called from the
// AVX2 dispatch when the CPU has VBMI; apart, every (width, rows) pair would need an explicit
// instantiation across files. Each fast kernel is held to the scalar path (attention_kernels.hpp)
// by tests/vq/vq_attention_kernels_test.cpp.
#include "vq_attention_kernels.hpp"

#include <algorithm>
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


// --- Width-specialised loops ---------------------------------------------------------------------
// A head's groups are sorted by width (narrowest first, vq_cache.hpp "Packed layout"), so its full
// groups form a few runs of one width (synthetic Llama-shaped K: twelve groups of 3 bits, then 4,
// 5..7; V: sixteen of 4). The loops below walk a run with the width a compile-time constant:
// - w <= 3: the 8 fields of a group fit the low 24 bits of one 32-bit load; lane i shifts it by
//   i*w and vpermps looks the low 3 bits up in a table of the code as a float (escape 0 -> 0,
//   fields of w < 3 repeated so the neighbour's bit above is ignored): 2 ALU ops per 8 values.
// - w = 4: the same with two tables (low 3 bits) and bit 3 choosing between them (vblendvps).
// - w = 5..8, 16: fields8's arithmetic with constant shifts and masks.
// Each gives the exact code of fields8/codes8 (escape -> 0) as a float, and the loops add in the
// same order as the generic template's (groups in turn into one accumulator per row and token;
// tokens in turn per lane), so the results equal the generic path's bit for bit (tested).

struct Run {
  std::int32_t g0, g1, w;  // full groups [g0, g1) of width w
};

// The runs of equal width among the head's full groups (d / 8 of them), into `runs`.
void width_runs(const HeadFields& f, std::vector<Run>& runs) {
  runs.clear();
  const std::int64_t full = f.d / 8;
  for (std::int64_t g = 0; g < full; ++g) {
    const int w = f.group_width[g];
    if (!runs.empty() && runs.back().w == w && runs.back().g1 == g)
      ++runs.back().g1;
    else
      runs.push_back({static_cast<std::int32_t>(g), static_cast<std::int32_t>(g + 1), w});
  }
}

// --- Look-ahead ---------------------------------------------------------------------------------
// A head's codes are a slice of each token-major row (every KV head's codes of the token, one side),
// and a prefetch of whole rows (the next tile's, 8 heads x 2 sides of work ahead) finds them gone
// from L1 again by the time a head reads its slices. The score and value loops ask for the head's
// slice of token t + kAheadTokens while they decode t (the recipe of the q4_0 kernels,
// src/peers/peer_attention_avx2.cpp): at 64k tokens on one thread 21.4 -> 18.0 ms a step (16 and
// 64 ahead gave about the same; commit bc87d12). The score loop's look-ahead runs
// past the tile's end into the next tile's first tokens; the whole-row next-tile fetch that
// vq_cache.cpp used to add on top cost ~2-3 % of a step once the kernels got faster (be58a3d) and
// is gone. Prefetches change no arithmetic: the same bits.
constexpr std::int64_t kAheadTokens = 32;

struct Span {
  std::uint32_t lo = 0, len = 1;  // the head's bytes in a row
};

inline Span head_span(const HeadFields& f) {
  const std::int64_t groups = (f.d + 7) / 8;
  if (groups == 0) return {};
  std::uint32_t lo = f.group_byte[0], hi = 0;
  for (std::int64_t g = 0; g < groups; ++g) {
    lo = std::min(lo, f.group_byte[g]);
    hi = std::max(hi, f.group_byte[g] + f.group_width[g]);  // a group's 8 fields: w bytes at most
  }
  return {lo, hi - lo};
}

// Token t's slice (t past the cache's rows: an address outside them; prefetches never fault, and
// the arithmetic is on integers).
inline void prefetch_head(const HeadFields& f, Span s, std::int64_t t) {
  const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(f.rows) +
                           static_cast<std::uintptr_t>((f.t0 + t) * static_cast<std::int64_t>(f.row_bytes)) + s.lo;
  for (std::uint32_t o = 0; o < s.len; o += 64) __builtin_prefetch(reinterpret_cast<const void*>(a + o));
  __builtin_prefetch(reinterpret_cast<const void*>(a + s.len - 1));
}

template <int W>
VQ_ATTN_INLINE __m256i lane_shifts() {
  return _mm256_setr_epi32(0, W, 2 * W, 3 * W, 4 * W, 5 * W, 6 * W, 7 * W);
}

// Code of field f (w bits) as a float: 0 for the escape f = 0, else f - 2^(w-1).
constexpr float code_of(int f, int w) { return f == 0 ? 0.0f : static_cast<float>(f - (1 << (w - 1))); }

template <int W>
VQ_ATTN_INLINE __m256 code_table(int hi = 0) {
  // Entry i: the field of index i's low w bits (i + 8 * hi for w = 4).
  auto c = [&](int i) { return W == 4 ? code_of(i + 8 * hi, 4) : code_of(i & ((1 << W) - 1), W); };
  return _mm256_setr_ps(c(0), c(1), c(2), c(3), c(4), c(5), c(6), c(7));
}

// The 8 codes of the group at p (width W), as floats.
template <int W>
VQ_ATTN_INLINE __m256 decode8(const std::uint8_t* p) {
  if constexpr (W <= 4) {
    std::uint32_t x;
    std::memcpy(&x, p, 4);  // W <= 4 bytes of the group; the buffer has 8 bytes of slack
    const __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(x)), lane_shifts<W>());
    if constexpr (W <= 3) {
      return _mm256_permutevar8x32_ps(code_table<W>(), idx);
    } else {
      return _mm256_blendv_ps(_mm256_permutevar8x32_ps(code_table<4>(0), idx), _mm256_permutevar8x32_ps(code_table<4>(1), idx),
                              _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
    }
  } else {
    __m256i fl;
    if constexpr (W == 16) {
      fl = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    } else {
      std::uint64_t x;
      std::memcpy(&x, p, 8);
      const __m256i v = _mm256_set_m128i(_mm_set1_epi32(static_cast<int>(x >> (4 * W))), _mm_set1_epi32(static_cast<int>(x)));
      fl = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, W, 2 * W, 3 * W, 0, W, 2 * W, 3 * W)),
                            _mm256_set1_epi32((1 << W) - 1));
    }
    const __m256i code = _mm256_sub_epi32(fl, _mm256_set1_epi32(1 << (W - 1)));
    return _mm256_cvtepi32_ps(_mm256_andnot_si256(_mm256_cmpeq_epi32(fl, _mm256_setzero_si256()), code));
  }
}

// Scores: R query rows x T tokens (row pointers `tok`), groups [g0, g1) of width W, into acc[t * R + r].
template <int W, int R, int T>
VQ_ATTN_INLINE void score_run(const HeadFields& f, const std::uint8_t* const* tok, std::int64_t g0, std::int64_t g1, const float* q,
                              __m256* acc) {
  const std::int64_t d = f.d;
  for (std::int64_t g = g0; g < g1; ++g) {
    const std::uint32_t off = f.group_byte[g];
    __m256 x[T];
    for (int t = 0; t < T; ++t) x[t] = decode8<W>(tok[t] + off);
    for (int r = 0; r < R; ++r) {
      const __m256 qv = _mm256_loadu_ps(q + r * d + 8 * g);
      for (int t = 0; t < T; ++t) acc[t * R + r] = _mm256_fmadd_ps(qv, x[t], acc[t * R + r]);
    }
  }
}

#define VQ_WIDTH_CASES(CALL) \
  case 1: CALL(1); break;    \
  case 2: CALL(2); break;    \
  case 3: CALL(3); break;    \
  case 4: CALL(4); break;    \
  case 5: CALL(5); break;    \
  case 6: CALL(6); break;    \
  case 7: CALL(7); break;    \
  case 8: CALL(8); break;    \
  default: CALL(16); break;

template <int R, int T>
VQ_ATTN_INLINE void score_tokens_by_width(const HeadFields& f, const std::vector<Run>& runs, std::int64_t j, std::int64_t n,
                                          const float* q, float* s) {
  static_assert(R * T <= 8);
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  const std::uint8_t* tok[T];
  for (int t = 0; t < T; ++t) tok[t] = f.rows + static_cast<std::size_t>(f.t0 + j + t) * f.row_bytes;
  for (const Run& run : runs) {
#define VQ_SCORE_RUN(w) score_run<w, R, T>(f, tok, run.g0, run.g1, q, acc)
    switch (run.w) { VQ_WIDTH_CASES(VQ_SCORE_RUN) }
#undef VQ_SCORE_RUN
  }
  const std::int64_t d = f.d, e = 8 * (d / 8);
  alignas(32) float out[8];
  _mm256_store_ps(out, attn::simd::hsum8(acc));
  const Fields src{f};
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) {
      float v = out[t * R + r];
      for (std::int64_t p = e; p < d; ++p) v += q[r * d + p] * src.scalar(j + t, p);
      s[r * n + j + t] = v;
    }
}

template <int R>
VQ_ATTN_INLINE void score_rows_by_width(const HeadFields& f, const std::vector<Run>& runs, std::int64_t n, const float* q, float* s) {
  constexpr int T = 8 / R;
  std::int64_t j = 0;
  for (; j + T <= n; j += T) {
    score_tokens_by_width<R, T>(f, runs, j, n, q, s);
  }
  for (; j < n; ++j) {
    score_tokens_by_width<R, 1>(f, runs, j, n, q, s);
  }
}

// Values: acc[r * d + 8g + i] += sum_j w[r * n + j] * code_j[8g + i] for R rows, groups [g0, g1) of
// width W, two groups per pass over the tokens (each weight broadcast feeds 16 lanes).
template <int W, int R>
VQ_ATTN_INLINE void accumulate_run(const HeadFields& f, std::int64_t n, std::int64_t g0, std::int64_t g1, const float* w, float* acc) {
  const std::int64_t d = f.d;
  const std::uint8_t* first = f.rows + static_cast<std::size_t>(f.t0) * f.row_bytes;
  std::int64_t g = g0;
  for (; g + 2 <= g1; g += 2) {
    const std::uint32_t off0 = f.group_byte[g], off1 = f.group_byte[g + 1];
    __m256 a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = _mm256_loadu_ps(acc + r * d + 8 * g), a[r][1] = _mm256_loadu_ps(acc + r * d + 8 * g + 8);
    const std::uint8_t* p = first;
    for (std::int64_t j = 0; j < n; ++j, p += f.row_bytes) {
      const __m256 x0 = decode8<W>(p + off0), x1 = decode8<W>(p + off1);
      for (int r = 0; r < R; ++r) {
        const __m256 wv = _mm256_broadcast_ss(w + r * n + j);
        a[r][0] = _mm256_fmadd_ps(wv, x0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(wv, x1, a[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * d + 8 * g, a[r][0]), _mm256_storeu_ps(acc + r * d + 8 * g + 8, a[r][1]);
  }
  if (g < g1) {
    const std::uint32_t off = f.group_byte[g];
    __m256 a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm256_loadu_ps(acc + r * d + 8 * g);
    const std::uint8_t* p = first;
    for (std::int64_t j = 0; j < n; ++j, p += f.row_bytes) {
      const __m256 x = decode8<W>(p + off);
      for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + r * n + j), x, a[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * d + 8 * g, a[r]);
  }
}

// --- AVX-512 (VBMI) values for widths <= 4 --------------------------------------------------------
// Two full groups of one width W <= 4 are 16 fields in 2W <= 8 consecutive bytes (groups of a run
// are back to back), so one 64-bit broadcast holds them all: vpmultishiftqb moves field i's bits
// (at bit i*W) to the low byte of dword lane i, and vpermps (16 lanes: the low 4 bits index) looks
// the code up as a float in a 16-entry table (fields of W < 4 repeated, as in code_table, so the
// neighbour's bits above are ignored; escape 0 -> 0). 3 instructions per 16 codes against 3 to 6
// per 8 on AVX2. Each lane still adds its field's weighted codes token by token, from the same
// starting sum, with the same fused multiply-add: the result is the AVX2 loop's bit for bit.
#define VQ_ATTN512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")))

bool cpu_has_avx512_vbmi() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi");
  return has;
}

template <int W>
VQ_ATTN512 inline __m512i multishift_control() {
  // Byte 0 of qword k (dword lane 2k) takes the bits at 2k*W, byte 4 (lane 2k + 1) those at (2k+1)*W.
  alignas(64) std::uint8_t c[64] = {};
  for (int k = 0; k < 8; ++k) c[8 * k] = static_cast<std::uint8_t>(2 * k * W), c[8 * k + 4] = static_cast<std::uint8_t>((2 * k + 1) * W);
  return _mm512_load_si512(c);
}

template <int W>
VQ_ATTN512 inline __m512 code_table16() {
  alignas(64) float t[16];
  for (int i = 0; i < 16; ++i) t[i] = code_of(i & ((1 << W) - 1), W);
  return _mm512_load_ps(t);
}

// GCC 12's vpmultishiftqb / vpermps intrinsics start from _mm512_undefined_*, which -Wextra
// reports as maybe-uninitialized wherever they are inlined (a false positive).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <int W>
VQ_ATTN512 __attribute__((always_inline)) inline __m512 decode16(const std::uint8_t* p, __m512i ctrl, __m512 table) {
  std::uint64_t x;
  std::memcpy(&x, p, 8);  // 2W <= 8 bytes of the two groups; the buffer has 8 bytes of slack
  return _mm512_permutexvar_ps(_mm512_multishift_epi64_epi8(ctrl, _mm512_set1_epi64(static_cast<long long>(x))), table);
}

// One pass over the tile's tokens for groups g .. g + 2Z (+1 when H) of width W <= 4: Z zmm per row
// (two groups each, decode16), and with H one more group in a ymm (the low half of a decode16 at
// its byte: the 8 bytes read past it are the row's or the buffer's slack). Ahead: ask for token j +
// kAheadTokens's slice of the head while decoding token j (the first pass over the tile).
template <int W, int R, int Z, bool H, bool Ahead>
VQ_ATTN512 __attribute__((always_inline)) inline void accumulate_pass_512(const HeadFields& f, std::int64_t n, std::int64_t g,
                                                                          const float* w, float* acc, __m512i ctrl, __m512 table,
                                                                          Span span) {
  const std::int64_t d = f.d;
  const std::size_t rb = f.row_bytes;
  __m512 a[R][Z > 0 ? Z : 1];
  __m256 b[R];
  for (int r = 0; r < R; ++r) {
    for (int z = 0; z < Z; ++z) a[r][z] = _mm512_loadu_ps(acc + r * d + 8 * g + 16 * z);
    if constexpr (H) b[r] = _mm256_loadu_ps(acc + r * d + 8 * g + 16 * Z);
  }
  const std::uint8_t* p = f.rows + static_cast<std::size_t>(f.t0) * rb + f.group_byte[g];  // groups g, g + 1, .. at W bytes apart
  for (std::int64_t j = 0; j < n; ++j, p += rb) {
    if constexpr (Ahead) prefetch_head(f, span, j + kAheadTokens);
    __m512 x[Z > 0 ? Z : 1];
    for (int z = 0; z < Z; ++z) x[z] = decode16<W>(p + 2 * W * z, ctrl, table);
    __m256 xh = _mm256_setzero_ps();
    if constexpr (H) xh = _mm512_castps512_ps256(decode16<W>(p + 2 * W * Z, ctrl, table));
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_set1_ps(w[r * n + j]);
      for (int z = 0; z < Z; ++z) a[r][z] = _mm512_fmadd_ps(wv, x[z], a[r][z]);
      if constexpr (H) b[r] = _mm256_fmadd_ps(_mm512_castps512_ps256(wv), xh, b[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int z = 0; z < Z; ++z) _mm512_storeu_ps(acc + r * d + 8 * g + 16 * z, a[r][z]);
    if constexpr (H) _mm256_storeu_ps(acc + r * d + 8 * g + 16 * Z, b[r]);
  }
}

// accumulate_run for W <= 4: eight groups per pass over the tokens (four zmm per row: sixteen
// accumulators at R = 4; each weight broadcast feeds four multiply-adds, each pass's per-token
// work is shared by 64 lanes), then what is left (1..7 groups) in one more pass. Each lane still
// adds its field's weighted codes token by token, from the same starting sum, with the same fused
// multiply-add: the AVX2 loop's result bit for bit.
template <int W, int R>
VQ_ATTN512 void accumulate_run_512(const HeadFields& f, std::int64_t n, std::int64_t g0, std::int64_t g1, const float* w, float* acc,
                                   bool ahead) {
  static_assert(W <= 4);
  const Span span = head_span(f);
  const __m512i ctrl = multishift_control<W>();
  const __m512 table = code_table16<W>();
  std::int64_t g = g0;
#define VQ_PASS(Z, H)                                                                            \
  do {                                                                                           \
    if (ahead)                                                                                   \
      accumulate_pass_512<W, R, Z, H, true>(f, n, g, w, acc, ctrl, table, span);                 \
    else                                                                                         \
      accumulate_pass_512<W, R, Z, H, false>(f, n, g, w, acc, ctrl, table, span);                \
    ahead = false;                                                                               \
    g += 2 * (Z) + ((H) ? 1 : 0);                                                                \
  } while (0)
  for (; g + 8 <= g1;) VQ_PASS(4, false);
  switch (g1 - g) {
    case 7: VQ_PASS(3, true); break;
    case 6: VQ_PASS(3, false); break;
    case 5: VQ_PASS(2, true); break;
    case 4: VQ_PASS(2, false); break;
    case 3: VQ_PASS(1, true); break;
    case 2: VQ_PASS(1, false); break;
    case 1: VQ_PASS(0, true); break;
    default: break;
  }
#undef VQ_PASS
}

#pragma GCC diagnostic pop

template <int W, int R>
VQ_ATTN512 void accumulate_wide_512(const HeadFields& f, std::int64_t n, std::int64_t g0, std::int64_t g1, const float* w, float* acc);

template <int R>
VQ_ATTN_INLINE void accumulate_rows_by_width(const HeadFields& f, const std::vector<Run>& runs, std::int64_t n, const float* w, float* acc,
                                             bool wide, bool ahead = false) {
  // The look-ahead goes with the first pass of the longest run of widths <= 4 (a pass over one
  // group would spend as long asking for the lines as using them).
  const Run* ahead_run = nullptr;
  if (wide && ahead)
    for (const Run& run : runs)
      if (run.w <= 4 && (!ahead_run || run.g1 - run.g0 > ahead_run->g1 - ahead_run->g0)) ahead_run = &run;
  for (const Run& run : runs) {
    if (wide && run.w <= 4) {
#define VQ_ACC_RUN_512(width) accumulate_run_512<width, R>(f, n, run.g0, run.g1, w, acc, &run == ahead_run)
      switch (run.w) {
        case 1: VQ_ACC_RUN_512(1); break;
        case 2: VQ_ACC_RUN_512(2); break;
        case 3: VQ_ACC_RUN_512(3); break;
        default: VQ_ACC_RUN_512(4); break;
      }
#undef VQ_ACC_RUN_512
      continue;
    }
    if (wide && run.w > 4 && run.w <= 8) {
#define VQ_ACC_WIDE_512(width) accumulate_wide_512<width, R>(f, n, run.g0, run.g1, w, acc)
      switch (run.w) {
        case 5: VQ_ACC_WIDE_512(5); break;
        case 6: VQ_ACC_WIDE_512(6); break;
        case 7: VQ_ACC_WIDE_512(7); break;
        default: VQ_ACC_WIDE_512(8); break;
      }
#undef VQ_ACC_WIDE_512
      continue;
    }
#define VQ_ACC_RUN(width) accumulate_run<width, R>(f, n, run.g0, run.g1, w, acc)
    switch (run.w) { VQ_WIDTH_CASES(VQ_ACC_RUN) }
#undef VQ_ACC_RUN
  }
  const std::int64_t d = f.d;
  const Fields src{f};
  for (std::int64_t e = 8 * (d / 8); e < d; ++e)
    for (int r = 0; r < R; ++r) {
      float a = acc[r * d + e];
      for (std::int64_t j = 0; j < n; ++j) a += w[r * n + j] * src.scalar(j, e);
      acc[r * d + e] = a;
    }
}

// --- AVX-512 (VBMI) scores for four query rows -----------------------------------------------------
// Two tokens side by side in one zmm: lanes 0..7 hold token j's 8 codes of a group, lanes 8..15 token
// j + 1's, against the group's query values duplicated in both halves. For W <= 4 the two groups
// (W <= 4 bytes each) go in one 64-bit broadcast, token j's in the low dword: vpmultishiftqb moves
// field i's bits to the low byte of lane i (token j + 1's: lane 8 + i, from bit 32), and vpermps
// looks the code up in code_table16: 5 instructions per 16 codes and 4 fused multiply-adds per 16
// lanes for the four rows, against AVX2's 8 lanes at a time. Wider groups are AVX2's decode8 of
// each token, side by side. Four tokens a step (two zmm per row: eight accumulators). Each lane adds
// the same fused multiply-adds in the same order (the runs' groups in turn, from zero) as the AVX2
// loop's lane for that token and row, and the eight lanes are summed by hsum8: the AVX2 loop's
// scores bit for bit (tests/vq/vq_attention_kernels_test.cpp holds them against each other).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <int W>
VQ_ATTN512 inline __m512i pair_shift_control() {
  // Dword lane i sits in qword i / 2 at byte 4 (i % 2); every qword holds the broadcast pair.
  alignas(64) std::uint8_t c[64] = {};
  for (int i = 0; i < 16; ++i) c[4 * i] = static_cast<std::uint8_t>(i < 8 ? i * W : 32 + (i - 8) * W);
  return _mm512_load_si512(c);
}

// Entries 16 * half .. 16 * half + 15 of the 5-bit fields' codes, as floats.
template <int Half>
VQ_ATTN512 inline __m512 code_table32() {
  alignas(64) float t[16];
  for (int i = 0; i < 16; ++i) t[i] = code_of(i + 16 * Half, 5);
  return _mm512_load_ps(t);
}

// Group g's codes of tokens at p0 and p1 (group bytes), as 16 floats.
template <int W>
VQ_ATTN512 __attribute__((always_inline)) inline __m512 decode_pair(const std::uint8_t* p0, const std::uint8_t* p1, __m512i ctrl,
                                                                    __m512 table) {
  if constexpr (W <= 4) {
    std::int32_t x0, x1;
    std::memcpy(&x0, p0, 4);  // W <= 4 bytes of the group; the buffer has 8 bytes of slack
    std::memcpy(&x1, p1, 4);
    // Every qword x0 | x1 << 32: token j's dword broadcast, token j + 1's into the odd dwords
    // (broadcasts from memory: no scalar shifts, no move from a general register).
    const __m512i v = _mm512_mask_broadcastd_epi32(_mm512_set1_epi32(x0), 0xAAAA, _mm_cvtsi32_si128(x1));
    return _mm512_permutexvar_ps(_mm512_multishift_epi64_epi8(ctrl, v), table);
  } else if constexpr (W == 5) {
    // As below, but the field's low 5 bits index a 32-entry table of codes (vpermt2ps; escape 0 -> 0).
    long long x0, x1;
    std::memcpy(&x0, p0, 8);  // the buffer has 8 bytes of slack
    std::memcpy(&x1, p1, 8);
    const __m512i v = _mm512_mask_broadcastq_epi64(_mm512_set1_epi64(x0), 0xF0, _mm_cvtsi64_si128(x1));
    return _mm512_permutex2var_ps(code_table32<0>(), _mm512_multishift_epi64_epi8(ctrl, v), code_table32<1>());
  } else if constexpr (W <= 8) {
    // Each token's group (W <= 8 bytes) in four qwords, token j's low, j + 1's high; lane i's byte 0
    // takes the bits at (i % 8) * W, masked to W: the field; then decode8's code (escape -> 0).
    long long x0, x1;
    std::memcpy(&x0, p0, 8);  // the buffer has 8 bytes of slack
    std::memcpy(&x1, p1, 8);
    const __m512i v = _mm512_mask_broadcastq_epi64(_mm512_set1_epi64(x0), 0xF0, _mm_cvtsi64_si128(x1));
    const __m512i fl = _mm512_and_si512(_mm512_multishift_epi64_epi8(ctrl, v), _mm512_set1_epi32((1 << W) - 1));
    return _mm512_cvtepi32_ps(_mm512_maskz_sub_epi32(_mm512_test_epi32_mask(fl, fl), fl, _mm512_set1_epi32(1 << (W - 1))));
  } else {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(decode8<W>(p0))), _mm256_castps_pd(decode8<W>(p1)), 1));
  }
}

// decode_pair's control for 4 < W <= 8: dword lane i's byte 0 takes the bits at (i % 8) * W of its qword.
template <int W>
VQ_ATTN512 inline __m512i wide_pair_control() {
  alignas(64) std::uint8_t c[64] = {};
  for (int i = 0; i < 16; ++i) c[4 * i] = static_cast<std::uint8_t>((i % 8) * W);
  return _mm512_load_si512(c);
}

// accumulate_run for 4 < W <= 8 (where it decodes 8 fields of one token in ~14 instructions): each
// group in turn, two tokens decoded side by side in one zmm (decode_pair), then each token's half
// added into the rows' eight-lane sums, token j before j + 1: the AVX2 loop's sums bit for bit.
// (V's last group of a head is often 5 bits wide: ~6 % of a 1k step on the AVX2 decode.)
template <int W, int R>
VQ_ATTN512 void accumulate_wide_512(const HeadFields& f, std::int64_t n, std::int64_t g0, std::int64_t g1, const float* w, float* acc) {
  static_assert(W > 4 && W <= 8);
  const std::int64_t d = f.d;
  const std::size_t rb = f.row_bytes;
  const std::uint8_t* first = f.rows + static_cast<std::size_t>(f.t0) * rb;
  const __m512i ctrl = wide_pair_control<W>();
  for (std::int64_t g = g0; g < g1; ++g) {
    __m256 a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm256_loadu_ps(acc + r * d + 8 * g);
    const std::uint8_t* p = first + f.group_byte[g];
    std::int64_t j = 0;
    for (; j + 2 <= n; j += 2, p += 2 * rb) {
      const __m512 x = decode_pair<W>(p, p + rb, ctrl, _mm512_setzero_ps());
      const __m256 x0 = _mm512_castps512_ps256(x), x1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
      for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + r * n + j), x0, a[r]);
      for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + r * n + j + 1), x1, a[r]);
    }
    if (j < n) {
      const __m256 x = decode8<W>(p);
      for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + r * n + j), x, a[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * d + 8 * g, a[r]);
  }
}

// acc[p * 4 + r] += row r's query . the codes of tokens tok[2p] (low half) and tok[2p + 1] (high),
// groups [g0, g1) of width W, for P pairs of tokens (each query vector loaded feeds 2P fused
// multiply-adds).
template <int W, int P>
VQ_ATTN512 __attribute__((always_inline)) inline void score_run_512(const HeadFields& f, const std::uint8_t* const* tok, std::int64_t g0,
                                                                    std::int64_t g1, const float* q, __m512* acc) {
  const std::int64_t d = f.d;
  __m512i ctrl = _mm512_setzero_si512();
  __m512 table = _mm512_setzero_ps();
  if constexpr (W <= 4) ctrl = pair_shift_control<W>(), table = code_table16<W>();
  if constexpr (W > 4 && W <= 8) ctrl = wide_pair_control<W>();
  for (std::int64_t g = g0; g < g1; ++g) {
    const std::uint32_t off = f.group_byte[g];
    __m512 x[P];
    for (int p = 0; p < P; ++p) x[p] = decode_pair<W>(tok[2 * p] + off, tok[2 * p + 1] + off, ctrl, table);
    for (int r = 0; r < 4; ++r) {
      const __m512 qv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(q + r * d + 8 * g))));
      for (int p = 0; p < P; ++p) acc[4 * p + r] = _mm512_fmadd_ps(qv, x[p], acc[4 * p + r]);
    }
  }
}
// hadd_ps of two zmm per 128-bit lane: [a0 + a1, a2 + a3, b0 + b1, b2 + b3] (AVX2's vhaddps, on four lanes).
VQ_ATTN512 __attribute__((always_inline)) inline __m512 hadd512(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The 32 scores of an eight-token step (acc[4p + r]: row r, tokens 2p (low half) and 2p + 1 (high))
// into s[r * n + t], t = 0..7: each token's and row's eight lanes summed as hsum8 sums them,
// ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), the same bits, but in zmm for all 32 at once
// (hsum8 per pair of tokens, its extracts and 32 scalar stores were a third of the kernel's time).
VQ_ATTN512 __attribute__((always_inline)) inline void sum_lanes_512(const __m512* acc, float* s, std::int64_t n) {
  __m512 v[4];
  for (int r = 0; r < 4; ++r)  // 128-bit lane k of v[r]: the quads' sums of lane k of acc[r], acc[4 + r], acc[8 + r], acc[12 + r]
    v[r] = hadd512(hadd512(acc[r], acc[4 + r]), hadd512(acc[8 + r], acc[12 + r]));
  // Lanes 0 and 2 hold x0..x3 of tokens (0, 2, 4, 6) and (1, 3, 5, 7), lanes 1 and 3 their x4..x7.
  const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  for (int r = 0; r < 4; r += 2) {
    const __m512 lo = _mm512_shuffle_f32x4(v[r], v[r + 1], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 hi = _mm512_shuffle_f32x4(v[r], v[r + 1], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512 sum = _mm512_permutexvar_ps(order, _mm512_add_ps(lo, hi));  // rows r, r + 1: tokens 0..7
    _mm256_storeu_ps(s + r * n, _mm512_castps512_ps256(sum));
    _mm256_storeu_ps(s + (r + 1) * n, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sum), 1)));
  }
}

// Scores of four query rows against tokens j .. j + 2P - 1 (score_tokens_by_width<4, 2> P times, same bits).
template <int P>
VQ_ATTN512 void score_tokens_512(const HeadFields& f, const std::vector<Run>& runs, std::int64_t j, std::int64_t n, const float* q,
                                 float* s) {
  __m512 acc[4 * P];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const std::uint8_t* tok[2 * P];
  for (int t = 0; t < 2 * P; ++t) tok[t] = f.rows + static_cast<std::size_t>(f.t0 + j + t) * f.row_bytes;
  for (const Run& run : runs) {
#define VQ_SCORE_RUN_512(w) score_run_512<w, P>(f, tok, run.g0, run.g1, q, acc)
    switch (run.w) { VQ_WIDTH_CASES(VQ_SCORE_RUN_512) }
#undef VQ_SCORE_RUN_512
  }
  const std::int64_t d = f.d, e = 8 * (d / 8);
  const Fields src{f};
  if constexpr (P == 4) {
    sum_lanes_512(acc, s + j, n);
    if (e < d)  // the last d % 8 fields, one by one after the groups' sum (as the AVX2 loop adds them)
      for (int t = 0; t < 8; ++t)
        for (int r = 0; r < 4; ++r) {
          float v = s[r * n + j + t];
          for (std::int64_t x = e; x < d; ++x) v += q[r * d + x] * src.scalar(j + t, x);
          s[r * n + j + t] = v;
        }
    return;
  }
  for (int p = 0; p < P; ++p) {
    __m256 lanes[8];  // AVX2's acc[t * 4 + r] for tokens 2p (t = 0) and 2p + 1 (t = 1)
    for (int r = 0; r < 4; ++r) {
      lanes[r] = _mm512_castps512_ps256(acc[4 * p + r]);
      lanes[4 + r] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[4 * p + r]), 1));
    }
    alignas(32) float out[8];
    _mm256_store_ps(out, attn::simd::hsum8(lanes));
    for (int t = 0; t < 2; ++t)
      for (int r = 0; r < 4; ++r) {
        const std::int64_t jt = j + 2 * p + t;
        float v = out[t * 4 + r];
        for (std::int64_t x = e; x < d; ++x) v += q[r * d + x] * src.scalar(jt, x);
        s[r * n + jt] = v;
      }
  }
}

VQ_ATTN512 void score_rows_512(const HeadFields& f, const std::vector<Run>& runs, std::int64_t n, const float* q, float* s, bool ahead) {
  const Span span = head_span(f);
  constexpr std::int64_t k = kAheadTokens;
  std::int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    if (ahead)
      for (int t = 0; t < 8; ++t) prefetch_head(f, span, j + k + t);
    score_tokens_512<4>(f, runs, j, n, q, s);
  }
  for (; j + 4 <= n; j += 4) {
    score_tokens_512<2>(f, runs, j, n, q, s);
  }
  for (; j + 2 <= n; j += 2) score_tokens_by_width<4, 2>(f, runs, j, n, q, s);
  for (; j < n; ++j) score_tokens_by_width<4, 1>(f, runs, j, n, q, s);
}
#pragma GCC diagnostic pop

// s = the tile's codes scored (float32 input; before the step, c and the escapes).
__attribute__((target("avx2,fma,f16c"))) void score_codes(const HeadFields& f, std::int64_t n, const float* q, std::int64_t nq, float* s,
                                                          Decode how) {
  const std::int64_t d = f.d;
  if (how == Decode::kGeneric) return attn::simd::score(Fields{f}, n, d, q, nq, s);
  thread_local std::vector<Run> runs;
  width_runs(f, runs);
  const bool wide = how == Decode::kByWidth && cpu_has_avx512_vbmi() && attn::avx512_enabled();
  std::int64_t r = 0;
  for (; r + 4 <= nq; r += 4) {
    if (wide)
      score_rows_512(f, runs, n, q + r * d, s + r * n, r == 0);
    else
      score_rows_by_width<4>(f, runs, n, q + r * d, s + r * n);
  }
  switch (nq - r) {
    case 3: score_rows_by_width<3>(f, runs, n, q + r * d, s + r * n); break;
    case 2: score_rows_by_width<2>(f, runs, n, q + r * d, s + r * n); break;
    case 1: score_rows_by_width<1>(f, runs, n, q + r * d, s + r * n); break;
    default: break;
  }
}

__attribute__((target("avx2,fma,f16c"))) void accumulate_codes(const HeadFields& f, std::int64_t n, const float* w, std::int64_t nq,
                                                               float* acc, Decode how) {
  const std::int64_t d = f.d;
  if (how == Decode::kGeneric) return attn::simd::accumulate(Fields{f}, n, d, w, nq, acc);
  const bool wide = how == Decode::kByWidth && cpu_has_avx512_vbmi() && attn::avx512_enabled();
  thread_local std::vector<Run> runs;
  width_runs(f, runs);
  std::int64_t r = 0;
  for (; r + 4 <= nq; r += 4) accumulate_rows_by_width<4>(f, runs, n, w + r * n, acc + r * d, wide, wide && r == 0);
  switch (nq - r) {
    case 3: accumulate_rows_by_width<3>(f, runs, n, w + r * n, acc + r * d, wide); break;
    case 2: accumulate_rows_by_width<2>(f, runs, n, w + r * n, acc + r * d, wide); break;
    case 1: accumulate_rows_by_width<1>(f, runs, n, w + r * n, acc + r * d, wide); break;
    default: break;
  }
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

// sum_j w[j], in four eight-lane partial sums (a serial sum of a 256-token tile's weights took as
// long as the tile's value loop): the same order on every CPU path.
__attribute__((target("avx2,fma,f16c"))) float sum_weights(const float* w, std::int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  std::int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(w + j));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(w + j + 8));
    a2 = _mm256_add_ps(a2, _mm256_loadu_ps(w + j + 16));
    a3 = _mm256_add_ps(a3, _mm256_loadu_ps(w + j + 24));
  }
  for (; j + 8 <= n; j += 8) a0 = _mm256_add_ps(a0, _mm256_loadu_ps(w + j));
  alignas(32) float l[8];
  _mm256_store_ps(l, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  float s = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
  for (; j < n; ++j) s += w[j];
  return s;
}

__attribute__((target("avx2,fma,f16c"))) void score(const HeadFields& f, std::int64_t n, const float* q, std::int64_t nq, float* s,
                                                    Decode how) {
  const std::int64_t d = f.d;
  if (f.round_f16) {
    attn::simd::score(Values16{f}, n, d, q, nq, s);
  } else {
    score_codes(f, n, q, nq, s, how);
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
                                                         const std::int32_t* order, Decode how) {
  const std::int64_t d = f.d;
  thread_local std::vector<float> sum;
  sum.assign(static_cast<std::size_t>(nq * d), 0.0f);
  if (f.round_f16) {
    attn::simd::accumulate(Values16{f}, n, d, w, nq, sum.data());
  } else {
    accumulate_codes(f, n, w, nq, sum.data(), how);
    for (std::int64_t r = 0; r < nq; ++r) {
      const float ws = sum_weights(w + r * n, n);
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
void score(const HeadFields&, std::int64_t, const float*, std::int64_t, float*, Decode) {}
void accumulate(const HeadFields&, std::int64_t, const float*, std::int64_t, float*, const std::int32_t*, Decode) {}

#endif

}  // namespace vq::vq_attention
