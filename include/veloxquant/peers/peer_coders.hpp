// The general-purpose coders veloxquant's rANS is measured against, on the same code streams:
// htscodecs' rANS 4x16 (order 0 and order 1, as used in CRAM), zstd at levels 1, 3 and 19, and
// lz4. Debian packages libhtscodecs-dev, libzstd-dev, liblz4-dev. The byte-oriented coders get
// the codes bit-packed (zstd, lz4) or one code per byte (htscodecs' rANS works on bytes; its
// order-1 model then conditions on the previous code of the stream).
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace vq {

struct PeerCoder {
  std::string name;
  // Compress `codes` (one b-bit code per byte).
  std::function<std::vector<std::uint8_t>(std::span<const std::uint8_t> codes)> encode;
  // Decompress back to one code per byte; throws FormatError on corrupt input.
  std::function<std::vector<std::uint8_t>(std::span<const std::uint8_t> compressed, std::size_t n_codes)> decode;
};

// The peers for b-bit codes, in the order the reports list them.
std::vector<PeerCoder> peer_coders(int bits);

}  // namespace vq
