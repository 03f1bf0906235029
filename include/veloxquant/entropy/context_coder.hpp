// Context-modelled rANS for a stream of quantization codes: each code is coded with a table chosen by
// its context, pooled over the stream's channels, so that a short stream pays for a few tables
// instead of one per channel.
//
// What a reader must know first:
// - Input: codes of `slices` x `tokens` x `dim` (token-major within a slice, the cache's layout),
//   each 0 .. 2^bits - 1, bits 1..4. The raw context of code (s, t, c) is A = 2^bits where a
//   quantization group starts at token t (the grid changes there, so the previous code says
//   little), else the previous code (s, t - 1, c). A + 1 raw contexts in all.
// - The encoder merges raw contexts into classes greedily (the pair whose merge lowers the
//   estimated payload + table bytes most, until no merge lowers it), one table per class. iid codes
//   end with one class (a pooled order-0 model); codes that drift slowly keep many.
// - Symbols of a class form one rANS segment, in (slice, token, channel) order; the decoder decodes
//   the segments with the fast kernels, then rebuilds the codes by following the contexts.
// - Block format (varint = unsigned LEB128):
//     u8      K                      classes, 1 .. A + 1
//     bits    class[A + 1]           each raw context's class, ceil(log2 K) bits each, LSB first,
//                                    padded to a byte (absent when K = 1)
//     varint  len[K - 1]             symbols of classes 0 .. K - 2, each >= 1 (the last class holds
//                                    the rest, also >= 1)
//     table   [K]                    FrequencyTable of each class (alphabet A)
//     rANS stream                    (rans.hpp) of the K segments, to the end of the block, except
//                                    the last 32 * floor(15 / bits) symbols when the stream has at
//                                    least 32 more: those are packed into the 32 lanes' start states
//                                    (bits back, rans.hpp), symbol n' + 32 m + j of lane j at bit
//                                    bits * m of state - 2^15, so they cost nothing
//   An empty stream (no codes) is the single byte 1. The shape and the group starts are the caller's (like a rANS stream's segments): they are not
//   stored.
// - context_decode validates everything and throws vq::FormatError; a class whose symbols run out
//   or are left over is an error.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "veloxquant/entropy/rans.hpp"

namespace vq {

inline constexpr int kContextMaxBits = 4;

struct ContextLayout {
  std::size_t slices = 0, tokens = 0, dim = 0;
  int bits = 4;
  std::vector<std::uint8_t> group_start;  // per token: 1 where a quantization group starts
  std::size_t size() const { return slices * tokens * dim; }
};

// Group starts of consecutive pieces (each piece's groups start at its first token) of
// group_size-token groups: what a cache stream's segment list describes.
std::vector<std::uint8_t> group_starts(std::span<const std::int64_t> piece_tokens, int group_size);

struct ContextCodedSize {
  std::size_t model = 0;    // K and the class map
  std::size_t tables = 0;   // segment lengths and tables
  std::size_t payload = 0;  // the rANS stream
  std::size_t classes = 0;
};

// Throws InvalidArgument when the layout is inconsistent (bits outside 1..4, group_start not one
// per token, codes of the wrong count or out of range).
std::vector<std::uint8_t> context_encode(std::span<const std::uint8_t> codes, const ContextLayout& layout,
                                         ContextCodedSize* size = nullptr, RansKernel kernel = RansKernel::Auto);

// Decodes exactly `bytes` into `codes` (layout.size() codes). Throws FormatError on malformed,
// truncated or trailing input, InvalidArgument on an inconsistent layout.
void context_decode(std::span<const std::uint8_t> bytes, const ContextLayout& layout, std::span<std::uint8_t> codes,
                    RansKernel kernel = RansKernel::Auto);

}  // namespace vq
