// LMCache's CacheGen codec: bins per layer, the quantizer by hand, its error budget, chunking
// invariance, the coded bytes (by hand and by an independent recomputation), decode, trim, errors.
#include "veloxquant/peers/lmcache_cache.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include <gtest/gtest.h>

#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/entropy/frequency_table.hpp"
#include "veloxquant/entropy/rans.hpp"
#include "../support/test_util.hpp"

namespace {

using vq::LmcacheKVCache;

vq::Tensor tokens_of(const vq::Tensor& t, std::int64_t s, std::int64_t e) { return t.slice(2, s, e); }

std::size_t varint_size(std::uint64_t v) {
  std::size_t n = 1;
  for (; v >= 0x80; v >>= 7) ++n;
  return n;
}

TEST(LmcacheBins, ScaledKeepsTheDepthFractions) {
  for (int l = 0; l < 32; ++l) {  // at 32 layers, scaled is LMCache's 7B/8B table
    EXPECT_EQ(vq::lmcache_bins(l, 32, true).key, l < 10 ? 32 : 16) << l;
    EXPECT_EQ(vq::lmcache_bins(l, 32, true).value, l < 2 ? 32 : 16) << l;
  }
  const int key5[] = {32, 32, 16, 16, 16}, value5[] = {32, 16, 16, 16, 16};  // stories260K: 5 layers
  for (int l = 0; l < 5; ++l) {
    EXPECT_EQ(vq::lmcache_bins(l, 5, true).key, key5[l]) << l;
    EXPECT_EQ(vq::lmcache_bins(l, 5, true).value, value5[l]) << l;
    EXPECT_EQ(vq::lmcache_bins(l, 5, false).key, 32);  // LMCache's rule below 10 layers
    EXPECT_EQ(vq::lmcache_bins(l, 5, false).value, 32);
  }
  EXPECT_EQ(vq::lmcache_bins(12, 40, false).key, 16);  // native: absolute boundaries 10 and 2
  EXPECT_EQ(vq::lmcache_bins(9, 40, false).key, 32);
  EXPECT_EQ(vq::lmcache_bins(2, 40, false).value, 16);
  EXPECT_EQ(vq::lmcache_bins(12, 40, true).key, 32);  // scaled: 32 * 12 < 10 * 40
  EXPECT_THROW(vq::lmcache_bins(5, 5, true), vq::InvalidArgument);
  EXPECT_THROW(vq::lmcache_bins(0, 0, true), vq::InvalidArgument);
}

TEST(LmcacheCache, QuantizesATokenByHand) {
  // Layer 4 of 5: 16 bins for K and V, MAX = 7. One token, C = 4 channels (1 head of 4).
  LmcacheKVCache c({}, 4, 5);
  ASSERT_EQ(c.bins().key, 16);
  const vq::Tensor K = vq::Tensor::from_f32({1, 1, 1, 4}, std::vector<float>{1.0f, -0.5f, 0.25f, 0.0f});
  const vq::Tensor V = vq::Tensor::from_f32({1, 1, 1, 4}, std::vector<float>{-2.0f, 0.0f, 0.0f, 0.0f});
  auto [k, v] = c.update_and_fetch(K, V);
  // s = 1: q = round_half_even(x * 7 + 7) = 14, round(3.5) = 4 (ties to even), round(8.75) = 9, 7.
  const int want_k[] = {14, 4, 9, 7};
  for (int d = 0; d < 4; ++d) {
    EXPECT_EQ(c.codes(0, 0)[static_cast<std::size_t>(d)], want_k[d]) << d;
    EXPECT_EQ(k.at(0, 0, 0, d), (static_cast<float>(want_k[d]) - 7.0f) / 7.0f * 1.0f) << d;
  }
  EXPECT_EQ(vq::f16_to_f32(c.scales(0, 0)[0]), 1.0f);
  // s = 2 (the magnitude, sign dropped): -2 -> 0, zeros -> 7.
  EXPECT_EQ(c.codes(0, 1)[0], 0);
  EXPECT_EQ(c.codes(0, 1)[1], 7);
  EXPECT_EQ(v.at(0, 0, 0, 0), -2.0f);
  EXPECT_EQ(vq::f16_to_f32(c.scales(0, 1)[0]), 2.0f);
}

TEST(LmcacheCache, ErrorWithinHalfAStep) {
  // Heads are concatenated into one vector per token: an error budget per token over all heads.
  const vq::Tensor K = vqtest::random_walk({2, 3, 300, 8}, 21), V = vqtest::random_uniform({2, 3, 300, 8}, 22);
  for (int layer : {0, 4}) {
    LmcacheKVCache c({}, layer, 5);
    auto [k, v] = c.update_and_fetch(K, V);
    for (int kv = 0; kv < 2; ++kv) {
      const vq::Tensor& x = kv == 0 ? K : V;
      const vq::Tensor& y = kv == 0 ? k : v;
      const int mq = (kv == 0 ? c.bins().key : c.bins().value) / 2 - 1;
      for (std::int64_t b = 0; b < 2; ++b)
        for (std::int64_t s = 0; s < 300; ++s) {
          float amax = 0;
          for (std::int64_t h = 0; h < 3; ++h)
            for (std::int64_t d = 0; d < 8; ++d) amax = std::max(amax, std::fabs(x.at(b, h, s, d)));
          const float sf = vq::f16_to_f32(c.scales(b, kv)[static_cast<std::size_t>(s)]);
          const float budget = sf / static_cast<float>(mq) / 2.0f * 1.0001f + std::fabs(amax - sf);
          for (std::int64_t h = 0; h < 3; ++h)
            for (std::int64_t d = 0; d < 8; ++d) ASSERT_LE(std::fabs(y.at(b, h, s, d) - x.at(b, h, s, d)), budget) << kv << " " << s;
        }
    }
  }
}

TEST(LmcacheCache, ChunkingDoesNotMatter) {
  const vq::Tensor K = vqtest::random_walk({1, 4, 600, 8}, 23), V = vqtest::random_walk({1, 4, 600, 8}, 24);
  LmcacheKVCache one({}, 0, 5), steps({}, 0, 5), sevens({}, 0, 5);
  auto [k1, v1] = one.update_and_fetch(K, V);
  for (std::int64_t s = 0; s < 600; ++s) {
    steps.update_and_fetch(tokens_of(K, s, s + 1), tokens_of(V, s, s + 1));
    if (s == 300) (void)steps.stored_bytes();  // a memoized partial state must not leak into the total
  }
  for (std::int64_t s = 0; s < 600; s += 7) {
    const std::int64_t e = std::min<std::int64_t>(600, s + 7);
    sevens.update_and_fetch(tokens_of(K, s, e), tokens_of(V, s, e));
  }
  EXPECT_EQ(one.chunks(), 3);
  for (auto* c : {&steps, &sevens}) {
    EXPECT_TRUE(c->state().keys.contiguous().bit_equal(k1.contiguous()));
    EXPECT_TRUE(c->state().values.contiguous().bit_equal(v1.contiguous()));
    EXPECT_EQ(c->stored_bytes().estimated_bytes, one.stored_bytes().estimated_bytes);
    EXPECT_EQ(c->stored_bytes().fixed_bytes, one.stored_bytes().fixed_bytes);
  }
}

TEST(LmcacheCache, BytesOfAConstantChunkByHand) {
  // 3 all-zero tokens, 1 head of 4 channels, layer 0 (32 bins: alphabet 31, MAX 15): every code
  // is 15 and every scale 0, so each channel's table holds one symbol.
  LmcacheKVCache c({}, 0, 5);
  const vq::Tensor z = vq::Tensor::zeros({1, 1, 3, 4}, vq::DType::F32);
  c.update_and_fetch(z, z);
  // Table: varint 31, u8 scale_bits (T = 3 -> 2), zero run of 15 (0, 14), freq 4, zero run of 15
  // (0, 14): 7 bytes. Stream: varint 12 symbols, 12 lane states x 4 bytes, no words (a symbol
  // holding the whole range never renormalises): 49 bytes.
  const double per_kv = 3 * 2 /*scales*/ + 4 * 7 /*tables*/ + 1 /*varint 49*/ + 49;
  EXPECT_EQ(c.stored_bytes().estimated_bytes, 1 /*varint T*/ + 2 * per_kv);
  EXPECT_EQ(c.encode_chunk(0, 0).size(), 169u);
  // Fixed width: 5-bit codes for 31 levels + 2 bytes per token scale, K and V.
  EXPECT_DOUBLE_EQ(c.stored_bytes().fixed_bytes, 2 * 3 * (4 * 5 / 8.0 + 2));
}

TEST(LmcacheCache, BytesAreTheChunksAsRecomputedFromTheCodes) {
  // 2 sequences x 600 tokens, chunk 256: chunks of 256, 256, 88. An independent recomputation of
  // the format from the public codes: header, scales, per-channel tables, one stream per K/V.
  const vq::Tensor K = vqtest::random_walk({2, 4, 600, 8}, 25), V = vqtest::random_walk({2, 4, 600, 8}, 26);
  LmcacheKVCache c({}, 1, 5);  // K 32 bins, V 16
  c.update_and_fetch(K, V);
  double total = 0;
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t t0 = 0; t0 < 600; t0 += 256) {
      const std::int64_t T = std::min<std::int64_t>(256, 600 - t0);
      const int scale_bits = T == 256 ? 8 : 7;  // ceil(log2 T)
      double bytes = static_cast<double>(varint_size(static_cast<std::uint64_t>(T)));
      for (int kv = 0; kv < 2; ++kv) {
        const int alphabet = (kv == 0 ? 32 : 16) - 1;
        std::vector<std::vector<std::uint16_t>> cols(32);
        std::vector<vq::FrequencyTable> tables;
        for (int ch = 0; ch < 32; ++ch) {
          for (std::int64_t t = 0; t < T; ++t) cols[static_cast<std::size_t>(ch)].push_back(c.codes(b, kv)[static_cast<std::size_t>((t0 + t) * 32 + ch)]);
          tables.push_back(vq::FrequencyTable::from_symbols(cols[static_cast<std::size_t>(ch)], alphabet, scale_bits));
          bytes += static_cast<double>(tables.back().serialized_size());
        }
        std::vector<vq::RansEncodeSegment> segs;
        for (int ch = 0; ch < 32; ++ch) segs.push_back({cols[static_cast<std::size_t>(ch)], &tables[static_cast<std::size_t>(ch)]});
        const auto stream = vq::rans_encode(segs);
        bytes += 2.0 * static_cast<double>(T) + static_cast<double>(varint_size(stream.size()) + stream.size());
      }
      EXPECT_EQ(static_cast<double>(c.encode_chunk(b, t0 / 256).size()), bytes) << b << " " << t0;
      total += bytes;
    }
  EXPECT_EQ(c.stored_bytes().estimated_bytes, total);
}

