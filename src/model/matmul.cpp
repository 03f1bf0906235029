// The forward pass's matrix products; see matmul.hpp.
#include "matmul.hpp"

#include <algorithm>
#include <cstddef>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#endif

namespace vq::detail {

namespace {

// The portable version; the vector ones below compute the same roundings.
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

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VQ_AVX512_PATH 1
#define VQ_AVX512 __attribute__((target("avx512f")))

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

// mm_block with 16 outputs per register: R rows x NV vectors, acc = 0 then acc = acc + x_i * w_i
// in order i. Masked: vectors that reach past out_dim load and store under a mask (the lanes past
// out_dim are never read from w nor written to y); unmasked blocks lie wholly below out_dim.
template <int R, int NV, bool Masked = true>
VQ_AVX512 inline void mm_block512(float* y, std::size_t ys, const float* x, std::size_t xs, const float* w, std::size_t ws, int in_dim, int o0,
                                  int out_dim) {
  __m512 acc[R][NV];
  __mmask16 mask[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    const int left = out_dim - o0 - 16 * v;
    mask[v] = left >= 16 ? static_cast<__mmask16>(0xFFFF) : left <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << left) - 1);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const float* wp = w + o0;
  for (int i = 0; i < in_dim; ++i, wp += ws) {
    __m512 b[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) b[r] = _mm512_set1_ps(x[static_cast<std::size_t>(r) * xs + static_cast<std::size_t>(i)]);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const __m512 wv = Masked ? _mm512_maskz_loadu_ps(mask[v], wp + 16 * v) : _mm512_loadu_ps(wp + 16 * v);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][v] = _mm512_add_ps(acc[r][v], _mm512_mul_ps(b[r], wv));
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float* dst = y + static_cast<std::size_t>(r) * ys + o0 + 16 * v;
      if (Masked)
        _mm512_mask_storeu_ps(dst, mask[v], acc[r][v]);
      else
        _mm512_storeu_ps(dst, acc[r][v]);
    }
}

// Outputs [o, o + 16 NV) of every row, 4 rows at a time (the last 1-3 in one block): one panel
// of the weights, read from L2 once and then from L1 for all the rows.
template <int NV, bool Masked>
VQ_AVX512 void mm_panel512(float* out, std::size_t os, const float* in, std::size_t is, const float* wt, std::size_t ws, int n, int in_dim,
                           int o, int out_dim) {
  int t = 0;
  for (; t + 4 <= n; t += 4)
    mm_block512<4, NV, Masked>(out + static_cast<std::size_t>(t) * os, os, in + static_cast<std::size_t>(t) * is, is, wt, ws, in_dim, o, out_dim);
  float* y = out + static_cast<std::size_t>(t) * os;
  const float* x = in + static_cast<std::size_t>(t) * is;
  switch (n - t) {
    case 1: mm_block512<1, NV, Masked>(y, os, x, is, wt, ws, in_dim, o, out_dim); break;
    case 2: mm_block512<2, NV, Masked>(y, os, x, is, wt, ws, in_dim, o, out_dim); break;
    case 3: mm_block512<3, NV, Masked>(y, os, x, is, wt, ws, in_dim, o, out_dim); break;
    default: break;
  }
}

