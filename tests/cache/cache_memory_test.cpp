// Memory follows the data: a cache given a wide input holding few (or no) tokens must not allocate
// per (slice, channel) or per capacity step out of proportion to it. Measured with nbytes(), which
// counts every buffer a cache holds (dense buffer, codes, scales, histograms).
#include <cstdint>
#include <string>

#include <gtest/gtest.h>

#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "../support/test_util.hpp"

namespace {

// Every method a .vqkv file, eval or rd can build, at its usual settings (cachegen_paper needs a
// profile and is built per model, so it is not here).
const char* const kMethods[] = {"fp32", "fp16", "fp8", "q8_0", "q4_0", "q4_1", "kivi:bits=2", "cachegen:bits=4", "cachegen:bits=8,group=1",
                                "cachegen:flush=per_call", "lmcache", "vq:bits=2"};

std::shared_ptr<vq::KVCache> make_cache(const std::string& spec, int head_dim) {
  auto caches = vq::make_caches(vq::MethodSpec::parse(spec), vq::ModelDescription::uniform(1, head_dim));
  return caches.at(0);
}

// [1, 4096, 0, 4096] once made the CacheGen cache allocate ~270 bytes per (slice, channel), 4.6 GB.
TEST(CacheMemory, AnEmptyWideInputAllocatesNothingPerChannel) {
  const auto k = vq::Tensor::zeros({1, 1024, 0, 1024}, vq::DType::F32);  // float32: every method takes it
  for (const char* spec : kMethods) {
    auto cache = make_cache(spec, 1024);
    cache->update_and_fetch(k, k);
    EXPECT_EQ(cache->offset(), 0) << spec;
    EXPECT_LE(cache->nbytes(), 64u * 1024) << spec;  // far below one byte per (slice, channel) of both sides (2 MiB)
  }
}

// One token of a wide input ([1, 4096, 1, 4096] cost 4.8 GB): at most a small multiple of its bytes.
TEST(CacheMemory, OneTokenOfAWideInputCostsAMultipleOfItsBytes) {
  const auto k = vqtest::random_uniform({1, 64, 1, 256}, 1);
  const auto v = vqtest::random_uniform({1, 64, 1, 256}, 2);
  const std::size_t input = k.nbytes() + v.nbytes();
  for (const char* spec : kMethods) {
    auto cache = make_cache(spec, 256);
    cache->update_and_fetch(k, v);
    (void)cache->stored_bytes();  // counters read: whatever they keep for it is allocated and counted
    EXPECT_LE(cache->nbytes(), 4 * input + 64 * 1024) << spec << " holds " << cache->nbytes() << " bytes for " << input;
  }
}

// Decode steps: the dense buffer grows geometrically but never past a few times what it holds.
TEST(CacheMemory, GrowthStaysWithinAFewTimesTheTokensHeld) {
  const auto k = vqtest::random_walk({1, 8, 700, 64}, 3);
  for (const char* spec : {"fp32", "cachegen:bits=4"}) {
    auto cache = make_cache(spec, 64);
    for (std::int64_t s = 0; s < 700; ++s) {
      cache->update_and_fetch(k.slice(2, s, s + 1), k.slice(2, s, s + 1));
      const std::size_t held = 2 * static_cast<std::size_t>(s + 1) * 8 * 64 * 4;
      ASSERT_LE(cache->nbytes(), 5 * held + 64 * 1024) << spec << " at " << s + 1 << " tokens";
    }
  }
}

// Histograms exist once a stream holds as many tokens as the alphabet has symbols (31 at 4 bits
// with token deltas; the first group of 32 closes past that), and are counted: per (slice,
// channel), 31 counts (124 bytes) plus a total and a running sum (16 bytes), per side.
TEST(CacheMemory, CacheGenCountsItsHistogramsOnceAGroupCloses) {
  vq::KVCacheConfig cfg;  // 4 bits, group 32, group_aligned, per channel, deltas
  vq::CacheGenKVCache cache(cfg);
  const auto k = vqtest::random_walk({1, 16, 32, 64}, 4, vq::DType::F16);
  cache.update_and_fetch(k.slice(2, 0, 31), k.slice(2, 0, 31));
  const std::size_t open = cache.nbytes();  // no group closed yet: the residual, no histograms
  EXPECT_GE(open, 2 * k.slice(2, 0, 31).nbytes());
  cache.update_and_fetch(k.slice(2, 31, 32), k.slice(2, 31, 32));
  const std::size_t closed = cache.nbytes();  // the group closed: codes and scales, the residual freed
  EXPECT_LT(closed, open);
  (void)cache.compressed_key_bytes();  // histograms fill when a counter is read
  (void)cache.compressed_value_bytes();
  const std::size_t hist = 2 * 16 * 64 * (31 * 4 + 16);
  EXPECT_GE(cache.nbytes(), closed + hist);
  EXPECT_LE(cache.nbytes(), closed + hist + 64 * 1024);
}

// A head dim no model has would overflow per-channel arithmetic (int): refused before allocating.
TEST(CacheMemory, AnAbsurdHeadDimIsRefused) {
  const auto k = vq::Tensor::zeros({1, 1, 0, vq::kMaxHeadDim + 1}, vq::DType::F16);
  for (const char* spec : {"fp32", "cachegen:bits=4"}) {
    auto cache = make_cache(spec, 64);
    EXPECT_THROW(cache->update_and_fetch(k, k), vq::InvalidArgument) << spec;
  }
}

}  // namespace
