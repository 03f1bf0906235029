#include "veloxquant/entropy/frequency_table.hpp"

#include <cmath>
#include <limits>
#include <string>

#include "byte_io.hpp"
#include "veloxquant/core/error.hpp"

namespace vq {
namespace {

void check_shape(std::size_t alphabet, int scale_bits) {
  require(alphabet >= 1 && alphabet <= static_cast<std::size_t>(kMaxAlphabet),
          "frequency table: alphabet size " + std::to_string(alphabet) + " is outside 1.." +
              std::to_string(kMaxAlphabet));
  require(scale_bits >= 1 && scale_bits <= kMaxScaleBits,
          "frequency table: scale_bits " + std::to_string(scale_bits) + " is outside 1.." +
              std::to_string(kMaxScaleBits));
}

// Bits saved by raising a frequency f -> f + 1 for a symbol seen c times (>= 0).
double gain_up(std::uint64_t c, std::uint32_t f) {
  return static_cast<double>(c) * std::log2(static_cast<double>(f + 1) / static_cast<double>(f));
}
// Bits lost by lowering f -> f - 1 (f >= 2).
double loss_down(std::uint64_t c, std::uint32_t f) {
  return static_cast<double>(c) * std::log2(static_cast<double>(f) / static_cast<double>(f - 1));
}

}  // namespace

FrequencyTable::FrequencyTable() : FrequencyTable(std::vector<std::uint32_t>{1u << kDefaultScaleBits}, kDefaultScaleBits) {}

FrequencyTable::FrequencyTable(std::vector<std::uint32_t> freqs, int scale_bits)
    : freq_(std::move(freqs)), cum_(freq_.size() + 1, 0), scale_bits_(scale_bits) {
  for (std::size_t i = 0; i < freq_.size(); ++i) cum_[i + 1] = cum_[i] + freq_[i];
}

FrequencyTable FrequencyTable::from_frequencies(std::span<const std::uint32_t> freqs, int scale_bits) {
  check_shape(freqs.size(), scale_bits);
  std::uint64_t sum = 0;
  for (auto f : freqs) sum += f;
  require(sum == (1ull << scale_bits), "frequency table: frequencies sum to " + std::to_string(sum) +
                                           ", not 2^" + std::to_string(scale_bits));
  return FrequencyTable(std::vector<std::uint32_t>(freqs.begin(), freqs.end()), scale_bits);
}

FrequencyTable FrequencyTable::from_symbols(std::span<const std::uint16_t> symbols, int alphabet_size, int scale_bits) {
  check_shape(static_cast<std::size_t>(alphabet_size > 0 ? alphabet_size : 0), scale_bits);
  std::vector<std::uint32_t> counts(static_cast<std::size_t>(alphabet_size), 0);
  for (auto s : symbols) {
    if (s >= alphabet_size)
      throw InvalidArgument("frequency table: symbol " + std::to_string(s) + " is outside the alphabet 0.." +
                            std::to_string(alphabet_size - 1));
    ++counts[s];
  }
  return from_histogram(counts, scale_bits);
}

FrequencyTable FrequencyTable::from_histogram(std::span<const std::uint32_t> counts, int scale_bits) {
  check_shape(counts.size(), scale_bits);
  const std::uint32_t M = 1u << scale_bits;
  const std::size_t a = counts.size();
  std::uint64_t n = 0;
  std::size_t present = 0;
  for (auto c : counts) {
    n += c;
    present += c != 0;
  }
  std::vector<std::uint32_t> f(a, 0);
  if (n == 0) {
    f[0] = M;
    return FrequencyTable(std::move(f), scale_bits);
  }
  require(present <= M, "frequency table: " + std::to_string(present) + " present symbols do not fit in 2^" +
                            std::to_string(scale_bits) + " slots; use more scale bits");

  // 1. Proportional start, every present symbol at least 1.
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < a; ++i) {
    if (!counts[i]) continue;
    const double ideal = static_cast<double>(counts[i]) * M / static_cast<double>(n);
    f[i] = std::max<std::uint32_t>(1, static_cast<std::uint32_t>(std::llround(ideal)));
    sum += f[i];
  }
  // 2. Make the total exact, one unit at a time where it costs least.
  while (sum > M) {
    std::size_t best = a;
    double best_loss = std::numeric_limits<double>::infinity();
    for (std::size_t i = 0; i < a; ++i)
      if (f[i] > 1) {
        const double l = loss_down(counts[i], f[i]);
        if (l < best_loss) best_loss = l, best = i;
      }
    --f[best];
    --sum;
  }
  while (sum < M) {
    std::size_t best = a;
    double best_gain = -1.0;
    for (std::size_t i = 0; i < a; ++i)
      if (counts[i]) {
        const double g = gain_up(counts[i], f[i]);
        if (g > best_gain) best_gain = g, best = i;
      }
    ++f[best];
    ++sum;
  }
  // 3. Exchange units while a move lowers the cost. The cost is a sum of convex functions of each
  // frequency, so no improving single-unit exchange means the table is optimal. Each move lowers the
  // cost strictly; the cap only guards against floating-point ties.
  for (std::size_t iter = 0; iter < 8 * a + 64; ++iter) {
    std::size_t down = a, up = a;
    double best_loss = std::numeric_limits<double>::infinity(), best_gain = 0.0;
    for (std::size_t i = 0; i < a; ++i) {
      if (!counts[i]) continue;
      if (f[i] > 1) {
        const double l = loss_down(counts[i], f[i]);
        if (l < best_loss) best_loss = l, down = i;
      }
    }
    if (down == a) break;
    for (std::size_t i = 0; i < a; ++i) {
      if (!counts[i] || i == down) continue;
      const double g = gain_up(counts[i], f[i]);
      if (g > best_gain) best_gain = g, up = i;
    }
    if (up == a || best_gain <= best_loss * (1.0 + 1e-12)) break;
    --f[down];
    ++f[up];
  }
  return FrequencyTable(std::move(f), scale_bits);
}

