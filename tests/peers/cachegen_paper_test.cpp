// The CacheGen paper's codec: settings, anchors and deltas by hand, error budgets, chunking
// invariance, the coded bytes (no tables billed), decode, the profile file and the profiler.
#include "veloxquant/peers/cachegen_paper_cache.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>

#include <gtest/gtest.h>

#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/entropy/rans.hpp"
#include "veloxquant/peers/cachegen_paper_profile.hpp"
#include "../support/test_util.hpp"

namespace {

using vq::CachegenPaperConfig;
using vq::CachegenPaperKVCache;
using vq::CachegenPaperProfile;

vq::Tensor tokens_of(const vq::Tensor& t, std::int64_t s, std::int64_t e) { return t.slice(2, s, e); }

std::size_t varint_size(std::uint64_t v) {
  std::size_t n = 1;
  for (; v >= 0x80; v >>= 7) ++n;
  return n;
}

// A profile of `n_layers` layers, every layer profiled on the same K/V.
std::shared_ptr<const CachegenPaperProfile> profile_of(const CachegenPaperConfig& cfg, int n_layers, const vq::Tensor& K, const vq::Tensor& V) {
  vq::CachegenPaperProfiler p(cfg, n_layers);
  for (int l = 0; l < n_layers; ++l) p.add(l, K, V);
  return std::make_shared<const CachegenPaperProfile>(p.finish());
}

CachegenPaperConfig config(int group, std::array<double, 3> bins, int chunk) {
  CachegenPaperConfig c;
  c.group = group;
  c.bins = bins;
  c.chunk = chunk;
  return c;
}

TEST(CachegenPaperConfig, BinsPerDepthThirdAndValidation) {
  EXPECT_EQ(vq::cachegen_delta_max_q(0.5), 2);
  EXPECT_EQ(vq::cachegen_delta_max_q(1.0), 1);
  EXPECT_EQ(vq::cachegen_delta_max_q(1.5), 1);
  EXPECT_EQ(vq::cachegen_delta_max_q(0.1), 10);
  const CachegenPaperConfig c;
  const double want5[] = {0.5, 0.5, 1.0, 1.0, 1.5};  // stories260K: 5 layers -> 2, 2, 1
  for (int l = 0; l < 5; ++l) EXPECT_EQ(c.bin_for_layer(l, 5), want5[l]) << l;
  for (int l = 0; l < 32; ++l) EXPECT_EQ(c.bin_for_layer(l, 32), l < 11 ? 0.5 : l < 22 ? 1.0 : 1.5) << l;
  EXPECT_THROW(c.bin_for_layer(5, 5), vq::InvalidArgument);
  for (double bad : {0.0, 0.005, 2.0, -1.0, std::nan("")}) EXPECT_THROW(config(10, {bad, 1, 1}, 100).validate(), vq::InvalidArgument) << bad;
  EXPECT_THROW(config(10, {0.5, 1, 1.5}, 15).validate(), vq::InvalidArgument);  // chunk not a multiple of group
  EXPECT_THROW(config(0, {0.5, 1, 1.5}, 10).validate(), vq::InvalidArgument);
  EXPECT_NO_THROW(config(1, {0.5, 1, 1.5}, 7).validate());
}

TEST(CachegenPaperCache, AnchorsAndDeltasByHand) {
  // group 2, bin 0.5 (max_q 2), one head of 2 channels; K carries the example, V is zero.
  const auto cfg = config(2, {0.5, 0.5, 0.5}, 4);
  const vq::Tensor K = vq::Tensor::from_f32({1, 1, 4, 2}, std::vector<float>{1.0f, -0.5f, 1.25f, -0.5f, 0.0f, 0.0f, 0.3f, 0.0f});
  const vq::Tensor Z = vq::Tensor::zeros({1, 1, 4, 2}, vq::DType::F32);
  CachegenPaperKVCache c(cfg, 0, 1, profile_of(cfg, 1, K, Z));
  auto [k, v] = c.update_and_fetch(K, Z);
  const auto codes = c.codes(0, 0);
  // Token 0, anchor, s = 1: round(1 * 127 + 127) = 254, round(-63.5 + 127) = round(63.5) = 64 (ties to even).
  EXPECT_EQ(codes[0], 254);
  EXPECT_EQ(codes[1], 64);
  const float a1 = (64.0f - 127.0f) / 127.0f;
  EXPECT_EQ(k.at(0, 0, 0, 0), 1.0f);
  EXPECT_EQ(k.at(0, 0, 0, 1), a1);
  // Token 1, delta to the reconstructed anchor: d = (0.25, -0.5 - a1 = -0.0039), s = 0.25, step =
  // 0.5 * 0.25: q = 2 and 0, symbols q + 2.
  EXPECT_EQ(codes[2], 4);
  EXPECT_EQ(codes[3], 2);
  EXPECT_EQ(vq::f16_to_f32(c.scales(0, 0)[1]), 0.25f);
  EXPECT_EQ(k.at(0, 0, 1, 0), 1.25f);
  EXPECT_EQ(k.at(0, 0, 1, 1), a1);  // the anchor's value: the delta rounded to 0
  // Token 2, anchor of group 1, all zero: s = 0, codes 127, values 0.
  EXPECT_EQ(codes[4], 127);
  EXPECT_EQ(k.at(0, 0, 2, 0), 0.0f);
  // Token 3: d = (0.3, 0); s = float16(0.3) = 0.300048828125, step = s / 2, q = round(1.9997) = 2.
  const float s16 = vq::f16_to_f32(vq::f32_to_f16(0.3f));
  EXPECT_EQ(s16, 0.300048828125f);
  EXPECT_EQ(codes[6], 4);
  EXPECT_EQ(k.at(0, 0, 3, 0), 0.0f + 2.0f * (0.5f * s16));
  // V is all zero: every anchor symbol 127, every delta symbol max_q = 2.
  EXPECT_EQ(c.codes(0, 1)[0], 127);
  EXPECT_EQ(c.codes(0, 1)[2], 2);
  EXPECT_EQ(v.at(0, 0, 3, 1), 0.0f);
}

TEST(CachegenPaperCache, ErrorBudgets) {
  const vq::Tensor K = vqtest::random_walk({2, 4, 95, 8}, 41), V = vqtest::random_uniform({2, 4, 95, 8}, 42);
  const CachegenPaperConfig cfg;  // group 10, bins 0.5 / 1 / 1.5
  const auto profile = profile_of(cfg, 3, K, V);
  for (int layer = 0; layer < 3; ++layer) {
    CachegenPaperKVCache c(cfg, layer, 3, profile);
    auto [k, v] = c.update_and_fetch(K, V);
    for (int kv = 0; kv < 2; ++kv) {
      const vq::Tensor& x = kv == 0 ? K : V;
      const vq::Tensor& y = kv == 0 ? k : v;
      for (std::int64_t b = 0; b < 2; ++b)
        for (std::int64_t s = 0; s < 95; ++s) {
          const bool anchor = s % 10 == 0;
          const std::int64_t a = s - s % 10;
          float amax = 0;  // of x (anchor) or of x - anchor reconstruction (delta)
          for (std::int64_t i = 0; i < 32; ++i) {
            const float xi = x.at(b, i / 8, s, i % 8);
            amax = std::max(amax, std::fabs(anchor ? xi : xi - y.at(b, i / 8, a, i % 8)));
          }
          const float sf = vq::f16_to_f32(c.scales(b, kv)[static_cast<std::size_t>(s)]);
          const float step = anchor ? sf / 127.0f : c.bin() * sf;
          const float budget = step / 2.0f * 1.0001f + std::fabs(amax - sf) + 1e-6f;
          for (std::int64_t i = 0; i < 32; ++i)
            ASSERT_LE(std::fabs(y.at(b, i / 8, s, i % 8) - x.at(b, i / 8, s, i % 8)), budget) << layer << " " << kv << " " << s;
        }
    }
  }
}

TEST(CachegenPaperCache, ChunkingDoesNotMatter) {
  const vq::Tensor K = vqtest::random_walk({1, 4, 157, 8}, 43), V = vqtest::random_walk({1, 4, 157, 8}, 44);
  const auto cfg = config(10, {0.25, 0.5, 0.75}, 30);
  const auto profile = profile_of(cfg, 2, K, V);
  CachegenPaperKVCache one(cfg, 1, 2, profile), steps(cfg, 1, 2, profile), sevens(cfg, 1, 2, profile);
  auto [k1, v1] = one.update_and_fetch(K, V);
  for (std::int64_t s = 0; s < 157; ++s) {
    steps.update_and_fetch(tokens_of(K, s, s + 1), tokens_of(V, s, s + 1));
    if (s == 70) (void)steps.stored_bytes();
  }
  for (std::int64_t s = 0; s < 157; s += 7) {
    const std::int64_t e = std::min<std::int64_t>(157, s + 7);
    sevens.update_and_fetch(tokens_of(K, s, e), tokens_of(V, s, e));
  }
  EXPECT_EQ(one.chunks(), 6);
  for (auto* c : {&steps, &sevens}) {
    EXPECT_TRUE(c->state().keys.contiguous().bit_equal(k1.contiguous()));
    EXPECT_TRUE(c->state().values.contiguous().bit_equal(v1.contiguous()));
    EXPECT_EQ(c->stored_bytes().estimated_bytes, one.stored_bytes().estimated_bytes);
    EXPECT_EQ(c->stored_bytes().fixed_bytes, one.stored_bytes().fixed_bytes);
  }
}

TEST(CachegenPaperCache, BytesArePayloadAndScalesOnly) {
  // 2 sequences x 57 tokens, group 10, chunk 30: chunks of 30 and 27 tokens; layer 0 of 1, bin 0.5.
  const vq::Tensor K = vqtest::random_walk({2, 4, 57, 8}, 45), V = vqtest::random_walk({2, 4, 57, 8}, 46);
  const auto cfg = config(10, {0.5, 1, 1.5}, 30);
  const auto profile = profile_of(cfg, 1, K, V);
  CachegenPaperKVCache c(cfg, 0, 1, profile);
  c.update_and_fetch(K, V);
  // Fixed width: 6 anchors x 32 channels x 8 bits, 51 deltas x 32 x 3 bits (5 levels), 2 bytes
  // per token scale; K and V, 2 sequences.
  EXPECT_DOUBLE_EQ(c.stored_bytes().fixed_bytes, 2 * 2 * (6 * 32 * 1.0 + 51 * 32 * 3 / 8.0 + 57 * 2.0));
  // Coded: per chunk varint T, then per K/V the scales, a varint length and the stream coded with
  // the PROFILE's tables (recomputed here from the public codes): no table bytes.
  double total = 0;
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t t0 = 0; t0 < 57; t0 += 30) {
      const std::int64_t T = std::min<std::int64_t>(30, 57 - t0), anchors = (T + 9) / 10;
      double bytes = static_cast<double>(varint_size(static_cast<std::uint64_t>(T)));
      for (int kv = 0; kv < 2; ++kv) {
        const auto& tb = profile->layers[0][kv];
        std::vector<std::vector<std::uint16_t>> anc(32), del(32);
        for (std::int64_t t = 0; t < T; ++t)
          for (int ch = 0; ch < 32; ++ch)
            (t % 10 == 0 ? anc : del)[static_cast<std::size_t>(ch)].push_back(c.codes(b, kv)[static_cast<std::size_t>((t0 + t) * 32 + ch)]);
        std::vector<vq::RansEncodeSegment> segs;
        for (std::size_t ch = 0; ch < 32; ++ch) {
          ASSERT_EQ(static_cast<std::int64_t>(anc[ch].size()), anchors);
          segs.push_back({anc[ch], &tb.anchor[ch]});
          segs.push_back({del[ch], &tb.delta[ch]});
        }
        const auto stream = vq::rans_encode(segs);
        bytes += 2.0 * static_cast<double>(T) + static_cast<double>(varint_size(stream.size()) + stream.size());
      }
      EXPECT_EQ(static_cast<double>(c.encode_chunk(b, t0 / 30).size()), bytes);
      total += bytes;
    }
  EXPECT_EQ(c.stored_bytes().estimated_bytes, total);
}

