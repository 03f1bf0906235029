// Incremental symbol histograms with an O(1) Shannon estimate per histogram.
//
// For a histogram with counts c_i summing to N, N * H = N log2 N - S where S = sum_i c_i log2 c_i.
// S is kept up to date as symbols are added and removed, so the estimate after a decode step costs
// O(new symbols), never O(context). Values agree with a from-scratch symbol_entropy_bits to about
// 1e-9 relative (floating-point summation order differs).
#pragma once
#include <cstdint>
#include <vector>

namespace vq {

class ChannelHistograms {
 public:
  ChannelHistograms() = default;
  // `count` histograms over symbols in [min_symbol, min_symbol + alphabet_size).
  ChannelHistograms(std::size_t count, int min_symbol, int alphabet_size);

  void add(std::size_t hist, int symbol);
  // Add n symbols read at symbols[0], symbols[stride], ...; recounts S from the counts when that
  // is cheaper than n incremental updates (n > alphabet size).
  void add_many(std::size_t hist, const std::int16_t* symbols, std::size_t n, std::size_t stride);
  // Bulk path: bump counts directly through counts(hist) (symbol s at index s - min_symbol()),
  // then call recount(hist, added) once to add `added` to the total and recompute S. Cheaper than
  // add() when a histogram receives more symbols than its alphabet size.
  std::uint32_t* counts(std::size_t hist) { return counts_.data() + hist * static_cast<std::size_t>(alphabet_); }
  void recount(std::size_t hist, std::uint64_t added);
  int min_symbol() const { return min_symbol_; }
  int alphabet_size() const { return alphabet_; }
  // Throws std::logic_error when the symbol is not present (an internal invariant).
  void remove(std::size_t hist, int symbol);

  std::uint64_t total(std::size_t hist) const { return totals_[hist]; }
  // N * H of histogram `hist`, in bits (0 when empty).
  double total_bits(std::size_t hist) const;
  // min(H, cap_bits) * N: the reference's capped estimate of code bits.
  double capped_bits(std::size_t hist, double cap_bits) const;
  // The same estimate for a histogram held elsewhere: N symbols whose counts c_i give
  // sum_xlogx = sum_i c_i log2 c_i.
  static double capped_bits_of(std::uint64_t n, double sum_xlogx, double cap_bits);
  std::size_t count() const { return totals_.size(); }
  // Bytes of memory held.
  std::size_t memory_bytes() const {
    return counts_.capacity() * sizeof(std::uint32_t) + totals_.capacity() * sizeof(std::uint64_t) + sum_xlogx_.capacity() * sizeof(double);
  }
  std::uint32_t symbol_count(std::size_t hist, int symbol) const;

 private:
  int min_symbol_ = 0;
  int alphabet_ = 0;
  std::vector<std::uint32_t> counts_;  // [count][alphabet]
  std::vector<std::uint64_t> totals_;
  std::vector<double> sum_xlogx_;      // S per histogram
};

// x * log2(x), 0 for x = 0; table-backed for small x.
double xlog2x(std::uint64_t x);

}  // namespace vq
