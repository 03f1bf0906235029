#include "veloxquant/cache/cachegen_cache.hpp"

#include <cmath>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/entropy/entropy_estimate.hpp"
#include "veloxquant/quant/group_quant.hpp"
#include "veloxquant/transform/token_delta.hpp"
#include "../support/test_util.hpp"

namespace {

vq::KVCacheConfig per_call(int bits = 4, int group = 32) {
  vq::KVCacheConfig c;
  c.cachegen_bits = bits;
  c.cachegen_group_size = group;
  c.cachegen_flush = vq::FlushMode::PerCall;
  return c;
}

vq::KVCacheConfig aligned(int bits = 4, int group = 32) {
  vq::KVCacheConfig c = per_call(bits, group);
  c.cachegen_flush = vq::FlushMode::GroupAligned;
  return c;
}

// What the reference computes for one call of one side: the reconstruction of every (b, h) slice
// and the summed byte counts.
struct RefCall {
  std::vector<std::vector<float>> recon;  // per slice
  std::uint64_t compressed = 0, fixed = 0;
};
RefCall reference_call(const vq::Tensor& x, const vq::KVCacheConfig& cfg) {
  RefCall out;
  const int n = static_cast<int>(x.dim(2)), d = static_cast<int>(x.dim(3)), bits = cfg.effective_bits();
  for (std::int64_t b = 0; b < x.dim(0); ++b)
    for (std::int64_t h = 0; h < x.dim(1); ++h) {
      const auto xs = vqtest::slice_f32(x, b, h);
      const auto q = vq::quantize_to_codes(xs, n, d, bits, cfg.cachegen_group_size);
      std::vector<float> r(xs.size());
      vq::dequant_codes(q, r);
      out.recon.push_back(r);
      const auto sym = cfg.cachegen_use_delta ? vq::token_delta(q.codes, n, d) : std::vector<std::int16_t>(q.codes.begin(), q.codes.end());
      out.compressed += vq::entropy_coded_bytes(sym, n, d, bits, q.n_groups(), cfg.cachegen_per_channel);
      out.fixed += vq::fixed_width_bytes(n, d, bits, q.n_groups());
    }
  return out;
}

TEST(CacheGen, ConfigDefaultsAndValidation) {
  vq::KVCacheConfig c;
  EXPECT_EQ(c.cachegen_bits, 4);
  EXPECT_EQ(c.cachegen_group_size, 32);
  EXPECT_TRUE(c.cachegen_use_delta);
  EXPECT_TRUE(c.cachegen_per_channel);
  EXPECT_EQ(c.cachegen_layer_groups, 3);
  EXPECT_FALSE(c.cachegen_resolved_bits.has_value());
  EXPECT_EQ(c.cachegen_flush, vq::FlushMode::GroupAligned);
  for (int bad : {0, 9, -1}) {
    c = {};
    c.cachegen_bits = bad;
    EXPECT_THROW(vq::CacheGenKVCache{c}, vq::InvalidArgument);
  }
  c = {};
  c.cachegen_group_size = 0;
  EXPECT_THROW(vq::CacheGenKVCache{c}, vq::InvalidArgument);
  c = {};
  c.cachegen_layer_groups = 0;
  EXPECT_THROW(vq::CacheGenKVCache{c}, vq::InvalidArgument);
  c = {};
  c.cachegen_resolved_bits = 12;
  EXPECT_THROW(vq::CacheGenKVCache{c}, vq::InvalidArgument);
  EXPECT_THROW(vq::flush_mode_from_name("sometimes"), vq::InvalidArgument);
}

TEST(CacheGen, EmptyCacheCounters) {
  vq::CacheGenKVCache cache;
  EXPECT_EQ(cache.compressed_key_bytes(), 0u);
  EXPECT_EQ(cache.fp16_value_bytes(), 0u);
  EXPECT_EQ(cache.entropy_savings(), 0.0);
  EXPECT_EQ(cache.assigned_avg_bits(), 4.0);
}

TEST(CacheGen, PerCallEqualsReferenceCallByCall) {
  for (bool delta : {true, false})
    for (bool channel : {true, false}) {
      auto cfg = per_call(3, 8);
      cfg.cachegen_use_delta = delta;
      cfg.cachegen_per_channel = channel;
      vq::CacheGenKVCache cache(cfg);
      auto k = vqtest::random_walk({2, 2, 60, 6}, 10);
      auto v = vqtest::random_walk({2, 2, 60, 5}, 11);
      std::uint64_t ck = 0, cv = 0, fk = 0, fv = 0;
      std::int64_t at = 0;
      for (std::int64_t len : {13, 1, 1, 8, 20, 17}) {
        auto ks = k.slice(2, at, at + len), vs = v.slice(2, at, at + len);
        auto rk = reference_call(ks, cfg), rv = reference_call(vs, cfg);
        auto [fk_t, fv_t] = cache.update_and_fetch(ks, vs);
        ck += rk.compressed;
        cv += rv.compressed;
        fk += rk.fixed;
        fv += rv.fixed;
        ASSERT_EQ(cache.compressed_key_bytes(), ck);
        ASSERT_EQ(cache.compressed_value_bytes(), cv);
        ASSERT_EQ(cache.fixed_width_key_bytes(), fk);
        ASSERT_EQ(cache.fixed_width_value_bytes(), fv);
        ASSERT_EQ(cache.fp16_key_bytes(), static_cast<std::uint64_t>(2 * 2 * (at + len) * 6 * 2));
        for (std::int64_t s = 0; s < 4; ++s) {
          auto got = vqtest::slice_f32(fk_t.slice(2, at, at + len), s / 2, s % 2);
          ASSERT_EQ(got, rk.recon[static_cast<std::size_t>(s)]);
        }
        at += len;
      }
      ASSERT_EQ(cache.offset(), 60);
    }
}

TEST(CacheGen, PerCallReproducesTheDecodeFlaw) {
  // One-token calls are never quantized and each is billed a whole group of scale/zero.
  vq::CacheGenKVCache cache(per_call());
  auto k = vqtest::random_walk({1, 2, 5, 16}, 3);
  for (std::int64_t s = 0; s < 5; ++s) cache.update_and_fetch(k.slice(2, s, s + 1), k.slice(2, s, s + 1));
  EXPECT_TRUE(cache.state().keys.bit_equal(k));  // exact
  EXPECT_EQ(cache.compressed_key_bytes(), 5u * 2u * 16u * 4u);  // D*4 per head per step
  EXPECT_GT(cache.compressed_key_bytes(), cache.fp16_key_bytes());
}

TEST(CacheGen, GroupAlignedIsIndependentOfChunking) {
  auto k = vqtest::random_walk({1, 3, 100, 8}, 20, vq::DType::F16);
  auto v = vqtest::random_walk({1, 3, 100, 8}, 21, vq::DType::F16);
  vq::CacheGenKVCache whole(aligned(4, 16)), steps(aligned(4, 16)), mixed(aligned(4, 16));
  auto [kw, vw] = whole.update_and_fetch(k, v);
  for (std::int64_t s = 0; s < 100; ++s) steps.update_and_fetch(k.slice(2, s, s + 1), v.slice(2, s, s + 1));
  for (std::int64_t s = 0; s < 100; s += 7) mixed.update_and_fetch(k.slice(2, s, std::min<std::int64_t>(s + 7, 100)), v.slice(2, s, std::min<std::int64_t>(s + 7, 100)));
  for (auto* c : {&steps, &mixed}) {
    ASSERT_TRUE(c->state().keys.bit_equal(kw));
    ASSERT_TRUE(c->state().values.bit_equal(vw));
    for (std::int64_t s = 0; s < 3; ++s) {
      ASSERT_TRUE(std::ranges::equal(c->key_stream().codes(s), whole.key_stream().codes(s)));
      ASSERT_TRUE(std::ranges::equal(c->value_stream().scales(s), whole.value_stream().scales(s)));
    }
    // The incremental estimate may differ by float summation order: at most a byte per slice.
    ASSERT_NEAR(static_cast<double>(c->compressed_key_bytes()), static_cast<double>(whole.compressed_key_bytes()), 3.0);
    ASSERT_EQ(c->fixed_width_value_bytes(), whole.fixed_width_value_bytes());
  }
  EXPECT_EQ(whole.key_stream().quantized_tokens(), 96);  // 6 closed groups of 16
  // The residual (tokens 96..99) is exact.
  EXPECT_TRUE(kw.slice(2, 96, 100).bit_equal(k.slice(2, 96, 100)));
  EXPECT_FALSE(kw.slice(2, 0, 96).bit_equal(k.slice(2, 0, 96)));
}

TEST(CacheGen, GroupAlignedCountersMatchTheFormulasOnTheClosedStream) {
  for (bool channel : {true, false}) {
    auto cfg = aligned(3, 32);
    cfg.cachegen_per_channel = channel;
    vq::CacheGenKVCache cache(cfg);
    auto k = vqtest::random_walk({2, 2, 150, 8}, 30);
    for (std::int64_t s = 0; s < 150; s += 10) cache.update_and_fetch(k.slice(2, s, s + 10), k.slice(2, s, s + 10));
    // 4 closed groups (128 tokens) + 22 residual tokens per slice.
    std::uint64_t want = 0;
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t h = 0; h < 2; ++h) {
        auto q = vq::quantize_to_codes(vqtest::slice_f32(k.slice(2, 0, 128), b, h), 128, 8, 3, 32);
        ASSERT_TRUE(std::ranges::equal(cache.key_stream().codes(b * 2 + h), q.codes));
        want += vq::entropy_coded_bytes(vq::token_delta(q.codes, 128, 8), 128, 8, 3, 4, channel);
        want += 22 * 8 * 2;
      }
    EXPECT_NEAR(static_cast<double>(cache.compressed_key_bytes()), static_cast<double>(want), 4.0);
    EXPECT_EQ(cache.fixed_width_key_bytes(), 4 * (vq::fixed_width_bytes(128, 8, 3, 4) + 22 * 8 * 2));
  }
}

