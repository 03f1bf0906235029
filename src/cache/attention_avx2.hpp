// Private: the AVX2 + FMA + F16C forms of the tile kernels (attention_avx2.cpp), called by
// attention_kernels.cpp only when attn::simd_enabled(). Same contracts as the public functions.
#pragma once
#include <cstdint>

#include "veloxquant/cache/attention_kernels.hpp"  // VQ_ATTN_HAVE_AVX2

#ifdef VQ_ATTN_HAVE_AVX2
namespace vq::attn::avx2 {

void score_f32(const float* k, std::int64_t n, std::int64_t d, std::int64_t stride, const float* q, std::int64_t nq, float* s);
void score_f16(const std::uint16_t* k, std::int64_t n, std::int64_t d, std::int64_t stride, const float* q, std::int64_t nq, float* s);
void accumulate_f32(const float* v, std::int64_t n, std::int64_t d, std::int64_t stride, const float* w, std::int64_t nq, float* acc);
void accumulate_f16(const std::uint16_t* v, std::int64_t n, std::int64_t d, std::int64_t stride, const float* w, std::int64_t nq,
                    float* acc);
void softmax_step(float* s, std::int64_t n, std::int64_t visible, float scale, float& m, float& l, float* acc, std::int64_t dv);
void exp_n(const float* x, float* y, std::int64_t n);

}  // namespace vq::attn::avx2

// The AVX-512 forms (attention_simd.hpp's simd512 templates), for d % 32 == 0, called only when
// attn::avx512_enabled().
namespace vq::attn::avx512 {

void score_f32(const float* k, std::int64_t n, std::int64_t d, std::int64_t stride, const float* q, std::int64_t nq, float* s);
void score_f16(const std::uint16_t* k, std::int64_t n, std::int64_t d, std::int64_t stride, const float* q, std::int64_t nq, float* s);
void accumulate_f32(const float* v, std::int64_t n, std::int64_t d, std::int64_t stride, const float* w, std::int64_t nq, float* acc);
void accumulate_f16(const std::uint16_t* v, std::int64_t n, std::int64_t d, std::int64_t stride, const float* w, std::int64_t nq,
                    float* acc);

}  // namespace vq::attn::avx512
#endif
