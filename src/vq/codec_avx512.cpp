// AVX-512 kernels of the vq codec's row-major regions (codec_kernels.hpp): the AVX2 kernels'
// steps on 16 lanes a vector, two vectors a group of 32 lanes (versions 2-5) or four of 64 (version 6). Per 16 lanes one gather from the columns'
// slot tables (decoder) or two 8-lane 64-bit gathers of their packed encoder constants (encoder).
// The decoder's refill expands the next words into the lanes that need them (vpexpandd), the
// encoder's renormalisation compresses the emitted words of the lanes that need it (vpcompressd)
// and stores exactly those (a masked store). Same words and codes as the scalar reference in
// codec.cpp: the words of a group are read (written) in ascending (descending) lane order.
// Compiled for AVX-512 F/BW/VL through target attributes; called only where
// rans_avx512_available() (codec.cpp's dispatch).
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which -Wmaybe-uninitialized
// misreads (a known false positive of that compiler); nothing here reads an undefined value.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>

#include "codec_kernels.hpp"
#include "../entropy/rans_kernels.hpp"

#define VQ_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,popcnt")))
#define VQ_AVX512 VQ_AVX512_TARGET __attribute__((always_inline)) inline

namespace vq::vq_codec_detail {

namespace {

constexpr int kF = 12;  // the packed entry's field width

VQ_AVX512 __m512i load16(const std::int32_t* p) { return _mm512_loadu_si512(p); }

// 16 lanes, each with its column's precision: slot = x & (2^scale - 1), then
// x = freq * (x >> scale) + (slot - cum), code = the entry's top byte.
template <int S>
VQ_AVX512 __m512i dec_step(__m512i x, __m512i& code, const std::int32_t* col_scale, const std::int32_t* dec_off, const std::uint32_t* pool) {
  const __m512i fmask = _mm512_set1_epi32((1 << kF) - 1);
  __m512i slot, y;
  if constexpr (S > 0) {
    slot = _mm512_and_si512(x, _mm512_set1_epi32((1 << S) - 1));
    y = _mm512_srli_epi32(x, S);
  } else {
    const __m512i scale = load16(col_scale);
    const __m512i one = _mm512_set1_epi32(1);
    slot = _mm512_and_si512(x, _mm512_sub_epi32(_mm512_sllv_epi32(one, scale), one));
    y = _mm512_srlv_epi32(x, scale);
  }
  const __m512i e = _mm512_i32gather_epi32(_mm512_add_epi32(slot, load16(dec_off)), pool, 4);
  code = _mm512_srai_epi32(e, 24);
  const __m512i freq = _mm512_and_si512(e, fmask);
  const __m512i bias = _mm512_and_si512(_mm512_srli_epi32(e, kF), fmask);
  return _mm512_add_epi32(_mm512_mullo_epi32(freq, y), bias);
}

// 32 int32 codes (two vectors, lane order) stored as 32 int16 in order: vpackssdw packs them per
// 128-bit lane (a0-3 b0-3 a4-7 ...), one vpermq puts the quadwords in order (4 uops for 32 codes
// against 6 for two vpmovdw).
VQ_AVX512 void store32(std::int16_t* out, __m512i a, __m512i b) {
  const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
  _mm512_storeu_si512(out, _mm512_permutexvar_epi64(order, _mm512_packs_epi32(a, b)));
}

// Lanes with x < 2^15 take the next words in lane order: 16 words are loaded (the caller keeps
// 32 bytes readable), expanded into the needing lanes, shifted in; p moves by the words taken.
// (Measured and not kept: the V vectors' start offsets as popcounts of one 64-bit mask of all
// needs, independent of each other instead of p moved vector by vector: ~10 % slower.)
VQ_AVX512 __m512i refill(__m512i x, const std::uint8_t*& p, __m512i low) {
  const __mmask16 need = _mm512_cmplt_epu32_mask(x, low);
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  p += 2 * static_cast<unsigned>(__builtin_popcount(need));
  return _mm512_mask_or_epi32(x, need, _mm512_slli_epi32(x, 16), _mm512_maskz_expand_epi32(need, w));
}

// The encoder step of 16 lanes: the packed constants (rans_kernels.hpp's pack_enc) of es[idx],
// renormalise while x >= freq << (31 - scale), then x = x + bias + (mulhi(x, rcp) >> shift) * cmpl.
// S: the region's one precision, or 0 (each lane's from scale).
template <int S>
VQ_AVX512 __m512i enc_step(__m512i x, __m512i idx, const std::int32_t* col_scale, const std::uint64_t* es, std::uint16_t*& ptr) {
  const auto* base = reinterpret_cast<const long long*>(es);
  const __m512i lo8 = _mm512_i32gather_epi64(_mm512_castsi512_si256(idx), base, 8);        // lanes 0..7
  const __m512i hi8 = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(idx, 1), base, 8);  // lanes 8..15
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i rcp = _mm512_permutex2var_epi32(lo8, even, hi8);
  const __m512i hw = _mm512_permutex2var_epi32(lo8, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi8);
  const __m512i f13 = _mm512_set1_epi32(0x1fff);
  const __m512i bias = _mm512_and_si512(hw, f13);
  const __m512i cmpl = _mm512_and_si512(_mm512_srli_epi32(hw, 13), f13);
  const __m512i shift = _mm512_srli_epi32(hw, 26);
  __m512i x_max;
  if constexpr (S > 0) {
    x_max = _mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(1 << S), cmpl), 31 - S);
  } else {
    const __m512i scale = load16(col_scale);
    const __m512i total = _mm512_sllv_epi32(_mm512_set1_epi32(1), scale);
    x_max = _mm512_sllv_epi32(_mm512_sub_epi32(total, cmpl), _mm512_sub_epi32(_mm512_set1_epi32(31), scale));
  }
  // x_max may be 2^31: an unsigned compare.
  const __mmask16 need = _mm512_cmpge_epu32_mask(x, x_max);
  const unsigned cnt = static_cast<unsigned>(__builtin_popcount(need));
  // The emitted words in ascending lane order end at the old ptr: exactly cnt words are written.
  const __m256i words = _mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32(need, x));
  ptr -= cnt;
  _mm256_mask_storeu_epi16(ptr, static_cast<__mmask16>((1u << cnt) - 1), words);
  x = _mm512_mask_srli_epi32(x, need, x, 16);
  const __m512i qe = _mm512_srli_epi64(_mm512_mul_epu32(x, rcp), 32);
  const __m512i qo = _mm512_mul_epu32(_mm512_srli_epi64(x, 32), _mm512_srli_epi64(rcp, 32));
  const __m512i q = _mm512_srlv_epi32(_mm512_mask_blend_epi32(0xAAAA, qe, qo), shift);
  return _mm512_add_epi32(_mm512_add_epi32(x, bias), _mm512_mullo_epi32(q, cmpl));
}

}  // namespace