TEST(CachegenPaperCache, ChunksDecodeToTheValues) {
  const vq::Tensor K = vqtest::random_walk({1, 4, 83, 8}, 47), V = vqtest::random_uniform({1, 4, 83, 8}, 48);
  const auto cfg = config(10, {0.5, 1, 1.5}, 40);
  const auto profile = profile_of(cfg, 3, K, V);
  CachegenPaperKVCache c(cfg, 2, 3, profile);
  auto [k, v] = c.update_and_fetch(K, V);
  for (std::int64_t ch = 0; ch < c.chunks(); ++ch) {
    const auto bytes = c.encode_chunk(0, ch);
    const auto d = CachegenPaperKVCache::decode_chunk(bytes, *profile, 2, 40);
    const std::int64_t T = std::min<std::int64_t>(40, 83 - ch * 40);
    ASSERT_EQ(d.tokens, T);
    for (int kv = 0; kv < 2; ++kv) {
      const auto x = CachegenPaperKVCache::dequantize_chunk(d, kv, *profile, 2);
      const vq::Tensor& y = kv == 0 ? k : v;
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int64_t i = 0; i < 32; ++i) ASSERT_EQ(x[static_cast<std::size_t>(t * 32 + i)], y.at(0, i / 8, ch * 40 + t, i % 8)) << t;
    }
    for (std::size_t n = 0; n < bytes.size(); n += 5)
      EXPECT_THROW(CachegenPaperKVCache::decode_chunk(std::span(bytes).first(n), *profile, 2, 40), vq::FormatError) << n;
    auto longer = bytes;
    longer.push_back(0);
    EXPECT_THROW(CachegenPaperKVCache::decode_chunk(longer, *profile, 2, 40), vq::FormatError);
    // The decoded chunk re-encodes to the cache's bytes; inconsistent chunks are argument errors.
    EXPECT_EQ(CachegenPaperKVCache::encode_chunk(d, *profile, 2), bytes);
    auto bad = d;
    bad.scales[0].pop_back();
    EXPECT_THROW(CachegenPaperKVCache::encode_chunk(bad, *profile, 2), vq::InvalidArgument);
    bad = d;
    bad.codes[1][32] = static_cast<std::uint16_t>(2 * c.delta_max_q() + 1);  // token 1 (32 channels in) is a delta: past its alphabet
    EXPECT_THROW(CachegenPaperKVCache::encode_chunk(bad, *profile, 2), vq::InvalidArgument);
    EXPECT_THROW(CachegenPaperKVCache::encode_chunk(d, *profile, 3), vq::InvalidArgument);
  }
}

