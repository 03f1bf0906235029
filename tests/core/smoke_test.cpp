#include <gtest/gtest.h>
#include "veloxquant/cache/cachegen_cache.hpp"
TEST(Smoke, Builds) { vq::CacheGenKVCache c; EXPECT_EQ(c.offset(), 0); }
