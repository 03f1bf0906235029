// llama.cpp's (ggml's) block formats for its quantized KV cache: q8_0, q4_0, q4_1.
//
// A block holds QK = 32 consecutive values of a row. The scale `d` (and the minimum `m` of q4_1)
// is stored as IEEE float16 bits. The `*_ref` functions reproduce ggml's scalar reference
// quantizers (ggml-quants.c, quantize_row_*_ref) rounding for rounding:
//   q8_0: d = amax/127, id = 1/d (float32, from the unrounded d), q = roundf(x*id)
//         (roundf: half away from zero); x ~= q*d16.
//   q4_0: v = the element of largest magnitude (the first one on a tie), sign kept;
//         d = v/-8, id = 1/d, q = min(15, (int8)(x*id + 8.5)) (truncation toward zero);
//         x ~= (q-8)*d16. Byte j holds element j (low nibble) and element j+16 (high nibble).
//   q4_1: d = (max-min)/15, m = min, id = 1/d, q = min(15, (int8)((x-min)*id + 0.5));
//         x ~= q*d16 + m16. Nibble layout as q4_0.
// id is computed from the float32 d before d is rounded to float16 (as ggml does), so the codes
// depend on d32 while the reconstruction uses d16. d == 0 (an all-zero block, or a constant block
// for q4_1) gives id = 0: every code is the zero point.
#pragma once
#include <cstdint>

namespace vq::ggml {

inline constexpr int QK = 32;  // values per block (QK8_0 = QK4_0 = QK4_1 = 32 in ggml)

struct block_q8_0 {
  std::uint16_t d;     // float16 scale
  std::int8_t qs[QK];  // codes
};
static_assert(sizeof(block_q8_0) == 34, "block_q8_0 is 2 + 32 bytes, as in ggml");

struct block_q4_0 {
  std::uint16_t d;          // float16 scale
  std::uint8_t qs[QK / 2];  // nibbles: byte j = element j | element j+16 << 4
};
static_assert(sizeof(block_q4_0) == 18, "block_q4_0 is 2 + 16 bytes, as in ggml");

struct block_q4_1 {
  std::uint16_t d;          // float16 scale
  std::uint16_t m;          // float16 minimum
  std::uint8_t qs[QK / 2];  // nibbles, as q4_0
};
static_assert(sizeof(block_q4_1) == 20, "block_q4_1 is 2 + 2 + 16 bytes, as in ggml");

// One block from QK floats (x must hold QK finite values) and back to QK floats.
void quantize_block_q8_0_ref(const float* x, block_q8_0& y);
void quantize_block_q4_0_ref(const float* x, block_q4_0& y);
void quantize_block_q4_1_ref(const float* x, block_q4_1& y);
void dequantize_block_q8_0_ref(const block_q8_0& b, float* y);
void dequantize_block_q4_0_ref(const block_q4_0& b, float* y);
void dequantize_block_q4_1_ref(const block_q4_1& b, float* y);
// n consecutive blocks to n*QK floats: the same values as the *_ref functions, block by block
// (tested), with the loop vectorised (an AVX2 clone where the CPU has it).
void dequantize_row_q8_0(const block_q8_0* b, std::int64_t n, float* y);
void dequantize_row_q4_0(const block_q4_0* b, std::int64_t n, float* y);
void dequantize_row_q4_1(const block_q4_1* b, std::int64_t n, float* y);

// Traits that let a cache be written once for every block type.
struct Q8_0 {
  using block = block_q8_0;
  static constexpr const char* name = "q8_0";
  static void quantize(const float* x, block& y) { quantize_block_q8_0_ref(x, y); }
  static void dequantize(const block& b, float* y) { dequantize_block_q8_0_ref(b, y); }
  static void dequantize_row(const block* b, std::int64_t n, float* y) { dequantize_row_q8_0(b, n, y); }
};
struct Q4_0 {
  using block = block_q4_0;
  static constexpr const char* name = "q4_0";
  static void quantize(const float* x, block& y) { quantize_block_q4_0_ref(x, y); }
  static void dequantize(const block& b, float* y) { dequantize_block_q4_0_ref(b, y); }
  static void dequantize_row(const block* b, std::int64_t n, float* y) { dequantize_row_q4_0(b, n, y); }
};
struct Q4_1 {
  using block = block_q4_1;
  static constexpr const char* name = "q4_1";
  static void quantize(const float* x, block& y) { quantize_block_q4_1_ref(x, y); }
  static void dequantize(const block& b, float* y) { dequantize_block_q4_1_ref(b, y); }
  static void dequantize_row(const block* b, std::int64_t n, float* y) { dequantize_row_q4_1(b, n, y); }
};

}  // namespace vq::ggml