TEST(CachegenPaperCache, TrimMidGroupThenContinue) {
  const vq::Tensor K = vqtest::random_walk({1, 4, 60, 8}, 49), V = vqtest::random_walk({1, 4, 60, 8}, 50);
  const CachegenPaperConfig cfg;
  const auto profile = profile_of(cfg, 1, K, V);
  CachegenPaperKVCache a(cfg, 0, 1, profile), b(cfg, 0, 1, profile);
  a.update_and_fetch(K, V);
  EXPECT_EQ(a.trim(37), 37);  // 23 tokens left: group 2's anchor (token 20) survives
  a.update_and_fetch(tokens_of(K, 23, 60), tokens_of(V, 23, 60));
  b.update_and_fetch(tokens_of(K, 0, 23), tokens_of(V, 0, 23));
  b.update_and_fetch(tokens_of(K, 23, 60), tokens_of(V, 23, 60));
  EXPECT_TRUE(a.state().keys.contiguous().bit_equal(b.state().keys.contiguous()));
  EXPECT_TRUE(a.state().values.contiguous().bit_equal(b.state().values.contiguous()));
  EXPECT_EQ(a.stored_bytes().estimated_bytes, b.stored_bytes().estimated_bytes);
  a.from_state(vq::KVState{});
  EXPECT_EQ(a.offset(), 0);
  EXPECT_EQ(a.stored_bytes().estimated_bytes, 0.0);
}

