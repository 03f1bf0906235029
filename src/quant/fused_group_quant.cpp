#include "veloxquant/quant/fused_group_quant.hpp"
#include "veloxquant/core/cpu_features.hpp"

#include <cstring>

#include "veloxquant/quant/group_quant.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#define VQ_HAVE_AVX2_KERNEL 1
#endif

namespace vq {

QuantStatus quantize_group_rows_portable(const std::byte* const* rows, std::byte* const* out_rows, int n_rows, int dim, int bits,
                                         DType dtype, std::uint8_t* codes, float* scale, float* minv, FusedGroupScratch& scratch) {
  const auto d = static_cast<std::size_t>(dim);
  scratch.in.resize(static_cast<std::size_t>(n_rows) * d);
  scratch.out.resize(scratch.in.size());
  for (int r = 0; r < n_rows; ++r) to_f32(rows[r], dtype, scratch.in.data() + static_cast<std::size_t>(r) * d, d);
  if (!all_finite(scratch.in.data(), scratch.in.size())) return QuantStatus::NonFinite;
  if (!quantize_group(scratch.in.data(), n_rows, dim, bits, codes, scale, minv)) return QuantStatus::RangeOverflow;
  dequant_group(codes, n_rows, dim, scale, minv, scratch.out.data());
  for (int r = 0; r < n_rows; ++r) from_f32(scratch.out.data() + static_cast<std::size_t>(r) * d, out_rows[r], dtype, d);
  return QuantStatus::Ok;
}

#ifdef VQ_HAVE_AVX2_KERNEL
namespace {

template <DType DT>
__attribute__((target("avx2,f16c"))) inline __m256 load8(const std::byte* p) {
  if constexpr (DT == DType::F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }
}

template <DType DT>
__attribute__((target("avx2,f16c"))) inline void store8(std::byte* p, __m256 v) {
  if constexpr (DT == DType::F16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    _mm256_storeu_ps(reinterpret_cast<float*>(p), v);
  }
}

// Every pass walks rows in order, all channels of a row before the next row, so the input, the
// dense output and the codes are each one sequential stream (walking a 32-channel column block down
// the rows touched one line in four at a 256-byte stride, which the hardware prefetcher followed
// badly). A group's running min and max live in its minv and scale (L1-resident); scale is then
// overwritten with the step in place.
template <DType DT>
__attribute__((target("avx2,f16c"), always_inline)) inline void min_max_row(const std::byte* row, int dim8, bool first, float* mn,
                                                                            float* mx, __m256& nonfinite) {
  constexpr std::size_t esz = DT == DType::F16 ? 2 : 4;
  for (int c = 0; c < dim8; c += 8) {
    const __m256 x = load8<DT>(row + static_cast<std::size_t>(c) * esz);
    nonfinite = _mm256_or_ps(nonfinite, _mm256_sub_ps(x, x));  // x - x: +0 for finite x, NaN for NaN and Inf
    if (first) {
      _mm256_storeu_ps(mn + c, x);
      _mm256_storeu_ps(mx + c, x);
    } else {
      _mm256_storeu_ps(mn + c, _mm256_min_ps(x, _mm256_loadu_ps(mn + c)));  // same operand order as the portable x < mn ? x : mn
      _mm256_storeu_ps(mx + c, _mm256_max_ps(x, _mm256_loadu_ps(mx + c)));
    }
  }
}

// Turns the group's max (stored in scale) into its step; returns false when a step overflows.
__attribute__((target("avx2,f16c"))) inline bool steps_from_range(float* scale, const float* mn, int dim8, __m256 levels) {
  const __m256 min_scale = _mm256_set1_ps(kMinScale);
  const __m256 fmax = _mm256_set1_ps(3.4028234e38f);
  int overflow = 0;
  for (int c = 0; c < dim8; c += 8) {
    const __m256 s = _mm256_max_ps(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(scale + c), _mm256_loadu_ps(mn + c)), levels),
                                   min_scale);  // s > 1e-8 ? s : 1e-8
    overflow |= _mm256_movemask_ps(_mm256_cmp_ps(s, fmax, _CMP_GT_OQ));
    _mm256_storeu_ps(scale + c, s);
  }
  return overflow == 0;
}

