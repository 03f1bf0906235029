// AVX2 tile kernels on llama.cpp blocks and fp8 codes (peer_attention.hpp): each storage form only
// says how to decode 16 of its values (a Source of src/cache/attention_simd.hpp).
#include "peer_attention.hpp"

#ifdef VQ_ATTN_HAVE_AVX2
#include "../cache/attention_simd.hpp"
#include "veloxquant/peers/fp8_cache.hpp"

#define VQ_ATTN_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace vq::peer_attention {

namespace {

using ggml::block_q4_0;
using ggml::block_q4_1;
using ggml::block_q8_0;

template <class Block>
struct Blocks;

// Values e .. e+15 of a block: (int8) q * d.
template <>
struct Blocks<block_q8_0> {
  const block_q8_0* p;
  std::int64_t stride;
  VQ_ATTN_INLINE void load16(std::int64_t t, std::int64_t e, __m256& lo, __m256& hi) const {
    const block_q8_0& b = p[t * stride + e / ggml::QK];
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(b.d));
    const std::int8_t* c = b.qs + (e % ggml::QK);
    lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)))), d);
    hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8)))), d);
  }
  VQ_ATTN_INLINE __m256 load8(std::int64_t, std::int64_t) const { return _mm256_setzero_ps(); }  // never called: d % 32 == 0
  VQ_ATTN_INLINE float scalar(std::int64_t, std::int64_t) const { return 0.0f; }
};

// The 16 nibbles of values e .. e+15 (low nibbles for the block's first half, high for its second).
VQ_ATTN_INLINE __m128i nibbles(const std::uint8_t* qs, std::int64_t e) {
  __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  if (e % ggml::QK >= ggml::QK / 2) x = _mm_srli_epi16(x, 4);
  return _mm_and_si128(x, _mm_set1_epi8(0x0F));
}

// (q - 8) * d.
template <>
struct Blocks<block_q4_0> {
  const block_q4_0* p;
  std::int64_t stride;
  VQ_ATTN_INLINE void load16(std::int64_t t, std::int64_t e, __m256& lo, __m256& hi) const {
    const block_q4_0& b = p[t * stride + e / ggml::QK];
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(b.d));
    const __m128i x = _mm_sub_epi8(nibbles(b.qs, e), _mm_set1_epi8(8));
    lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x)), d);
    hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(x, 8))), d);
  }
  VQ_ATTN_INLINE __m256 load8(std::int64_t, std::int64_t) const { return _mm256_setzero_ps(); }
  VQ_ATTN_INLINE float scalar(std::int64_t, std::int64_t) const { return 0.0f; }
};

// q * d + m (two roundings, as the dequantizer; q * d is exact).
template <>
struct Blocks<block_q4_1> {
  const block_q4_1* p;
  std::int64_t stride;
  VQ_ATTN_INLINE void load16(std::int64_t t, std::int64_t e, __m256& lo, __m256& hi) const {
    const block_q4_1& b = p[t * stride + e / ggml::QK];
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(b.d)), m = _mm256_set1_ps(_cvtsh_ss(b.m));
    const __m128i x = nibbles(b.qs, e);
    lo = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x)), d), m);
    hi = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(x, 8))), d), m);
  }
  VQ_ATTN_INLINE __m256 load8(std::int64_t, std::int64_t) const { return _mm256_setzero_ps(); }
  VQ_ATTN_INLINE float scalar(std::int64_t, std::int64_t) const { return 0.0f; }
};

// e4m3 code c -> the float16 bits of c's value * 2^-8: sign to bit 15, exponent and mantissa
// (7 bits) to bits 13..7.
VQ_ATTN_INLINE __m256i fp8_to_f16_bits(__m256i c16) {
  return _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(c16, 8), _mm256_set1_epi16(static_cast<short>(0x8000))),
                         _mm256_and_si256(_mm256_slli_epi16(c16, 7), _mm256_set1_epi16(0x3F80)));
}

