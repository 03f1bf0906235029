#include "veloxquant/entropy/channel_histograms.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <stdexcept>

namespace vq {

namespace {
constexpr std::size_t kTable = 1 << 16;
const std::array<double, kTable>& xlogx_table() {
  static const std::array<double, kTable> table = [] {
    std::array<double, kTable> t{};
    for (std::size_t i = 1; i < kTable; ++i) t[i] = static_cast<double>(i) * std::log2(static_cast<double>(i));
    return t;
  }();
  return table;
}
}  // namespace

double xlog2x(std::uint64_t x) {
  if (x < kTable) return xlogx_table()[x];
  const double d = static_cast<double>(x);
  return d * std::log2(d);
}

ChannelHistograms::ChannelHistograms(std::size_t count, int min_symbol, int alphabet_size)
    : min_symbol_(min_symbol),
      alphabet_(alphabet_size),
      counts_(count * static_cast<std::size_t>(alphabet_size), 0),
      totals_(count, 0),
      sum_xlogx_(count, 0.0) {}

void ChannelHistograms::add(std::size_t hist, int symbol) {
  std::uint32_t& c = counts_[hist * static_cast<std::size_t>(alphabet_) + static_cast<std::size_t>(symbol - min_symbol_)];
  sum_xlogx_[hist] += xlog2x(c + 1ull) - xlog2x(c);
  ++c;
  ++totals_[hist];
}

void ChannelHistograms::add_many(std::size_t hist, const std::int16_t* symbols, std::size_t n, std::size_t stride) {
  if (n <= static_cast<std::size_t>(alphabet_)) {
    for (std::size_t i = 0; i < n; ++i) add(hist, symbols[i * stride]);
    return;
  }
  std::uint32_t* c = counts(hist);
  for (std::size_t i = 0; i < n; ++i) ++c[symbols[i * stride] - min_symbol_];
  recount(hist, n);
}

void ChannelHistograms::recount(std::size_t hist, std::uint64_t added) {
  const std::uint32_t* c = counts(hist);
  totals_[hist] += added;
  double s = 0.0;
  for (int a = 0; a < alphabet_; ++a) s += xlog2x(c[a]);
  sum_xlogx_[hist] = s;
}

void ChannelHistograms::remove(std::size_t hist, int symbol) {
  std::uint32_t& c = counts_[hist * static_cast<std::size_t>(alphabet_) + static_cast<std::size_t>(symbol - min_symbol_)];
  if (c == 0) throw std::logic_error("ChannelHistograms::remove: symbol not present");
  sum_xlogx_[hist] += xlog2x(c - 1ull) - xlog2x(c);
  --c;
  --totals_[hist];
  if (totals_[hist] == 0) sum_xlogx_[hist] = 0.0;  // drop accumulated rounding noise
}

namespace {
double total_bits_of(std::uint64_t n, double sum_xlogx) {
  if (n == 0) return 0.0;
  const double bits = xlog2x(n) - sum_xlogx;
  // Any histogram with two or more distinct symbols has N*H >= 1 bit, so a smaller result is
  // rounding noise of a single-symbol histogram, whose entropy is exactly 0.
  return bits < 0.5 ? 0.0 : bits;
}
}  // namespace

double ChannelHistograms::total_bits(std::size_t hist) const { return total_bits_of(totals_[hist], sum_xlogx_[hist]); }

double ChannelHistograms::capped_bits(std::size_t hist, double cap_bits) const {
  return capped_bits_of(totals_[hist], sum_xlogx_[hist], cap_bits);
}

double ChannelHistograms::capped_bits_of(std::uint64_t n, double sum_xlogx, double cap_bits) {
  return std::min(total_bits_of(n, sum_xlogx), cap_bits * static_cast<double>(n));
}

std::uint32_t ChannelHistograms::symbol_count(std::size_t hist, int symbol) const {
  if (symbol < min_symbol_ || symbol >= min_symbol_ + alphabet_) return 0;
  return counts_[hist * static_cast<std::size_t>(alphabet_) + static_cast<std::size_t>(symbol - min_symbol_)];
}

}  // namespace vq