int FrequencyTable::present_symbols() const {
  int n = 0;
  for (auto f : freq_) n += f != 0;
  return n;
}

double FrequencyTable::cost_bits(std::span<const std::uint32_t> counts) const {
  double bits = 0.0;
  const double M = static_cast<double>(total());
  for (std::size_t i = 0; i < counts.size(); ++i) {
    if (!counts[i]) continue;
    if (i >= freq_.size() || freq_[i] == 0) return std::numeric_limits<double>::infinity();
    bits += static_cast<double>(counts[i]) * std::log2(M / static_cast<double>(freq_[i]));
  }
  return bits;
}

void FrequencyTable::serialize_to(std::vector<std::uint8_t>& out) const {
  using entropy_detail::put_varint;
  put_varint(out, freq_.size());
  out.push_back(static_cast<std::uint8_t>(scale_bits_));
  for (std::size_t i = 0; i < freq_.size();) {
    if (freq_[i]) {
      put_varint(out, freq_[i]);
      ++i;
      continue;
    }
    std::size_t run = 1;
    while (i + run < freq_.size() && freq_[i + run] == 0) ++run;
    put_varint(out, 0);
    put_varint(out, run - 1);
    i += run;
  }
}

std::vector<std::uint8_t> FrequencyTable::serialize() const {
  std::vector<std::uint8_t> out;
  out.reserve(serialized_size());
  serialize_to(out);
  return out;
}

std::size_t FrequencyTable::serialized_size() const {
  using entropy_detail::varint_size;
  std::size_t n = varint_size(freq_.size()) + 1;
  for (std::size_t i = 0; i < freq_.size();) {
    if (freq_[i]) {
      n += varint_size(freq_[i]);
      ++i;
      continue;
    }
    std::size_t run = 1;
    while (i + run < freq_.size() && freq_[i + run] == 0) ++run;
    n += 1 + varint_size(run - 1);
    i += run;
  }
  return n;
}

FrequencyTable FrequencyTable::deserialize(std::span<const std::uint8_t> bytes, std::size_t* consumed) {
  entropy_detail::ByteReader r(bytes, "frequency table");
  const auto a = static_cast<std::size_t>(r.varint(kMaxAlphabet, "alphabet size"));
  if (a == 0) r.fail("alphabet size is 0");
  const int scale_bits = r.u8();
  if (scale_bits < 1 || scale_bits > kMaxScaleBits)
    r.fail("scale_bits " + std::to_string(scale_bits) + " is outside 1.." + std::to_string(kMaxScaleBits));
  const std::uint32_t M = 1u << scale_bits;
  std::vector<std::uint32_t> f(a, 0);
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < a;) {
    const auto v = static_cast<std::uint32_t>(r.varint(M, "frequency"));
    if (v) {
      f[i++] = v;
      sum += v;
      if (sum > M) r.fail("frequencies sum past 2^" + std::to_string(scale_bits));
    } else {
      const auto run = static_cast<std::size_t>(r.varint(a - i - 1, "zero run"));
      i += run + 1;
    }
  }
  if (sum != M) r.fail("frequencies sum to " + std::to_string(sum) + ", not 2^" + std::to_string(scale_bits));
  if (consumed) *consumed = r.pos();
  return FrequencyTable(std::move(f), scale_bits);
}

}  // namespace vq