namespace {

// 32 residuals (two vectors, lane order) finished as store32 stores them: + ((k * prev + 4) >> 3)
// in 16-bit lanes (|k| <= 8, |prev| <= 255, |residual| <= 127: exact); bad collects the lanes
// outside +-255.
VQ_AVX512 void store32_pred(std::int16_t* out, __m512i a, __m512i b, const std::int16_t* prev, const std::int16_t* k, __mmask32& bad) {
  const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
  const __m512i res = _mm512_permutexvar_epi64(order, _mm512_packs_epi32(a, b));
  const __m512i pred = _mm512_srai_epi16(_mm512_add_epi16(_mm512_mullo_epi16(_mm512_loadu_si512(k), _mm512_loadu_si512(prev)), _mm512_set1_epi16(4)), 3);
  const __m512i v = _mm512_add_epi16(res, pred);
  bad |= _mm512_cmpgt_epi16_mask(v, _mm512_set1_epi16(255)) | _mm512_cmplt_epi16_mask(v, _mm512_set1_epi16(-255));
  _mm512_storeu_si512(out, v);
}

// The kernels on V vectors of 16 lanes: a group of 16 V symbols (V = 2: 32 lanes, V = 4: 64 lanes).
// P: a predicted side coded whole (PredictRows; groups row-aligned): each group finished as stored.
template <int V, int S, bool P = false>
VQ_AVX512_TARGET const std::uint8_t* decode_lanes(std::uint32_t* x, std::int16_t* codes, std::size_t& i, std::size_t n, std::size_t j,
                                                  const RegionTables& t, const std::uint8_t* p, const std::uint8_t* end,
                                                  PredictRows* pr = nullptr) {
  constexpr std::size_t G = 16 * V;
  __m512i X[V];
  for (int v = 0; v < V; ++v) X[v] = _mm512_loadu_si512(x + 16 * v);
  const __m512i low = _mm512_set1_epi32(static_cast<int>(rans_detail::kL));
  const std::size_t step = G % t.m, m = t.m;  // columns a group advances, mod m
  const std::int32_t *const col_scale = t.col_scale, *const dec_off = t.dec_off;  // (codes may alias t for the compiler)
  const std::uint32_t* const pool = t.dec_pool;
  // A group takes at most G words (2 G bytes); each refill loads 32 bytes from where it starts.
  // k: i in a register (through the reference, the compiler reloaded it after every store).
  std::size_t k = i;
  // P: the row's column (c), its token (tok) and the previous token's finished codes (prev; zero at token 0).
  std::size_t c = 0, tok = 0;
  const std::int16_t* prev = nullptr;
  const std::int16_t* kk = nullptr;
  __mmask32 bad = 0;
  if constexpr (P) {
    const std::size_t row = k / pr->n;
    c = k % pr->n;
    tok = row % pr->tokens;
    prev = tok == 0 ? pr->zero : codes + (row - 1) * pr->n;
    kk = pr->k;
  }
  while (n - k >= G && static_cast<std::size_t>(end - p) >= 2 * G) {
    __m512i C[V];
    for (int v = 0; v < V; ++v) X[v] = dec_step<S>(X[v], C[v], col_scale + j + 16 * v, dec_off + j + 16 * v, pool);
    for (int v = 0; v < V; ++v) X[v] = refill(X[v], p, low);
    if constexpr (P) {
      for (int v = 0; v < V; v += 2) store32_pred(codes + k + 16 * v, C[v], C[v + 1], prev + c + 16 * v, kk + c + 16 * v, bad);
      c += G;
      if (c == pr->n) {  // the next row: this one is its previous token's, unless a batch starts
        c = 0;
        prev = ++tok == pr->tokens ? (tok = 0, pr->zero) : codes + k + G - pr->n;
      }
    } else {
      for (int v = 0; v < V; v += 2) store32(codes + k + 16 * v, C[v], C[v + 1]);
    }
    k += G;
    j += step;
    if (j >= m) j -= m;
  }
  if constexpr (P) pr->bad |= bad != 0;
  i = k;
  for (int v = 0; v < V; ++v) _mm512_storeu_si512(x + 16 * v, X[v]);
  return p;
}

template <int V, int S>
VQ_AVX512_TARGET std::uint16_t* encode_lanes(std::uint32_t* x, const std::int16_t* codes, std::size_t i0, std::size_t i1, std::size_t j1,
                                             const RegionTables& t, std::uint16_t* ptr) {
  constexpr std::size_t G = 16 * V;
  __m512i X[V];
  for (int v = 0; v < V; ++v) X[v] = _mm512_loadu_si512(x + 16 * v);
  const std::size_t step = G % t.m;
  std::size_t j = j1;
  for (std::size_t g = i1; g > i0; g -= G) {
    j = j >= step ? j - step : j + t.m - step;  // the column of symbol g - G
    const std::int16_t* q = codes + g - G;
    // The highest lanes first: their words lie above those of the lanes below.
    for (int v = V - 1; v >= 0; --v) {
      const __m512i c = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16 * v)));
      X[v] = enc_step<S>(X[v], _mm512_add_epi32(c, load16(t.enc_off + j + 16 * v)), t.col_scale + j + 16 * v, t.enc_pool, ptr);
    }
  }
  for (int v = 0; v < V; ++v) _mm512_storeu_si512(x + 16 * v, X[v]);
  return ptr;
}

}  // namespace