// matmul_ref's result. Four rows and more: panels of 64 outputs (4 rows x 4 vectors, 16
// accumulators, per input a weight vector serves 4 rows and a broadcast 4 vectors), the weights'
// panel reused from L1 by every row; the last panel narrower, masked where out_dim is not a
// multiple of 16. Fewer rows: each row alone, 128 outputs per block (8 independent accumulators:
// the adds' latency hidden), the rest in one block.
VQ_AVX512 void matmul_avx512(float* out, std::size_t os, const float* in, std::size_t is, const float* wt, std::size_t ws, int n, int in_dim,
                             int out_dim) {
  if (n >= 4) {
    int o = 0;
    for (; o + 64 <= out_dim; o += 64) mm_panel512<4, false>(out, os, in, is, wt, ws, n, in_dim, o, out_dim);
    const int left = out_dim - o;
    if (left > 0) {
      if (left % 16 == 0) {
        switch (left / 16) {
          case 1: mm_panel512<1, false>(out, os, in, is, wt, ws, n, in_dim, o, out_dim); break;
          case 2: mm_panel512<2, false>(out, os, in, is, wt, ws, n, in_dim, o, out_dim); break;
          default: mm_panel512<3, false>(out, os, in, is, wt, ws, n, in_dim, o, out_dim); break;
        }
      } else {
        switch ((left + 15) / 16) {
          case 1: mm_panel512<1, true>(out, os, in, is, wt, ws, n, in_dim, o, out_dim); break;
          case 2: mm_panel512<2, true>(out, os, in, is, wt, ws, n, in_dim, o, out_dim); break;
          case 3: mm_panel512<3, true>(out, os, in, is, wt, ws, n, in_dim, o, out_dim); break;
          default: mm_panel512<4, true>(out, os, in, is, wt, ws, n, in_dim, o, out_dim); break;
        }
      }
    }
    return;
  }
  for (int t = 0; t < n; ++t) {
    float* y = out + static_cast<std::size_t>(t) * os;
    const float* x = in + static_cast<std::size_t>(t) * is;
    int o = 0;
    for (; o + 128 <= out_dim; o += 128) mm_block512<1, 8>(y, os, x, is, wt, ws, in_dim, o, out_dim);
    if (o >= out_dim) continue;
    switch ((out_dim - o + 15) / 16) {
      case 1: mm_block512<1, 1>(y, os, x, is, wt, ws, in_dim, o, out_dim); break;
      case 2: mm_block512<1, 2>(y, os, x, is, wt, ws, in_dim, o, out_dim); break;
      case 3: mm_block512<1, 3>(y, os, x, is, wt, ws, in_dim, o, out_dim); break;
      case 4: mm_block512<1, 4>(y, os, x, is, wt, ws, in_dim, o, out_dim); break;
      case 5: mm_block512<1, 5>(y, os, x, is, wt, ws, in_dim, o, out_dim); break;
      case 6: mm_block512<1, 6>(y, os, x, is, wt, ws, in_dim, o, out_dim); break;
      case 7: mm_block512<1, 7>(y, os, x, is, wt, ws, in_dim, o, out_dim); break;
      default: mm_block512<1, 8>(y, os, x, is, wt, ws, in_dim, o, out_dim); break;
    }
  }
}
#endif

}  // namespace

bool matmul_with(MatmulPath path, float* out, std::size_t os, const float* in, std::size_t is, const float* wt, std::size_t ws, int n,
                 int in_dim, int out_dim) {
  switch (path) {
    case MatmulPath::Portable: matmul_ref(out, os, in, is, wt, ws, n, in_dim, out_dim); return true;
    case MatmulPath::Avx2:
#ifdef VQ_AVX2_PATH
      if (cpu_has_avx2() && ws % 8 == 0) return matmul_avx2(out, os, in, is, wt, ws, n, in_dim, out_dim), true;
#endif
      return false;
    case MatmulPath::Avx512:
#ifdef VQ_AVX512_PATH
      if (cpu_has_avx512() && ws % 8 == 0) return matmul_avx512(out, os, in, is, wt, ws, n, in_dim, out_dim), true;
#endif
      return false;
  }
  return false;
}

void matmul_t(float* out, std::size_t os, const float* in, std::size_t is, const float* wt, std::size_t ws, int n, int in_dim, int out_dim) {
  if (matmul_with(MatmulPath::Avx512, out, os, in, is, wt, ws, n, in_dim, out_dim)) return;
  if (matmul_with(MatmulPath::Avx2, out, os, in, is, wt, ws, n, in_dim, out_dim)) return;
  matmul_ref(out, os, in, is, wt, ws, n, in_dim, out_dim);
}

}  // namespace vq::detail
