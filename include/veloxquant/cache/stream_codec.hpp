// Stream codec: the closed codes of one side (keys or values) of a CacheGenKVCache as bytes, and
// back, exactly. This is what encoded_{key,value}_bytes measure.
//
// What a reader must know first:
// - One model (FrequencyTable) per (head slice, channel) of the side; all of them are segments of
//   ONE interleaved rANS stream (rans.hpp), so the codec's 32 lane states (up to 128 bytes) are paid
//   once per side, never per channel. Segment order: slice 0 channel 0, slice 0 channel 1, ...; a
//   segment holds its channel's symbols in token order (channel-major: that is what the model is
//   per channel).
// - Symbols (SymbolTransform): Codes, the b-bit codes themselves (alphabet 2^b), or TokenDelta,
//   code[t] - code[t-1] + (2^b - 1) (alphabet 2^(b+1) - 1), with the delta restarting (previous
//   code taken as 0) at the first token of every independently quantized piece: the whole closed
//   stream in group_aligned mode, each update_and_fetch call's tokens in per_call mode (as the
//   reference's estimate does). In per_call mode a (slice, channel) still has ONE table over all of
//   its pieces: a table per one-token decode step would cost far more than it saves.
// - Context (bits <= 4): the codes coded by the context coder (entropy/context_coder.hpp): tables
//   per class of (previous code | group start), pooled over the side's channels, instead of one
//   per channel, and two codes per rANS step.
// - The DEFAULT (StreamCodecOptions::transform unset, default_transform) is Context for codes of
//   up to 4 bits and Codes above, chosen by measurement (docs/benchmarks.md, "Choosing the symbol
//   model (issue 4)"): on stories260K's real K/V Context stores 7 % fewer bytes than Codes at 4 bits
//   (7.6-13 % at 1-3 bits), on the synthetic K/V 20 % fewer; min/max groups leave the token delta no
//   better than the codes, and its wider alphabet costs table bytes.
// - Scales and minima are stored as raw float32, bit for bit: reconstruction uses them in float32,
//   and decoding must be exact. That is 8 bytes per (group, channel, slice), twice what the
//   reference's estimate bills (fp16, 4 bytes); the estimate (compressed_*_bytes) is unchanged.
// - Format (integers little-endian, varint = unsigned LEB128):
//     u8      version                  1
//     u8      bits                     1..8
//     u8      transform                0 = Codes, 1 = TokenDelta, 2 = Context
//     varint  dim                      channels per slice, D
//     varint  slices                   B * H
//     varint  group_size               tokens per quantization group, >= 1
//     varint  tokens                   closed (quantized) tokens per slice, N
//     varint  groups                   quantization groups per slice
//     varint  pieces                   independently quantized pieces; then varint tokens[pieces]
//                                      (each >= 1, summing to N; groups = sum ceil(tokens_i / G))
//     when N * D * slices > 0:
//       table[slices * D]              FrequencyTable::serialize_to, one per (slice, channel)
//       f32     scales[slices][groups * D]
//       f32     minima[slices][groups * D]
//       rANS stream                    to the end of the buffer (rans.hpp), N * D * slices symbols
//     Context instead: no tables, the scales and minima as above, then the context-coded block
//     (context_coder.hpp) to the end: layout slices x N x D, group starts from the pieces.
// - Decoding validates every length and value and throws FormatError on anything inconsistent; it
//   allocates codes only up to the caller's max_codes (a one-symbol table codes any count in zero
//   payload bytes, so only the caller can bound that) and metadata only as far as the bytes
//   present justify.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "veloxquant/cache/quantized_stream.hpp"
#include "veloxquant/entropy/context_coder.hpp"
#include "veloxquant/entropy/frequency_table.hpp"
#include "veloxquant/entropy/rans.hpp"

