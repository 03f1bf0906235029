#include "veloxquant/entropy/rans.hpp"

#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"

namespace {

using Syms = std::vector<std::uint16_t>;
using Bytes = std::vector<std::uint8_t>;

enum class Dist { Uniform, Laplace, Geometric };

// Symbols over [0, alphabet): uniform, a discretised Laplacian centred mid-alphabet (like token
// deltas), or a steep geometric (one dominant symbol).
Syms make_symbols(int alphabet, std::size_t n, Dist dist, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Syms s(n);
  std::exponential_distribution<double> lap(0.6), geo(2.0);
  for (auto& v : s) {
    int x = 0;
    if (dist == Dist::Uniform) x = static_cast<int>(rng() % static_cast<unsigned>(alphabet));
    if (dist == Dist::Laplace) x = alphabet / 2 + static_cast<int>(std::lround((rng() & 1 ? 1 : -1) * lap(rng)));
    if (dist == Dist::Geometric) x = static_cast<int>(geo(rng));
    v = static_cast<std::uint16_t>(std::clamp(x, 0, alphabet - 1));
  }
  return s;
}

std::vector<vq::RansKernel> kernels() {
  std::vector<vq::RansKernel> k{vq::RansKernel::Scalar};
  if (vq::rans_avx2_available()) k.push_back(vq::RansKernel::Avx2);
  return k;
}

// Encode with every kernel (identical bytes), decode with every kernel into junk (identical symbols).
Bytes round_trip(const Syms& s, const vq::FrequencyTable& t) {
  const Bytes ref = vq::rans_encode(s, t, vq::RansKernel::Scalar);
  EXPECT_LE(ref.size(), vq::rans_encode_bound(s.size()));
  for (auto k : kernels()) {
    EXPECT_EQ(vq::rans_encode(s, t, k), ref) << "encoder kernel " << static_cast<int>(k);
    Syms out(s.size(), 0xBEEF);
    vq::rans_decode(ref, t, out, k);
    EXPECT_EQ(out, s) << "decoder kernel " << static_cast<int>(k);
  }
  return ref;
}

TEST(RansRoundTrip, AlphabetsSizesDistributions) {
  const std::size_t sizes[] = {0, 1, 2, 31, 32, 33, 63, 64, 65, 100, 4095, 4096};
  for (int alphabet : {1, 2, 3, 5, 16, 17, 64, 255, 256, 300, 511})
    for (Dist d : {Dist::Uniform, Dist::Laplace, Dist::Geometric})
      for (std::size_t n : sizes) {
        const Syms s = make_symbols(alphabet, n, d, 1000 * alphabet + n);
        const auto t = vq::FrequencyTable::from_symbols(s, alphabet, 12);
        round_trip(s, t);
      }
}

TEST(RansRoundTrip, LargeStreamsAllScales) {
  for (int scale = 9; scale <= vq::kMaxScaleBits; ++scale)
    for (int alphabet : {16, 256, 511}) {
      const Syms s = make_symbols(alphabet, 100000, Dist::Laplace, static_cast<std::uint64_t>(scale));
      const auto t = vq::FrequencyTable::from_symbols(s, alphabet, scale);
      const Bytes b = round_trip(s, t);
      std::vector<std::uint32_t> h(static_cast<std::size_t>(alphabet));
      for (auto v : s) ++h[v];
      // Within 0.5% + the states of the ideal cost under the table.
      EXPECT_LE(static_cast<double>(b.size()), t.cost_bits(h) / 8 * 1.005 + 4 * vq::kRansLanes + 8);
    }
}

TEST(RansRoundTrip, SmallScalesAndTinyAlphabets) {
  for (int scale = 1; scale <= 8; ++scale)
    for (int alphabet : {1, 2, 3}) {
      if (alphabet > (1 << scale)) continue;
      const Syms s = make_symbols(alphabet, 1000, Dist::Uniform, 99);
      round_trip(s, vq::FrequencyTable::from_symbols(s, alphabet, scale));
    }
}

TEST(RansRoundTrip, SingleSymbolCostsNoPayload) {
  const Syms s(5000, 3);
  const auto t = vq::FrequencyTable::from_symbols(s, 7, 12);
  const Bytes b = round_trip(s, t);
  EXPECT_EQ(b.size(), 2u + 4u * vq::kRansLanes);  // varint(5000) + the states, no words
  const Syms one(1, 0);
  round_trip(one, vq::FrequencyTable::from_symbols(one, 1, 15));
}

TEST(RansRoundTrip, EmptyStreamIsOneByte) {
  const vq::FrequencyTable t;
  EXPECT_EQ(vq::rans_encode(Syms{}, t), Bytes{0});
  Syms out;
  vq::rans_decode(Bytes{0}, t, out);
}

TEST(RansRoundTrip, SegmentsWithDifferentTablesShareStates) {
  std::mt19937 rng(4);
  for (int trial = 0; trial < 40; ++trial) {
    const int nseg = 1 + static_cast<int>(rng() % 6);
    std::vector<Syms> syms;
    std::vector<vq::FrequencyTable> tables;
    for (int k = 0; k < nseg; ++k) {
      const int alphabet = 1 + static_cast<int>(rng() % 300);
      syms.push_back(make_symbols(alphabet, rng() % 3 ? rng() % 700 : rng() % 5, static_cast<Dist>(rng() % 3), rng()));
      tables.push_back(vq::FrequencyTable::from_symbols(syms.back(), alphabet, 9 + static_cast<int>(rng() % 7)));
    }
    std::vector<vq::RansEncodeSegment> enc;
    for (int k = 0; k < nseg; ++k) enc.push_back({syms[k], &tables[k]});
    const Bytes ref = vq::rans_encode(enc, vq::RansKernel::Scalar);
    for (auto kern : kernels()) {
      EXPECT_EQ(vq::rans_encode(enc, kern), ref);
      std::vector<Syms> outs;
      for (auto& s : syms) outs.emplace_back(s.size(), 0xFFFF);
      std::vector<vq::RansDecodeSegment> dec;
      for (int k = 0; k < nseg; ++k) dec.push_back({outs[k], &tables[k]});
      vq::rans_decode(ref, dec, kern);
      EXPECT_EQ(outs, syms);
    }
  }
}

TEST(RansRoundTrip, BlockIsSelfDescribing) {
  for (std::size_t n : {0, 1, 33, 4096}) {
    const Syms s = make_symbols(16, n, Dist::Laplace, n);
    for (auto k : kernels()) {
      const Bytes b = vq::encode_block(s, 16, {.scale_bits = 11, .kernel = k});
      EXPECT_EQ(vq::decode_block(b, n, k), s);
      if (n) {
        EXPECT_THROW(vq::decode_block(b, n - 1, k), vq::FormatError);
      }
    }
  }
}

TEST(RansErrors, EncoderRejectsSymbolsTheTableCannotCode) {
  const auto t = vq::FrequencyTable::from_histogram(std::vector<std::uint32_t>{1, 0, 1}, 4);
  EXPECT_THROW(vq::rans_encode(Syms{0, 1}, t), vq::InvalidArgument);
  EXPECT_THROW(vq::rans_encode(Syms{0, 3}, t), vq::InvalidArgument);
  vq::RansEncodeSegment no_table{};
  EXPECT_THROW(vq::rans_encode(std::span(&no_table, 1)), vq::InvalidArgument);
  EXPECT_THROW(vq::encode_block(Syms{0, 16}, 16), vq::InvalidArgument);
}

TEST(RansErrors, CountMismatchAndTrailingBytes) {
  const Syms s = make_symbols(16, 500, Dist::Laplace, 1);
  const auto t = vq::FrequencyTable::from_symbols(s, 16);
  Bytes b = vq::rans_encode(s, t);
  for (auto k : kernels()) {
    Syms fewer(499), more(501);
    EXPECT_THROW(vq::rans_decode(b, t, fewer, k), vq::FormatError);
    EXPECT_THROW(vq::rans_decode(b, t, more, k), vq::FormatError);
    Bytes extra = b;
    extra.push_back(0);
    Syms out(500);
    EXPECT_THROW(vq::rans_decode(extra, t, out, k), vq::FormatError);  // odd payload
    extra.push_back(0);
    EXPECT_THROW(vq::rans_decode(extra, t, out, k), vq::FormatError);  // a word left over
  }
}

// Every truncation and every single-bit flip of a small stream: a FormatError, or (rarely) a clean
// decode, never a crash (the ASan build checks the "never reads out of bounds" half).
TEST(RansErrors, TruncationsAndBitFlipsAreDetected) {
  const Syms s = make_symbols(16, 300, Dist::Laplace, 2);
  const auto t = vq::FrequencyTable::from_symbols(s, 16);
  const Bytes b = vq::rans_encode(s, t);
  for (auto k : kernels()) {
    Syms out(s.size());
    for (std::size_t n = 0; n < b.size(); ++n)
      EXPECT_THROW(vq::rans_decode(std::span(b.data(), n), t, out, k), vq::FormatError) << n;
    std::size_t detected = 0, total = 0;
    for (std::size_t i = 0; i < b.size(); ++i)
      for (int bit = 0; bit < 8; ++bit) {
        Bytes c = b;
        c[i] ^= static_cast<std::uint8_t>(1 << bit);
        ++total;
        try {
          vq::rans_decode(c, t, out, k);
        } catch (const vq::FormatError&) {
          ++detected;
        }
      }
    EXPECT_GE(detected, total * 99 / 100) << detected << " of " << total;
  }
}

TEST(RansErrors, WrongTableOrCorruptBlockNeverCrashes) {
  const Syms s = make_symbols(256, 2000, Dist::Laplace, 3);
  const auto t = vq::FrequencyTable::from_symbols(s, 256);
  const Bytes b = vq::rans_encode(s, t);
  const auto other = vq::FrequencyTable::from_symbols(make_symbols(256, 2000, Dist::Uniform, 4), 256);
  for (auto k : kernels()) {
    Syms out(s.size());
    EXPECT_THROW(vq::rans_decode(b, other, out, k), vq::FormatError);
  }
  Bytes block = vq::encode_block(s, 256);
  std::mt19937 rng(8);
  for (int trial = 0; trial < 2000; ++trial) {
    Bytes c = block;
    for (int j = 0; j < 3; ++j) c[rng() % c.size()] = static_cast<std::uint8_t>(rng());
    if (trial % 4 == 0) c.resize(rng() % c.size());
    for (auto k : kernels()) {
      try {
        const auto got = vq::decode_block(c, 4000, k);
        EXPECT_LE(got.size(), 4000u);
      } catch (const vq::FormatError&) {
      }
    }
  }
}

TEST(RansErrors, BadStatesAndHugeCounts) {
  const vq::FrequencyTable t;
  Syms out(1);
  // n = 1, state below 2^15.
  EXPECT_THROW(vq::rans_decode(Bytes{1, 0xff, 0x7f, 0, 0}, t, out), vq::FormatError);
  // n = 1, state 2^31.
  EXPECT_THROW(vq::rans_decode(Bytes{1, 0, 0, 0, 0x80}, t, out), vq::FormatError);
  // n = 1, state 2^15 exactly: the single-symbol table decodes it and returns to 2^15.
  vq::rans_decode(Bytes{1, 0, 0x80, 0, 0}, t, out);
  EXPECT_EQ(out[0], 0);
  // A block claiming 2^60 symbols is refused before any allocation.
  Bytes block = t.serialize();
  for (std::uint8_t v : {0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x10}) block.push_back(v);
  EXPECT_THROW(vq::decode_block(block, 1u << 20), vq::FormatError);
  EXPECT_THROW(vq::rans_stream_symbols(Bytes{0x80}), vq::FormatError);
}

TEST(RansKernels, Avx2MatchesScalarOnRandomStreams) {
  if (!vq::rans_avx2_available()) GTEST_SKIP() << "no AVX2 on this CPU";
  std::mt19937 rng(12);
  for (int trial = 0; trial < 200; ++trial) {
    const int alphabet = 1 + static_cast<int>(rng() % 511);
    const Syms s = make_symbols(alphabet, rng() % 5000, static_cast<Dist>(rng() % 3), rng());
    const auto t = vq::FrequencyTable::from_symbols(s, alphabet, 9 + static_cast<int>(rng() % 7));
    round_trip(s, t);
  }
}

}  // namespace