TEST(CachegenPaperCache, RejectsBadInputAndMismatchedProfiles) {
  const vq::Tensor K = vqtest::random_uniform({1, 4, 12, 8}, 51);
  const CachegenPaperConfig cfg;
  const auto profile = profile_of(cfg, 2, K, K);
  EXPECT_THROW(CachegenPaperKVCache(cfg, 0, 2, nullptr), vq::InvalidArgument);
  EXPECT_THROW(CachegenPaperKVCache(cfg, 0, 3, profile), vq::InvalidArgument);  // profiled for 2 layers
  EXPECT_THROW(CachegenPaperKVCache(config(10, {0.25, 1, 1.5}, 1500), 0, 2, profile), vq::InvalidArgument);  // other bins
  CachegenPaperKVCache c(cfg, 0, 2, profile);
  c.update_and_fetch(K, K);
  const vq::Tensor other = vqtest::random_uniform({1, 2, 1, 8}, 52);  // 16 channels, profile has 32
  EXPECT_THROW(c.update_and_fetch(other, other), vq::InvalidArgument);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), 40000.0f}) {
    vq::Tensor t = vqtest::random_uniform({1, 4, 1, 8}, 53);
    t.set(0, 1, 0, 3, bad);
    EXPECT_THROW(c.update_and_fetch(t, t), vq::InvalidArgument) << bad;
  }
  EXPECT_EQ(c.offset(), 12);
}

