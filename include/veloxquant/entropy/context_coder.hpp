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
// - The rANS stream holds the codes token by token, all channels of a token together ((slice,
//   channel) index s * dim + c; C = slices * dim per token), symbol i in lane i % 32 as rans.hpp
//   lays out lanes, each coded with the table of its class. A lane's context is the code C symbols
//   back: with C >= 32 never inside its own group of 32, so the AVX2 decoder decodes a group at
//   once with one gather per 8 lanes from the classes' slot tables (C a multiple of 32; else the
//   scalar loop, same result).
// - Block format (varint = unsigned LEB128):
//     u8      K                      classes, 1 .. A + 1
//     bits    class[A + 1]           each raw context's class, ceil(log2 K) bits each, LSB first,
//                                    padded to a byte (absent when K = 1)
//     table   [K]                    FrequencyTable of each class (alphabet A, table_scale_bits(A))
//     varint  n'                     symbols rANS-coded: all but the last 32 * floor(15 / bits)
//                                    when the stream has at least 32 more (else all)
//     u32     state[min(n', 32)]     final encoder states (rans.hpp)
//     u16     word[...]              renormalisation words, to the end of the block
//   The last 32 * floor(15 / bits) symbols ride in the lanes' start states ("bits back"): symbol
//   n' + 32 m + j at bit bits * m of lane j's state - 2^15; they cost nothing. An empty stream (no
//   codes) is the single byte 1. The shape and the group starts are the caller's (like a rANS
//   stream's segments): they are not stored.
// - context_decode validates everything and throws vq::FormatError (counts, states, words left over
//   or missing, a final state that holds no tail).
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
// per token, codes of the wrong count or out of range). `kernel` is accepted for symmetry and
// ignored: there is one encoder (its tables change per symbol, which leaves nothing for the AVX2
// encoder's register tables); the decoder uses AVX2 where it can.
std::vector<std::uint8_t> context_encode(std::span<const std::uint8_t> codes, const ContextLayout& layout,
                                         ContextCodedSize* size = nullptr, RansKernel kernel = RansKernel::Auto);

// Decodes exactly `bytes` into `codes` (layout.size() codes). Throws FormatError on malformed,
// truncated or trailing input, InvalidArgument on an inconsistent layout.
void context_decode(std::span<const std::uint8_t> bytes, const ContextLayout& layout, std::span<std::uint8_t> codes,
                    RansKernel kernel = RansKernel::Auto);

}  // namespace vq