VQ_AVX512_TARGET const std::uint8_t* decode_region_avx512(std::uint32_t* x, std::int16_t* codes, std::size_t& i, std::size_t n,
                                                          std::size_t j, const RegionTables& t, const std::uint8_t* p,
                                                          const std::uint8_t* end) {
  // The region's one precision as a constant where its columns share it (most regions: every
  // column of a 7B-shaped layer at 2 bits has a 10-bit table), else each lane's own.
  switch ((t.lanes == 64 ? 100 : 0) + t.uniform_scale) {
    case 110: return decode_lanes<4, 10>(x, codes, i, n, j, t, p, end);
    case 112: return decode_lanes<4, 12>(x, codes, i, n, j, t, p, end);
    case 10: return decode_lanes<2, 10>(x, codes, i, n, j, t, p, end);
    case 12: return decode_lanes<2, 12>(x, codes, i, n, j, t, p, end);
    default: return t.lanes == 64 ? decode_lanes<4, 0>(x, codes, i, n, j, t, p, end) : decode_lanes<2, 0>(x, codes, i, n, j, t, p, end);
  }
}

VQ_AVX512_TARGET const std::uint8_t* decode_region_pred_avx512(std::uint32_t* x, std::int16_t* codes, std::size_t& i, std::size_t n,
                                                               const RegionTables& t, PredictRows& pr, const std::uint8_t* p,
                                                               const std::uint8_t* end) {
  const std::size_t j = i % t.m;
  switch ((t.lanes == 64 ? 100 : 0) + t.uniform_scale) {
    case 110: return decode_lanes<4, 10, true>(x, codes, i, n, j, t, p, end, &pr);
    case 112: return decode_lanes<4, 12, true>(x, codes, i, n, j, t, p, end, &pr);
    case 10: return decode_lanes<2, 10, true>(x, codes, i, n, j, t, p, end, &pr);
    case 12: return decode_lanes<2, 12, true>(x, codes, i, n, j, t, p, end, &pr);
    default:
      return t.lanes == 64 ? decode_lanes<4, 0, true>(x, codes, i, n, j, t, p, end, &pr) : decode_lanes<2, 0, true>(x, codes, i, n, j, t, p, end, &pr);
  }
}

