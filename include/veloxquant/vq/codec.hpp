// The coded form of one layer of our method (`vq`): quantizer parameters, per-coefficient
// parametric entropy models, and the codes, rANS-coded (entropy/rans.hpp). Its size is what the
// cache bills (VqKVCache::stored_bytes), so every byte of it is metadata that counts.
//
// What a reader must know first:
// - A side (K or V) of a layer is `rows` = batch * tokens rows of n transformed coefficients;
//   row b * tokens + t is token t of batch b. Code q of coefficient c stands for
//   offset_c + q * step (step float32; see vq/vq_cache.hpp), |q| <= kVqMaxCode. The offset is
//   the coefficient's mean rounded to a quarter step, stored as an integer m_c (offset_c =
//   m_c * step / 4, vq_offset): it only places the quantizer's grid (the error of a uniform
//   quantizer does not depend on where its grid sits), so a quarter step is as good as float16
//   and takes one varint byte where float16 takes two.
// - No frequency table is stored. Each coefficient's codes are modelled by a discretised Gaussian
//   or Laplace distribution on [-amax, amax] with a scale from a 1-byte parameter; the decoder
//   rebuilds the table from (amax, param) with vq_table(). A stored table would cost ~20 bytes per
//   coefficient (0.6 bits per element at a 256-token context with 32 coefficients per row);
//   the parametric one costs 2 bytes and codes within a few percent of the empirical entropy.
//   vq_table computes its probabilities with IEEE +, -, *, / and ldexp only (no libm exp/erf),
//   so every platform rebuilds bit-identical tables.
// - High rates: the model's alphabet is at most 511 symbols, so a coefficient whose codes would
//   need more (set per coefficient at calibration) is split: q = hi * 2^shift + low, hi coded by
//   the model on [-amax, amax], low (0 .. 2^shift - 1) by a uniform table (the low bits of a
//   wide distribution are nearly uniform). The quantizer keeps |q| <= vq_max_code(shift) =
//   255 * 2^shift; the coder takes any q whose hi part is within +-255 (up to 256 * 2^shift - 1),
//   shift <= 7, so every q fits int16.
// - Version 5 codes each coefficient's hi parts as residuals of a prediction from the previous
//   token's: residual = hi[t] - ((k_c * hi[t - 1] + 4) >> 3), k_c in -7..8 per coefficient (0: no
//   prediction; token 0 of each batch is predicted as 0), chosen by least squares when it lowers
//   the residual energy by >= 10 % and every residual fits +-255 (src/vq/codec_predict.hpp). The
//   models (amax_c, param_c) are the residuals'. And a row whose hi parts equal an earlier row's
//   (sides of >= 16 coefficients) is not coded at all, only named in the header (a token the layer
//   sees alone repeats its row). K and V drift along tokens, which an order-0 model per coefficient
//   cannot see: on a 7B-shaped synthetic layer at 2 bits the prediction halves the stream, on
//   stories260K the row copies save 12 % (docs/benchmarks.md, "The vq codec (issue 15)"; 574bfa8).
// - Format (integers little-endian, varint = unsigned LEB128):
//     u8      version = 6 (1 to 5 still decode; see below; 7: version 6 with 8 lanes, kVqNarrowLanes,
//             whatever the stream's length: what vq/vq_chain.hpp's small layers are coded with)
//     varint  batch, tokens, n_k, n_v
//     per side (K, then V):
//       u32     step (float32 bits; finite, > 0: float16 could not hold the step of small data)
//       shifts: u8 0 (none); or u8 1, varint k, k x (varint gap, u8 shift_c) (sparse, gap = index
//               - previous index - 1); or u8 2, ceil(n / 2) bytes of 4-bit shift_c (dense, even c low)
//       predictors: the same three layouts of a nibble per coefficient, k_c & 15 (k_c = 0: nibble 0)
//       row copies: u8 0 (none); or u8 1, varint k, k x (varint gap, varint d - 1): the copied rows in
//               order (gap = row - previous copied row - 1), row copying row - d (d >= 1, any batch)
//       per coefficient c: varint zigzag(m_c) (|m_c| <= kVqMaxOffset); varint amax_c (<= kVqMaxCode);
//                          u8 param_c, only when amax_c > 0 (amax_c = 0: every hi part is 0, none coded)
//     one rANS stream to the end: entropy/rans.hpp's framing with L lanes (varint count n, min(n, L)
//     final states, the words; symbol i in lane i % L), L = 64 when n >= 2^18, else 32 (src/vq/codec_kernels.hpp's vq_stream_lanes),
//     holding per side (K, then V):
//       the side's REGION: its hi parts' residuals + amax_c row by row, the copied rows left out (row r: the coded coefficients, those
//         with amax_c > 0, in order), each with its coefficient's table; then
//       per coefficient with shift_c > 0, in order: its `rows` low parts (uniform, shift_c bits).
//     Coefficient c's table has 2^S_c slots: S_c = 10 when amax_c <= 63, else 12 (vq_coef_scale_bits).
//     Version 5 is version 6 with 32 lanes always (rans.hpp's: symbol i in lane i % 32). 64 lanes give
//     the fast decoder four independent 16-lane vectors per step instead of two: its steps are bound
//     by the latency of each lane's chain (table gather, product, refill), not by throughput
//     (commit 706e11c). Their 32 more final states (128 bytes) would cost
//     a small stream several percent, so only streams of >= 2^18 symbols (>= 0.3 % of a stream at
//     ~1.4 bits a symbol) take them; shorter ones are version 5's stream. Same symbols, tables, header.
//     Version 4 is version 5 without the predictors (no byte; every k_c = 0: the region holds the
//     hi parts themselves). Version 3 is version 4 with one S per side (10 when the side's largest amax_c is <= 31, else
//     12: vq_side_scale_bits); version 2 is version 3 with S = 12 always.
//     Row-major coding puts 32 different coefficients in the 32 lanes of a step, so the decoder
//     writes codes in the cache's own layout and the AVX2 kernels (src/vq/codec_avx2.cpp) decode
//     32 symbols per step with one 8-lane gather per 8 lanes from the tables of the call's distinct
//     (amax, param) pairs. Version 1 held the same header with the stream in column order: one
//     segment per coefficient with amax > 0 (its `rows` hi parts), each followed, when shift_c > 0,
//     by its low parts. Both versions code the same symbols with the same tables; only their order,
//     hence the lanes' words, differs (sizes within a few bytes).
// - param: bit 7 = family (0 Gaussian, 1 Laplace), bits 0-6 = i, scale sigma = 2^((i - 48) / 8)
//   code steps (1/8-octave resolution: a mismatch of half a step costs ~0.1 % of the rate).
// Where all layers of one stored context meet: a stored context (a .vqkv file; a store chunk is
// one) holds its vq layers as CODES blocks in chunk, then layer, then side order (BlockPlan,
// src/format/vqkv_layout.hpp), so src/format/vqkv_write.cpp's vq_codes_block and
// src/format/vqkv_read.cpp's read_vq_codes see one chunk's layers one after the other. Each layer is
// coded on its own today (vq_encode / vq_decode); a coder across layers (predicting layer l's
// codes from layer l-1's of the same chunk) keeps the previous layer's codes in those two places
// and raises the format's version. The live cache (VqKVCache) stays per layer.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "veloxquant/entropy/frequency_table.hpp"
#include "veloxquant/entropy/rans.hpp"

