// Static order-0 probability model for the rANS codec: symbol frequencies normalised to 2^scale_bits.
//
// What a reader must know first:
// - A table covers symbols 0 .. alphabet_size-1 (at most kMaxAlphabet). Frequencies sum to exactly
//   2^scale_bits; a symbol with frequency 0 cannot be encoded. Built from a histogram, every
//   present symbol gets a frequency >= 1, and the frequencies minimise the coded size
//   sum_i count_i * log2(2^scale_bits / freq_i) (exactly: the cost is convex per symbol, and the
//   normaliser exchanges units until no move lowers it).
// - The serialised table travels with the data and its bytes count: serialized_size() says how many.
//   Format (all varints are unsigned LEB128):
//     varint  alphabet_size            1 .. 511
//     u8      scale_bits               1 .. 15
//     entries, until alphabet_size symbols are covered, in symbol order:
//       varint f, f > 0                 the next symbol has frequency f (f <= 2^scale_bits)
//       varint 0, varint r              the next r + 1 symbols have frequency 0
//   For 4-bit codes at 12 bits this is about 2 + 16 x 2 bytes (a frequency >= 128 takes two).
// - deserialize() validates everything (ranges, exact total, no trailing entries) and throws
//   vq::FormatError; it never reads past the span it is given.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace vq {

// 511 = the signed token deltas of 8-bit codes, -255 .. 255, the widest alphabet the cache makes.
inline constexpr int kMaxAlphabet = 511;
// 15: frequencies (up to 2^15) then fit in 16 bits, and the codec's state lower bound 2^15 keeps
// x >> scale_bits >= 1 (see rans.hpp); 2^15 slot-table entries is also where decode tables leave L1/L2.
inline constexpr int kMaxScaleBits = 15;
// Default precision, chosen by measurement (docs/benchmarks.md, "rANS codec (issue 4)"): on 64
// channels x 4096 tokens, 11 bits codes within 0.11% of Shannon + table for 4- and 8-bit codes
// (12 bits: 0.04-0.10%). For alphabets above 16 it decodes faster than 12 bits because each
// channel's slot table (2^scale_bits entries) is built per stream, and at 11 bits one 32-bit slot
// entry holds freq, bias and symbol for any alphabet up to 511 (2 x 11 + 9 bits): one gather per 8
// lanes. Alphabets <= 16 (raw 4-bit codes) use no slot table, so their speed is the same at any
// precision.
inline constexpr int kDefaultScaleBits = 11;

// The precision veloxquant's encoders (the cache's stream codec and the .vqkv writer) give a table
// of `alphabet_size` symbols: 10 bits up to 16 symbols (raw codes of 1-4 bits), else
// kDefaultScaleBits. At 10 bits a 4-bit table's frequencies are mostly below 128, one varint byte
// each instead of two: on stories260K's codes (512 tokens per channel) the tables shrink by a third
// and the coded size by 2.7 %, on 4096-token channels by 0.45 %, while the payload grows by less
// than 0.01 % (docs/benchmarks.md, "Table precision"). These alphabets decode without a slot table,
// so the precision does not change decode speed; above 16 symbols 11 bits stays (one 32-bit slot
// entry per slot, and 10 bits decoded 8-bit codes slower).
inline constexpr int kSmallAlphabetScaleBits = 10;
inline int table_scale_bits(int alphabet_size) { return alphabet_size <= 16 ? kSmallAlphabetScaleBits : kDefaultScaleBits; }

class FrequencyTable {
 public:
  // A one-symbol table (symbol 0 has the whole range); alphabet 1, kDefaultScaleBits.
  FrequencyTable();

  // Normalise a histogram (counts.size() = alphabet size, 1..kMaxAlphabet) to 2^scale_bits.
  // Every symbol with a nonzero count gets a frequency >= 1. An all-zero histogram gives symbol 0
  // the whole range. Throws InvalidArgument when the alphabet is empty or too large, scale_bits is
  // outside 1..kMaxScaleBits, or more symbols are present than 2^scale_bits.
  static FrequencyTable from_histogram(std::span<const std::uint32_t> counts, int scale_bits = kDefaultScaleBits);
  // Histogram of `symbols` over alphabet_size symbols, then from_histogram. Throws InvalidArgument
  // when a symbol is >= alphabet_size.
  static FrequencyTable from_symbols(std::span<const std::uint16_t> symbols, int alphabet_size,
                                     int scale_bits = kDefaultScaleBits);
  // Use frequencies as given; throws InvalidArgument unless they sum to exactly 2^scale_bits.
  static FrequencyTable from_frequencies(std::span<const std::uint32_t> freqs, int scale_bits);

  // Parse a serialised table at the start of `bytes`; `consumed` (if not null) receives its size.
  // Throws FormatError on any malformed, truncated or inconsistent input.
  static FrequencyTable deserialize(std::span<const std::uint8_t> bytes, std::size_t* consumed = nullptr);
  // Append the serialised table to `out`.
  void serialize_to(std::vector<std::uint8_t>& out) const;
  std::vector<std::uint8_t> serialize() const;
  std::size_t serialized_size() const;

  int alphabet_size() const { return static_cast<int>(freq_.size()); }
  int scale_bits() const { return scale_bits_; }
  std::uint32_t total() const { return 1u << scale_bits_; }
  std::uint32_t freq(int symbol) const { return freq_[static_cast<std::size_t>(symbol)]; }
  // Cumulative frequency: cum(s) = sum of freq(t) for t < s; cum(alphabet_size) = total().
  std::uint32_t cum(int symbol) const { return cum_[static_cast<std::size_t>(symbol)]; }
  std::span<const std::uint32_t> freqs() const { return freq_; }
  int present_symbols() const;

  // Ideal coded size in bits of a stream with these symbol counts under this table:
  // sum_i counts_i * log2(total / freq_i); +infinity when a counted symbol has frequency 0.
  double cost_bits(std::span<const std::uint32_t> counts) const;

  friend bool operator==(const FrequencyTable& a, const FrequencyTable& b) {
    return a.scale_bits_ == b.scale_bits_ && a.freq_ == b.freq_;
  }

 private:
  FrequencyTable(std::vector<std::uint32_t> freqs, int scale_bits);
  std::vector<std::uint32_t> freq_;
  std::vector<std::uint32_t> cum_;
  int scale_bits_ = kDefaultScaleBits;
};

}  // namespace vq
