// Our method's coder (vq/codec.hpp): bit-exact round trips, the parametric tables, hostile input.
// (One suite of ~750 lines: the format's five versions and three kernels share its fixtures.)
#include "veloxquant/vq/codec.hpp"
#include "veloxquant/vq/codec_decode_into.hpp"

#include "../../src/vq/codec_kernels.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <optional>
#include <random>
#include <string>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/synth/synthetic_kv.hpp"
#include "veloxquant/vq/vq_cache.hpp"

namespace {

// Random codes: Gaussian of `sigma` code steps per coefficient, some coefficients all zero, some
// split (shift > 0) with codes up to their bound.
vq::VqLayerCodes random_codes(std::int64_t batch, std::int64_t tokens, int nk, int nv, std::uint64_t seed, bool shifts) {
  std::mt19937_64 rng(seed);
  vq::VqLayerCodes lc;
  lc.batch = batch;
  lc.tokens = tokens;
  for (vq::VqSideCodes* s : {&lc.k, &lc.v}) {
    s->n = s == &lc.k ? nk : nv;
    s->step = 0.37f;
    for (int c = 0; c < s->n; ++c) {
      s->offset.push_back(static_cast<std::int32_t>(rng() % 2001) - 1000);
      s->shift.push_back(shifts && c % 3 == 1 ? static_cast<std::uint8_t>(1 + c % vq::kVqMaxShift) : 0);
    }
    s->codes.resize(static_cast<std::size_t>(lc.rows() * s->n));
    for (std::int64_t r = 0; r < lc.rows(); ++r)
      for (int c = 0; c < s->n; ++c) {
        const int lim = vq::vq_max_code(s->shift[static_cast<std::size_t>(c)]);
        const double sigma = c % 4 == 0 ? 0.0 : (c % 4 == 1 ? 0.3 : (c % 4 == 2 ? 3.0 : 40.0)) * (1 << s->shift[static_cast<std::size_t>(c)]);
        std::normal_distribution<double> g(0.0, sigma > 0 ? sigma : 1.0);
        const int q = sigma > 0 ? static_cast<int>(std::lround(g(rng))) : 0;
        s->codes[static_cast<std::size_t>(r * s->n + c)] = static_cast<std::int16_t>(std::clamp(q, -lim, lim));
      }
    if (lc.rows() > 0 && s->n > 1) s->codes[1] = static_cast<std::int16_t>(vq::vq_max_code(s->shift[1]));  // the extreme code
  }
  return lc;
}

// Small codes (every amax <= 31): version 3 codes such sides with 10-bit tables, version 2 with 12.
// (The same function wrote tests/golden/vq_layer_v2_small.bin with the version 2 encoder.)
vq::VqLayerCodes small_codes(std::int64_t batch, std::int64_t tokens, int n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  vq::VqLayerCodes lc;
  lc.batch = batch;
  lc.tokens = tokens;
  for (vq::VqSideCodes* s : {&lc.k, &lc.v}) {
    s->n = n;
    s->step = 0.5f;
    s->offset.assign(static_cast<std::size_t>(n), -3);
    for (std::int64_t i = 0; i < lc.rows() * n; ++i) {
      std::normal_distribution<double> g(0.0, 0.2 + static_cast<double>(i % n) / 8.0);
      s->codes.push_back(static_cast<std::int16_t>(std::clamp<long>(std::lround(g(rng)), -31, 31)));
    }
  }
  return lc;
}

// Small codes whose K side has one coefficient of amax 40 and one of 100 (version 3 coded that whole
// side with 12-bit tables). tests/golden/vq_layer_v3_mixed.bin holds these codes, written by the
// version 3 encoder of commit 25b6eea (the same function in a one-off program).
vq::VqLayerCodes mixed_codes() {
  auto lc = small_codes(2, 150, 40, 1504);
  lc.k.codes[7] = -40;
  lc.k.codes[9] = 100;
  return lc;
}

// Codes that drift along tokens, as real K/V do: per coefficient an AR(1) process of correlation
// rho (0.98, 0.9, 0.6, 0, -0.7 by c % 5) in two batches; coefficient 3 is all zero, coefficient 5
// is split (shift 2) with a wide walk, and coefficient 7 sits at +200 but jumps to -200 and back
// (strongly correlated, yet a prediction from the previous token would leave a residual of -400,
// outside the alphabet). tests/golden/vq_layer_v4_drift.bin holds these codes written by the
// version 4 encoder (commit 6f6c9bf), vq_layer_v5_drift.bin by version 5.
vq::VqLayerCodes drift_codes() {
  std::mt19937_64 rng(1505);
  vq::VqLayerCodes lc;
  lc.batch = 2;
  lc.tokens = 90;
  static constexpr double kRho[5] = {0.98, 0.9, 0.6, 0.0, -0.7};
  for (vq::VqSideCodes* s : {&lc.k, &lc.v}) {
    s->n = s == &lc.k ? 12 : 20;
    s->step = 0.25f;
    s->offset.assign(static_cast<std::size_t>(s->n), 2);
    s->shift.assign(static_cast<std::size_t>(s->n), 0);
    s->shift[5] = 2;
    s->codes.assign(static_cast<std::size_t>(lc.rows() * s->n), 0);
    std::normal_distribution<double> g(0.0, 1.0);
    for (int c = 0; c < s->n; ++c) {
      const double rho = kRho[c % 5], sigma = c == 5 ? 60.0 : 1.0 + (c % 4);
      for (std::int64_t b = 0; b < lc.batch; ++b) {
        double x = 0.0;
        for (std::int64_t t = 0; t < lc.tokens; ++t) {
          x = rho * x + sigma * g(rng);
          const int lim = vq::vq_max_code(s->shift[static_cast<std::size_t>(c)]);
          int q = std::clamp(static_cast<int>(std::lround(x)), -lim, lim);
          if (c == 3) q = 0;
          if (c == 7) q = (t % 30 == 10) ? -200 : 200;
          s->codes[static_cast<std::size_t>((b * lc.tokens + t) * s->n + c)] = static_cast<std::int16_t>(q);
        }
      }
    }
  }
  return lc;
}

void expect_equal(const vq::VqLayerCodes& a, const vq::VqLayerCodes& b) {
  EXPECT_EQ(a.batch, b.batch);
  EXPECT_EQ(a.tokens, b.tokens);
  for (auto [x, y] : {std::pair{&a.k, &b.k}, std::pair{&a.v, &b.v}}) {
    EXPECT_EQ(x->n, y->n);
    EXPECT_EQ(x->step, y->step);
    EXPECT_EQ(x->offset, y->offset);
    EXPECT_EQ(x->codes, y->codes);
    for (int c = 0; c < x->n; ++c)
      EXPECT_EQ(x->shift.empty() ? 0 : x->shift[static_cast<std::size_t>(c)], y->shift[static_cast<std::size_t>(c)]);
  }
}

TEST(VqCodec, RoundTripIsBitExact) {
  struct Case {
    std::int64_t batch, tokens;
    int nk, nv;
    bool shifts;
  };
  for (const Case& c : {Case{1, 0, 1, 1, false}, Case{1, 1, 1, 1, false}, Case{1, 1, 32, 32, true}, Case{2, 33, 8, 12, true},
                        Case{1, 256, 32, 32, false}, Case{3, 31, 5, 7, true}}) {
    const auto lc = random_codes(c.batch, c.tokens, c.nk, c.nv, static_cast<std::uint64_t>(c.tokens * 7 + c.nk), c.shifts);
    const auto bytes = vq::vq_encode(lc);
    const auto back = vq::vq_decode(bytes, static_cast<std::uint64_t>(lc.rows() * (c.nk + c.nv)));
    expect_equal(lc, back);
    EXPECT_EQ(vq::vq_encode(back), bytes);  // deterministic
  }
}

TEST(VqCodec, AllZeroSideCostsOnlyItsHeader) {
  vq::VqLayerCodes lc;
  lc.batch = 1;
  lc.tokens = 100;
  for (vq::VqSideCodes* s : {&lc.k, &lc.v}) {
    s->n = 4;
    s->offset.assign(4, 0);
    s->codes.assign(400, 0);
  }
  // version, 4 varints, per side: step 4 + shift, predictor and row copy flags 3 + 4 x (offset 1 +
  // amax 1); an empty rANS stream (1).
  EXPECT_EQ(vq::vq_encode(lc).size(), 1u + 4u + 2u * (4u + 3u + 8u) + 1u);
  expect_equal(lc, vq::vq_decode(vq::vq_encode(lc), 800));
}

TEST(VqCodec, TablesAreValidSymmetricAndDeterministic) {
  for (int scale : {vq::kVqScaleBits, vq::kVqSmallScaleBits})
    for (int amax : {1, 2, 7, 31, 40, 255})
      for (int param : {0, 1, 30, 48, 64, 100, 127, 128, 160, 176, 255}) {
        const auto t = vq::vq_table(amax, static_cast<std::uint8_t>(param), scale);
        ASSERT_EQ(t.alphabet_size(), 2 * amax + 1);
        ASSERT_EQ(t.scale_bits(), scale);
        std::uint32_t sum = 0;
        for (int s = 0; s < t.alphabet_size(); ++s) {
          EXPECT_GE(t.freq(s), 1u) << amax << " " << param;
          sum += t.freq(s);
        }
        EXPECT_EQ(sum, 1u << scale);
        for (int k = 1; k <= amax; ++k) EXPECT_EQ(t.freq(amax + k), t.freq(amax - k));
        EXPECT_TRUE(t == vq::vq_table(amax, static_cast<std::uint8_t>(param), scale));
      }
  EXPECT_THROW(vq::vq_table(3, 0, 11), vq::InvalidArgument);
  EXPECT_EQ(vq::vq_table(0, 0).alphabet_size(), 1);
  EXPECT_THROW(vq::vq_table(256, 0), vq::InvalidArgument);
}

TEST(VqCodec, BestParameterCodesCloseToTheEntropy) {
  // Gaussian codes of sigma 2.5 steps: the chosen table must code within 2% of the empirical
  // entropy (plus the table's floor of one slot per symbol).
  std::mt19937_64 rng(3);
  std::normal_distribution<double> g(0.0, 2.5);
  std::vector<int> q(20000);
  int amax = 0;
  for (auto& v : q) v = static_cast<int>(std::lround(g(rng))), amax = std::max(amax, std::abs(v));
  std::vector<std::uint32_t> hist(static_cast<std::size_t>(2 * amax + 1), 0);
  for (int v : q) ++hist[static_cast<std::size_t>(v + amax)];
  double entropy = 0;
  for (auto h : hist)
    if (h) entropy -= h * std::log2(static_cast<double>(h) / static_cast<double>(q.size()));
  const auto param = vq::vq_best_param(hist, amax);
  EXPECT_EQ(param & 0x80, 0) << "a Gaussian histogram should pick the Gaussian family";
  EXPECT_LT(vq::vq_table(amax, param).cost_bits(hist), entropy * 1.02);
}

TEST(VqCodec, EncodeRejectsInconsistentInput) {
  auto lc = random_codes(1, 10, 4, 4, 1, false);
  lc.k.codes[0] = 256;  // beyond +-255 without a shift
  EXPECT_THROW(vq::vq_encode(lc), vq::InvalidArgument);
  lc = random_codes(1, 10, 4, 4, 1, false);
  lc.v.codes.pop_back();
  EXPECT_THROW(vq::vq_encode(lc), vq::InvalidArgument);
  lc = random_codes(1, 10, 4, 4, 1, false);
  lc.k.step = 0.0f;
  EXPECT_THROW(vq::vq_encode(lc), vq::InvalidArgument);
  lc = random_codes(1, 10, 4, 4, 1, false);
  lc.k.shift.assign(4, vq::kVqMaxShift + 1);
  EXPECT_THROW(vq::vq_encode(lc), vq::InvalidArgument);
}

// The kernels a decode test runs: the reference, Auto, and each SIMD kernel this CPU has.
std::vector<vq::RansKernel> decode_kernels() {
  std::vector<vq::RansKernel> k = {vq::RansKernel::Scalar, vq::RansKernel::Auto};
  if (vq::rans_avx2_available()) k.push_back(vq::RansKernel::Avx2);
  if (vq::rans_avx512_available()) k.push_back(vq::RansKernel::Avx512);
  return k;
}

TEST(VqCodec, DecodeRejectsEveryTruncationCorruptionAndTrailingByte) {
  const auto lc = random_codes(1, 40, 6, 6, 9, true);
  const auto bytes = vq::vq_encode(lc);
  const std::uint64_t max = static_cast<std::uint64_t>(lc.rows() * 12);
  for (std::size_t n = 0; n < bytes.size(); ++n)
    EXPECT_THROW(vq::vq_decode(std::span(bytes).first(n), max), vq::FormatError) << "prefix " << n;
  auto longer = bytes;
  longer.push_back(0);
  EXPECT_THROW(vq::vq_decode(longer, max), vq::FormatError);
  EXPECT_THROW(vq::vq_decode(bytes, max - 1), vq::FormatError);  // more codes than the caller expects
  auto bad = bytes;
  bad[0] = 8;  // version
  EXPECT_THROW(vq::vq_decode(bad, max), vq::FormatError);
  // Any single flipped bit either fails cleanly or decodes to something (never crashes).
  for (const auto kernel : decode_kernels())
    for (std::size_t i = 0; i < bytes.size(); ++i) {
      auto b = bytes;
      b[i] ^= 0x10;
      try {
        (void)vq::vq_decode(b, max, kernel);
      } catch (const vq::FormatError&) {
      }
    }
}

// Every kernel writes the same bytes and reads back the same codes (the AVX2 and AVX-512 kernels
// code whole groups of 32 lanes with per-column tables; the scalar reference one symbol at a time).
// A kernel the CPU lacks is skipped (after the others ran), not passed.
void expect_kernels_agree(const vq::VqLayerCodes& lc) {
  const auto bytes = vq::vq_encode(lc, vq::RansKernel::Scalar);
  ASSERT_EQ(bytes[0], 6);
  const std::uint64_t max = static_cast<std::uint64_t>(lc.rows() * (lc.k.n + lc.v.n));
  expect_equal(lc, vq::vq_decode(bytes, max, vq::RansKernel::Scalar));
  struct Fast {
    vq::RansKernel kernel;
    bool present;
    const char* name;
  };
  std::string missing;
  for (const Fast& f : {Fast{vq::RansKernel::Avx2, vq::rans_avx2_available(), "AVX2"},
                        Fast{vq::RansKernel::Avx512, vq::rans_avx512_available(), "AVX-512"}, Fast{vq::RansKernel::Auto, true, "Auto"}}) {
    if (!f.present) {
      missing += std::string(missing.empty() ? "" : ", ") + f.name;
      continue;
    }
    SCOPED_TRACE(f.name);
    EXPECT_EQ(vq::vq_encode(lc, f.kernel), bytes);
    expect_equal(lc, vq::vq_decode(bytes, max, f.kernel));
  }
  if (!missing.empty()) GTEST_SKIP() << "no " << missing << " on this CPU";
}

// A kernel the CPU lacks is refused with InvalidArgument, never run.
// Version 7 (8 lanes, the chained layers' streams): the same codes as version 6 in fewer bytes (24
// fewer lane states), whichever kernel encodes or decodes it; damage fails cleanly.
TEST(VqCodec, NarrowVersionRoundTripsWithEveryKernel) {
  for (const auto& lc : {random_codes(1, 256, 32, 32, 5, false), random_codes(2, 33, 8, 12, 6, true), random_codes(1, 3, 4, 4, 7, false)}) {
    const std::uint64_t max = static_cast<std::uint64_t>(lc.rows() * (lc.k.n + lc.v.n));
    const auto v6 = vq::vq_encode(lc), v7 = vq::vq_encode(lc, vq::RansKernel::Scalar, 7);
    EXPECT_EQ(v7[0], 7);
    for (const auto kernel : decode_kernels()) {
      EXPECT_EQ(vq::vq_encode(lc, kernel, 7), v7);
      expect_equal(lc, vq::vq_decode(v7, max, kernel));
    }
    if (lc.rows() * (lc.k.n + lc.v.n) >= 64) EXPECT_LT(v7.size() + 48, v6.size());  // 24 fewer states, less what they held
    for (std::size_t n = 0; n < v7.size(); ++n) EXPECT_THROW(vq::vq_decode(std::span(v7).first(n), max), vq::FormatError) << n;
  }
  EXPECT_THROW(vq::vq_encode(random_codes(1, 3, 4, 4, 7, false), vq::RansKernel::Auto, 5), vq::InvalidArgument);
}

TEST(VqCodec, MissingKernelIsRefused) {
  const auto lc = random_codes(1, 40, 6, 6, 9, false);
  const auto bytes = vq::vq_encode(lc, vq::RansKernel::Scalar);
  const std::uint64_t max = static_cast<std::uint64_t>(lc.rows() * 12);
  bool any = false;
  for (const auto& [kernel, present] : {std::pair{vq::RansKernel::Avx2, vq::rans_avx2_available()},
                                       std::pair{vq::RansKernel::Avx512, vq::rans_avx512_available()}}) {
    if (present) continue;
    any = true;
    EXPECT_THROW(vq::vq_encode(lc, kernel), vq::InvalidArgument);
    EXPECT_THROW(vq::vq_decode(bytes, max, kernel), vq::InvalidArgument);
  }
  if (!any) GTEST_SKIP() << "this CPU has every kernel";
}

TEST(VqCodec, FastKernelEqualsTheScalarReferenceBitForBit) {
  struct Case {
    std::int64_t batch, tokens;
    int nk, nv;
    bool shifts;
  };
  // Empty and one-token sides, B > 1, widths below, at and above 32 lanes (and 32 columns: the
  // AVX-512 side pass and histogram) and not multiples of them, zero columns (c % 4 == 0) so the coded region is narrower than the side, split columns,
  // and sigma 40 (amax > 127: that side takes the reference path inside the fast call).
  for (const Case& c : {Case{1, 0, 3, 5, true}, Case{1, 1, 1, 1, false}, Case{1, 1, 40, 33, true}, Case{2, 33, 8, 12, true},
                        Case{1, 256, 32, 32, false}, Case{3, 31, 5, 7, true}, Case{2, 300, 64, 96, false}, Case{1, 129, 100, 3, true},
                        // more than 65,535 rows: the AVX-512 histogram's 16-bit counters are flushed
                        Case{1, 70000, 3, 2, false}}) {
    SCOPED_TRACE(::testing::Message() << c.batch << "x" << c.tokens << " " << c.nk << "/" << c.nv);
    expect_kernels_agree(random_codes(c.batch, c.tokens, c.nk, c.nv, static_cast<std::uint64_t>(c.tokens * 5 + c.nv), c.shifts));
  }
  // Every column coded with small codes (the region is the side's own codes, the AVX2 path end to end).
  vq::VqLayerCodes lc;
  lc.batch = 2;
  lc.tokens = 77;
  std::mt19937_64 rng(11);
  for (vq::VqSideCodes* s : {&lc.k, &lc.v}) {
    s->n = 96;
    s->offset.assign(96, 3);
    for (std::int64_t i = 0; i < lc.rows() * 96; ++i) {
      std::normal_distribution<double> g(0.0, 0.5 + static_cast<double>(i % 96) / 20.0);
      s->codes.push_back(static_cast<std::int16_t>(std::clamp<long>(std::lround(g(rng)), -127, 127) + (i % 96 == 0 ? 1 : 0)));
    }
  }
  expect_kernels_agree(lc);
}

// The two table precisions: a side whose amax are all <= 31 (10-bit tables) beside one with a code
// of 32 (version 3's boundary), each way round; version 4's per-coefficient choice; and the fast
// kernel on all of them.
TEST(VqCodec, SidesOfBothTablePrecisionsRoundTrip) {
  for (int wide = 0; wide < 2; ++wide) {
    auto lc = small_codes(2, 70, 40, 31 + static_cast<std::uint64_t>(wide));
    lc.k.codes[5] = 31;
    (wide ? lc.k : lc.v).codes[7] = -32;  // this side's amax 32: 12-bit tables
    SCOPED_TRACE(wide);
    expect_kernels_agree(lc);
  }
  // Version 4 chooses per coefficient: a side with amax 40 (10-bit, <= 63) and 100 (12-bit) beside
  // small ones, so one group's lanes mix both precisions; and amax 63 / 64 at the boundary.
  expect_kernels_agree(mixed_codes());
  auto edge = small_codes(1, 90, 70, 77);
  edge.k.codes[3] = 63;
  edge.k.codes[4] = -64;
  edge.v.codes[69] = 64;
  expect_kernels_agree(edge);
  // The version 3 stream of mixed_codes() coded all of K with 12-bit tables; version 4 only one
  // coefficient: the coarser tables cost within 1 % of the size.
  {
    std::ifstream in(std::string(VQ_SOURCE_DIR) + "/tests/golden/vq_layer_v3_mixed.bin", std::ios::binary);
    ASSERT_TRUE(in);
    const std::vector<std::uint8_t> v3((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto v4 = vq::vq_encode(mixed_codes());
    EXPECT_LT(static_cast<double>(v4.size()), 1.01 * static_cast<double>(v3.size()));
    EXPECT_NE(v4, v3);
  }
  // The 10-bit tables cost little: within 1 % of the 12-bit ones' coded size on Gaussian codes
  // (the version 2 stream of the same codes, tests/golden/vq_layer_v2_small.bin, holds 12-bit).
  const std::string path = std::string(VQ_SOURCE_DIR) + "/tests/golden/vq_layer_v2_small.bin";
  std::ifstream in(path, std::ios::binary);
  ASSERT_TRUE(in) << path;
  const std::vector<std::uint8_t> v2((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto v3 = vq::vq_encode(small_codes(2, 150, 40, 1503));
  EXPECT_LT(static_cast<double>(v3.size()), 1.01 * static_cast<double>(v2.size()));
}

// Version 2 streams (row-major like version 3, every table 12-bit; written by the version 2 encoder
// of commit d0811c0 with these functions) still decode to their codes in both kernels, and fail
// cleanly when cut.
TEST(VqCodec, VersionTwoStreamsStillDecode) {
  struct Golden {
    const char* file;
    vq::VqLayerCodes codes;
  };
  for (const Golden& g : {Golden{"vq_layer_v2.bin", random_codes(2, 37, 8, 12, 1502, true)},
                          Golden{"vq_layer_v2_small.bin", small_codes(2, 150, 40, 1503)}}) {
    SCOPED_TRACE(g.file);
    std::ifstream in(std::string(VQ_SOURCE_DIR) + "/tests/golden/" + g.file, std::ios::binary);
    ASSERT_TRUE(in);
    const std::vector<std::uint8_t> file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_EQ(file.at(0), 2);
    const auto max = static_cast<std::uint64_t>(g.codes.rows() * (g.codes.k.n + g.codes.v.n));
    for (const auto kernel : decode_kernels()) {
      expect_equal(g.codes, vq::vq_decode(file, max, kernel));
      for (std::size_t n = 0; n < file.size(); n += 13) EXPECT_THROW(vq::vq_decode(std::span(file).first(n), max, kernel), vq::FormatError) << n;
    }
    EXPECT_EQ(vq::vq_encode(g.codes)[0], 6);  // what is written now
  }
}

// A version 3 stream (tables of 2^10 or 2^12 slots per side) still decodes in both kernels and
// fails cleanly when cut.
TEST(VqCodec, VersionThreeStreamsStillDecode) {
  std::ifstream in(std::string(VQ_SOURCE_DIR) + "/tests/golden/vq_layer_v3_mixed.bin", std::ios::binary);
  ASSERT_TRUE(in);
  const std::vector<std::uint8_t> file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(file.at(0), 3);
  const auto codes = mixed_codes();
  const auto max = static_cast<std::uint64_t>(codes.rows() * (codes.k.n + codes.v.n));
  for (const auto kernel : decode_kernels()) {
    expect_equal(codes, vq::vq_decode(file, max, kernel));
    for (std::size_t n = 0; n < file.size(); n += 13) EXPECT_THROW(vq::vq_decode(std::span(file).first(n), max, kernel), vq::FormatError) << n;
  }
}

// Truncated and corrupt streams long enough for the AVX2 groups fail cleanly in both kernels.
TEST(VqCodec, LongStreamsTruncatedOrCorruptFailCleanly) {
  const auto lc = random_codes(2, 300, 64, 40, 77, false);
  const auto bytes = vq::vq_encode(lc);
  const std::uint64_t max = static_cast<std::uint64_t>(lc.rows() * 104);
  for (const auto kernel : decode_kernels()) {
    for (std::size_t n = 0; n < bytes.size(); n += (n + 300 < bytes.size() ? 97 : 1))
      EXPECT_THROW(vq::vq_decode(std::span(bytes).first(n), max, kernel), vq::FormatError) << "prefix " << n;
    std::mt19937_64 rng(5);
    int failed = 0;
    for (int t = 0; t < 200; ++t) {
      auto b = bytes;
      b[bytes.size() / 2 + rng() % (bytes.size() / 2)] ^= static_cast<std::uint8_t>(1u << (rng() % 8));  // in the payload
      try {
        (void)vq::vq_decode(b, max, kernel);
      } catch (const vq::FormatError&) {
        ++failed;
      }
    }
    EXPECT_GT(failed, 150) << "a flipped payload bit should almost always be caught by the final states";
  }
}

// Codes the cache makes at rates 0.5 .. 10 bits (10 bits splits codes: shift > 0), B = 2.
TEST(VqCodec, RoundTripsTheCachesCodesAtEveryRate) {
  vq::SyntheticKVConfig sc;
  sc.batch = 2;
  sc.heads = 2;
  sc.head_dim = 32;
  sc.tokens = 150;
  sc.seed = 4;
  const auto kv = vq::make_synthetic_kv(sc);
  bool split = false;
  for (double bits : {0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0}) {
    SCOPED_TRACE(bits);
    vq::VqConfig config;
    config.bits = bits;
    vq::VqKVCache cache(config);
    cache.update_and_fetch(kv.keys, kv.values);
    const auto lc = cache.codes();
    for (const auto* s : {&lc.k, &lc.v})
      for (auto v : s->shift) split |= v > 0;
    expect_kernels_agree(lc);
  }
  EXPECT_TRUE(split) << "10 bits should split some coefficient's codes";
}

// The parameter search reads precomputed costs instead of building 14 tables: it must choose
// exactly what the tables' cost_bits chose (same coded sizes, same rd table).
TEST(VqCodec, BestParameterIsTheArgminOfTheTablesCost) {
  std::mt19937_64 rng(21);
  for (int trial = 0; trial < 300; ++trial) {
    const int amax = 1 + static_cast<int>(rng() % (trial < 250 ? 20 : 255));
    std::vector<std::uint32_t> hist(static_cast<std::size_t>(2 * amax + 1));
    const double sigma = 0.2 + static_cast<double>(rng() % 1000) / 50.0;
    for (int i = 0; i < 2 * amax + 1; ++i) {
      const double z = (i - amax) / sigma;
      hist[static_cast<std::size_t>(i)] = static_cast<std::uint32_t>(1000.0 * std::exp(-0.5 * z * z) + (rng() % 3 == 0 ? rng() % 5 : 0));
    }
    hist[static_cast<std::size_t>(amax)] += 1;
    double n = 0, m2 = 0;
    for (int i = 0; i < 2 * amax + 1; ++i) {
      n += hist[static_cast<std::size_t>(i)];
      m2 += static_cast<double>(hist[static_cast<std::size_t>(i)]) * (i - amax) * (i - amax);
    }
    const int i0 = static_cast<int>(std::lround(8.0 * std::log2(std::sqrt(std::max(m2 / n, 1e-4))))) + 48;
    std::uint8_t best = 0;
    double best_cost = INFINITY;
    for (int family = 0; family < 2; ++family)
      for (int i = std::max(0, i0 - 3); i <= std::min(127, i0 + 3); ++i) {
        const auto param = static_cast<std::uint8_t>(family << 7 | i);
        const double cost = vq::vq_table(amax, param).cost_bits(hist);
        if (cost < best_cost) best_cost = cost, best = param;
      }
    ASSERT_EQ(vq::vq_best_param(hist, amax), best) << "amax " << amax << " sigma " << sigma;
  }
}

// A version 1 stream (one rANS segment per coefficient, written by the encoder before version 2)
// still decodes to its codes: B = 2, 37 tokens, 8 + 12 coefficients with zero, small, wide and split
// codes. Written once with the version 1 encoder:
//   VQ_WRITE_GOLDEN=1 ./build/tests/vq_tests --gtest_filter='VqCodec.VersionOneStreamStillDecodes'
TEST(VqCodec, VersionOneStreamStillDecodes) {
  const std::string path = std::string(VQ_SOURCE_DIR) + "/tests/golden/vq_layer_v1.bin";
  const auto lc = random_codes(2, 37, 8, 12, 1501, true);
  if (std::getenv("VQ_WRITE_GOLDEN") != nullptr) {
    const auto b = vq::vq_encode(lc);
    ASSERT_EQ(b[0], 1);
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  }
  std::ifstream in(path, std::ios::binary);
  ASSERT_TRUE(in) << path;
  const std::vector<std::uint8_t> file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(file.empty());
  EXPECT_EQ(file[0], 1);
  expect_equal(lc, vq::vq_decode(file, static_cast<std::uint64_t>(lc.rows() * 20)));
  for (std::size_t n = 0; n < file.size(); n += 7)
    EXPECT_THROW(vq::vq_decode(std::span(file).first(n), static_cast<std::uint64_t>(lc.rows() * 20)), vq::FormatError) << n;
}

// A version 4 stream of codes that drift along tokens (no prediction: every hi part coded as it is)
// still decodes in both kernels and fails cleanly when cut. Written once with the version 4 encoder:
//   VQ_WRITE_GOLDEN=1 ./build/tests/vq_tests --gtest_filter='VqCodec.VersionFourStreamsStillDecode'
TEST(VqCodec, VersionFourStreamsStillDecode) {
  const std::string path = std::string(VQ_SOURCE_DIR) + "/tests/golden/vq_layer_v4_drift.bin";
  const auto codes = drift_codes();
  if (std::getenv("VQ_WRITE_GOLDEN") != nullptr) {
    const auto b = vq::vq_encode(codes);
    ASSERT_EQ(b[0], 4);
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  }
  std::ifstream in(path, std::ios::binary);
  ASSERT_TRUE(in) << path;
  const std::vector<std::uint8_t> file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(file.at(0), 4);
  const auto max = static_cast<std::uint64_t>(codes.rows() * (codes.k.n + codes.v.n));
  for (const auto kernel : {vq::RansKernel::Scalar, vq::RansKernel::Auto}) {
    expect_equal(codes, vq::vq_decode(file, max, kernel));
    for (std::size_t n = 0; n < file.size(); n += 13) EXPECT_THROW(vq::vq_decode(std::span(file).first(n), max, kernel), vq::FormatError) << n;
  }
}

// A version 5 stream (prediction and row copies, 32 lanes; written by the version 5 encoder of commit
// 778c61a) still decodes in every kernel, also into junk-filled buffers, and fails cleanly when cut;
// it holds the symbols version 6 writes for so short a stream (32 lanes below 2^18 symbols): the
// same bytes but the version.
TEST(VqCodec, VersionFiveStreamsStillDecode) {
  std::ifstream in(std::string(VQ_SOURCE_DIR) + "/tests/golden/vq_layer_v5_drift.bin", std::ios::binary);
  ASSERT_TRUE(in);
  const std::vector<std::uint8_t> file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(file.at(0), 5);
  const auto codes = drift_codes();
  const auto max = static_cast<std::uint64_t>(codes.rows() * (codes.k.n + codes.v.n));
  for (const auto kernel : decode_kernels()) {
    expect_equal(codes, vq::vq_decode(file, max, kernel));
    vq::VqLayerCodes into;
    into.k.codes.assign(codes.k.codes.size(), 0x5a5a);
    into.v.codes.assign(3, -7);
    vq::vq_decode(file, max, into, kernel);
    expect_equal(codes, into);
    for (std::size_t n = 0; n < file.size(); n += 13) EXPECT_THROW(vq::vq_decode(std::span(file).first(n), max, kernel), vq::FormatError) << n;
  }
  auto v6 = vq::vq_encode(codes);
  ASSERT_EQ(v6.at(0), 6);
  v6[0] = 5;
  EXPECT_EQ(v6, file);
}

// Version 6 (version 5's prediction and row copies; 64 lanes for long streams) on codes that drift
// along tokens writes exactly tests/golden/vq_layer_v6_drift.bin (every size change shows in review;
// regenerate only on a deliberate format change:
//   VQ_WRITE_GOLDEN=1 ./build/tests/vq_tests --gtest_filter='VqCodec.VersionSix*'),
// well below version 4's stream of the same codes; with every ninth V row a repeat of an earlier one
// (V is 20 wide: searched for copies) smaller still; the kernels agree, cuts and flips fail cleanly.
TEST(VqCodec, VersionSixPredictsAcrossTokens) {
  const std::string path = std::string(VQ_SOURCE_DIR) + "/tests/golden/vq_layer_v6_drift.bin";
  const auto codes = drift_codes();
  const auto bytes = vq::vq_encode(codes);
  ASSERT_EQ(bytes.at(0), 6);
  if (std::getenv("VQ_WRITE_GOLDEN") != nullptr)
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  std::ifstream in(path, std::ios::binary);
  ASSERT_TRUE(in) << path;
  const std::vector<std::uint8_t> file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(file, bytes) << "the encoder's bytes changed: a new format version?";
  std::ifstream in4(std::string(VQ_SOURCE_DIR) + "/tests/golden/vq_layer_v4_drift.bin", std::ios::binary);
  const std::vector<std::uint8_t> v4((std::istreambuf_iterator<char>(in4)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(v4.empty());
  EXPECT_LT(static_cast<double>(bytes.size()), 0.85 * static_cast<double>(v4.size()));
  const auto max = static_cast<std::uint64_t>(codes.rows() * (codes.k.n + codes.v.n));
  EXPECT_EQ(vq::vq_encode(vq::vq_decode(v4, max)), bytes);  // a version 4 stream re-encodes as version 6
  expect_kernels_agree(codes);
  auto repeats = codes;
  const auto n_v = static_cast<std::size_t>(repeats.v.n);
  for (std::size_t r = 4; r < static_cast<std::size_t>(repeats.rows()); r += 9)
    std::copy_n(repeats.v.codes.begin() + static_cast<std::ptrdiff_t>((r - 4) * n_v), n_v, repeats.v.codes.begin() + static_cast<std::ptrdiff_t>(r * n_v));
  expect_kernels_agree(repeats);
  const auto rbytes = vq::vq_encode(repeats);
  EXPECT_LT(rbytes.size() + 50, bytes.size());
  for (const auto kernel : {vq::RansKernel::Scalar, vq::RansKernel::Auto}) {
    for (std::size_t n = 0; n < rbytes.size(); ++n) EXPECT_THROW(vq::vq_decode(std::span(rbytes).first(n), max, kernel), vq::FormatError) << n;
    for (std::size_t i = 0; i < rbytes.size(); ++i)
      for (const std::uint8_t flip : {0x01, 0x10, 0x80}) {
        auto b = rbytes;
        b[i] ^= flip;
        try {
          (void)vq::vq_decode(b, max, kernel);
        } catch (const vq::FormatError&) {
        }
      }
  }
}

// Codes that drift along tokens, `tokens` x (nk + nv) with every coefficient coded (no zero
// column), so a long one gives a stream of 64 lanes.
vq::VqLayerCodes wide_drift_codes(std::int64_t batch, std::int64_t tokens, int nk, int nv, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  vq::VqLayerCodes lc;
  lc.batch = batch;
  lc.tokens = tokens;
  std::normal_distribution<double> g(0.0, 1.0);
  for (vq::VqSideCodes* s : {&lc.k, &lc.v}) {
    s->n = s == &lc.k ? nk : nv;
    s->step = 0.5f;
    s->offset.assign(static_cast<std::size_t>(s->n), 1);
    s->codes.assign(static_cast<std::size_t>(lc.rows() * s->n), 0);
    for (int c = 0; c < s->n; ++c)
      for (std::int64_t b = 0; b < batch; ++b) {
        double x = 0.0;
        for (std::int64_t t = 0; t < tokens; ++t) {
          x = (c % 3 == 0 ? 0.95 : 0.3) * x + (1.0 + c % 7) * g(rng);
          s->codes[static_cast<std::size_t>((b * tokens + t) * s->n + c)] = static_cast<std::int16_t>(std::clamp<long>(std::lround(x), -120, 120));
        }
      }
  }
  return lc;
}

// Streams of >= 2^18 symbols take 64 lanes (vq_stream_lanes): every kernel writes the reference's
// bytes and decodes them (also straddling the boundary, with B > 1, widths that are not multiples
// of 64, a few rows copied), and cuts and flips of one fail cleanly.
TEST(VqCodec, VersionSixLongStreamsUse64LanesInEveryKernel) {
  EXPECT_EQ(vq::vq_codec_detail::vq_stream_lanes(6, (1u << 18) - 1), 32u);
  EXPECT_EQ(vq::vq_codec_detail::vq_stream_lanes(6, 1u << 18), 64u);
  EXPECT_EQ(vq::vq_codec_detail::vq_stream_lanes(5, 1u << 20), 32u);
  // 2 x 1024 x (70 + 58) = 262,144 symbols: exactly the first 64-lane stream; 1 x 2100 x 130 above it.
  auto copies = wide_drift_codes(1, 2100, 66, 64, 32);
  for (std::size_t r = 7; r < 2100; r += 11)
    std::copy_n(copies.k.codes.begin() + static_cast<std::ptrdiff_t>((r - 5) * 66), 66, copies.k.codes.begin() + static_cast<std::ptrdiff_t>(r * 66));
  for (const auto& lc : {wide_drift_codes(2, 1024, 70, 58, 30), wide_drift_codes(2, 1024, 70, 57, 31), copies}) {
    SCOPED_TRACE(lc.rows() * (lc.k.n + lc.v.n));
    expect_kernels_agree(lc);
  }
  const auto lc = wide_drift_codes(1, 2100, 70, 60, 33);
  const auto bytes = vq::vq_encode(lc);
  const auto max = static_cast<std::uint64_t>(lc.rows() * (lc.k.n + lc.v.n));
  for (const auto kernel : decode_kernels()) {
    for (std::size_t n = 0; n < bytes.size(); n += 1999) EXPECT_THROW(vq::vq_decode(std::span(bytes).first(n), max, kernel), vq::FormatError) << n;
    for (std::size_t i = 0; i < bytes.size(); i += 997) {
      auto b = bytes;
      b[i] ^= 0x21;
      try {
        (void)vq::vq_decode(b, max, kernel);  // decodes (to something) or throws FormatError: nothing else
      } catch (const vq::FormatError&) {
      }
    }
  }
}

// Regions whose columns share one table precision take the AVX-512 kernels' constant-precision
// paths (RegionTables::uniform_scale: every column 10-bit, every column 12-bit), the others the
// per-lane one; each on 32 lanes (short streams) and 64 (>= 2^18 symbols): every kernel writes the
// reference's bytes and decodes them. sigma per column: 1.5 (amax <= 63: 10-bit), 45 (amax 64-127:
// 12-bit, still the fast decoder's byte), or both in one side.
TEST(VqCodec, RegionsOfOneOrMixedPrecisionsAgreeWithTheReference) {
  auto make = [](std::int64_t tokens, int n, int mode, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    vq::VqLayerCodes lc;
    lc.batch = 1;
    lc.tokens = tokens;
    for (vq::VqSideCodes* s : {&lc.k, &lc.v}) {
      s->n = n;
      s->offset.assign(static_cast<std::size_t>(n), 0);
      s->codes.resize(static_cast<std::size_t>(tokens * n));
      for (std::int64_t r = 0; r < tokens; ++r)
        for (int c = 0; c < n; ++c) {
          const bool wide = mode == 1 || (mode == 2 && c % 5 == 2);
          std::normal_distribution<double> g(0.0, wide ? 45.0 : 1.5);
          s->codes[static_cast<std::size_t>(r * n + c)] = static_cast<std::int16_t>(std::clamp<long>(std::lround(g(rng)), -127, 127));
        }
      // Every wide column reaches past 63 and every narrow one stays within it.
      for (int c = 0; c < n; ++c) {
        const bool wide = mode == 1 || (mode == 2 && c % 5 == 2);
        s->codes[static_cast<std::size_t>(c)] = static_cast<std::int16_t>(wide ? 100 : 0);
      }
    }
    return lc;
  };
  for (int mode = 0; mode < 3; ++mode)
    for (const std::int64_t tokens : {std::int64_t{300}, std::int64_t{2100}}) {  // 2 x 300 x 70: 32 lanes; 2 x 2100 x 70: 64
      SCOPED_TRACE(::testing::Message() << "mode " << mode << ", " << tokens << " tokens");
      expect_kernels_agree(make(tokens, 70, mode, static_cast<std::uint64_t>(mode * 10 + tokens)));
    }
}

// vq_decode into a caller's VqLayerCodes: its code buffers are reused as they are (junk of the right
// size is overwritten in place, without reallocation; other sizes are resized), whatever the version,
// kernel and side layout (zero columns, split columns, row copies), with the result vq_decode returns.
TEST(VqCodec, DecodeIntoTheCallersBuffersOverJunk) {
  auto copies = drift_codes();
  for (std::size_t r = 4; r < static_cast<std::size_t>(copies.rows()); r += 9)
    std::copy_n(copies.v.codes.begin() + static_cast<std::ptrdiff_t>((r - 4) * 20), 20, copies.v.codes.begin() + static_cast<std::ptrdiff_t>(r * 20));
  std::ifstream in(std::string(VQ_SOURCE_DIR) + "/tests/golden/vq_layer_v1.bin", std::ios::binary);
  const std::vector<std::uint8_t> v1((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(v1.empty());
  std::vector<std::vector<std::uint8_t>> streams = {vq::vq_encode(random_codes(2, 33, 8, 12, 5, true)), vq::vq_encode(copies),
                                                    vq::vq_encode(wide_drift_codes(1, 2100, 70, 60, 34)), vq::vq_encode(small_codes(1, 40, 40, 3)), v1};
  for (std::size_t k = 0; k < streams.size(); ++k) {
    const auto& b = streams[k];
    SCOPED_TRACE(k);
    const std::uint64_t max = ~0ull >> 1;
    const auto want = vq::vq_decode(b, max, vq::RansKernel::Scalar);
    for (const auto kernel : decode_kernels()) {
      vq::VqLayerCodes out;
      out.k.codes.assign(want.k.codes.size(), 0x7abc);  // right size: reused
      out.v.codes.assign(want.v.codes.size() / 2 + 1, -0x1234);  // wrong size: resized
      out.k.offset.assign(5, 99);
      const std::int16_t* kept = out.k.codes.data();
      vq::vq_decode(b, max, out, kernel);
      expect_equal(want, out);
      if (b[0] >= 2) EXPECT_EQ(out.k.codes.data(), kept);
      vq::vq_decode(b, max, out, kernel);  // again over its own result
      expect_equal(want, out);
    }
  }
}

// A predicted side with every column coded and no row copies, rows of whole lane groups (n a
// multiple of the stream's lanes): the AVX-512 decoder undoes the prediction as it stores each
// group (codec_kernels.hpp's PredictRows), with token 0 of each batch inside the region and the
// groups it leaves (tail, short payload) finished after it. Every kernel decodes the reference's
// codes; on cut and flipped streams every kernel agrees with the reference (the same codes, or
// FormatError from both), including hi parts the prediction drives outside +-255.
TEST(VqCodec, PredictedSidesFinishedInTheKernelAgreeWithTheReference) {
  // 2 x 3 x 700 x 64 = 268,800 symbols: 64 lanes; 2 x 2 x 150 x 96: 32 lanes (96 = 3 x 32).
  for (const auto& lc : {wide_drift_codes(3, 700, 64, 128, 40), wide_drift_codes(2, 150, 96, 32, 41), wide_drift_codes(1, 2100, 128, 64, 42)}) {
    SCOPED_TRACE(lc.rows() * (lc.k.n + lc.v.n));
    expect_kernels_agree(lc);
    const auto bytes = vq::vq_encode(lc);
    const auto max = static_cast<std::uint64_t>(lc.rows() * (lc.k.n + lc.v.n));
    auto decode = [&](std::span<const std::uint8_t> b, vq::RansKernel kernel) -> std::optional<vq::VqLayerCodes> {
      try {
        return vq::vq_decode(b, max, kernel);
      } catch (const vq::FormatError&) {
        return std::nullopt;
      }
    };
    std::mt19937_64 rng(lc.rows());
    for (int trial = 0; trial < 40; ++trial) {
      auto b = bytes;
      std::size_t cut = b.size();
      if (trial % 4 == 3)
        cut = static_cast<std::size_t>(rng() % b.size());
      else
        b[b.size() / 8 + rng() % (b.size() - b.size() / 8)] ^= static_cast<std::uint8_t>(1u << (rng() % 8));
      const auto want = decode(std::span(b).first(cut), vq::RansKernel::Scalar);
      for (const auto kernel : decode_kernels()) {
        const auto got = decode(std::span(b).first(cut), kernel);
        ASSERT_EQ(want.has_value(), got.has_value()) << trial;
        if (want) expect_equal(*want, *got);
      }
    }
  }
}

}  // namespace
