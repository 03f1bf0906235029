#include "veloxquant/entropy/entropy_estimate.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"

namespace vq {

namespace {
double entropy_of_counts(const std::vector<std::uint64_t>& counts, std::uint64_t total) {
  if (total == 0) return 0.0;
  double h = 0.0;
  const double n = static_cast<double>(total);
  for (auto c : counts) {
    if (c == 0) continue;
    const double p = static_cast<double>(c) / n;
    h -= p * std::log2(p);
  }
  return h;
}

template <class Get>
double entropy_of(std::size_t n, Get get) {
  if (n == 0) return 0.0;
  int lo = get(0), hi = get(0);
  for (std::size_t i = 1; i < n; ++i) {
    lo = std::min(lo, get(i));
    hi = std::max(hi, get(i));
  }
  std::vector<std::uint64_t> counts(static_cast<std::size_t>(hi - lo + 1), 0);
  for (std::size_t i = 0; i < n; ++i) ++counts[static_cast<std::size_t>(get(i) - lo)];
  return entropy_of_counts(counts, n);
}
}  // namespace

double symbol_entropy_bits(std::span<const std::int16_t> symbols) {
  return entropy_of(symbols.size(), [&](std::size_t i) { return static_cast<int>(symbols[i]); });
}

double estimated_code_bits(std::span<const std::int16_t> symbols, int n_tokens, int dim, int bits, bool per_channel) {
  require(n_tokens >= 0 && dim >= 1 && symbols.size() == static_cast<std::size_t>(n_tokens) * static_cast<std::size_t>(dim),
          "estimated_code_bits: {} symbols given for a [{}, {}] slice", symbols.size(), n_tokens, dim);
  const double n = static_cast<double>(n_tokens);
  if (!per_channel) return std::min(symbol_entropy_bits(symbols), static_cast<double>(bits)) * n * dim;
  double total = 0.0;
  const auto d = static_cast<std::size_t>(dim);
  for (std::size_t c = 0; c < d; ++c) {
    const double h = entropy_of(static_cast<std::size_t>(n_tokens), [&](std::size_t i) { return static_cast<int>(symbols[i * d + c]); });
    total += std::min(h, static_cast<double>(bits)) * n;
  }
  return total;
}

std::uint64_t code_bits_to_bytes(double code_bits) {
  if (code_bits <= 0.0) return 0;
  return static_cast<std::uint64_t>(std::ceil(code_bits / 8.0));
}

std::uint64_t entropy_coded_bytes(std::span<const std::int16_t> symbols, int n_tokens, int dim, int bits, int n_groups,
                                  bool per_channel) {
  return code_bits_to_bytes(estimated_code_bits(symbols, n_tokens, dim, bits, per_channel)) +
         static_cast<std::uint64_t>(n_groups) * static_cast<std::uint64_t>(dim) * kGroupMetaBytesPerChannel;
}

std::uint64_t fixed_width_bytes(std::int64_t n_tokens, int dim, int bits, std::int64_t n_groups) {
  const std::uint64_t code_bits = static_cast<std::uint64_t>(n_tokens) * static_cast<std::uint64_t>(dim) * static_cast<std::uint64_t>(bits);
  return (code_bits + 7) / 8 + static_cast<std::uint64_t>(n_groups) * static_cast<std::uint64_t>(dim) * kGroupMetaBytesPerChannel;
}

}  // namespace vq