TEST(LmcacheCache, ChunksDecodeToTheCodesAndValues) {
  const vq::Tensor K = vqtest::random_walk({1, 4, 300, 8}, 27), V = vqtest::random_uniform({1, 4, 300, 8}, 28);
  LmcacheKVCache c({100, true}, 2, 5);
  auto [k, v] = c.update_and_fetch(K, V);
  for (std::int64_t ch = 0; ch < c.chunks(); ++ch) {
    const auto bytes = c.encode_chunk(0, ch);
    const auto d = LmcacheKVCache::decode_chunk(bytes, 32, 32, c.bins(), 100);
    ASSERT_EQ(d.tokens, 100);
    for (int kv = 0; kv < 2; ++kv) {
      const auto codes = c.codes(0, kv).subspan(static_cast<std::size_t>(ch * 100 * 32), 100 * 32);
      ASSERT_TRUE(std::equal(codes.begin(), codes.end(), d.codes[kv].begin()));
      const int mq = (kv == 0 ? c.bins().key : c.bins().value) / 2 - 1;
      const vq::Tensor& y = kv == 0 ? k : v;
      for (std::int64_t t = 0; t < 100; ++t)
        for (std::int64_t i = 0; i < 32; ++i) {
          const float sf = vq::f16_to_f32(d.scales[kv][static_cast<std::size_t>(t)]);
          const float x = (static_cast<float>(d.codes[kv][static_cast<std::size_t>(t * 32 + i)]) - static_cast<float>(mq)) / static_cast<float>(mq) * sf;
          ASSERT_EQ(x, y.at(0, i / 8, ch * 100 + t, i % 8));
        }
    }
    // Every truncation and a trailing byte are format errors, never a crash.
    for (std::size_t n = 0; n < bytes.size(); n += 7)
      EXPECT_THROW(LmcacheKVCache::decode_chunk(std::span(bytes).first(n), 32, 32, c.bins(), 100), vq::FormatError) << n;
    auto longer = bytes;
    longer.push_back(0);
    EXPECT_THROW(LmcacheKVCache::decode_chunk(longer, 32, 32, c.bins(), 100), vq::FormatError);
    EXPECT_THROW(LmcacheKVCache::decode_chunk(bytes, 32, 32, c.bins(), 99), vq::FormatError);  // more tokens than allowed
    // The decoded chunk re-encodes to the cache's bytes; inconsistent chunks are argument errors.
    EXPECT_EQ(LmcacheKVCache::encode_chunk(d, c.bins()), bytes);
    auto bad = d;
    bad.codes[1].pop_back();
    EXPECT_THROW(LmcacheKVCache::encode_chunk(bad, c.bins()), vq::InvalidArgument);
    bad = d;
    bad.codes[0][5] = static_cast<std::uint16_t>(c.bins().key - 1);  // one past the alphabet 0 .. bins - 2
    EXPECT_THROW(LmcacheKVCache::encode_chunk(bad, c.bins()), vq::InvalidArgument);
  }
}

