// The transform stage of our `vq` method: what turns a token's K or V rows into the coefficients
// the quantizer codes, and coefficients back into rows.
//
// What a reader must know first:
// - Forward (encoder): RoPE undone on keys (vq_unrope), then y = F x per token in double
//   (vq_forward; F is VqSideTransform's matrix: per head blocks or one matrix mixing every head).
//   The AVX-512 path and the scalar reference (vq_forward_ref) add the same products in the same
//   order, so the codes are the same bits whichever runs (tests/vq/transform_test.cpp).
// - Inverse (decoder): x_hat = F^-1 y_hat per head in float32, each output accumulated over j in
//   order, then keys re-rotated in double (reconstruct_head from F^-1's rows, reconstruct_head_cols
//   from its per-head column blocks: the same bits). The cache's tiles, state() and vq_reconstruct
//   all go through these (reconstruct_kernels.hpp does the same arithmetic for many tokens at once).
// - reconstruct_head and reconstruct_head_cols are built for AVX2 and a default target, chosen at
//   load time (core/kernel_clones.hpp).
// - round_even is std::nearbyint (half to even) without the library call: the quantizer's rounding.
// The design (why weight-derived transforms, what shaping does): docs/methods.md, "vq".
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "veloxquant/vq/basis.hpp"

namespace vq::vq_transform {

// std::nearbyint in the default rounding mode (half to even), without the library call on CPUs
// without SSE4.1's round: adding and subtracting 1.5 * 2^52 rounds any |v| < 2^51 exactly so.
inline double round_even(double v) {
  constexpr double kMagic = 6755399441055744.0;  // 1.5 * 2^52
  return std::fabs(v) < 2251799813685248.0 ? (v + kMagic) - kMagic : std::nearbyint(v);
}

// Undo RoPE on each (2i, 2i+1) pair of every head of x (heads x d doubles), angle = pos * freq_i,
// with cos / sin from the position's VqRopeTable row `cs` (pairs {cos, sin}).
void vq_unrope(double* x, int heads, int d, const double* cs, std::size_t pairs);

// y = F x (n doubles); a copy when F is the identity. Takes the AVX-512 path where it can.
void vq_forward(const VqSideTransform& t, const double* x, double* y);
// The scalar path of vq_forward: the same bits (the reference the fast path is tested against).
void vq_forward_ref(const VqSideTransform& t, const double* x, double* y);

// Head h's d outputs from a row's y_hat (n floats): x_hat = F^-1 y_hat (inv: F^-1 row-major, n x n;
// null: y_hat's own values), keys re-rotated at `pos` when freq is non-empty. acc: d floats of scratch.
void reconstruct_head(const float* __restrict inv, int n, const float* __restrict yhat, int h, int d, const std::vector<double>* freq,
                      std::int64_t pos, float* __restrict acc, float* __restrict out);
// The same from head h's column block of F^-1 (VqSideTransform::inv_cols: span columns of d) and its
// span y_hat values: the same bits as reconstruct_head.
void reconstruct_head_cols(const float* __restrict cols, int span, const float* __restrict y, int d, const std::vector<double>* freq,
                           std::int64_t pos, float* __restrict acc, float* __restrict out);

}  // namespace vq::vq_transform
