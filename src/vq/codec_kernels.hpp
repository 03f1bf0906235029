// Private: the lane kernels of the vq codec's version 2 stream (vq/codec.hpp), in which a side's
// hi parts are coded row by row across its coded coefficients ("the region": rows x m codes,
// row-major, region index i = r * m + j for coded column j), each with its column's table.
// Symbol i of the region has stream index base + i and lane (base + i) % L, L = t.lanes (32, or 64 for
// version 6's long streams: vq_stream_lanes below).
// The scalar reference lives in codec.cpp; the AVX2 kernels here (codec_avx2.cpp) and the AVX-512
// ones (codec_avx512.cpp) code whole groups of L symbols that start at a stream index divisible
// by L, so vector v, lane k codes lane 8 v + k (16 v + k), and produce the same words and codes
// as the reference.
#pragma once
#include <cstddef>
#include <cstdint>

namespace vq::vq_codec_detail {

// Interleaved rANS lanes of a vq stream (vq/codec.hpp): version 6 takes kVqLanes = 64 when the stream
// holds at least kVqWideLaneSymbols symbols, else (and versions 2-5 always) rans.hpp's 32. The 32
// more final states cost 128 bytes: <= 0.3 % of a stream of 2^18 symbols at ~1.4 bits a symbol.
inline constexpr std::size_t kVqLanes = 64;
inline constexpr std::uint64_t kVqWideLaneSymbols = std::uint64_t{1} << 18;
// Version 7 (the chained layers of vq/vq_chain.hpp: small layers, where 32 lanes' final states were
// 0.06 bits of every element of a 256-token stories260K layer) takes kVqNarrowLanes always, coded
// and decoded by the reference (the vector kernels work in groups of 32 or 64 lanes).
inline constexpr std::size_t kVqNarrowLanes = 8;
inline constexpr std::size_t vq_stream_lanes(int version, std::uint64_t symbols) {
  return version == 7 ? kVqNarrowLanes : version >= 6 && symbols >= kVqWideLaneSymbols ? kVqLanes : 32;
}

// Tables of a region. Offsets are given for j = 0 .. m + 63 (entry j is column j % m's), so a group
// of 32 or 64 starting at column j reads them contiguously whatever m.
struct RegionTables {
  std::size_t m = 0;                          // coded columns
  std::size_t lanes = 32;                     // the stream's lanes: 32 (versions 2-5) or 64 (version 6)
  // Per column (j = 0 .. m + 63, as the offsets) its table's precision: 2^scale slots (10 or 12;
  // version 4 chooses it per coefficient, so one lane's tables may be 1 K and the next lane's 4 K).
  const std::int32_t* col_scale = nullptr;
  // The precision every column shares (10 or 12), or 0 when they differ: the AVX-512 decoder then
  // takes it as a constant (no per-lane shift and mask).
  int uniform_scale = 0;
  // Decoder: one entry per slot, freq | (slot - cum) << 12 | (code & 0xff) << 24 (12-bit fields
  // whatever the scale: a coded column has amax >= 1, so >= 3 symbols and freq <= 2^12 - 2), tables of 2^scale entries one after the other (4 KiB each at
  // scale 10, so the ~120 tables of a 7B-shaped layer at 2 bits fit L2: one gather per 8 lanes).
  const std::int32_t* dec_off = nullptr;      // offset of the column's table in dec_pool
  const std::uint32_t* dec_pool = nullptr;
  const std::int32_t* enc_off = nullptr;      // encoder: index of the column's code 0 in enc_pool
  const std::uint64_t* enc_pool = nullptr;    // rans_detail::pack_enc of each table's symbols
};

// Decodes region symbols [i, n) in groups of L = t.lanes while at least 2 L payload bytes remain (so
// every word load stays inside); (base + i) % L == 0 and j == i % m on entry. Advances i and
// returns the new word pointer. Codes need |code| <= 127 (the entry's byte).
const std::uint8_t* decode_region_avx2(std::uint32_t* x, std::int16_t* codes, std::size_t& i, std::size_t n, std::size_t j,
                                       const RegionTables& t, const std::uint8_t* p, const std::uint8_t* end);
// Encodes region symbols [i0, i1) backwards in groups of L ((base + i0) % L == 0, (i1 - i0) % L
// == 0), words below ptr; j1 = i1 % m. Returns the new ptr.
std::uint16_t* encode_region_avx2(std::uint32_t* x, const std::int16_t* codes, std::size_t i0, std::size_t i1, std::size_t j1,
                                  const RegionTables& t, std::uint16_t* ptr);

// The same on 16 lanes a vector (AVX-512 F/BW/VL: only where rans_avx512_available()).
const std::uint8_t* decode_region_avx512(std::uint32_t* x, std::int16_t* codes, std::size_t& i, std::size_t n, std::size_t j,
                                         const RegionTables& t, const std::uint8_t* p, const std::uint8_t* end);
std::uint16_t* encode_region_avx512(std::uint32_t* x, const std::int16_t* codes, std::size_t i0, std::size_t i1, std::size_t j1,
                                    const RegionTables& t, std::uint16_t* ptr);

// A predicted side coded whole (every column coded, no row copies; version 5's prediction,
// codec_predict.hpp): region index i is the side's code i ([rows, n] row-major), so the AVX-512
// decoder can undo the prediction as it stores each group, out = residual + ((k[c] * prev[c] + 4)
// >> 3) with prev the previous token's finished codes (none at token 0 of a batch), instead of a
// second pass over the rows (~25 % of a decode). Groups must not cross rows: n % L == 0 and the
// region starts at a stream index divisible by L.
struct PredictRows {
  const std::int16_t* k = nullptr;     // per column its predictor (n entries)
  const std::int16_t* zero = nullptr;  // n zeros (the "previous row" of token 0)
  std::size_t n = 0, tokens = 0;
  bool bad = false;                    // out: some rebuilt hi part left +-255 (a corrupt stream)
};
// decode_region_avx512 over region symbols [i, n_sym) of such a side ((base + i) % L == 0 on entry),
// writing finished hi parts; advances i by whole groups like it. The symbols it leaves (fewer than
// L, or too few payload bytes left) are the caller's (reference steps, then vq_unpredict_row).
const std::uint8_t* decode_region_pred_avx512(std::uint32_t* x, std::int16_t* codes, std::size_t& i, std::size_t n_sym,
                                              const RegionTables& t, PredictRows& pr, const std::uint8_t* p, const std::uint8_t* end);

// The encoder's pass over a side's codes [rows, n] (row-major): with shift (per column), hi = the
// codes' hi parts q >> shift[c]; without, hi is null (the codes are their own hi parts). amax[c]
// (n entries) = max over rows of |hi| as an unsigned 16-bit value (|-32768| reads 32768).
void side_hi_avx512(const std::int16_t* codes, const std::uint8_t* shift, std::size_t rows, std::size_t n, std::int16_t* hi,
                    std::uint16_t* amax);
// Adds the histograms of a side's hi parts [rows, n], row r at hi + r * stride, to hist: column c's value v (|v| <= amax[c])
// at hist[hoff[c] + v]. Columns of small amax are counted 32 at a time with compares.
void side_hist_avx512(const std::int16_t* hi, std::size_t rows, std::size_t n, std::size_t stride, const int* amax, const std::int32_t* hoff,
                      std::uint32_t* hist);

}  // namespace vq::vq_codec_detail
