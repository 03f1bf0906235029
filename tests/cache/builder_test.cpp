#include "veloxquant/cache/builder.hpp"

#include <gtest/gtest.h>

#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/quant/layer_schedule.hpp"

namespace {

TEST(Builder, ScheduleOverAttentionLayers) {
  for (int n : {8, 9, 12, 24, 28, 32}) {
    vq::KVCacheConfig cfg;
    auto caches = vq::KVCacheBuilder::for_model(vq::ModelDescription::uniform(n, 64), cfg);
    ASSERT_EQ(static_cast<int>(caches.size()), n);
    const auto want = vq::layer_group_bits(n, 4, 3);
    int prev = 99;
    for (int i = 0; i < n; ++i) {
      auto* c = dynamic_cast<vq::CacheGenKVCache*>(caches[static_cast<std::size_t>(i)].get());
      ASSERT_NE(c, nullptr);
      ASSERT_EQ(c->config().cachegen_resolved_bits, want[static_cast<std::size_t>(i)]);
      ASSERT_LE(c->config().effective_bits(), prev);
      prev = c->config().effective_bits();
    }
    EXPECT_EQ(dynamic_cast<vq::CacheGenKVCache*>(caches.front().get())->config().effective_bits(), 4);
    EXPECT_LT(dynamic_cast<vq::CacheGenKVCache*>(caches.back().get())->config().effective_bits(), 4);
  }
}

TEST(Builder, LayersWithoutAttentionGetAPlainCache) {
  vq::ModelDescription m;
  m.layer_head_dims = {64, std::nullopt, 64, 64, std::nullopt, 64};
  vq::KVCacheConfig cfg;
  cfg.cachegen_layer_groups = 2;
  auto caches = vq::KVCacheBuilder::for_model(m, cfg);
  const auto want = vq::layer_group_bits(4, 4, 2);
  std::size_t a = 0;
  for (std::size_t i = 0; i < caches.size(); ++i) {
    if (!m.layer_head_dims[i]) {
      EXPECT_EQ(caches[i]->kind(), "KVCache");
      continue;
    }
    EXPECT_EQ(dynamic_cast<vq::CacheGenKVCache&>(*caches[i]).config().effective_bits(), want[a++]);
  }
}

TEST(Builder, RefusesPresetResolvedBitsAndBadConfig) {
  vq::KVCacheConfig cfg;
  cfg.cachegen_resolved_bits = 3;
  EXPECT_THROW(vq::KVCacheBuilder::for_model(vq::ModelDescription::uniform(4, 8), cfg), vq::InvalidArgument);
  cfg = {};
  cfg.cachegen_bits = 0;
  EXPECT_THROW(vq::KVCacheBuilder::for_model(vq::ModelDescription::uniform(4, 8), cfg), vq::InvalidArgument);
  vq::ModelDescription m;
  m.layer_head_dims = {0};
  EXPECT_THROW(vq::KVCacheBuilder::for_model(m, {}), vq::InvalidArgument);
}

TEST(Builder, ASingleCacheUsesUniformBits) {
  vq::KVCacheConfig cfg;
  cfg.cachegen_bits = 5;
  vq::CacheGenKVCache c(cfg);
  EXPECT_EQ(c.config().effective_bits(), 5);
  auto one = vq::KVCacheBuilder::for_model(vq::ModelDescription::uniform(1, 8), cfg);
  EXPECT_EQ(dynamic_cast<vq::CacheGenKVCache&>(*one[0]).config().effective_bits(), 5);
}

}  // namespace
