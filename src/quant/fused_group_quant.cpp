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

// One block of W vectors (8 * W channels starting at c): each row's block is read as W adjacent
// vectors (a whole cache line for W = 4 and f16), so both passes stream through the rows.
template <DType DT, int W>
__attribute__((target("avx2,f16c"), always_inline)) inline bool block(const std::byte* const* rows, std::byte* const* out_rows,
                                                                      int n_rows, int dim, int c, __m256 levels, std::uint8_t* codes,
                                                                      float* scale, float* minv, int& overflow) {
  constexpr std::size_t esz = DT == DType::F16 ? 2 : 4;
  const std::size_t off = static_cast<std::size_t>(c) * esz;
  const __m256 min_scale = _mm256_set1_ps(kMinScale);
  const __m256 fmax = _mm256_set1_ps(3.4028234e38f);
  __m256 mn[W], mx[W], s[W];
  __m256 nonfinite = _mm256_setzero_ps();  // OR of x - x: +0 for finite x, NaN for NaN and Inf
  for (int w = 0; w < W; ++w) {
    mn[w] = mx[w] = load8<DT>(rows[0] + off + static_cast<std::size_t>(w) * 8 * esz);
    nonfinite = _mm256_or_ps(nonfinite, _mm256_sub_ps(mn[w], mn[w]));
  }
  for (int r = 1; r < n_rows; ++r)
    for (int w = 0; w < W; ++w) {
      const __m256 x = load8<DT>(rows[r] + off + static_cast<std::size_t>(w) * 8 * esz);
      mn[w] = _mm256_min_ps(x, mn[w]);  // same operand order as the portable x < mn ? x : mn
      mx[w] = _mm256_max_ps(x, mx[w]);
      nonfinite = _mm256_or_ps(nonfinite, _mm256_sub_ps(x, x));
    }
  if (!_mm256_testz_si256(_mm256_castps_si256(nonfinite), _mm256_castps_si256(nonfinite))) return false;
  for (int w = 0; w < W; ++w) {
    s[w] = _mm256_max_ps(_mm256_div_ps(_mm256_sub_ps(mx[w], mn[w]), levels), min_scale);  // s > 1e-8 ? s : 1e-8
    overflow |= _mm256_movemask_ps(_mm256_cmp_ps(s[w], fmax, _CMP_GT_OQ));
    _mm256_storeu_ps(scale + c + 8 * w, s[w]);
    _mm256_storeu_ps(minv + c + 8 * w, mn[w]);
  }
  // v = (x - min) / scale is >= +0 (x >= min exactly, scale > 0), so the reference's clip at 0 is
  // a no-op and is skipped; rounding to nearest-even (roundps) equals rint for 0 <= v < 2^23, and
  // the rounded, clamped v is the code as a float, so the reconstruction uses it directly.
  for (int r = 0; r < n_rows; ++r) {
    __m256i q32[W];
    for (int w = 0; w < W; ++w) {
      const std::size_t o = off + static_cast<std::size_t>(w) * 8 * esz;
      __m256 v = _mm256_div_ps(_mm256_sub_ps(load8<DT>(rows[r] + o), mn[w]), s[w]);
      v = _mm256_min_ps(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), levels);
      q32[w] = _mm256_cvttps_epi32(v);
      store8<DT>(out_rows[r] + o, _mm256_add_ps(_mm256_mul_ps(v, s[w]), mn[w]));
    }
    std::uint8_t* q = codes + static_cast<std::size_t>(r) * dim + c;
    if constexpr (W == 4) {  // 32 codes in one store: pack, then undo the per-lane interleave
      const __m256i b = _mm256_packus_epi16(_mm256_packs_epi32(q32[0], q32[1]), _mm256_packs_epi32(q32[2], q32[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    } else {
      for (int w = 0; w < W; ++w) {
        const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q32[w]), _mm256_extracti128_si256(q32[w], 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(q + 8 * w), _mm_packus_epi16(q16, q16));
      }
    }
  }
  return true;
}

// Channels [0, dim8) in blocks of 32 then 8; the tail (dim % 8) goes through the portable formulas.
template <DType DT>
__attribute__((target("avx2,f16c"))) QuantStatus kernel(const std::byte* const* rows, std::byte* const* out_rows, int n_rows, int dim,
                                                 int bits, std::uint8_t* codes, float* scale, float* minv) {
  constexpr std::size_t esz = DT == DType::F16 ? 2 : 4;
  const int dim8 = dim & ~7;
  const __m256 levels = _mm256_set1_ps(static_cast<float>((1 << bits) - 1));
  int overflow = 0;
  int c = 0;
  for (; c + 32 <= dim8; c += 32)
    if (!block<DT, 4>(rows, out_rows, n_rows, dim, c, levels, codes, scale, minv, overflow)) return QuantStatus::NonFinite;
  for (; c < dim8; c += 8)
    if (!block<DT, 1>(rows, out_rows, n_rows, dim, c, levels, codes, scale, minv, overflow)) return QuantStatus::NonFinite;
  if (overflow) return QuantStatus::RangeOverflow;
  if (dim8 < dim) {  // tail channels: portable arithmetic, one channel at a time
    const int tail = dim - dim8;
    float s[8], m[8];
    std::vector<float> col(static_cast<std::size_t>(n_rows) * tail), out(col.size());
    std::vector<std::uint8_t> qc(col.size());
    for (int r = 0; r < n_rows; ++r) to_f32(rows[r] + static_cast<std::size_t>(dim8) * esz, DT, col.data() + r * tail, static_cast<std::size_t>(tail));
    if (!all_finite(col.data(), col.size())) return QuantStatus::NonFinite;
    if (!quantize_group(col.data(), n_rows, tail, bits, qc.data(), s, m)) return QuantStatus::RangeOverflow;
    dequant_group(qc.data(), n_rows, tail, s, m, out.data());
    for (int k = 0; k < tail; ++k) {
      scale[dim8 + k] = s[k];
      minv[dim8 + k] = m[k];
    }
    for (int r = 0; r < n_rows; ++r) {
      std::memcpy(codes + static_cast<std::size_t>(r) * dim + dim8, qc.data() + r * tail, static_cast<std::size_t>(tail));
      from_f32(out.data() + r * tail, out_rows[r] + static_cast<std::size_t>(dim8) * esz, DT, static_cast<std::size_t>(tail));
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
#ifdef VQ_HAVE_AVX2_KERNEL
  if (cpu_ok() && n_rows >= 1) {
    if (dtype == DType::F16) return kernel<DType::F16>(rows, out_rows, n_rows, dim, bits, codes, scale, minv);
    if (dtype == DType::F32) return kernel<DType::F32>(rows, out_rows, n_rows, dim, bits, codes, scale, minv);
  }
#endif
  return quantize_group_rows_portable(rows, out_rows, n_rows, dim, bits, dtype, codes, scale, minv, scratch);
}

}  // namespace vq