struct Fp8Rows {
  const std::uint8_t* p;
  std::int64_t stride;
  VQ_ATTN_INLINE void load16(std::int64_t t, std::int64_t e, __m256& lo, __m256& hi) const {
    const __m256i h = fp8_to_f16_bits(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + t * stride + e))));
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h)), hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
  VQ_ATTN_INLINE __m256 load8(std::int64_t t, std::int64_t e) const {
    const __m256i h = fp8_to_f16_bits(_mm256_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + t * stride + e))));
    return _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  }
  VQ_ATTN_INLINE float scalar(std::int64_t t, std::int64_t e) const { return fp8::e4m3_to_f32(p[t * stride + e]) * 0x1p-8f; }
};

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12, AVX-512 intrinsics (attention_simd.hpp)
// --- AVX-512: a whole block (32 values) per load32 ------------------------------------------------
#define VQ_ATTN_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))

template <class Block>
struct Blocks512;

VQ_ATTN512_INLINE __m512 block_scale(std::uint16_t d) { return _mm512_set1_ps(_cvtsh_ss(d)); }

// Tokens ahead of the one being decoded whose head row the kernels fetch into L1 (the Source's
// prefetch(t), called once per token by simd512::score and accumulate). The loop's next-tile
// prefetch (ggml_block_cache.cpp) brings every head's rows of the next tile towards the core, but
// token-major rows are 8 heads x 2 sides of work apart, and by the time a head reads its share the
// lines have mostly left L1 again: at 64k tokens the block loads stalled on them for over half of
// the step (perf annotate: the samples sat on the instructions after the four token loads).
// 32 tokens ahead is a few hundred ns of work at D = 128, long enough for a fill from L2/L3 or
// memory and short enough for the lines to stay in L1 (8 and 16 ahead gave less; with 256-token
// tiles, q4_0 at 64k on one thread 25.5 -> 11.9 ms: commit 0b6abd0).
constexpr std::int64_t kPrefetchTokens = 32;

// The head row (d / 32 blocks) of token t + kPrefetchTokens. Past the cache's last token the
// address is outside the array: prefetches never fault, and the integer arithmetic keeps the
// pointer arithmetic inside the language's rules.
template <class Block>
VQ_ATTN512_INLINE void prefetch_ahead(const Block* p, std::int64_t stride, std::int64_t t, std::int64_t row_bytes) {
  const std::uintptr_t a =
      reinterpret_cast<std::uintptr_t>(p) + static_cast<std::uintptr_t>((t + kPrefetchTokens) * stride) * sizeof(Block);
  for (std::int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(reinterpret_cast<const void*>(a + static_cast<std::uintptr_t>(o)));
  __builtin_prefetch(reinterpret_cast<const void*>(a + static_cast<std::uintptr_t>(row_bytes - 1)));
}

// (int8) q * d, as the AVX2 source.
template <>
struct Blocks512<block_q8_0> {
  const block_q8_0* p;
  std::int64_t stride;
  std::int64_t row_bytes;  // the head row's blocks: d / 32 * sizeof(Block)
  VQ_ATTN512_INLINE void prefetch(std::int64_t t) const { prefetch_ahead(p, stride, t, row_bytes); }
  VQ_ATTN512_INLINE void load32(std::int64_t t, std::int64_t e, __m512& lo, __m512& hi) const {
    const block_q8_0& b = p[t * stride + e / ggml::QK];
    const __m512 d = block_scale(b.d);
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs)))), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 16)))), d);
  }
};

// The nibbles looked up in a 16-entry table of the block's values (vpermps reads the low 4 bits
// of each index): the table is (i - 8) * d for q4_0 and i * d + m for q4_1, the dequantizer's
// own arithmetic per entry, so the values are the AVX2 source's (and the dequantizer's) exactly.
VQ_ATTN512_INLINE void nibbles32(const std::uint8_t* qs, __m512 table, __m512& lo, __m512& hi) {
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));  // byte j in lane j
  lo = _mm512_permutexvar_ps(x, table);                          // element j: byte j's low nibble
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), table);    // element j + 16: its high nibble
}

VQ_ATTN512_INLINE __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

template <>
struct Blocks512<block_q4_0> {
  const block_q4_0* p;
  std::int64_t stride;
  std::int64_t row_bytes;
  VQ_ATTN512_INLINE void prefetch(std::int64_t t) const { prefetch_ahead(p, stride, t, row_bytes); }
  VQ_ATTN512_INLINE void load32(std::int64_t t, std::int64_t e, __m512& lo, __m512& hi) const {
    const block_q4_0& b = p[t * stride + e / ggml::QK];
    nibbles32(b.qs, _mm512_mul_ps(_mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f)), block_scale(b.d)), lo, hi);
  }
};