VQ_AVX512_TARGET std::uint16_t* encode_region_avx512(std::uint32_t* x, const std::int16_t* codes, std::size_t i0, std::size_t i1,
                                                     std::size_t j1, const RegionTables& t, std::uint16_t* ptr) {
  switch ((t.lanes == 64 ? 100 : 0) + t.uniform_scale) {
    case 110: return encode_lanes<4, 10>(x, codes, i0, i1, j1, t, ptr);
    case 112: return encode_lanes<4, 12>(x, codes, i0, i1, j1, t, ptr);
    case 10: return encode_lanes<2, 10>(x, codes, i0, i1, j1, t, ptr);
    case 12: return encode_lanes<2, 12>(x, codes, i0, i1, j1, t, ptr);
    default: return t.lanes == 64 ? encode_lanes<4, 0>(x, codes, i0, i1, j1, t, ptr) : encode_lanes<2, 0>(x, codes, i0, i1, j1, t, ptr);
  }
}

// The side pass (codec_kernels.hpp): 32 columns a vector, rows in order; the shifts by vpsravw.
VQ_AVX512_TARGET void side_hi_avx512(const std::int16_t* codes, const std::uint8_t* shift, std::size_t rows, std::size_t n,
                                     std::int16_t* hi, std::uint16_t* amax) {
  for (std::size_t c = 0; c < n; c += 32) {
    const __mmask32 tail = n - c >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (n - c)) - 1);
    _mm512_mask_storeu_epi16(amax + c, tail, _mm512_setzero_si512());
  }
  for (std::size_t r = 0; r < rows; ++r) {
    const std::int16_t* q = codes + r * n;
    std::int16_t* h = hi ? hi + r * n : nullptr;
    for (std::size_t c = 0; c < n; c += 32) {
      const __mmask32 tail = n - c >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (n - c)) - 1);
      __m512i v = _mm512_maskz_loadu_epi16(tail, q + c);
      if (h) {
        v = _mm512_srav_epi16(v, _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(tail, shift + c)));
        _mm512_mask_storeu_epi16(h + c, tail, v);
      }
      // |v| as unsigned: |-32768| reads 32768.
      const __m512i a = _mm512_max_epu16(_mm512_maskz_loadu_epi16(tail, amax + c), _mm512_abs_epi16(v));
      _mm512_mask_storeu_epi16(amax + c, tail, a);
    }
  }
}

