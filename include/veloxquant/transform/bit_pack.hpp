// Fixed-width bit packing of b-bit codes (1 <= b <= 8), least significant bit first: code i
// occupies bits [i*b, (i+1)*b) of the little-endian bit string. ceil(n * b / 8) bytes.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace vq {

std::size_t packed_size(std::size_t n_codes, int bits);
// Throws InvalidArgument when bits is outside 1..8 or a code does not fit in `bits` bits.
std::vector<std::uint8_t> pack_bits(std::span<const std::uint8_t> codes, int bits);
// Throws FormatError when `packed` is shorter than packed_size(n_codes, bits).
std::vector<std::uint8_t> unpack_bits(std::span<const std::uint8_t> packed, std::size_t n_codes, int bits);

}  // namespace vq