template <>
struct Blocks512<block_q4_1> {
  const block_q4_1* p;
  std::int64_t stride;
  std::int64_t row_bytes;  // the head row's blocks: d / 32 * sizeof(Block)
  VQ_ATTN512_INLINE void prefetch(std::int64_t t) const { prefetch_ahead(p, stride, t, row_bytes); }
  VQ_ATTN512_INLINE void load32(std::int64_t t, std::int64_t e, __m512& lo, __m512& hi) const {
    const block_q4_1& b = p[t * stride + e / ggml::QK];
    nibbles32(b.qs, _mm512_add_ps(_mm512_mul_ps(iota16(), block_scale(b.d)), block_scale(b.m)), lo, hi);
  }
};

template <class Block>
VQ_ATTN_AVX512 void score_blocks_512(const Block* first, std::int64_t token_stride, std::int64_t n, std::int64_t d, const float* q,
                                     std::int64_t nq, float* s) {
  attn::simd512::score(Blocks512<Block>{first, token_stride, d / ggml::QK * static_cast<std::int64_t>(sizeof(Block))}, n, d, q, nq, s);
}

template <class Block>
VQ_ATTN_AVX512 void accumulate_blocks_512(const Block* first, std::int64_t token_stride, std::int64_t n, std::int64_t d, const float* w,
                                          std::int64_t nq, float* acc) {
  attn::simd512::accumulate(Blocks512<Block>{first, token_stride, d / ggml::QK * static_cast<std::int64_t>(sizeof(Block))}, n, d, w, nq, acc);
}

}  // namespace

template <class Block>
VQ_ATTN_AVX2 void score_blocks(const Block* first, std::int64_t token_stride, std::int64_t n, std::int64_t d, const float* q, std::int64_t nq,
                               float* s) {
  if (attn::avx512_enabled()) return score_blocks_512(first, token_stride, n, d, q, nq, s);
  attn::simd::score(Blocks<Block>{first, token_stride}, n, d, q, nq, s);
}

template <class Block>
VQ_ATTN_AVX2 void accumulate_blocks(const Block* first, std::int64_t token_stride, std::int64_t n, std::int64_t d, const float* w,
                                    std::int64_t nq, float* acc) {
  if (attn::avx512_enabled()) return accumulate_blocks_512(first, token_stride, n, d, w, nq, acc);
  attn::simd::accumulate(Blocks<Block>{first, token_stride}, n, d, w, nq, acc);
}

#define VQ_PEER_BLOCK_KERNELS(Block)                                                                                                      \
  template VQ_ATTN_AVX2 void score_blocks<Block>(const Block*, std::int64_t, std::int64_t, std::int64_t, const float*, std::int64_t, float*);      \
  template VQ_ATTN_AVX2 void accumulate_blocks<Block>(const Block*, std::int64_t, std::int64_t, std::int64_t, const float*, std::int64_t, float*)
VQ_PEER_BLOCK_KERNELS(block_q8_0);
VQ_PEER_BLOCK_KERNELS(block_q4_0);
VQ_PEER_BLOCK_KERNELS(block_q4_1);
#undef VQ_PEER_BLOCK_KERNELS

VQ_ATTN_AVX2 void score_fp8(const std::uint8_t* first, std::int64_t token_stride, std::int64_t n, std::int64_t d, const float* q,
                            std::int64_t nq, float* s) {
  attn::simd::score(Fp8Rows{first, token_stride}, n, d, q, nq, s);
}

VQ_ATTN_AVX2 void accumulate_fp8(const std::uint8_t* first, std::int64_t token_stride, std::int64_t n, std::int64_t d, const float* w,
                                 std::int64_t nq, float* acc) {
  attn::simd::accumulate(Fp8Rows{first, token_stride}, n, d, w, nq, acc);
}

#pragma GCC diagnostic pop

}  // namespace vq::peer_attention
#endif  // VQ_ATTN_HAVE_AVX2
