#include "veloxquant/cache/kv_cache.hpp"

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"
#include "../support/test_util.hpp"

namespace {

TEST(KVCache, AppendsAndFetchesEverything) {
  vq::KVCache cache;
  auto k = vqtest::random_uniform({2, 3, 10, 4}, 1);
  auto v = vqtest::random_uniform({2, 3, 10, 6}, 2);  // V may have another head dim
  auto [k1, v1] = cache.update_and_fetch(k.slice(2, 0, 7), v.slice(2, 0, 7));
  EXPECT_EQ(cache.offset(), 7);
  EXPECT_TRUE(k1.bit_equal(k.slice(2, 0, 7)));
  auto [k2, v2] = cache.update_and_fetch(k.slice(2, 7, 10), v.slice(2, 7, 10));
  EXPECT_EQ(cache.offset(), 10);
  EXPECT_TRUE(k2.bit_equal(k));
  EXPECT_TRUE(v2.bit_equal(v));
  EXPECT_EQ(k2.dtype(), vq::DType::F32);
}

TEST(KVCache, FetchIsAViewNotACopy) {
  vq::KVCache cache;
  auto k = vqtest::random_uniform({1, 2, 300, 4}, 1, vq::DType::F16);
  auto [a, av] = cache.update_and_fetch(k, k);  // past one step: capacity rounds up to 512 tokens
  auto [b, bv] = cache.update_and_fetch(k.slice(2, 0, 3), k.slice(2, 0, 3));  // within capacity: the same buffer
  EXPECT_TRUE(a.shares_storage_with(b));
  EXPECT_TRUE(cache.state().keys.shares_storage_with(b));
  EXPECT_EQ(b.dtype(), vq::DType::F16);
}

TEST(KVCache, GrowsPastCapacityKeepingContents) {
  vq::KVCache cache;
  auto k = vqtest::random_walk({1, 2, 1000, 8}, 3);
  for (std::int64_t s = 0; s < 1000; ++s) cache.update_and_fetch(k.slice(2, s, s + 1), k.slice(2, s, s + 1));
  EXPECT_TRUE(cache.state().keys.bit_equal(k));
  EXPECT_GE(cache.nbytes(), 2 * k.nbytes());
}

// A loader that announces the prefix it feeds in chunks (expect_tokens) gets one buffer of that
// size: fetches of every chunk after the first share it (nothing reallocated, no row copied
// twice), the contents are the chunks', and more tokens than announced still fit.
TEST(KVCache, ExpectedTokensAreReservedAtOnce) {
  auto k = vqtest::random_walk({1, 2, 1300, 64}, 3);   // chunks of 128 x 64 floats: past the page-populate minimum
  auto v = vqtest::random_walk({1, 2, 1300, 64}, 4);
  vq::KVCache hinted, plain;
  hinted.expect_tokens(1280);
  const auto [first, fv] = hinted.update_and_fetch(k.slice(2, 0, 128), v.slice(2, 0, 128));
  plain.update_and_fetch(k.slice(2, 0, 128), v.slice(2, 0, 128));
  EXPECT_EQ(hinted.nbytes(), 2 * 1280 * 2 * 64 * sizeof(float));
  bool plain_moved = false;
  for (std::int64_t t = 128; t < 1280; t += 128) {
    const auto [hk, hv] = hinted.update_and_fetch(k.slice(2, t, t + 128), v.slice(2, t, t + 128));
    EXPECT_TRUE(hk.shares_storage_with(first)) << t;
    const auto before = plain.state().keys;
    const auto [pk, pv] = plain.update_and_fetch(k.slice(2, t, t + 128), v.slice(2, t, t + 128));
    plain_moved = plain_moved || !pk.shares_storage_with(before);
  }
  EXPECT_TRUE(plain_moved);  // without the hint the buffer grows (and copies) on the way
  EXPECT_TRUE(hinted.state().keys.bit_equal(k.slice(2, 0, 1280)));
  EXPECT_TRUE(hinted.state().values.bit_equal(v.slice(2, 0, 1280)));
  hinted.update_and_fetch(k.slice(2, 1280, 1300), v.slice(2, 1280, 1300));
  EXPECT_TRUE(hinted.state().keys.bit_equal(k));
  EXPECT_TRUE(hinted.state().values.bit_equal(v));
}

// A buffer of 2 MiB or more sized by expect_tokens is written whole: it is mapped in huge pages
// (core/page_vector.hpp map_huge, 2 MiB-aligned). Its contents are the chunks', views of it outlive
// the cache, and a buffer grown past the hint goes back to the heap with every token kept.
TEST(KVCache, AnExpectedBufferOfHugePagesHoldsTheChunks) {
  auto k = vqtest::random_walk({1, 4, 2100, 64}, 5);  // 2048 tokens x 4 heads x 64 floats: 2 MiB a side
  auto v = vqtest::random_walk({1, 4, 2100, 64}, 6);
  vq::Tensor view;
  {
    vq::KVCache cache;
    cache.expect_tokens(2048);
    for (std::int64_t t = 0; t < 2048; t += 256) {
      const auto [hk, hv] = cache.update_and_fetch(k.slice(2, t, t + 256), v.slice(2, t, t + 256));
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(hk.row(0, 0, 0)) % (std::uintptr_t{2} << 20), 0u) << t;
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(hv.row(0, 0, 0)) % (std::uintptr_t{2} << 20), 0u) << t;
      view = hk;
    }
    EXPECT_EQ(cache.nbytes(), 2 * k.slice(2, 0, 2048).nbytes());
    EXPECT_TRUE(cache.state().values.bit_equal(v.slice(2, 0, 2048)));
    cache.update_and_fetch(k.slice(2, 2048, 2100), v.slice(2, 2048, 2100));  // past the hint
    EXPECT_TRUE(cache.state().keys.bit_equal(k));
    EXPECT_TRUE(cache.state().values.bit_equal(v));
  }
  EXPECT_TRUE(view.bit_equal(k.slice(2, 0, 2048)));  // the mapping lives as long as a view holds it
}