// Below as many tokens as the alphabet has symbols (511 at 8 bits) the counters count the codes
// afresh instead of keeping a histogram per (slice, channel); both ways give the formula's bytes,
// and the switch between them (trim back below included) changes nothing.
TEST(CacheGen, FewTokensAtEightBitsAreCountedWithoutHistograms) {
  for (bool channel : {true, false}) {
    auto cfg = aligned(8, 4);
    cfg.cachegen_per_channel = channel;
    vq::CacheGenKVCache cache(cfg);
    auto k = vqtest::random_walk({1, 2, 600, 8}, 31);
    std::int64_t fed = 0;
    auto check = [&](std::int64_t tokens) {
      std::uint64_t want = 0;
      for (std::int64_t h = 0; h < 2; ++h) {
        auto q = vq::quantize_to_codes(vqtest::slice_f32(k.slice(2, 0, tokens), 0, h), static_cast<int>(tokens), 8, 8, 4);
        want += vq::entropy_coded_bytes(vq::token_delta(q.codes, static_cast<int>(tokens), 8), static_cast<int>(tokens), 8, 8,
                                        static_cast<int>(tokens / 4), channel);
      }
      EXPECT_NEAR(static_cast<double>(cache.compressed_key_bytes()), static_cast<double>(want), 4.0) << tokens << " " << channel;
    };
    for (const std::int64_t upto : {4, 8, 100, 508, 512, 600}) {
      cache.update_and_fetch(k.slice(2, fed, upto), k.slice(2, fed, upto));
      fed = upto;
      check(upto);
    }
    cache.trim(200);  // 400 tokens: below the alphabet again, histograms already there
    check(400);
  }
}

