// Interleaved static rANS: 32 lanes of 32-bit states, 16-bit renormalisation, one shared buffer.
//
// What a reader must know first (after ryg_rans and htscodecs' rANS 32x16):
// - Symbols are uint16 indices 0 .. alphabet-1 of a FrequencyTable (frequency_table.hpp); a symbol
//   with frequency 0 cannot be encoded (InvalidArgument).
// - Symbol i of the stream is coded by lane i % kRansLanes. All lanes share one buffer of 16-bit
//   words. The ENCODER RUNS BACKWARDS (last symbol first) and writes words from the end of the
//   buffer downwards, so that the decoder runs forwards and reads them in ascending order: within a
//   group of 32 symbols, lane 0's word (if it needs one) comes first.
// - A state x lives in [kRansStateLow, 2^31). Decoding a symbol: slot = x mod 2^scale_bits,
//   s = symbol at slot, x = freq(s) * (x >> scale_bits) + slot - cum(s); then if x < kRansStateLow,
//   x = (x << 16) | next word. One refill always suffices (x >= 1 before it). The encoder is the
//   exact inverse; every lane starts (encoder) and must end (decoder) at kRansStateLow, which the
//   decoder checks: a mismatch, a short or a long payload is a FormatError.
// - A stream may hold several segments coded with different tables (e.g. one per channel): the
//   states run on across segments, so the 32 final states (up to 128 bytes) are paid once per
//   stream, not per segment. Lane assignment uses the index in the whole stream.
// - Stream format (integers little-endian, varint = unsigned LEB128):
//     varint  n                        symbols in the stream (all segments)
//     u32     state[min(n, 32)]        final encoder states = initial decoder states, lanes 0..
//                                      (lanes >= n never code a symbol and are not stored)
//     u16     word[...]                renormalisation words, in decoder read order, to the end
// - Two kernels produce identical bytes and symbols: Scalar (the reference: plain division in the
//   encoder, cum/freq lookups in the decoder) and Avx2 (reciprocal multiply in the encoder; in the
//   decoder, for alphabets <= 16 a comparison of the slot against cumulative frequencies held in
//   registers, above that 8-lane gathers from a per-segment slot table), chosen at run time by
//   Auto when the CPU has AVX2.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "veloxquant/entropy/frequency_table.hpp"

namespace vq {

// 32 lanes = 4 AVX2 vectors of 8: four independent decode chains hide the lookup latency, and a
// group of 32 symbols is also one GPU warp. Part of the format: changing it changes every stream.
inline constexpr int kRansLanes = 32;
// Lower bound L of a state: 2^15. States stay below 2^31 = L << 16 so that (a) one 16-bit word
// renormalises, (b) the encoder's 32-bit reciprocal (Alverson's method, as in ryg_rans) is exact
// for x < 2^31, and (c) x >> scale_bits >= 1 for every scale_bits <= 15, so x never reaches 0.
inline constexpr std::uint32_t kRansStateLow = 1u << 15;

enum class RansKernel {
  Auto,    // the fastest the CPU has: Avx512, else Avx2, else Scalar
  Scalar,  // the reference
  Avx2,    // throws InvalidArgument where the CPU lacks AVX2
  // The vq codec's 16-lane kernels (vq/codec.hpp); the other coders, which have no AVX-512
  // kernels, run their AVX2 ones. Throws InvalidArgument where the CPU lacks AVX-512 F/BW/VL.
  Avx512,
};
bool rans_avx2_available();
bool rans_avx512_available();  // AVX-512 F, BW and VL (and AVX2)

// One piece of a stream and its table. The table must outlive the call.
struct RansEncodeSegment {
  std::span<const std::uint16_t> symbols;
  const FrequencyTable* table = nullptr;
};
struct RansDecodeSegment {
  std::span<std::uint16_t> out;
  const FrequencyTable* table = nullptr;
};

// Worst-case size in bytes of rans_encode's output for n symbols: header + 2 bytes per symbol
// (a symbol emits at most one 16-bit word), whatever the tables.
std::size_t rans_encode_bound(std::size_t n_symbols);

// Encode into a new buffer / append to `out`. Throws InvalidArgument when a symbol is outside its
// table's alphabet or has frequency 0, or a segment has no table.
std::vector<std::uint8_t> rans_encode(std::span<const std::uint16_t> symbols, const FrequencyTable& table,
                                      RansKernel kernel = RansKernel::Auto);
std::vector<std::uint8_t> rans_encode(std::span<const RansEncodeSegment> segments,
                                      RansKernel kernel = RansKernel::Auto);
void rans_encode_append(std::vector<std::uint8_t>& out, std::span<const RansEncodeSegment> segments,
                        RansKernel kernel = RansKernel::Auto);

// Decode a whole stream (exactly `bytes`, nothing after it) into `out`, whose size must equal the
// stream's symbol count: the caller's size bounds the work. Throws FormatError on any corrupt,
// truncated or trailing input, or a count mismatch; `out` is then unspecified.
void rans_decode(std::span<const std::uint8_t> bytes, const FrequencyTable& table, std::span<std::uint16_t> out,
                 RansKernel kernel = RansKernel::Auto);
void rans_decode(std::span<const std::uint8_t> bytes, std::span<const RansDecodeSegment> segments,
                 RansKernel kernel = RansKernel::Auto);
// The symbol count in a stream's header (FormatError when the header is malformed).
std::uint64_t rans_stream_symbols(std::span<const std::uint8_t> bytes);

// A self-describing block: the serialised FrequencyTable, then one rANS stream to the end.
struct RansBlockOptions {
  int scale_bits = kDefaultScaleBits;  // table precision, 1..kMaxScaleBits
  RansKernel kernel = RansKernel::Auto;
};
// Builds the table from the symbols' histogram over alphabet_size symbols.
std::vector<std::uint8_t> encode_block(std::span<const std::uint16_t> symbols, int alphabet_size,
                                       const RansBlockOptions& options = {});
// Throws FormatError when the block is malformed or holds more than max_symbols symbols (a
// single-symbol table codes any count in zero payload bytes, so only the caller can bound the
// allocation).
std::vector<std::uint16_t> decode_block(std::span<const std::uint8_t> bytes, std::size_t max_symbols,
                                        RansKernel kernel = RansKernel::Auto);

}  // namespace vq
