// Private to the peers: attention tile kernels straight on llama.cpp blocks (q8_0, q4_0, q4_1)
// and on fp8 e4m3 codes, so that GgmlBlockCache and Fp8KVCache score K and sum V without a
// float32 tile (KVCache::score_key_tile / accumulate_value_tile). AVX2 + FMA + F16C (the blocks also on
// AVX-512 F/BW/DQ/VL where attn::avx512_enabled(): a block per load, nibbles looked up), built on
// src/cache/attention_simd.hpp; callers run them only when attn::simd_enabled(), and otherwise take
// the KVCache defaults (dequantize a tile, then the scalar float kernels), which are what the
// tests hold these against.
//
// - Blocks: a tile is n tokens of one head row of d values (d % 32 == 0, so the head owns whole
//   blocks), token t's first block at first + t * token_stride. A block is decoded 16 values at a
//   time to exactly the float32 values its dequantizer gives ((q - 8) * d, q * d, q * d + m: the
//   products are exact in float32), so scores differ from the dense ones only in summation order.
// - fp8: token t's d codes at first + t * token_stride. A code is decoded as its bits moved into a
//   float16 (e4m3's exponent bias 7 against float16's 15: the float16 read is the e4m3 value
//   times 2^-8, exactly, subnormals included) and converted with vcvtph2ps; the token's scale
//   times 256 is factored out: the caller multiplies the scores by it, and the weights before
//   accumulating (the "scale factored out" of llama.cpp's V loop).
#pragma once
#include <cstdint>

#include "veloxquant/cache/attention_kernels.hpp"
#include "veloxquant/peers/ggml_blocks.hpp"

namespace vq::peer_attention {

// Ask for `rows` rows of `row_bytes` bytes, `stride` bytes apart, from `first` on (the next tile's
// token rows, while this tile is computed): with token-major storage a head's rows are hundreds
// of bytes apart and the hardware prefetchers, which stop at every 4 KiB page, lose the stream.
// Callers keep the rows inside their buffers.
inline void prefetch_rows(const void* first, std::int64_t rows, std::int64_t row_bytes, std::int64_t stride) {
  const auto* p = static_cast<const char*>(first);
  for (std::int64_t r = 0; r < rows; ++r, p += stride)
    for (std::int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(p + o);
}

}  // namespace vq::peer_attention

#ifdef VQ_ATTN_HAVE_AVX2
namespace vq::peer_attention {

// Block is ggml::block_q8_0, block_q4_0 or block_q4_1 (instantiated in peer_attention_avx2.cpp).
template <class Block>
void score_blocks(const Block* first, std::int64_t token_stride, std::int64_t n, std::int64_t d, const float* q, std::int64_t nq, float* s);
template <class Block>
void accumulate_blocks(const Block* first, std::int64_t token_stride, std::int64_t n, std::int64_t d, const float* w, std::int64_t nq,
                       float* acc);

void score_fp8(const std::uint8_t* first, std::int64_t token_stride, std::int64_t n, std::int64_t d, const float* q, std::int64_t nq,
               float* s);
void accumulate_fp8(const std::uint8_t* first, std::int64_t token_stride, std::int64_t n, std::int64_t d, const float* w, std::int64_t nq,
                    float* acc);

}  // namespace vq::peer_attention
#endif