TEST(CacheGen, DecodeStepsAreQuantizedAndNeverBilledAWholeGroup) {
  vq::CacheGenKVCache cache(aligned());
  auto k = vqtest::random_walk({1, 2, 64, 16}, 4);
  for (std::int64_t s = 0; s < 31; ++s) cache.update_and_fetch(k.slice(2, s, s + 1), k.slice(2, s, s + 1));
  EXPECT_EQ(cache.compressed_key_bytes(), cache.fp16_key_bytes());  // all residual, 2 bytes/elem
  cache.update_and_fetch(k.slice(2, 31, 32), k.slice(2, 31, 32));   // closes group 0
  EXPECT_EQ(cache.key_stream().quantized_tokens(), 32);
  EXPECT_LT(cache.compressed_key_bytes(), cache.fp16_key_bytes());
  EXPECT_FALSE(cache.state().keys.bit_equal(k.slice(2, 0, 32)));  // really quantized
  for (std::int64_t s = 32; s < 64; ++s) cache.update_and_fetch(k.slice(2, s, s + 1), k.slice(2, s, s + 1));
  EXPECT_LE(cache.compressed_key_bytes(), cache.fixed_width_key_bytes());
  EXPECT_LT(cache.fixed_width_key_bytes(), cache.fp16_key_bytes());
}