namespace {

// A row's 32 codes from `row` as int8 (the narrow lanes fit; 0 past the tail), its wide lanes
// added to hist one by one (hoff from the row's first column).
VQ_AVX512 __m256i row_bytes(const std::int16_t* row, __mmask32 tail, __mmask32 wide, const std::int32_t* hoff, std::uint32_t* hist) {
  for (std::uint32_t m = wide; m; m &= m - 1) {
    const auto l = static_cast<std::size_t>(__builtin_ctz(m));
    ++hist[static_cast<std::size_t>(hoff[l] + row[l])];
  }
  return _mm512_cvtepi16_epi8(_mm512_maskz_loadu_epi16(tail, row));
}

// acc[0..15] += the 16 bytes of b.
VQ_AVX512 void add_bytes(std::uint32_t* acc, __m128i b) {
  _mm512_storeu_si512(acc, _mm512_add_epi32(_mm512_loadu_si512(acc), _mm512_cvtepu8_epi32(b)));
}

// The histograms of up to 32 columns from c over rows [r0, r1): the lanes of `lanes` (each of
// amax <= A) counted with byte compares, two rows a vector (row r in bytes 0..31, r + 1 in
// 32..63), in 8-bit counters flushed every 127 row pairs; those of `wide` one by one, row by row
// (so each row's 64 bytes are read once); tail: the columns that exist.
template <int A>
VQ_AVX512_TARGET void count_columns(const std::int16_t* hi, std::size_t stride, std::size_t c, std::size_t rows, __mmask32 tail, __mmask32 lanes,
                                    __mmask32 wide, const std::int32_t* hoff, const int* amax, std::uint32_t* hist) {
  std::uint32_t acc[2 * A + 1][64] = {};
  const __m512i one = _mm512_set1_epi8(1);
  const __mmask64 both = static_cast<__mmask64>(lanes) | static_cast<__mmask64>(lanes) << 32;
  for (std::size_t r0 = 0; r0 < rows;) {
    __m512i cnt[2 * A + 1];
    for (auto& v : cnt) v = _mm512_setzero_si512();
    const std::size_t r1 = std::min(rows, r0 + 2 * 127);
    for (std::size_t r = r0; r < r1; r += 2) {
      const bool pair = r + 1 < r1;
      // The rows are n codes apart: fetch ahead (prefetches past the end are harmless hints).
      _mm_prefetch(reinterpret_cast<const char*>(hi + (r + 16) * stride + c), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(hi + (r + 17) * stride + c), _MM_HINT_T0);
      const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(row_bytes(hi + r * stride + c, tail, wide, hoff + c, hist)),
                                             pair ? row_bytes(hi + (r + 1) * stride + c, tail, wide, hoff + c, hist) : _mm256_setzero_si256(), 1);
      const __mmask64 live = pair ? both : static_cast<__mmask64>(lanes);
#pragma GCC unroll 32
      for (int k = 0; k <= 2 * A; ++k)
        cnt[k] = _mm512_mask_add_epi8(cnt[k], _mm512_mask_cmpeq_epi8_mask(live, v, _mm512_set1_epi8(static_cast<char>(k - A))), cnt[k], one);
    }
    for (int k = 0; k <= 2 * A; ++k) {  // (the extract's index must be an immediate at every -O level)
      add_bytes(acc[k], _mm512_extracti32x4_epi32(cnt[k], 0));
      add_bytes(acc[k] + 16, _mm512_extracti32x4_epi32(cnt[k], 1));
      add_bytes(acc[k] + 32, _mm512_extracti32x4_epi32(cnt[k], 2));
      add_bytes(acc[k] + 48, _mm512_extracti32x4_epi32(cnt[k], 3));
    }
    r0 = r1;
  }
  for (std::size_t l = 0; l < 32; ++l) {
    if (!(lanes >> l & 1)) continue;
    const int a = amax[c + l];
    for (int v = -a; v <= a; ++v) hist[static_cast<std::size_t>(hoff[c + l] + v)] += acc[v + A][l] + acc[v + A][l + 32];
  }
}

// Columns up to this amax are counted with compares (2 amax + 1 counters), wider ones one by one.
constexpr int kNarrow = 8;

}  // namespace

VQ_AVX512_TARGET void side_hist_avx512(const std::int16_t* hi, std::size_t rows, std::size_t n, std::size_t stride, const int* amax, const std::int32_t* hoff,
                                       std::uint32_t* hist) {
  for (std::size_t c = 0; c < n; c += 32) {
    const std::size_t w = std::min<std::size_t>(32, n - c);
    const __mmask32 tail = w == 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << w) - 1);
    __mmask32 lanes = 0, wide = 0;
    int A = 0;
    for (std::size_t l = 0; l < w; ++l) {
      const int a = amax[c + l];
      if (a == 0) {  // every code 0: one bin
        hist[static_cast<std::size_t>(hoff[c + l])] += static_cast<std::uint32_t>(rows);
      } else if (a <= kNarrow) {
        lanes |= 1u << l;
        A = std::max(A, a);
      } else {
        wide |= 1u << l;
      }
    }
    if (lanes == 0 && wide == 0) continue;
    switch (A) {
#define VQ_COUNT(a) \
  case a:           \
    count_columns<a>(hi, stride, c, rows, tail, lanes, wide, hoff, amax, hist); \
    break;
      VQ_COUNT(0) VQ_COUNT(1) VQ_COUNT(2) VQ_COUNT(3) VQ_COUNT(4) VQ_COUNT(5) VQ_COUNT(6) VQ_COUNT(7) VQ_COUNT(8)
#undef VQ_COUNT
    }
  }
}

}  // namespace vq::vq_codec_detail