TEST(CachegenPaperProfile, ProfilerCountsAndFileRoundTrip) {
  const vq::Tensor K = vqtest::random_walk({2, 2, 25, 4}, 54), V = vqtest::random_walk({2, 2, 25, 6}, 55);
  const CachegenPaperConfig cfg;
  vq::CachegenPaperProfiler p(cfg, 2);
  p.add(0, K, V);
  EXPECT_THROW(p.finish(), vq::InvalidArgument);  // layer 1 never fed
  EXPECT_THROW(p.add(1, V, V.slice(1, 0, 1)), vq::InvalidArgument);
  p.add(1, K, V);
  const CachegenPaperProfile prof = p.finish();
  EXPECT_EQ(prof.tokens, 50u);  // layer 0's sequences only
  ASSERT_EQ(prof.n_layers(), 2);
  EXPECT_EQ(prof.layers[0][0].channels, 8);
  EXPECT_EQ(prof.layers[0][1].channels, 12);
  EXPECT_EQ(prof.layers[1][0].delta_max_q, 1);  // layer 1 of 2 is in the middle third: bin 1
  for (const auto& t : prof.layers[0])
    for (std::int64_t c = 0; c < t.channels; ++c) {
      std::uint64_t na = 0, nd = 0;
      for (auto n : t.anchor_counts[static_cast<std::size_t>(c)]) na += n;
      for (auto n : t.delta_counts[static_cast<std::size_t>(c)]) nd += n;
      EXPECT_EQ(na, 50u);                  // every token's anchor code
      EXPECT_EQ(nd, 2u * (25 - 3));        // deltas: tokens that are not anchors (0, 10, 20)
      EXPECT_EQ(t.anchor[static_cast<std::size_t>(c)].present_symbols(), vq::kCachegenAnchorAlphabet);  // smoothed
    }
  const auto bytes = prof.serialize();
  const CachegenPaperProfile back = CachegenPaperProfile::parse(bytes);
  EXPECT_EQ(back.serialize(), bytes);
  EXPECT_TRUE(back.layers[1][1].delta[3] == prof.layers[1][1].delta[3]);
  const std::string path = vqtest::temp_dir() + "/profile_test.prof";
  prof.save(path);
  EXPECT_EQ(CachegenPaperProfile::load(path).serialize(), bytes);
  EXPECT_THROW(CachegenPaperProfile::load(path + ".missing"), vq::IoError);
  for (std::size_t n = 0; n < bytes.size(); n += 13)
    EXPECT_THROW(CachegenPaperProfile::parse(std::span(bytes).first(n)), vq::FormatError) << n;
  auto longer = bytes;
  longer.push_back(0);
  EXPECT_THROW(CachegenPaperProfile::parse(longer), vq::FormatError);
  auto bad_magic = bytes;
  bad_magic[0] = 'X';
  EXPECT_THROW(CachegenPaperProfile::parse(bad_magic), vq::FormatError);
}

}  // namespace