TEST(CacheGen, CountersOnLongSequences) {
  for (auto cfg : {per_call(), aligned()}) {
    vq::CacheGenKVCache corr(cfg), iid(cfg);
    auto k = vqtest::random_walk({1, 4, 1024, 32}, 5, vq::DType::F32, 0.02f);
    auto u = vqtest::random_uniform({1, 4, 1024, 32}, 6);
    corr.update_and_fetch(k, k);
    iid.update_and_fetch(u, u);
    EXPECT_GT(corr.compressed_key_bytes(), 0u);
    EXPECT_LE(corr.compressed_key_bytes(), corr.fixed_width_key_bytes());
    EXPECT_LT(corr.fixed_width_key_bytes(), corr.fp16_key_bytes());
    EXPECT_GT(corr.entropy_savings(), 0.0);
    EXPECT_GE(iid.entropy_savings(), 0.0);
    EXPECT_LT(corr.assigned_avg_bits(), 16.0);
    EXPECT_LT(corr.assigned_avg_bits(), 4.0 + 1.0);  // metadata adds 1 bit/elem at group 32
  }
}

TEST(CacheGen, OutputDtypeEqualsInputDtypeAndShapeIsKept) {
  for (auto dt : {vq::DType::F32, vq::DType::F16, vq::DType::BF16})
    for (auto cfg : {per_call(), aligned()}) {
      vq::CacheGenKVCache cache(cfg);
      auto k = vqtest::random_walk({2, 3, 70, 8}, 7, dt);
      auto [kf, vf] = cache.update_and_fetch(k, k);
      EXPECT_EQ(kf.dtype(), dt);
      EXPECT_EQ(kf.shape(), k.shape());
      // error budget: half a quantization step of a 4-bit group (range of a random walk of 32
      // steps of sd 0.1 stays well under 8), plus the dtype's rounding.
      const auto a = k.to_f32_vector(), b = kf.to_f32_vector();
      for (std::size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 0.5 * 8.0 / 15.0 + 0.05);
    }
}

TEST(CacheGen, DecodeAfterPrefillHasNoNanAndIsDeterministic) {
  auto run = [] {
    vq::CacheGenKVCache cache(aligned());
    auto k = vqtest::random_walk({1, 2, 300, 8}, 8, vq::DType::F16);
    cache.update_and_fetch(k.slice(2, 0, 200), k.slice(2, 0, 200));
    std::pair<vq::Tensor, vq::Tensor> out;
    for (std::int64_t s = 200; s < 300; ++s) out = cache.update_and_fetch(k.slice(2, s, s + 1), k.slice(2, s, s + 1));
    return std::make_pair(out.first.contiguous(true), cache.compressed_key_bytes());
  };
  auto a = run(), b = run();
  EXPECT_TRUE(a.first.bit_equal(b.first));
  EXPECT_EQ(a.second, b.second);
  for (float x : a.first.to_f32_vector()) ASSERT_FALSE(std::isnan(x));
}

