// The order-1 context coder (entropy/order1_coder.hpp): bit-exact round trips, per-channel and
// pooled; conditioning on the previous code pays off on correlated codes; bad bytes and codes that
// do not fit the bits are clear errors.
#include <algorithm>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/entropy/order1_coder.hpp"

namespace {

struct Codes {
  std::vector<std::vector<std::uint8_t>> slices;  // token-major
  vq::Order1Codes view;
};

// A clamped random walk along tokens per channel (correlated, as quantized K/V are), or uniform noise.
Codes make(std::size_t slices, std::size_t tokens, std::size_t channels, int bits, bool walk, unsigned seed) {
  Codes c;
  std::mt19937 g(seed);
  c.slices.assign(slices, std::vector<std::uint8_t>(tokens * channels));
  for (auto& s : c.slices)
    for (std::size_t ch = 0; ch < channels; ++ch) {
      int v = static_cast<int>(g() % (1u << bits));
      for (std::size_t t = 0; t < tokens; ++t) {
        v = walk ? std::clamp(v + static_cast<int>(g() % 3) - 1, 0, (1 << bits) - 1) : static_cast<int>(g() % (1u << bits));
        s[t * channels + ch] = static_cast<std::uint8_t>(v);
      }
    }
  c.view = {{}, tokens, channels, bits};
  for (const auto& s : c.slices) c.view.slices.push_back(s);
  return c;
}

// The codes channel-major ([slice * channels + channel][token]), as the decoder returns them.
std::vector<std::uint8_t> channel_major(const Codes& c) {
  std::vector<std::uint8_t> out;
  for (const auto& s : c.slices)
    for (std::size_t ch = 0; ch < c.view.channels; ++ch)
      for (std::size_t t = 0; t < c.view.tokens; ++t) out.push_back(s[t * c.view.channels + ch]);
  return out;
}

TEST(Order1Coder, RoundTripsBitExactly) {
  for (const bool pooled : {false, true})
    for (const int bits : {1, 2, 4, 8})
      for (const auto [slices, tokens, channels] : {std::tuple{1, 100, 8}, {3, 37, 5}, {2, 0, 4}, {1, 1, 1}}) {
        SCOPED_TRACE(::testing::Message() << "pooled=" << pooled << " bits=" << bits << " " << slices << "x" << tokens << "x" << channels);
        const Codes c = make(static_cast<std::size_t>(slices), static_cast<std::size_t>(tokens), static_cast<std::size_t>(channels), bits, true, 7);
        const auto bytes = vq::order1_encode(c.view, pooled);
        EXPECT_EQ(vq::order1_decode(bytes, c.view, pooled), channel_major(c));
      }
}

TEST(Order1Coder, CorrelatedCodesCostLessThanNoise) {
  const Codes walk = make(2, 2000, 8, 4, true, 1), noise = make(2, 2000, 8, 4, false, 1);
  const std::size_t w = vq::order1_encode(walk.view, true).size(), n = vq::order1_encode(noise.view, true).size();
  // A +-1 walk has at most 3 successors per context: about log2(3) bits per code against 4.
  EXPECT_LT(w, n * 1.7 / 4.0) << w << " vs " << n;
  EXPECT_GT(n, 2u * 2000u * 8u * 4u / 8u * 95u / 100u);  // noise stays near 4 bits per code
}

TEST(Order1Coder, BadInputIsAClearError) {
  const Codes c = make(1, 50, 4, 3, true, 3);
  const auto bytes = vq::order1_encode(c.view, false);
  for (std::size_t cut : {std::size_t{0}, bytes.size() / 3, bytes.size() - 1}) {
    EXPECT_THROW(vq::order1_decode(std::span<const std::uint8_t>(bytes).first(cut), c.view, false), vq::FormatError) << cut;
  }
  // Another shape than the one encoded: the histograms disagree with it.
  vq::Order1Codes longer = c.view;
  longer.tokens = 51;
  EXPECT_THROW(vq::order1_decode(bytes, longer, false), vq::FormatError);
  // A code past the bits, a slice of the wrong size, bits outside 1..8.
  Codes wide = make(1, 10, 2, 3, true, 4);
  wide.slices[0][5] = 8;
  wide.view.slices[0] = wide.slices[0];
  EXPECT_THROW(vq::order1_encode(wide.view, false), vq::InvalidArgument);
  vq::Order1Codes shortv = c.view;
  shortv.tokens = 49;
  EXPECT_THROW(vq::order1_encode(shortv, false), vq::InvalidArgument);
  vq::Order1Codes nine = c.view;
  nine.bits = 9;
  EXPECT_THROW(vq::order1_encode(nine, false), vq::InvalidArgument);
}

}  // namespace
