// The load path's decoder buffers and caches (vq/code_buffers.hpp; vq_decode's per-thread table
// cache; VqKVCache's widening a block of rows at a time): every one gives the codes of a plain
// decode / a cache fed at once, whatever the arrays held before and whatever was decoded before.
#include "veloxquant/vq/code_buffers.hpp"

#include <algorithm>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "../support/test_util.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/vq/vq_cache.hpp"

namespace {

// Codes of several shapes that take every decoder path: drifting columns (prediction), all-zero
// columns (a compact region), repeated rows (row copies: a compact region again), split columns
// (low parts), wide codes (12-bit tables, and amax > 127: the reference kernel).
vq::VqLayerCodes codes_of(std::int64_t batch, std::int64_t tokens, int n, std::uint64_t seed, int kind) {
  std::mt19937_64 rng(seed);
  vq::VqLayerCodes lc;
  lc.batch = batch;
  lc.tokens = tokens;
  std::normal_distribution<double> g(0.0, 1.0);
  for (vq::VqSideCodes* s : {&lc.k, &lc.v}) {
    s->n = n;
    s->step = 0.5f;
    s->offset.assign(static_cast<std::size_t>(n), 1);
    s->shift.assign(static_cast<std::size_t>(n), 0);
    if (kind == 3) s->shift[1] = 3;
    s->codes.assign(static_cast<std::size_t>(lc.rows() * n), 0);
    for (int c = 0; c < n; ++c) {
      double x = 0;
      const double sigma = kind == 2 ? 60.0 : 0.5 + (c % 5);
      for (std::int64_t r = 0; r < lc.rows(); ++r) {
        x = 0.9 * x + sigma * g(rng);
        const int lim = vq::vq_max_code(s->shift[static_cast<std::size_t>(c)]);
        int q = std::clamp(static_cast<int>(std::lround(x)), -lim, lim);
        if (kind == 0 && c % 7 == 3) q = 0;  // all-zero columns
        s->codes[static_cast<std::size_t>(r * n + c)] = static_cast<std::int16_t>(q);
      }
    }
    if (kind == 1)  // every 4th row repeats the one before
      for (std::int64_t r = 1; r < lc.rows(); r += 4)
        std::copy_n(s->codes.begin() + (r - 1) * n, n, s->codes.begin() + r * n);
  }
  return lc;
}

std::vector<std::int16_t> junk(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::int16_t> v(n);
  for (auto& x : v) x = static_cast<std::int16_t>(rng());
  return v;
}

void expect_same(const vq::VqLayerCodes& a, const vq::VqLayerCodes& b) {
  EXPECT_EQ(a.batch, b.batch);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.k.codes, b.k.codes);
  EXPECT_EQ(a.v.codes, b.v.codes);
  EXPECT_EQ(a.k.offset, b.k.offset);
  EXPECT_EQ(a.v.offset, b.v.offset);
  EXPECT_EQ(a.k.shift, b.k.shift);
  EXPECT_EQ(a.v.shift, b.v.shift);
}

}  // namespace

// Decoding into arrays that hold junk (of the exact size, larger, smaller, none) gives the codes of
// a decode into fresh arrays, on every path; the arrays go back and are taken again.
TEST(VqCodeBuffers, DecodeOverJunkFilledArraysGivesTheSameCodes) {
  for (int kind = 0; kind < 4; ++kind) {
    const vq::VqLayerCodes in = codes_of(kind == 1 ? 2 : 1, 67, 40, 100 + kind, kind);
    const auto bytes = vq::vq_encode(in);
    const vq::VqLayerCodes want = vq::vq_decode(bytes, 1 << 20);
    EXPECT_EQ(want.k.codes, in.k.codes) << kind;
    const std::size_t exact = in.k.codes.size();
    for (const std::size_t size : {exact, exact + 333, exact / 3, std::size_t{0}}) {
      vq::VqCodeBuffers buffers;
      buffers.give(junk(size + 1, size + 7));  // an array of another size still serves
      buffers.give(junk(size, size));
      const vq::VqLayerCodes got = vq::vq_decode(bytes, 1 << 20, vq::RansKernel::Auto, &buffers);
      expect_same(got, want);
      vq::VqLayerCodes back = got;
      buffers.give(std::move(back));
      const vq::VqLayerCodes again = vq::vq_decode(bytes, 1 << 20, vq::RansKernel::Auto, &buffers);
      expect_same(again, want);
    }
    for (const vq::RansKernel k : {vq::RansKernel::Scalar, vq::RansKernel::Auto}) {
      vq::VqCodeBuffers buffers;
      buffers.give(junk(exact, 9));
      buffers.give(junk(exact, 10));
      expect_same(vq::vq_decode(bytes, 1 << 20, k, &buffers), want);
      EXPECT_EQ(buffers.held(), 0u);
    }
  }
}