TEST(CacheGen, NanInputIsRejectedBeforeAnythingChanges) {
  vq::CacheGenKVCache cache;
  auto k = vqtest::random_walk({1, 1, 40, 4}, 9);
  cache.update_and_fetch(k, k);
  auto bad = k.contiguous(true);
  bad.set(0, 0, 5, 1, std::nanf(""));
  EXPECT_THROW(cache.update_and_fetch(bad, k), vq::InvalidArgument);
  EXPECT_THROW(cache.update_and_fetch(k, bad), vq::InvalidArgument);
  bad.set(0, 0, 5, 1, 3e38f);  // finite, but max - min overflows float32
  bad.set(0, 0, 6, 1, -3e38f);
  EXPECT_THROW(cache.update_and_fetch(bad, k), vq::InvalidArgument);
  EXPECT_EQ(cache.offset(), 40);
  EXPECT_EQ(cache.key_stream().quantized_tokens(), 32);
  // A failing call that would have closed a group over older residual rows (32..39) restores
  // them exactly, for either side failing, in both flush modes.
  for (auto cfg : {aligned(), per_call()}) {
    vq::CacheGenKVCache c(cfg);
    c.update_and_fetch(k, k);
    const auto before_k = c.state().keys.contiguous(true), before_v = c.state().values.contiguous(true);
    const auto counters = c.compressed_key_bytes() + c.compressed_value_bytes() + c.fixed_width_value_bytes();
    auto more = vqtest::random_walk({1, 1, 30, 4}, 19);
    auto more_bad = more.contiguous(true);
    more_bad.set(0, 0, 29, 3, std::nanf(""));
    EXPECT_THROW(c.update_and_fetch(more, more_bad), vq::InvalidArgument);
    EXPECT_THROW(c.update_and_fetch(more_bad, more), vq::InvalidArgument);
    EXPECT_EQ(c.offset(), 40);
    EXPECT_TRUE(c.state().keys.bit_equal(before_k));
    EXPECT_TRUE(c.state().values.bit_equal(before_v));
    EXPECT_EQ(c.compressed_key_bytes() + c.compressed_value_bytes() + c.fixed_width_value_bytes(), counters);
    // and the cache goes on as if the failed calls never happened
    vq::CacheGenKVCache fresh(cfg);
    fresh.update_and_fetch(k, k);
    auto [a, av] = c.update_and_fetch(more, more);
    auto [b, bv] = fresh.update_and_fetch(more, more);
    EXPECT_TRUE(a.bit_equal(b));
    EXPECT_TRUE(av.bit_equal(bv));
  }
}

TEST(CacheGen, TrimRollsCountersBackHonestly) {
  auto k = vqtest::random_walk({1, 2, 130, 8}, 12);
  auto v = vqtest::random_walk({1, 2, 130, 8}, 13);
  // Histograms are brought up to date lazily, when a counter is read: trim both before and after
  // a read.
  for (bool read_first : {false, true}) {
  for (std::int64_t keep : {128, 100, 64, 40, 5, 0}) {
    vq::CacheGenKVCache cache(aligned()), fresh(aligned());
    auto [kf, vf] = cache.update_and_fetch(k, v);
    if (read_first) {
      EXPECT_GT(cache.compressed_key_bytes() + cache.compressed_value_bytes(), 0u);
    }
    const auto before = kf.slice(2, 0, keep).contiguous(true);
    EXPECT_EQ(cache.trim(130 - keep), 130 - keep);
    EXPECT_EQ(cache.offset(), keep);
    if (keep > 0) fresh.update_and_fetch(k.slice(2, 0, keep), v.slice(2, 0, keep));
    // the cache as it stands costs what a cache fed only those tokens costs
    EXPECT_NEAR(static_cast<double>(cache.compressed_key_bytes()), static_cast<double>(fresh.compressed_key_bytes()), 2.0) << keep;
    EXPECT_EQ(cache.fixed_width_value_bytes(), fresh.fixed_width_value_bytes()) << keep;
    EXPECT_EQ(cache.fp16_key_bytes(), fresh.fp16_key_bytes());
    EXPECT_EQ(cache.key_stream().quantized_tokens(), keep / 32 * 32);
    if (keep > 0) {
      EXPECT_TRUE(cache.state().keys.bit_equal(before));  // what was fetched stays
    }
    // and the cache keeps working: re-adding the trimmed tokens closes groups again
    cache.update_and_fetch(k.slice(2, keep, 130), v.slice(2, keep, 130));
    EXPECT_EQ(cache.key_stream().quantized_tokens(), 128);
    EXPECT_EQ(cache.offset(), 130);
  }
  }
}