// v = (x - min) / scale is >= +0 (x >= min exactly, scale > 0), so the reference's clip at 0 is
// a no-op and is skipped; rounding to nearest-even (roundps) equals rint for 0 <= v < 2^23, and
// the rounded, clamped v is the code as a float, so the reconstruction uses it directly.
// (Multiplying by 1 / scale with an exact fallback near halves was measured slower: the division
// is not what bounds this kernel, memory is.)
template <DType DT>
__attribute__((target("avx2,f16c"), always_inline)) inline __m256i quant8(const std::byte* in, std::byte* out, const float* mn,
                                                                         const float* s, __m256 levels) {
  const __m256 m = _mm256_loadu_ps(mn), st = _mm256_loadu_ps(s);
  __m256 v = _mm256_div_ps(_mm256_sub_ps(load8<DT>(in), m), st);
  v = _mm256_min_ps(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), levels);
  store8<DT>(out, _mm256_add_ps(_mm256_mul_ps(v, st), m));
  return _mm256_cvttps_epi32(v);
}

template <DType DT>
__attribute__((target("avx2,f16c"), always_inline)) inline void quant_row(const std::byte* in, std::byte* out, std::uint8_t* q, int dim8,
                                                                          const float* mn, const float* s, __m256 levels) {
  constexpr std::size_t esz = DT == DType::F16 ? 2 : 4;
  int c = 0;
  for (; c + 32 <= dim8; c += 32) {  // 32 codes in one store: pack, then undo the per-lane interleave
    __m256i q32[4];
    for (int w = 0; w < 4; ++w) {
      const std::size_t o = static_cast<std::size_t>(c + 8 * w) * esz;
      q32[w] = quant8<DT>(in + o, out + o, mn + c + 8 * w, s + c + 8 * w, levels);
    }
    const __m256i b = _mm256_packus_epi16(_mm256_packs_epi32(q32[0], q32[1]), _mm256_packs_epi32(q32[2], q32[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + c), _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
  for (; c < dim8; c += 8) {
    const std::size_t o = static_cast<std::size_t>(c) * esz;
    const __m256i q32 = quant8<DT>(in + o, out + o, mn + c, s + c, levels);
    const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q32), _mm256_extracti128_si256(q32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + c), _mm_packus_epi16(q16, q16));
  }
}

// Channels [dim8, dim) of one group (dim % 8 of them): the portable formulas, one channel at a time.
QuantStatus tail_channels(const std::byte* const* rows, std::byte* const* out_rows, int n_rows, int dim, int dim8, int bits, DType dt,
                          std::uint8_t* codes, float* scale, float* minv) {
  const std::size_t esz = dtype_size(dt);
  const int tail = dim - dim8;
  float s[8], m[8];
  std::vector<float> col(static_cast<std::size_t>(n_rows) * tail), out(col.size());
  std::vector<std::uint8_t> qc(col.size());
  for (int r = 0; r < n_rows; ++r) to_f32(rows[r] + static_cast<std::size_t>(dim8) * esz, dt, col.data() + r * tail, static_cast<std::size_t>(tail));
  if (!all_finite(col.data(), col.size())) return QuantStatus::NonFinite;
  if (!quantize_group(col.data(), n_rows, tail, bits, qc.data(), s, m)) return QuantStatus::RangeOverflow;
  dequant_group(qc.data(), n_rows, tail, s, m, out.data());
  for (int k = 0; k < tail; ++k) {
    scale[dim8 + k] = s[k];
    minv[dim8 + k] = m[k];
  }
  for (int r = 0; r < n_rows; ++r) {
    std::memcpy(codes + static_cast<std::size_t>(r) * dim + dim8, qc.data() + r * tail, static_cast<std::size_t>(tail));
    from_f32(out.data() + r * tail, out_rows[r] + static_cast<std::size_t>(dim8) * esz, dt, static_cast<std::size_t>(tail));
  }
  return QuantStatus::Ok;
}

// n_groups consecutive groups of group_rows rows each. Group g + 1's min/max pass runs row by row
// inside group g's quantizing pass, so the loads of the next group's input (from memory) overlap the
// stores of this group's output instead of each pass waiting on one stream alone. Each group's
// status is checked in order (non-finite, overflow, then the tail channels'), so the first failing
// group decides, as when groups are quantized one call at a time.
template <DType DT>
__attribute__((target("avx2,f16c"))) QuantStatus kernel(const std::byte* const* rows, std::byte* const* out_rows, int n_groups, int group_rows,
                                                 int dim, int bits, std::uint8_t* codes, float* scale, float* minv) {
  const int dim8 = dim & ~7;
  const __m256 levels = _mm256_set1_ps(static_cast<float>((1 << bits) - 1));
  const auto d = static_cast<std::size_t>(dim);
  __m256 nonfinite = _mm256_setzero_ps();
  for (int r = 0; r < group_rows; ++r) min_max_row<DT>(rows[r], dim8, r == 0, minv, scale, nonfinite);
  for (int g = 0; g < n_groups; ++g) {
    const std::size_t row0 = static_cast<std::size_t>(g) * static_cast<std::size_t>(group_rows);
    float* const sc = scale + static_cast<std::size_t>(g) * d;
    float* const mn = minv + static_cast<std::size_t>(g) * d;
    if (!_mm256_testz_si256(_mm256_castps_si256(nonfinite), _mm256_castps_si256(nonfinite))) return QuantStatus::NonFinite;
    if (!steps_from_range(sc, mn, dim8, levels)) return QuantStatus::RangeOverflow;
    if (dim8 < dim) {
      const QuantStatus st = tail_channels(rows + row0, out_rows + row0, group_rows, dim, dim8, bits, DT, codes + row0 * d, sc, mn);
      if (st != QuantStatus::Ok) return st;
    }
    nonfinite = _mm256_setzero_ps();
    const bool next = g + 1 < n_groups;
    for (int r = 0; r < group_rows; ++r) {
      const std::size_t i = row0 + static_cast<std::size_t>(r);
      quant_row<DT>(rows[i], out_rows[i], codes + i * d, dim8, mn, sc, levels);
      if (next) min_max_row<DT>(rows[i + static_cast<std::size_t>(group_rows)], dim8, r == 0, mn + d, sc + d, nonfinite);
    }
  }
  return QuantStatus::Ok;
}

bool cpu_ok() {
  static const bool ok = __builtin_cpu_supports("avx2") && cpu_has_f16c_avx();
  return ok;
}

}  // namespace
#endif

