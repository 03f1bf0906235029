#include "veloxquant/entropy/frequency_table.hpp"

#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"

namespace {

using Hist = std::vector<std::uint32_t>;

Hist random_hist(std::mt19937& rng, int alphabet, int present, std::uint32_t max_count) {
  Hist h(static_cast<std::size_t>(alphabet), 0);
  for (int k = 0; k < present; ++k) h[rng() % static_cast<unsigned>(alphabet)] = 1 + rng() % max_count;
  return h;
}

void expect_invariants(const vq::FrequencyTable& t, const Hist& h) {
  ASSERT_EQ(t.alphabet_size(), static_cast<int>(h.size()));
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < h.size(); ++i) {
    sum += t.freq(static_cast<int>(i));
    if (h[i]) {
      EXPECT_GE(t.freq(static_cast<int>(i)), 1u) << "present symbol " << i;
    }
    if (!h[i]) {
      EXPECT_EQ(t.freq(static_cast<int>(i)), 0u) << "absent symbol " << i;
    }
    EXPECT_EQ(t.cum(static_cast<int>(i + 1)), t.cum(static_cast<int>(i)) + t.freq(static_cast<int>(i)));
  }
  EXPECT_EQ(sum, t.total());
  EXPECT_EQ(t.cum(t.alphabet_size()), t.total());
}

// Local optimality of the normaliser: no unit moved between two present symbols lowers the cost.
// The cost is separable convex, so this is global optimality.
void expect_no_improving_exchange(const vq::FrequencyTable& t, const Hist& h) {
  for (std::size_t i = 0; i < h.size(); ++i) {
    if (!h[i] || t.freq(static_cast<int>(i)) < 2) continue;
    const double loss = h[i] * std::log2(double(t.freq(int(i))) / (t.freq(int(i)) - 1));
    for (std::size_t j = 0; j < h.size(); ++j) {
      if (!h[j] || j == i) continue;
      const double gain = h[j] * std::log2(double(t.freq(int(j)) + 1) / t.freq(int(j)));
      EXPECT_LE(gain, loss * (1 + 1e-9) + 1e-9) << "move " << i << " -> " << j;
    }
  }
}

TEST(FrequencyTable, NormalisationInvariantsRandom) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int alphabet = 1 + static_cast<int>(rng() % vq::kMaxAlphabet);
    const int scale = 9 + static_cast<int>(rng() % 7);  // 9..15: any alphabet fits
    const int present = 1 + static_cast<int>(rng() % static_cast<unsigned>(alphabet));
    const Hist h = random_hist(rng, alphabet, present, trial % 2 ? 5 : 100000);
    const auto t = vq::FrequencyTable::from_histogram(h, scale);
    expect_invariants(t, h);
    if (trial % 10 == 0) expect_no_improving_exchange(t, h);
  }
}

TEST(FrequencyTable, OptimalOnSkewedSmallAlphabets) {
  std::mt19937 rng(3);
  for (int scale : {4, 8, 12}) {
    for (int trial = 0; trial < 20; ++trial) {
      Hist h(16);
      for (auto& c : h) c = rng() % 3 ? static_cast<std::uint32_t>(std::pow(2.0, rng() % 20)) : 0u;
      h[0] += 1;
      const auto t = vq::FrequencyTable::from_histogram(h, scale);
      expect_invariants(t, h);
      expect_no_improving_exchange(t, h);
    }
  }
}

TEST(FrequencyTable, CostCloseToEntropyOnLaplacian) {
  // A discretised Laplacian over 16 symbols (4-bit deltas), 4096 draws.
  Hist h(16, 0);
  std::mt19937 rng(11);
  std::exponential_distribution<double> e(0.7);
  for (int k = 0; k < 4096; ++k) {
    const double v = (rng() & 1 ? 1 : -1) * e(rng);
    ++h[static_cast<std::size_t>(std::clamp(static_cast<int>(std::lround(v)) + 8, 0, 15))];
  }
  double n = 0, hbits = 0;
  for (auto c : h) n += c;
  for (auto c : h)
    if (c) hbits -= c * std::log2(c / n);
  const auto t = vq::FrequencyTable::from_histogram(h, 12);
  EXPECT_LE(t.cost_bits(h), hbits * 1.001);
  EXPECT_GE(t.cost_bits(h), hbits - 1e-6);
}

TEST(FrequencyTable, DegenerateHistograms) {
  const auto empty = vq::FrequencyTable::from_histogram(Hist(5, 0), 10);
  EXPECT_EQ(empty.freq(0), 1024u);
  EXPECT_EQ(empty.present_symbols(), 1);
  const auto single = vq::FrequencyTable::from_histogram(Hist{0, 0, 7, 0}, 12);
  EXPECT_EQ(single.freq(2), 4096u);
  EXPECT_EQ(single.present_symbols(), 1);
  // Every symbol present, exactly as many as slots.
  const auto full = vq::FrequencyTable::from_histogram(Hist(256, 1), 8);
  for (int i = 0; i < 256; ++i) EXPECT_EQ(full.freq(i), 1u);
  // A dominant symbol still leaves 1 to each rare one.
  Hist skew(300, 1);
  skew[0] = 1u << 30;
  const auto t = vq::FrequencyTable::from_histogram(skew, 9);
  expect_invariants(t, skew);
  EXPECT_EQ(t.freq(0), 512u - 299u);
  const vq::FrequencyTable def;
  EXPECT_EQ(def.alphabet_size(), 1);
  EXPECT_EQ(def.freq(0), 1u << vq::kDefaultScaleBits);
}