TEST(CacheGen, PerCallTrimDropsWholeCallsExactlyAndReaccountsAPartialOne) {
  auto k = vqtest::random_walk({1, 2, 90, 8}, 14);
  vq::CacheGenKVCache cache(per_call()), first_two(per_call());
  cache.update_and_fetch(k.slice(2, 0, 40), k.slice(2, 0, 40));
  cache.update_and_fetch(k.slice(2, 40, 50), k.slice(2, 40, 50));
  cache.update_and_fetch(k.slice(2, 50, 90), k.slice(2, 50, 90));
  first_two.update_and_fetch(k.slice(2, 0, 40), k.slice(2, 0, 40));
  first_two.update_and_fetch(k.slice(2, 40, 50), k.slice(2, 40, 50));
  cache.trim(40);
  EXPECT_EQ(cache.compressed_key_bytes(), first_two.compressed_key_bytes());
  EXPECT_EQ(cache.fixed_width_key_bytes(), first_two.fixed_width_key_bytes());
  cache.trim(15);  // cuts into the first call: its kept 35 tokens are accounted as a 35-token stream
  const auto codes = cache.key_stream().codes(0);
  std::vector<std::uint8_t> kept(codes.begin(), codes.end());
  ASSERT_EQ(kept.size(), 35u * 8u);
  EXPECT_EQ(cache.fixed_width_key_bytes(), 2 * vq::fixed_width_bytes(35, 8, 4, 2));
  EXPECT_EQ(cache.key_stream().n_groups(), 2);
}

TEST(CacheGen, FullStateRoundTripAndContinuation) {
  for (auto cfg : {per_call(), aligned()}) {
    auto k = vqtest::random_walk({1, 2, 120, 8}, 15, vq::DType::F16);
    vq::CacheGenKVCache a(cfg), b(per_call(7, 5));
    a.update_and_fetch(k.slice(2, 0, 50), k.slice(2, 0, 50));
    a.update_and_fetch(k.slice(2, 50, 77), k.slice(2, 50, 77));
    b.from_full_state(a.full_state());
    EXPECT_EQ(b.config(), a.config());
    EXPECT_EQ(b.offset(), 77);
    EXPECT_TRUE(b.state().keys.bit_equal(a.state().keys));
    EXPECT_EQ(b.compressed_key_bytes(), a.compressed_key_bytes());
    for (std::int64_t s = 77; s < 120; ++s) {
      auto [ka, va] = a.update_and_fetch(k.slice(2, s, s + 1), k.slice(2, s, s + 1));
      auto [kb, vb] = b.update_and_fetch(k.slice(2, s, s + 1), k.slice(2, s, s + 1));
      ASSERT_TRUE(ka.bit_equal(kb));
    }
    EXPECT_EQ(b.compressed_value_bytes(), a.compressed_value_bytes());
    EXPECT_THROW(b.from_state(a.state()), vq::InvalidArgument);
  }
}

TEST(CacheGen, ResolvedBitsOverrideBaseBits) {
  auto cfg = aligned(4);
  cfg.cachegen_resolved_bits = 2;
  vq::CacheGenKVCache cache(cfg);
  auto k = vqtest::random_walk({1, 1, 64, 8}, 16);
  cache.update_and_fetch(k, k);
  EXPECT_EQ(cache.key_stream().bits(), 2);
  for (auto c : cache.key_stream().codes(0)) ASSERT_LE(c, 3);
  EXPECT_EQ(cache.fixed_width_key_bytes(), vq::fixed_width_bytes(64, 8, 2, 2));
}

// Resident: the cache holds 4-bit codes and float32 scale + minimum per (group of 32, channel),
// 6 bits per element here, not a dense copy (fetch materialises one for the caller only).
TEST(CacheGen, NbytesIsTheCodesNotADenseCopy) {
  vq::CacheGenKVCache cache;
  vq::KVCache plain;
  auto k = vqtest::random_walk({1, 2, 64, 8}, 17, vq::DType::F16);
  const auto fetched = cache.update_and_fetch(k, k);
  plain.update_and_fetch(k, k);
  EXPECT_LT(cache.nbytes(), plain.nbytes() / 2);
  const std::size_t codes = 2 * 2 * 64 * 8 / 2, params = 2 * 2 * 2 * 8 * 8;  // sides * slices * ...
  EXPECT_GE(cache.nbytes(), codes + params);
  EXPECT_LE(cache.nbytes(), codes + params + 512);  // + the per-slice vectors' headers
  EXPECT_TRUE(fetched.first.bit_equal(cache.state().keys));
}

}  // namespace