bool fused_quant_has_fast_path(DType dtype) {
#ifdef VQ_HAVE_AVX2_KERNEL
  return cpu_ok() && (dtype == DType::F16 || dtype == DType::F32);
#else
  (void)dtype;
  return false;
#endif
}

QuantStatus quantize_group_rows(const std::byte* const* rows, std::byte* const* out_rows, int n_rows, int dim, int bits, DType dtype,
                         std::uint8_t* codes, float* scale, float* minv, FusedGroupScratch& scratch) {
  return quantize_groups(rows, out_rows, 1, n_rows, dim, bits, dtype, codes, scale, minv, scratch);
}

QuantStatus quantize_groups(const std::byte* const* rows, std::byte* const* out_rows, int n_groups, int group_rows, int dim, int bits,
                            DType dtype, std::uint8_t* codes, float* scale, float* minv, FusedGroupScratch& scratch) {
#ifdef VQ_HAVE_AVX2_KERNEL
  if (cpu_ok() && n_groups >= 1 && group_rows >= 1) {
    if (dtype == DType::F16) return kernel<DType::F16>(rows, out_rows, n_groups, group_rows, dim, bits, codes, scale, minv);
    if (dtype == DType::F32) return kernel<DType::F32>(rows, out_rows, n_groups, group_rows, dim, bits, codes, scale, minv);
  }
#endif
  const auto d = static_cast<std::size_t>(dim);
  for (int g = 0; g < n_groups; ++g) {
    const std::size_t row0 = static_cast<std::size_t>(g) * static_cast<std::size_t>(group_rows);
    const QuantStatus st = quantize_group_rows_portable(rows + row0, out_rows + row0, group_rows, dim, bits, dtype, codes + row0 * d,
                                                        scale + static_cast<std::size_t>(g) * d, minv + static_cast<std::size_t>(g) * d, scratch);
    if (st != QuantStatus::Ok) return st;
  }
  return QuantStatus::Ok;
}

}  // namespace vq
