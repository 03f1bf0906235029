// AVX2 kernels of the vq codec's row-major regions (codec_kernels.hpp): per 8 lanes one gather from
// the columns' slot tables (decoder) or two from their packed encoder constants (encoder),
// each lane's table chosen by its column through a contiguous load of per-column offsets. Same
// words and codes as the scalar reference in codec.cpp: the 32 steps of a group are independent,
// and the words of a group are read (written) in ascending (descending) lane order.
#include <immintrin.h>

#include "codec_kernels.hpp"
#include "../entropy/rans_avx2_steps.hpp"
#include "veloxquant/vq/codec.hpp"

namespace vq::vq_codec_detail {

namespace {

using namespace rans_detail::avx2;

constexpr int kF = 12;  // the packed entry's field width

// Each lane with its column's precision: slot = x & (2^scale - 1), x >> scale.
VQ_AVX2 __m256i dec_step(__m256i x, __m256i& code, const RegionTables& t, std::size_t j) {
  const __m256i fmask = _mm256_set1_epi32((1 << kF) - 1);
  const __m256i scale = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.col_scale + j));
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i smask = _mm256_sub_epi32(_mm256_sllv_epi32(one, scale), one);
  const __m256i idx = _mm256_add_epi32(_mm256_and_si256(x, smask), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.dec_off + j)));
  const __m256i e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(t.dec_pool), idx, 4);
  code = _mm256_srai_epi32(e, 24);
  const __m256i freq = _mm256_and_si256(e, fmask);
  const __m256i bias = _mm256_and_si256(_mm256_srli_epi32(e, kF), fmask);
  return _mm256_add_epi32(_mm256_mullo_epi32(freq, _mm256_srlv_epi32(x, scale)), bias);
}

// rans_avx2_steps.hpp's enc_step_packed with a precision per lane: two 4-lane 64-bit gathers of the
// packed constants, renormalise while x >= freq << (31 - scale), then the reciprocal step.
VQ_AVX2 __m256i enc_step(__m256i x, __m256i idx, __m256i scale, const std::uint64_t* es, __m256i& bad, std::uint16_t*& ptr) {
  const EncEntries e = gather_enc_entries(idx, es, bad);
  const __m256i total = _mm256_sllv_epi32(_mm256_set1_epi32(1), scale);
  const __m256i xshift = _mm256_sub_epi32(_mm256_set1_epi32(31), scale);
  const __m256i x_max_m1 = _mm256_sub_epi32(_mm256_sllv_epi32(_mm256_sub_epi32(total, e.cmpl), xshift), _mm256_set1_epi32(1));
  return enc_core(x, x_max_m1, e.rcp, e.bias, e.cs, ptr);
}

// 16 int32 codes (two vectors, lane order) as 16 int16, in order.
VQ_AVX2 void store16(std::int16_t* out, __m256i a, __m256i b) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
}

}  // namespace

namespace {

// The kernels on V vectors of 8 lanes: a group of 8 V symbols (V = 4: 32 lanes, V = 8: 64 lanes).
template <int V>
__attribute__((target("avx2,popcnt"))) const std::uint8_t* decode_lanes(std::uint32_t* x, std::int16_t* codes, std::size_t& i, std::size_t n,
                                                                        std::size_t j, const RegionTables& t, const std::uint8_t* p,
                                                                        const std::uint8_t* end) {
  constexpr std::size_t G = 8 * V;
  __m256i X[V];
  for (int v = 0; v < V; ++v) X[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8 * v));
  const __m256i low = _mm256_set1_epi32(static_cast<int>(rans_detail::kL));
  const std::size_t step = G % t.m;  // columns a group advances, mod m
  while (n - i >= G && static_cast<std::size_t>(end - p) >= 2 * G) {
    __m256i C[V];
    for (int v = 0; v < V; ++v) X[v] = dec_step(X[v], C[v], t, j + 8 * v);
    for (int v = 0; v < V; ++v) X[v] = refill(X[v], p, low);
    for (int v = 0; v < V; v += 2) store16(codes + i + 8 * v, C[v], C[v + 1]);
    i += G;
    j += step;
    if (j >= t.m) j -= t.m;
  }
  for (int v = 0; v < V; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 8 * v), X[v]);
  return p;
}

template <int V>
__attribute__((target("avx2,popcnt"))) std::uint16_t* encode_lanes(std::uint32_t* x, const std::int16_t* codes, std::size_t i0, std::size_t i1,
                                                                   std::size_t j1, const RegionTables& t, std::uint16_t* ptr) {
  constexpr std::size_t G = 8 * V;
  __m256i X[V];
  for (int v = 0; v < V; ++v) X[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8 * v));
  const std::size_t step = G % t.m;
  __m256i bad = _mm256_setzero_si256();
  std::size_t j = j1;
  for (std::size_t g = i1; g > i0; g -= G) {
    j = j >= step ? j - step : j + t.m - step;  // the column of symbol g - G
    const std::int16_t* q = codes + g - G;
    // The highest lanes first: their words lie above those of the lanes below.
    for (int v = V - 1; v >= 0; --v) {
      const __m256i code = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 8 * v)));
      const __m256i idx = _mm256_add_epi32(code, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.enc_off + j + 8 * v)));
      X[v] = enc_step(X[v], idx, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.col_scale + j + 8 * v)), t.enc_pool, bad, ptr);
    }
  }
  for (int v = 0; v < V; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 8 * v), X[v]);
  return ptr;
}

}  // namespace

__attribute__((target("avx2,popcnt"))) const std::uint8_t* decode_region_avx2(std::uint32_t* x, std::int16_t* codes, std::size_t& i,
                                                                              std::size_t n, std::size_t j, const RegionTables& t,
                                                                              const std::uint8_t* p, const std::uint8_t* end) {
  return t.lanes == 64 ? decode_lanes<8>(x, codes, i, n, j, t, p, end) : decode_lanes<4>(x, codes, i, n, j, t, p, end);
}

__attribute__((target("avx2,popcnt"))) std::uint16_t* encode_region_avx2(std::uint32_t* x, const std::int16_t* codes, std::size_t i0,
                                                                         std::size_t i1, std::size_t j1, const RegionTables& t,
                                                                         std::uint16_t* ptr) {
  return t.lanes == 64 ? encode_lanes<8>(x, codes, i0, i1, j1, t, ptr) : encode_lanes<4>(x, codes, i0, i1, j1, t, ptr);
}

}  // namespace vq::vq_codec_detail