namespace vq {

// Largest |code|: alphabets of 2 * 255 + 1 = 511 symbols, the rANS tables' limit (kMaxAlphabet).
inline constexpr int kVqMaxCode = 255;
// Table precision: 2^12 slots leave room for every symbol of a 511-symbol alphabet to keep a
// frequency >= 1 while the mode keeps most of the range at small scales.
inline constexpr int kVqScaleBits = 12;
// Version 3: a side whose amax are all <= kVqSmallAmax codes with tables of 2^10 slots instead. Its
// decoder tables are 4 KiB, so the ~120 distinct tables of a 7B-shaped layer at 2 bits (480 KiB)
// stay in a core's L2 where 16 KiB ones (1.9 MiB) did not (the fast decoder's gathers were bound
// by those misses); the coarser probabilities cost ~0.1-0.3 % of the size at such small alphabets
// (docs/benchmarks.md, "The vq codec (issue 15)").
inline constexpr int kVqSmallScaleBits = 10;
inline constexpr int kVqSmallAmax = 31;
inline constexpr int vq_side_scale_bits(int max_amax) { return max_amax <= kVqSmallAmax ? kVqSmallScaleBits : kVqScaleBits; }
// Version 4: the precision per coefficient, 2^10 slots when its amax_c <= kVqSmallAmaxV4, else 2^12.
// A side with a few wide coefficients (the 7B-shaped layer's K: ~60 of 1024 above 31, none above 63)
// no longer codes all of them with 16 KiB decoder tables; 127 symbols in 1024 slots still leave the
// mode most of the range (size +0.03 % on that layer, commit 9672c5e).
inline constexpr int kVqSmallAmaxV4 = 63;
inline constexpr int vq_coef_scale_bits(int amax) { return amax <= kVqSmallAmaxV4 ? kVqSmallScaleBits : kVqScaleBits; }

// Largest split of a code: 256 * 128 - 1 = 32767 still fits the int16 codes.
inline constexpr int kVqMaxShift = 7;
inline constexpr int vq_max_code(int shift) { return kVqMaxCode << shift; }
// |m_c| bound: 2^24, so float(m_c) is exact.
inline constexpr std::int32_t kVqMaxOffset = 1 << 24;
// The grid offset m quarter steps stand for (float arithmetic, as the decoder computes it).
inline float vq_offset(std::int32_t m, float step) { return static_cast<float>(m) * (step * 0.25f); }

struct VqSideCodes {
  int n = 0;                          // coefficients per row
  float step = 1.0f;                  // quantizer step
  std::vector<std::int32_t> offset;   // [n] grid offsets m_c, in quarter steps
  std::vector<std::uint8_t> shift;    // [n] or empty (all 0)
  std::vector<std::int16_t> codes;    // [rows, n] row-major
};

// A side's calibration (n, step, offset, shift) without its codes.
inline VqSideCodes vq_side_params(const VqSideCodes& s) { return {s.n, s.step, s.offset, s.shift, {}}; }

struct VqLayerCodes {
  std::int64_t batch = 0, tokens = 0;
  VqSideCodes k, v;
  std::int64_t rows() const { return batch * tokens; }
};

// The table of a coefficient's model: alphabet 2 * amax + 1 (symbol = code + amax), 2^scale_bits
// slots (kVqScaleBits or kVqSmallScaleBits).
FrequencyTable vq_table(int amax, std::uint8_t param, int scale_bits = kVqScaleBits);
// The parameter whose kVqScaleBits table codes `histogram` (over [-amax, amax]) in the fewest bits.
std::uint8_t vq_best_param(std::span<const std::uint32_t> histogram, int amax);

// Serialise; throws InvalidArgument on inconsistent sizes or a code outside +-kVqMaxCode.
// Writes version 6, or version 7 when asked (the chained layers of vq/vq_chain.hpp: version 6 with
// 8 lanes, for small layers). kernel: RansKernel::Scalar is the reference; Auto / Avx2 / Avx512
// write the same bytes.
std::vector<std::uint8_t> vq_encode(const VqLayerCodes& codes, RansKernel kernel = RansKernel::Auto, int version = 6);
// Parse and decode; max_codes bounds rows * (n_k + n_v) (the caller knows what it expects).
// Throws FormatError on any malformed, truncated, oversized or trailing input.
// Reads versions 1 to 7; every kernel returns the same codes. (vq/codec_decode_into.hpp: the same
// into a caller's buffers, without allocating or zero-filling them.)
VqLayerCodes vq_decode(std::span<const std::uint8_t> bytes, std::uint64_t max_codes, RansKernel kernel = RansKernel::Auto);

}  // namespace vq
