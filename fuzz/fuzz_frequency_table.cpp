// libFuzzer target: FrequencyTable::deserialize on arbitrary bytes, and from_histogram on the
// bytes read as counts. Checks: only vq::FormatError escapes the parser; a parsed table keeps its
// invariants and survives a serialise/parse round trip; normalised tables keep theirs.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "veloxquant/core/error.hpp"
#include "veloxquant/entropy/frequency_table.hpp"

namespace {

void check(const vq::FrequencyTable& t) {
  std::uint64_t sum = 0;
  for (auto f : t.freqs()) sum += f;
  if (sum != t.total() || t.cum(t.alphabet_size()) != t.total()) std::abort();
  const auto bytes = t.serialize();
  if (bytes.size() != t.serialized_size()) std::abort();
  std::size_t used = 0;
  if (!(vq::FrequencyTable::deserialize(bytes, &used) == t) || used != bytes.size()) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    check(vq::FrequencyTable::deserialize(std::span<const std::uint8_t>(data, size)));
  } catch (const vq::FormatError&) {
  }
  // The same bytes as a histogram: byte 0 picks the scale, then 16-bit counts.
  if (size >= 3) {
    const int scale = 9 + data[0] % 7;  // 9..15: room for any alphabet up to 511
    std::vector<std::uint32_t> counts;
    for (std::size_t i = 1; i + 1 < size && counts.size() < vq::kMaxAlphabet; i += 2)
      counts.push_back(static_cast<std::uint32_t>(data[i]) << (data[i + 1] & 15) | data[i + 1] >> 4);
    const auto t = vq::FrequencyTable::from_histogram(counts, scale);
    check(t);
    for (std::size_t i = 0; i < counts.size(); ++i)
      if ((counts[i] != 0) != (t.freq(static_cast<int>(i)) != 0) && counts[i] != 0) std::abort();
  }
  return 0;
}
