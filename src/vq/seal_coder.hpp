// The sealed tiles of a VqKVCache with resident=coded (vq_cache.hpp, "Sealed tiles"): a tile's
// codes (rows x n int16, row-major, rows <= 64) held Rice-coded, decoded tile by tile when read.
//
// What a reader must know first:
// - Format of one tile (bits LSB-first, the tile starts on a byte; it ends at the next byte):
//   1. Row copies: one bit; when it is 1 (only sides of n >= kCopyMinN), per row r one bit, and
//      when that is 1, 7 bits d - 1: row r is the codes of the row d rows back (1 <= d <= 127),
//      in this tile (d <= r) or in the previous tile, which is then full (row kMaxTileRows + r - d
//      of it, never one of its own copies from the tile before it); such rows have no values below.
//      A token the layer sees alone repeats its row (stories260K's first layer: every repeated
//      token); a copy costs 8 bits instead of the row's values.
//   2. n x 5 bits, mode_c, chosen per tile and coefficient, whichever gives the tile fewest bits for c:
//      - mode_c = k_c | delta_c << 4 except 31: the Rice parameter k in 0..15 and whether each code
//        is coded as its difference from the previous row's (row 0's from 0), so that codes that
//        drift along tokens cost the spread of their steps, not of their values;
//      - mode_c = 31 (zero runs): 3 bits kr_c and 2 bits kv_c follow. The coefficient's codes (of the
//        rows with values, in order) are coded as runs: a run length L (Rice kr_c: the zeros before
//        the next nonzero code, or up to the tile's end), then that nonzero code as zigzag(q) - 1
//        (Rice kv_c), then the next run length, and so on. A coefficient the step leaves mostly at 0
//        costs a fraction of a bit per code (a Rice code costs at least 1).
//   3. The values of the rows not copied, row by row, coefficient by coefficient: a Rice value z
//      with parameter k is u = z >> k; u < kRiceEscape: u zero bits, a one bit, the k low bits of
//      z; otherwise kRiceEscape zero bits and z in kRiceRawBits bits. Rice-mode coefficients code
//      z = zigzag(value) (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...; a difference of two codes within
//      +-32640 zigzags below 2^18); zero-run coefficients code their run lengths and nonzero codes
//      as they fall due (a run length where the previous nonzero code, or the tile's start, left
//      them; no bits inside a run).
// - Why Rice rather than the codec's rANS (vq/codec.hpp): no tables to build per tile and no
//   per-tile header beyond ~5 bits per coefficient; on a discretised Gaussian it codes within ~0.1-0.25 bit of
//   the entropy (a packed field of fixed width costs ~0.8-1.3 above it at the same rates).
// - Tiles live in memory only (never in a file): the format may change with the code.
// - decode_tile reads 8 bytes at a time: the buffer needs 8 readable bytes past the tile's end.
#pragma once
#include <cstdint>
#include <vector>

namespace vq::seal {

inline constexpr unsigned kRiceEscape = 20, kRiceRawBits = 18;
inline constexpr std::int64_t kMaxTileRows = 64;  // row copies name d - 1 in 6 bits
inline constexpr int kCopyMinN = 8;                // narrower rows never take copies (a copy costs 7 bits)

// Appends the tile's bytes to `out` (1 <= rows <= kMaxTileRows). `prev`: the previous tile's codes
// (kMaxTileRows rows; null for the first tile), `prev_back` its rows that copy from the tile before
// it (copies_back). Returns this tile's rows that copy from `prev` (a mask, bit r = row r).
std::uint64_t encode_tile(const std::int16_t* codes, std::int64_t rows, int n, std::vector<std::uint8_t>& out,
                          const std::int16_t* prev = nullptr, std::uint64_t prev_back = 0);
// Bytes encode_tile would append (for tests and sizing).
std::size_t tile_bytes(const std::int16_t* codes, std::int64_t rows, int n, const std::int16_t* prev = nullptr,
                       std::uint64_t prev_back = 0);
// The rows of the tile at `in` that copy from the previous tile (bit r = row r; 0: it needs no `prev`).
std::uint64_t copies_back(const std::uint8_t* in, std::int64_t rows);
// rows x n codes from a tile at `in`; returns the tile's size in bytes. `prev`: the previous tile's
// codes; without it (null) the rows that copy from it are left as they are.
std::size_t decode_tile(const std::uint8_t* in, std::int64_t rows, int n, std::int16_t* codes, const std::int16_t* prev = nullptr);

}  // namespace vq::seal