TEST(FrequencyTable, RejectsBadArguments) {
  EXPECT_THROW(vq::FrequencyTable::from_histogram(Hist{}, 12), vq::InvalidArgument);
  EXPECT_THROW(vq::FrequencyTable::from_histogram(Hist(512, 1), 12), vq::InvalidArgument);
  EXPECT_THROW(vq::FrequencyTable::from_histogram(Hist(4, 1), 0), vq::InvalidArgument);
  EXPECT_THROW(vq::FrequencyTable::from_histogram(Hist(4, 1), 16), vq::InvalidArgument);
  EXPECT_THROW(vq::FrequencyTable::from_histogram(Hist(5, 1), 2), vq::InvalidArgument);  // 5 > 4 slots
  EXPECT_THROW(vq::FrequencyTable::from_frequencies(Hist{1, 2}, 2), vq::InvalidArgument);
  EXPECT_NO_THROW(vq::FrequencyTable::from_frequencies(Hist{1, 3}, 2));
  const std::vector<std::uint16_t> syms{0, 1, 4};
  EXPECT_THROW(vq::FrequencyTable::from_symbols(syms, 4), vq::InvalidArgument);
  EXPECT_EQ(vq::FrequencyTable::from_symbols(syms, 5).present_symbols(), 3);
}

TEST(FrequencyTable, SerialisationRoundTrip) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    const int alphabet = 1 + static_cast<int>(rng() % vq::kMaxAlphabet);
    const int scale = 9 + static_cast<int>(rng() % 7);
    const Hist h = random_hist(rng, alphabet, 1 + static_cast<int>(rng() % static_cast<unsigned>(alphabet)), 1000);
    const auto t = vq::FrequencyTable::from_histogram(h, scale);
    auto bytes = t.serialize();
    EXPECT_EQ(bytes.size(), t.serialized_size());
    bytes.push_back(0xAB);  // trailing data is not the table's
    std::size_t used = 0;
    const auto back = vq::FrequencyTable::deserialize(bytes, &used);
    EXPECT_EQ(used, bytes.size() - 1);
    EXPECT_EQ(back, t);
  }
}

TEST(FrequencyTable, CompactForFourBitCodes) {
  Hist h{1, 3, 10, 40, 120, 300, 600, 900, 900, 600, 300, 120, 40, 10, 3, 1};
  const auto t = vq::FrequencyTable::from_histogram(h, 12);
  EXPECT_LE(t.serialized_size(), 2u + 16u * 2u);
  // Long zero runs cost two bytes each.
  Hist sparse(511, 0);
  sparse[0] = 5;
  sparse[510] = 5;
  EXPECT_LE(vq::FrequencyTable::from_histogram(sparse, 12).serialized_size(), 3u + 2u + 3u + 2u);
}

TEST(FrequencyTable, ParserRejectsMalformed) {
  using B = std::vector<std::uint8_t>;
  auto bad = [](const B& b) { EXPECT_THROW(vq::FrequencyTable::deserialize(b), vq::FormatError) << ::testing::PrintToString(b); };
  bad({});
  bad({0, 12});                        // alphabet 0
  bad({0x80, 0x04, 12});               // alphabet 512
  bad({2, 0});                         // scale 0
  bad({2, 16});                        // scale 16
  bad({2, 2, 1, 2});                   // sums to 3, not 4
  bad({2, 2, 5});                      // frequency > 4
  bad({2, 2, 4, 0, 1});                // zero run past the alphabet
  bad({2, 2, 3, 3});                   // sums past 4
  bad({1, 2, 0x84, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01});  // varint too long
  EXPECT_EQ(vq::FrequencyTable::deserialize(B{2, 2, 0, 0, 4}).freq(1), 4u);  // a zero run then 4

  // Every truncation of a valid table fails; every single-byte change either fails or parses into
  // a table that keeps the invariants.
  const auto t = vq::FrequencyTable::from_histogram(Hist{0, 5, 0, 0, 0, 90, 3, 1000, 0, 2}, 11);
  const auto bytes = t.serialize();
  for (std::size_t n = 0; n < bytes.size(); ++n)
    EXPECT_THROW(vq::FrequencyTable::deserialize(std::span(bytes.data(), n)), vq::FormatError) << n;
  for (std::size_t i = 0; i < bytes.size(); ++i)
    for (int bit = 0; bit < 8; ++bit) {
      auto b = bytes;
      b[i] ^= static_cast<std::uint8_t>(1 << bit);
      try {
        const auto u = vq::FrequencyTable::deserialize(b);
        std::uint64_t sum = 0;
        for (auto f : u.freqs()) sum += f;
        EXPECT_EQ(sum, u.total());
      } catch (const vq::FormatError&) {
      }
    }
}

}  // namespace