namespace vq {

// Saved in the format: never renumber.
enum class SymbolTransform : std::uint8_t { Codes = 0, TokenDelta = 1, Context = 2 };
inline constexpr std::uint8_t kStreamCodecVersion = 1;

// The transform a side of `bits`-bit codes gets by default: Context up to 4 bits, else Codes.
SymbolTransform default_transform(int bits);

struct StreamCodecOptions {
  std::optional<SymbolTransform> transform = std::nullopt;  // unset: default_transform(bits), see above for why
  int scale_bits = 0;  // table precision; 0: table_scale_bits(alphabet) (10 bits for raw 4-bit codes, else 11)
  RansKernel kernel = RansKernel::Auto;
};

// A decoded side: everything needed to verify (or rebuild) the codes of a QuantizedStream.
struct DecodedStream {
  int bits = 0;
  int dim = 0;
  std::int64_t slices = 0;
  int group_size = 0;
  std::int64_t tokens = 0;
  std::int64_t groups = 0;
  SymbolTransform transform = SymbolTransform::Codes;
  std::vector<std::int64_t> piece_tokens;
  // Flat, slice after slice (an empty stream allocates nothing, however many slices it names).
  std::vector<std::uint8_t> codes;  // [slice][token * D + c]
  std::vector<float> scales;        // [slice][group * D + c]
  std::vector<float> minima;        // [slice][group * D + c]

  std::span<const std::uint8_t> slice_codes(std::int64_t s) const {
    const auto n = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(dim);
    return std::span<const std::uint8_t>(codes).subspan(static_cast<std::size_t>(s) * n, n);
  }
  std::span<const float> slice_scales(std::int64_t s) const {
    const auto n = static_cast<std::size_t>(groups) * static_cast<std::size_t>(dim);
    return std::span<const float>(scales).subspan(static_cast<std::size_t>(s) * n, n);
  }
  std::span<const float> slice_minima(std::int64_t s) const {
    const auto n = static_cast<std::size_t>(groups) * static_cast<std::size_t>(dim);
    return std::span<const float>(minima).subspan(static_cast<std::size_t>(s) * n, n);
  }
};

// The bytes that describe where a side's encoded size goes.
struct EncodedStreamSize {
  std::uint64_t total = 0;     // the whole buffer
  std::uint64_t header = 0;
  std::uint64_t tables = 0;
  std::uint64_t metadata = 0;  // scales and minima, float32
  std::uint64_t payload = 0;   // the rANS stream
};

std::vector<std::uint8_t> encode_stream(const QuantizedStream& stream, const StreamCodecOptions& options = {});
// Same, also reporting where the bytes went.
std::vector<std::uint8_t> encode_stream(const QuantizedStream& stream, const StreamCodecOptions& options, EncodedStreamSize& size);

// Throws FormatError on any malformed, truncated, trailing or inconsistent input, or when the
// buffer holds more than max_codes codes (slices * tokens * dim).
DecodedStream decode_stream(std::span<const std::uint8_t> bytes, std::uint64_t max_codes, RansKernel kernel = RansKernel::Auto);

// Codes of some slices, unpacked from a stream's packed rows and owned here, viewed as the
// context coder's slices (a contiguous range of spans: ContextSlices(x) views it).
struct StreamCodeSlices {
  std::vector<std::vector<std::uint8_t>> codes;
  std::vector<std::span<const std::uint8_t>> spans;  // one per slice, into codes
  const std::span<const std::uint8_t>* begin() const { return spans.data(); }
  const std::span<const std::uint8_t>* end() const { return spans.data() + spans.size(); }
  const std::span<const std::uint8_t>* data() const { return spans.data(); }
  std::size_t size() const { return spans.size(); }
  const std::span<const std::uint8_t>& operator[](std::size_t i) const { return spans[i]; }
};

// The context coder's view of a stream's tokens [t0, t0 + count) (count 0: to the last closed
// token; t0 must start a group): per slice, those tokens' codes (unpacked copies), and their layout
// (group starts from the stream's pieces). What the Context transform, the .vqkv writer and
// `bench codec` code.
StreamCodeSlices context_slices(const QuantizedStream& stream, std::size_t t0 = 0, std::size_t count = 0);
ContextLayout context_layout(const QuantizedStream& stream);

// Symbols of one channel (n tokens at codes[c], codes[c + stride], ...), as the codec models them:
// the piece boundaries restart the delta. Appends to `out`. Exposed for benchmarks and tests.
void channel_symbols(const std::uint8_t* codes, std::size_t stride, std::span<const std::int64_t> piece_tokens, int bits,
                     SymbolTransform transform, std::vector<std::uint16_t>& out);
// Alphabet of the transform's symbols for b-bit codes: 2^b (Codes, Context) or 2^(b+1) - 1 (TokenDelta).
int symbol_alphabet(int bits, SymbolTransform transform);

}  // namespace vq
