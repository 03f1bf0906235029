#include "veloxquant/transform/bit_pack.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"

namespace vq {

std::size_t packed_size(std::size_t n_codes, int bits) { return (n_codes * static_cast<std::size_t>(bits) + 7) / 8; }

std::vector<std::uint8_t> pack_bits(std::span<const std::uint8_t> codes, int bits) {
  require(bits >= 1 && bits <= 8, fmt::format("pack_bits: bits must be in 1..8, got {}", bits));
  std::vector<std::uint8_t> out(packed_size(codes.size(), bits), 0);
  if (bits == 8) {
    std::copy(codes.begin(), codes.end(), out.begin());
    return out;
  }
  const unsigned limit = 1u << bits;
  std::uint64_t acc = 0;
  int fill = 0;
  std::size_t o = 0;
  for (std::size_t i = 0; i < codes.size(); ++i) {
    if (codes[i] >= limit) throw InvalidArgument(fmt::format("pack_bits: code {} at {} does not fit in {} bits", codes[i], i, bits));
    acc |= static_cast<std::uint64_t>(codes[i]) << fill;
    fill += bits;
    while (fill >= 8) {
      out[o++] = static_cast<std::uint8_t>(acc);
      acc >>= 8;
      fill -= 8;
    }
  }
  if (fill > 0) out[o] = static_cast<std::uint8_t>(acc);
  return out;
}

std::vector<std::uint8_t> unpack_bits(std::span<const std::uint8_t> packed, std::size_t n_codes, int bits) {
  require(bits >= 1 && bits <= 8, fmt::format("unpack_bits: bits must be in 1..8, got {}", bits));
  if (packed.size() < packed_size(n_codes, bits))
    throw FormatError(fmt::format("unpack_bits: {} bytes hold fewer than {} codes of {} bits", packed.size(), n_codes, bits));
  std::vector<std::uint8_t> out(n_codes);
  if (bits == 8) {
    std::copy_n(packed.begin(), n_codes, out.begin());
    return out;
  }
  const std::uint64_t mask = (1u << bits) - 1;
  std::uint64_t acc = 0;
  int fill = 0;
  std::size_t in = 0;
  for (std::size_t i = 0; i < n_codes; ++i) {
    while (fill < bits) {
      acc |= static_cast<std::uint64_t>(packed[in++]) << fill;
      fill += 8;
    }
    out[i] = static_cast<std::uint8_t>(acc & mask);
    acc >>= bits;
    fill -= bits;
  }
  return out;
}

}  // namespace vq