TEST(KVCache, MismatchesAreRejectedAndLeaveTheCacheUnchanged) {
  vq::KVCache cache;
  auto k = vqtest::random_uniform({1, 2, 3, 4}, 1);
  cache.update_and_fetch(k, k);
  EXPECT_THROW(cache.update_and_fetch(k, vqtest::random_uniform({1, 2, 2, 4}, 1)), vq::InvalidArgument);
  EXPECT_THROW(cache.update_and_fetch(vqtest::random_uniform({1, 3, 3, 4}, 1), vqtest::random_uniform({1, 3, 3, 4}, 1)),
               vq::InvalidArgument);
  EXPECT_THROW(cache.update_and_fetch(vqtest::random_uniform({1, 2, 3, 5}, 1), k), vq::InvalidArgument);
  auto h = vqtest::random_uniform({1, 2, 3, 4}, 1, vq::DType::F16);
  EXPECT_THROW(cache.update_and_fetch(h, h), vq::InvalidArgument);
  EXPECT_THROW(cache.update_and_fetch(h, k), vq::InvalidArgument);
  EXPECT_EQ(cache.offset(), 3);
  EXPECT_TRUE(cache.state().keys.bit_equal(k));
}

TEST(KVCache, TrimAndStateRoundTrip) {
  vq::KVCache cache;
  auto k = vqtest::random_uniform({1, 2, 9, 4}, 1);
  auto v = vqtest::random_uniform({1, 2, 9, 4}, 2);
  cache.update_and_fetch(k, v);
  EXPECT_TRUE(cache.is_trimmable());
  EXPECT_EQ(cache.trim(4), 4);
  EXPECT_EQ(cache.offset(), 5);
  EXPECT_TRUE(cache.state().values.bit_equal(v.slice(2, 0, 5)));
  EXPECT_EQ(cache.trim(100), 5);
  EXPECT_EQ(cache.offset(), 0);
  EXPECT_THROW(cache.trim(-1), vq::InvalidArgument);

  cache.update_and_fetch(k, v);
  vq::KVCache copy;
  copy.from_state(cache.state());
  EXPECT_EQ(copy.offset(), 9);
  EXPECT_TRUE(copy.state().keys.bit_equal(k));
  EXPECT_FALSE(copy.state().keys.shares_storage_with(cache.state().keys));
  // after trim, new tokens overwrite the dropped ones
  cache.trim(3);
  auto [kk, vv] = cache.update_and_fetch(v.slice(2, 0, 1), k.slice(2, 0, 1));
  EXPECT_EQ(cache.offset(), 7);
  EXPECT_TRUE(kk.slice(2, 6, 7).bit_equal(v.slice(2, 0, 1)));
}

TEST(KVCache, EmptyCacheAdoptsANewLayout) {
  vq::KVCache cache;
  cache.update_and_fetch(vqtest::random_uniform({1, 2, 3, 4}, 1), vqtest::random_uniform({1, 2, 3, 4}, 1));
  cache.trim(3);
  auto [k, v] = cache.update_and_fetch(vqtest::random_uniform({2, 1, 1, 8}, 1), vqtest::random_uniform({2, 1, 1, 8}, 1));
  EXPECT_EQ(k.shape(), (vq::Shape4{2, 1, 1, 8}));
}

}  // namespace
