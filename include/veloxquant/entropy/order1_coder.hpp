// An order-1 context coder over quantized codes: a measurement of what conditioning each code on
// the previous code of its channel buys (`veloxquant bench codec`'s "veloxquant-rans order-1" rows,
// docs/benchmarks.md), not a format any file uses.
//
// - Context: the previous code of the same channel (0 before its first token).
// - Each (channel, context) with symbols is one segment of one rANS stream (entropy/rans.hpp),
//   symbols grouped by context. The per-context histograms travel instead of tables (varints, runs
//   of zeros as in FrequencyTable's format); the decoder rebuilds each table with
//   FrequencyTable::from_histogram, and a histogram's total is its segment's length.
// - pooled: one histogram per context for all channels instead of one per (channel, context): far
//   fewer table bytes, at the price of channels sharing a model.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace vq {

// The codes: `slices` spans of tokens x channels codes each, token-major ([token][channel]), each
// code < 2^bits (bits 1..8). A slice's channels are channels [slice * channels, (slice + 1) * channels).
struct Order1Codes {
  std::vector<std::span<const std::uint8_t>> slices;
  std::size_t tokens = 0, channels = 0;
  int bits = 0;
};

std::vector<std::uint8_t> order1_encode(const Order1Codes& codes, bool pooled);
// The codes of `shape` (its slices are not read) channel-major ([slice * channels + channel][token]);
// throws FormatError for bytes that are truncated or disagree with the shape.
std::vector<std::uint8_t> order1_decode(std::span<const std::uint8_t> bytes, const Order1Codes& shape, bool pooled);

}  // namespace vq