TEST(LmcacheCache, TrimAndFromState) {
  const vq::Tensor K = vqtest::random_walk({1, 2, 400, 8}, 29), V = vqtest::random_walk({1, 2, 400, 8}, 30);
  LmcacheKVCache a({}, 0, 5), b({}, 0, 5);
  a.update_and_fetch(K, V);
  (void)a.stored_bytes();  // memoizes chunk 0; trim must forget what it cuts
  EXPECT_EQ(a.trim(250), 250);
  b.update_and_fetch(tokens_of(K, 0, 150), tokens_of(V, 0, 150));
  EXPECT_TRUE(a.state().keys.contiguous().bit_equal(b.state().keys.contiguous()));
  EXPECT_EQ(a.stored_bytes().estimated_bytes, b.stored_bytes().estimated_bytes);
  a.update_and_fetch(tokens_of(K, 150, 400), tokens_of(V, 150, 400));
  b.update_and_fetch(tokens_of(K, 150, 400), tokens_of(V, 150, 400));
  EXPECT_EQ(a.stored_bytes().estimated_bytes, b.stored_bytes().estimated_bytes);
  // from_state of reconstructions is a fixed point (each token's absmax is one of its own values).
  LmcacheKVCache c({}, 0, 5);
  c.from_state(a.state());
  EXPECT_TRUE(c.state().keys.contiguous().bit_equal(a.state().keys.contiguous()));
  c.from_state(vq::KVState{});
  EXPECT_EQ(c.offset(), 0);
  EXPECT_EQ(c.stored_bytes().estimated_bytes, 0.0);
}

TEST(LmcacheCache, RejectsWhatFloat16ScalesCannotHold) {
  LmcacheKVCache c({}, 0, 5);
  const vq::Tensor ok = vqtest::random_uniform({1, 1, 2, 4}, 31);
  c.update_and_fetch(ok, ok);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), 70000.0f}) {
    vq::Tensor t = vqtest::random_uniform({1, 1, 2, 4}, 32);
    t.set(0, 0, 1, 2, bad);
    EXPECT_THROW(c.update_and_fetch(t, ok), vq::InvalidArgument) << bad;
    EXPECT_EQ(c.offset(), 2);  // unchanged
  }
  EXPECT_THROW(LmcacheKVCache({0, true}, 0, 5), vq::InvalidArgument);
  EXPECT_THROW(LmcacheKVCache({}, 5, 5), vq::InvalidArgument);
}

}  // namespace
