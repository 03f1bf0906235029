// The arithmetic of one tile of attention's online-softmax loop (cache/attention.hpp), over rows of
// float32 or float16 values: a portable scalar form and an AVX2 + FMA + F16C form picked at run
// time.
//
// What a reader must know first:
// - A tile is n token rows of one (batch, KV head), `stride` elements apart, d values each. The
//   loop hands the kernels every query row that reads that KV head at once (nq = G query heads x
//   Sq query tokens), so each K and V row is read once per tile for all of them.
// - score:       s[r * n + j]    = q_r . k_j                      (unscaled; q row-major, d apart)
//   accumulate:  acc[r * d + e] += sum_j w[r * n + j] * v_j[e]    (w row-major, n apart)
//   softmax_step: one query row's online-softmax update over a tile's scores (in place: the
//   scores become the row's weights, 0 past `visible`).
// - The scalar forms sum a dot product in eight partial sums and use std::exp; the SIMD forms sum
//   in other orders with fused multiply-adds and a polynomial exp (within 2 ulp of std::exp). They
//   agree within float32 rounding (tests: AttentionKernels.*), not bit for bit.
// - The AVX-512 forms score four tokens against up to four query rows at a time and accumulate 64
//   values of a row per pass; they too agree with the scalar forms within float32 rounding.
// - simd_enabled(): the CPU has AVX2, FMA and F16C and nobody switched the SIMD forms off.
//   set_simd_enabled(false) makes every kernel here (and the caches' own tile kernels, which ask
//   the same switch) take the scalar path: process-wide, for tests and for measuring.
#pragma once
#include <cstdint>

// Where the AVX2 forms are compiled (x86-64 with GCC or clang); elsewhere only the scalar forms exist.
#if defined(__x86_64__) && defined(__GNUC__)
#define VQ_ATTN_HAVE_AVX2 1
#endif

namespace vq::attn {

bool simd_enabled();
// Returns the previous setting. `on` = use the SIMD forms where the CPU has them.
bool set_simd_enabled(bool on);
// The AVX-512 forms (F/BW/DQ/VL) of score_* and accumulate_* below for d % 32 == 0, and of the
// caches' own tile kernels (the llama.cpp blocks, vq's VBMI decode), run where simd_enabled(), the
// CPU has the instructions, and nobody switched them off; set_avx512_enabled(false) leaves the AVX2
// forms (process-wide, for tests and for measuring). Returns the previous setting.
bool avx512_enabled();
bool set_avx512_enabled(bool on);

void score_f32(const float* k, std::int64_t n, std::int64_t d, std::int64_t stride, const float* q, std::int64_t nq, float* s);
void score_f16(const std::uint16_t* k, std::int64_t n, std::int64_t d, std::int64_t stride, const float* q, std::int64_t nq, float* s);
void accumulate_f32(const float* v, std::int64_t n, std::int64_t d, std::int64_t stride, const float* w, std::int64_t nq, float* acc);
void accumulate_f16(const std::uint16_t* v, std::int64_t n, std::int64_t d, std::int64_t stride, const float* w, std::int64_t nq,
                    float* acc);

// One query row over the first n scores of a tile, of which the first `visible` count (the rest
// are causally masked): s[j] <- scale * s[j], the running max m, sum l and accumulator acc[dv]
// rescaled to the new max, then s[j] <- exp(s[j] - m) for j < visible and 0 beyond; l gains
// their sum. visible <= 0 zeroes s and changes nothing else.
void softmax_step(float* s, std::int64_t n, std::int64_t visible, float scale, float& m, float& l, float* acc, std::int64_t dv);

// Eight-lane exp for the SIMD softmax, exposed for its test: y[i] = exp(x[i]) for n values,
// x <= 88; results below exp(-87.3) may be 0 or tiny (never used: they vanish beside the max's 1).
void exp_simd(const float* x, float* y, std::int64_t n);

}  // namespace vq::attn