// A corrupt stream fails the same way with buffers.
TEST(VqCodeBuffers, CorruptStreamsFailAsWithoutBuffers) {
  const auto bytes = vq::vq_encode(codes_of(1, 80, 33, 5, 0));
  for (std::size_t cut = 1; cut < bytes.size(); cut += 7) {
    vq::VqCodeBuffers buffers;
    buffers.give(junk(80 * 33, cut));
    const std::span<const std::uint8_t> part(bytes.data(), cut);
    EXPECT_THROW(vq::vq_decode(part, 1 << 20, vq::RansKernel::Auto, &buffers), vq::FormatError) << cut;
  }
}

// The decoder's tables persist per thread across calls: streams of different models decoded in any
// order, on several threads, give their own codes every time.
TEST(VqCodeBuffers, InterleavedDecodesOfDifferentModelsAgree) {
  std::vector<std::vector<std::uint8_t>> streams;
  std::vector<vq::VqLayerCodes> want;
  for (int i = 0; i < 6; ++i) {
    const vq::VqLayerCodes in = codes_of(1, 50 + 10 * i, 24 + 8 * i, 200 + i, i % 4);
    streams.push_back(vq::vq_encode(in));
    want.push_back(in);
  }
  const auto run = [&](int seed, int& failures) {
    std::mt19937 rng(static_cast<unsigned>(seed));
    vq::VqCodeBuffers buffers;
    for (int r = 0; r < 60; ++r) {
      const std::size_t i = rng() % streams.size();
      vq::VqLayerCodes got = vq::vq_decode(streams[i], 1 << 20, vq::RansKernel::Auto, r % 2 ? &buffers : nullptr);
      failures += got.k.codes != want[i].k.codes || got.v.codes != want[i].v.codes;
      buffers.give(std::move(got));
    }
  };
  int f0 = 0, f1 = 0, f2 = 0;
  run(1, f0);
  std::thread a(run, 2, std::ref(f1)), b(run, 3, std::ref(f2));
  a.join();
  b.join();
  EXPECT_EQ(f0 + f1 + f2, 0);
}

// Widening re-packs a side a block of rows at a time: a cache fed a drifting walk in many small
// updates (each may widen, over more rows than a block) holds the codes of one fed it at once,
// and its fields did widen.
TEST(VqCodeBuffers, WideningInBlocksKeepsEveryCode) {
  const vq::Tensor K = vqtest::random_walk({1, 2, 900, 128}, 61, vq::DType::F32, 0.3f);
  const vq::Tensor V = vqtest::random_walk({1, 2, 900, 128}, 62, vq::DType::F32, 0.3f);
  vq::VqConfig cfg;
  cfg.calib = 32;
  vq::VqKVCache once(cfg), steps(cfg);
  once.update(K, V);
  std::vector<std::uint8_t> first_widths;
  for (std::int64_t t = 0; t < 900; t += 75) {
    steps.update(K.slice(2, t, t + 75), V.slice(2, t, t + 75));
    if (t == 0) first_widths = steps.key_widths();
  }
  EXPECT_NE(steps.key_widths(), first_widths);  // widened along the way
  const auto a = once.codes(), b = steps.codes();
  EXPECT_EQ(a.k.codes, b.k.codes);
  EXPECT_EQ(a.v.codes, b.v.codes);
  EXPECT_EQ(once.state().keys.to_f32_vector(), steps.state().keys.to_f32_vector());
}

// A stream naming more distinct tables than the per-thread cache keeps (its coefficients of many
// amax and scales) decodes right, and so do the ordinary streams decoded before and after it.
TEST(VqCodeBuffers, StreamsOfManyTablesPassTheCacheAndDecode) {
  std::mt19937_64 rng(77);
  vq::VqLayerCodes many;
  many.batch = 1;
  many.tokens = 48;
  for (vq::VqSideCodes* s : {&many.k, &many.v}) {
    s->n = 3000;
    s->step = 1.0f;
    s->offset.assign(3000, 0);
    s->codes.resize(48 * 3000);
    for (int c = 0; c < 3000; ++c) {
      const int amax = 1 + c % 255;
      std::normal_distribution<double> g(0.0, 0.3 + 0.15 * (c / 255) * amax / 8.0);
      for (int r = 0; r < 48; ++r)
        s->codes[static_cast<std::size_t>(r * 3000 + c)] = static_cast<std::int16_t>(r == 0 ? amax : std::clamp<long>(std::lround(g(rng)), -amax, amax));
    }
  }
  const auto big = vq::vq_encode(many);
  const vq::VqLayerCodes small = codes_of(1, 60, 32, 9, 0);
  const auto little = vq::vq_encode(small);
  for (int round = 0; round < 3; ++round) {
    EXPECT_EQ(vq::vq_decode(little, 1 << 24).k.codes, small.k.codes) << round;
    const vq::VqLayerCodes got = vq::vq_decode(big, 1 << 24);
    EXPECT_EQ(got.k.codes, many.k.codes) << round;
    EXPECT_EQ(got.v.codes, many.v.codes) << round;
  }
}
