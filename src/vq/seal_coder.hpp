// The sealed tiles of a VqKVCache with resident=coded (vq_cache.hpp, "Sealed tiles"): a tile's
// codes (rows x n int16, row-major) held Rice-coded, decoded tile by tile when read.
//
// What a reader must know first:
// - Format of one tile (bits LSB-first, the tile starts on a byte): n x 5 bits, mode_c = k_c | delta_c << 4
//   (chosen per tile and coefficient: the Rice parameter k in 0..15 and whether to code each code's
//   difference from the previous row's, row 0's from 0, whichever gives the tile fewest bits for c:
//   codes that drift along tokens cost the spread of their steps, not of their values), then the
//   values row by row, coefficient by coefficient: z = zigzag(value) (0, -1, 1, -2, ... -> 0, 1,
//   2, 3, ...), u = z >> k_c; u < kRiceEscape: u zero bits, a one bit, the k_c low bits of z;
//   otherwise kRiceEscape zero bits and z in kRiceRawBits bits (a difference of two codes within
//   +-32640 zigzags below 2^18). The tile ends at the next byte.
// - Why Rice rather than the codec's rANS (vq/codec.hpp): no tables to build per tile and no
//   per-tile header beyond 5 bits per coefficient; on a discretised Gaussian it codes within ~0.1-0.25 bit of
//   the entropy (a packed field of fixed width costs ~0.8-1.3 above it at the same rates).
// - decode_tile reads 8 bytes at a time: the buffer needs 8 readable bytes past the tile's end.
#pragma once
#include <cstdint>
#include <vector>

namespace vq::seal {

inline constexpr unsigned kRiceEscape = 20, kRiceRawBits = 18;

// Appends the tile's bytes to `out`.
void encode_tile(const std::int16_t* codes, std::int64_t rows, int n, std::vector<std::uint8_t>& out);
// Bytes encode_tile would append (for tests and sizing).
std::size_t tile_bytes(const std::int16_t* codes, std::int64_t rows, int n);
// rows x n codes from a tile at `in`; returns the tile's size in bytes.
std::size_t decode_tile(const std::uint8_t* in, std::int64_t rows, int n, std::int16_t* codes);

}  // namespace vq::seal
