// ggml's scalar reference quantizers, written from the rules in include/veloxquant/peers/ggml_blocks.hpp.
#include "veloxquant/peers/ggml_blocks.hpp"

#include <algorithm>
#include <cfloat>
#include <cmath>

#include "veloxquant/core/dtype.hpp"

namespace vq::ggml {

// The dequantizers run in attention's inner loop (GgmlBlockCache's tiles): an AVX2 clone where the
// CPU has it. Element-wise int -> float and one multiply (add): every clone rounds the same.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VQ_DEQUANT_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VQ_DEQUANT_CLONES
#endif

void quantize_block_q8_0_ref(const float* x, block_q8_0& y) {
  float amax = 0.0f;
  for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;  // (1 << 7) - 1
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  y.d = f32_to_f16(d);
  for (int j = 0; j < QK; ++j) y.qs[j] = static_cast<std::int8_t>(std::round(x[j] * id));  // roundf: ties away from zero
}

VQ_DEQUANT_CLONES void dequantize_block_q8_0_ref(const block_q8_0& b, float* y) {
  const float d = f16_to_f32(b.d);
  for (int j = 0; j < QK; ++j) y[j] = static_cast<float>(b.qs[j]) * d;
}

void quantize_block_q4_0_ref(const float* x, block_q4_0& y) {
  float amax = 0.0f, vmax = 0.0f;  // largest magnitude and the signed value that has it (first wins)
  for (int j = 0; j < QK; ++j) {
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      vmax = x[j];
    }
  }
  const float d = vmax / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  y.d = f32_to_f16(d);
  for (int j = 0; j < QK / 2; ++j) {
    const float x0 = x[j] * id, x1 = x[QK / 2 + j] * id;
    // (int8_t) truncates toward zero; x*id + 8.5 lies in [0.5, 16.5] for finite input.
    const int q0 = std::min(15, static_cast<int>(static_cast<std::int8_t>(x0 + 8.5f)));
    const int q1 = std::min(15, static_cast<int>(static_cast<std::int8_t>(x1 + 8.5f)));
    y.qs[j] = static_cast<std::uint8_t>(q0 | (q1 << 4));
  }
}

VQ_DEQUANT_CLONES void dequantize_block_q4_0_ref(const block_q4_0& b, float* y) {
  const float d = f16_to_f32(b.d);
  for (int j = 0; j < QK / 2; ++j) {
    y[j] = static_cast<float>((b.qs[j] & 0x0F) - 8) * d;
    y[QK / 2 + j] = static_cast<float>((b.qs[j] >> 4) - 8) * d;
  }
}

void quantize_block_q4_1_ref(const float* x, block_q4_1& y) {
  float mn = FLT_MAX, mx = -FLT_MAX;
  for (int j = 0; j < QK; ++j) {
    mn = std::min(mn, x[j]);
    mx = std::max(mx, x[j]);
  }
  const float d = (mx - mn) / 15.0f;  // (1 << 4) - 1
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  y.d = f32_to_f16(d);
  y.m = f32_to_f16(mn);
  for (int j = 0; j < QK / 2; ++j) {
    const float x0 = (x[j] - mn) * id, x1 = (x[QK / 2 + j] - mn) * id;
    const int q0 = std::min(15, static_cast<int>(static_cast<std::int8_t>(x0 + 0.5f)));
    const int q1 = std::min(15, static_cast<int>(static_cast<std::int8_t>(x1 + 0.5f)));
    y.qs[j] = static_cast<std::uint8_t>(q0 | (q1 << 4));
  }
}

VQ_DEQUANT_CLONES void dequantize_block_q4_1_ref(const block_q4_1& b, float* y) {
  const float d = f16_to_f32(b.d), m = f16_to_f32(b.m);
  for (int j = 0; j < QK / 2; ++j) {
    y[j] = static_cast<float>(b.qs[j] & 0x0F) * d + m;
    y[QK / 2 + j] = static_cast<float>(b.qs[j] >> 4) * d + m;
  }
}

// Rows of blocks (attention's tiles): the block loop inlined, so the compiler vectorises each
// block's 32 conversions and the scale's float16 decode is the only call per block. Same
// arithmetic as the *_ref functions, element for element.
VQ_DEQUANT_CLONES void dequantize_row_q8_0(const block_q8_0* b, std::int64_t n, float* y) {
  for (std::int64_t i = 0; i < n; ++i, y += QK) {
    const float d = f16_to_f32(b[i].d);
    for (int j = 0; j < QK; ++j) y[j] = static_cast<float>(b[i].qs[j]) * d;
  }
}

VQ_DEQUANT_CLONES void dequantize_row_q4_0(const block_q4_0* b, std::int64_t n, float* y) {
  for (std::int64_t i = 0; i < n; ++i, y += QK) {
    const float d = f16_to_f32(b[i].d);
    for (int j = 0; j < QK / 2; ++j) {
      y[j] = static_cast<float>((b[i].qs[j] & 0x0F) - 8) * d;
      y[QK / 2 + j] = static_cast<float>((b[i].qs[j] >> 4) - 8) * d;
    }
  }
}

VQ_DEQUANT_CLONES void dequantize_row_q4_1(const block_q4_1* b, std::int64_t n, float* y) {
  for (std::int64_t i = 0; i < n; ++i, y += QK) {
    const float d = f16_to_f32(b[i].d), m = f16_to_f32(b[i].m);
    for (int j = 0; j < QK / 2; ++j) {
      y[j] = static_cast<float>(b[i].qs[j] & 0x0F) * d + m;
      y[QK / 2 + j] = static_cast<float>(b[i].qs[j] >> 4) * d + m;
    }
  }
}

}  // namespace vq::ggml
