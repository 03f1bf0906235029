// The sealed tiles of a VqKVCache with resident=coded (vq_cache.hpp, "Sealed tiles"): a tile's
// codes (rows x n int16, row-major) held Rice-coded, decoded tile by tile when read.
//
// What a reader must know first:
// - Format of one tile (bits LSB-first, the tile starts on a byte): n x 4-bit k_c (Rice parameter
//   per coefficient, chosen per tile: the k in 0..15 that minimises the tile's bits for c), then
//   the codes row by row, coefficient by coefficient: z = zigzag(q) (0, -1, 1, -2, ... -> 0, 1,
//   2, 3, ...), u = z >> k_c; u < kRiceEscape: u zero bits, a one bit, the k_c low bits of z;
//   otherwise kRiceEscape zero bits and z in 17 bits (the codes' reach, +-32640, zigzags below
//   2^17). The tile ends at the next byte.
// - Why Rice rather than the codec's rANS (vq/codec.hpp): no tables to build per tile and no
//   per-tile header beyond n nibbles; on a discretised Gaussian it codes within ~0.1-0.25 bit of
//   the entropy (a packed field of fixed width costs ~0.8-1.3 above it at the same rates).
// - decode_tile reads 8 bytes at a time: the buffer needs 8 readable bytes past the tile's end.
#pragma once
#include <cstdint>
#include <vector>

namespace vq::seal {

inline constexpr unsigned kRiceEscape = 20;

// Appends the tile's bytes to `out`.
void encode_tile(const std::int16_t* codes, std::int64_t rows, int n, std::vector<std::uint8_t>& out);
// Bytes encode_tile would append (for tests and sizing).
std::size_t tile_bytes(const std::int16_t* codes, std::int64_t rows, int n);
// rows x n codes from a tile at `in`; returns the tile's size in bytes.
std::size_t decode_tile(const std::uint8_t* in, std::int64_t rows, int n, std::int16_t* codes);

}  // namespace vq::seal
