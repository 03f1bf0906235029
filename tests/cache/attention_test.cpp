// attend over a plain KVCache (the shared online-softmax loop and its reference): causal mask,
// grouped-query heads, batches, head dims, tile boundaries, and the errors.
#include "veloxquant/cache/attention.hpp"
#include "veloxquant/cache/attention_kernels.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/core/error.hpp"
#include "../support/test_util.hpp"

namespace {

using vq::DType;
using vq::KVCache;
using vq::Tensor;

// Largest |a - b| over two float32 tensors of equal shape, and the largest |b|.
std::pair<double, double> max_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  const auto x = a.to_f32_vector(), y = b.to_f32_vector();
  double d = 0, m = 0;
  for (std::size_t i = 0; i < x.size(); ++i) d = std::max(d, std::fabs(double(x[i]) - y[i])), m = std::max(m, std::fabs(double(y[i])));
  return {d, m};
}

struct Case {
  std::int64_t B, Hkv, Hq, D, T, Sq;
  DType dtype;
};

// Fill a cache with T tokens (the last Sq fed as their own call, as a host does), then attend.
void expect_attend_matches_ref(const Case& c) {
  SCOPED_TRACE(::testing::Message() << "B=" << c.B << " Hkv=" << c.Hkv << " Hq=" << c.Hq << " D=" << c.D << " T=" << c.T << " Sq=" << c.Sq
                                    << " " << vq::dtype_name(c.dtype));
  const Tensor k = vqtest::random_walk({c.B, c.Hkv, c.T, c.D}, 11, c.dtype), v = vqtest::random_walk({c.B, c.Hkv, c.T, c.D}, 12, c.dtype);
  KVCache cache;
  cache.update_and_fetch(k.slice(2, 0, c.T - c.Sq), v.slice(2, 0, c.T - c.Sq));
  cache.update_and_fetch(k.slice(2, c.T - c.Sq, c.T), v.slice(2, c.T - c.Sq, c.T));
  const Tensor q = vqtest::random_uniform({c.B, c.Hq, c.Sq, c.D}, 13, c.dtype);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
  const Tensor out = cache.attend(q, scale);
  EXPECT_EQ(out.dtype(), DType::F32);
  const auto [d, m] = max_diff(out, vq::attend_ref(cache, q, scale));
  EXPECT_GT(m, 0.1);                // a real output, not zeros
  EXPECT_LE(d, 2e-6 * (1.0 + m));   // float32 accumulation vs double
}

const Case kShapes[] = {Case{1, 1, 1, 8, 1, 1, DType::F32}, Case{1, 4, 4, 8, 37, 1, DType::F32}, Case{1, 4, 16, 8, 600, 1, DType::F32},
                        Case{2, 4, 8, 8, 600, 9, DType::F32}, Case{3, 2, 6, 13, 77, 5, DType::F32}, Case{1, 8, 32, 128, 300, 1, DType::F32},
                        Case{2, 2, 4, 128, 70, 70, DType::F32}, Case{2, 3, 6, 13, 90, 4, DType::F16}, Case{1, 2, 4, 128, 65, 2, DType::F16},
                        Case{1, 2, 2, 8, 40, 3, DType::BF16}, Case{1, 2, 10, 24, 333, 3, DType::F16},
                        // D = 16 and D = 8 with tile tails: the small-head-dim kernels (attention_small_d.cpp)
                        Case{1, 2, 4, 16, 300, 1, DType::F32}, Case{2, 2, 4, 16, 70, 7, DType::F16}, Case{1, 1, 2, 8, 263, 5, DType::F32}};

TEST(Attend, MatchesTheReferenceOverEveryShape) {
  for (const Case& c : kShapes) expect_attend_matches_ref(c);
}

// The scalar kernels (what a CPU without AVX2 runs) as well.
TEST(Attend, ScalarPathMatchesTheReferenceOverEveryShape) {
  const bool was = vq::attn::set_simd_enabled(false);
  for (const Case& c : kShapes) expect_attend_matches_ref(c);
  vq::attn::set_simd_enabled(was);
}

// Query i of Sq sees exactly tokens 0 .. offset - Sq + i: the same as one query over a cache cut there.
TEST(Attend, CausalMaskEqualsAttendingOverAShorterCache) {
  const std::int64_t T = 50, Sq = 6;
  const Tensor k = vqtest::random_walk({2, 2, T, 16}, 1), v = vqtest::random_walk({2, 2, T, 16}, 2);
  const Tensor q = vqtest::random_uniform({2, 4, Sq, 16}, 3);
  KVCache full;
  full.update_and_fetch(k, v);
  const Tensor all = full.attend(q, 0.25f);
  for (std::int64_t i = 0; i < Sq; ++i) {
    KVCache cut;
    cut.update_and_fetch(k.slice(2, 0, T - Sq + i + 1), v.slice(2, 0, T - Sq + i + 1));
    const Tensor one = cut.attend(q.slice(2, i, i + 1), 0.25f);
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t h = 0; h < 4; ++h)
        for (std::int64_t d = 0; d < 16; ++d) EXPECT_EQ(all.at(b, h, i, d), one.at(b, h, 0, d)) << i;
  }
}

// Grouped-query: query head q reads KV head q / G, so duplicating KV heads G times is the same.
TEST(Attend, GroupedQueryHeadsReadTheirGroupsKvHead) {
  const Tensor k = vqtest::random_walk({1, 2, 20, 8}, 4), v = vqtest::random_walk({1, 2, 20, 8}, 5);
  const Tensor q = vqtest::random_uniform({1, 6, 1, 8}, 6);
  KVCache grouped, expanded;
  grouped.update_and_fetch(k, v);
  Tensor ke = Tensor::zeros({1, 6, 20, 8}, DType::F32), ve = Tensor::zeros({1, 6, 20, 8}, DType::F32);
  for (std::int64_t h = 0; h < 6; ++h)
    for (std::int64_t t = 0; t < 20; ++t)
      for (std::int64_t d = 0; d < 8; ++d) ke.set(0, h, t, d, k.at(0, h / 3, t, d)), ve.set(0, h, t, d, v.at(0, h / 3, t, d));
  expanded.update_and_fetch(ke, ve);
  EXPECT_TRUE(grouped.attend(q, 0.5f).bit_equal(expanded.attend(q, 0.5f)));
}

// One query over one token returns that token's value; equal scores average the values.
TEST(Attend, SmallCasesByHand) {
  KVCache c;
  const Tensor k = Tensor::from_f32({1, 1, 2, 2}, std::vector<float>{1, 0, 1, 0});
  const Tensor v = Tensor::from_f32({1, 1, 2, 2}, std::vector<float>{2, 4, 6, -8});
  c.update_and_fetch(k, v);
  const Tensor q = Tensor::from_f32({1, 1, 2, 2}, std::vector<float>{3, 1, 3, 1});
  const Tensor o = c.attend(q, 1.0f);
  EXPECT_EQ(o.at(0, 0, 0, 0), 2.0f);  // query 0 sees token 0 only
  EXPECT_EQ(o.at(0, 0, 0, 1), 4.0f);
  EXPECT_EQ(o.at(0, 0, 1, 0), 4.0f);  // query 1: equal scores, the mean
  EXPECT_EQ(o.at(0, 0, 1, 1), -2.0f);
}

// The loop reads the cache in tiles, never the whole K or V at once, each token once per KV head.
class CountingCache : public KVCache {
 public:
  mutable std::int64_t max_tile = 0, key_tokens = 0, value_tokens = 0;
  const float* read_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const override {
    max_tile = std::max(max_tile, n), key_tokens += n;
    return KVCache::read_key_tile(b, h, t0, n, scratch);
  }
  const float* read_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const override {
    value_tokens += n;
    return KVCache::read_value_tile(b, h, t0, n, scratch);
  }
};

TEST(Attend, ReadsTilesNotTheWholeCache) {
  CountingCache c;
  const Tensor k = vqtest::random_walk({2, 8, 1000, 128}, 7, DType::F16);
  c.update_and_fetch(k, k);
  const Tensor q = vqtest::random_uniform({2, 32, 1, 128}, 8);
  const Tensor out = c.attend(q, 0.1f);
  EXPECT_EQ(c.max_tile, static_cast<std::int64_t>(vq::kAttentionTileBytes / 4 / 128));
  EXPECT_EQ(c.key_tokens, 2 * 8 * 1000);  // once per (batch, KV head), shared by its 4 query heads
  EXPECT_EQ(c.value_tokens, 2 * 8 * 1000);
}

// A cache picks its tile length (KVCache::attention_tile_tokens); the loop clamps it to
// 1 .. kAttentionMaxTileTokens and the result is still attention over the cache, across splits.
class TiledCache : public CountingCache {
 public:
  std::int64_t tile = 0;
  std::int64_t attention_tile_tokens() const override { return tile; }
};

TEST(Attend, TakesTheCachesTileLengthClamped) {
  const Tensor k = vqtest::random_walk({1, 2, 4500, 64}, 9, DType::F16), v = vqtest::random_walk({1, 2, 4500, 64}, 10, DType::F16);
  const Tensor q = vqtest::random_uniform({1, 4, 2, 64}, 11);
  for (const std::int64_t asked : {std::int64_t{0}, std::int64_t{1}, std::int64_t{7}, std::int64_t{256}, std::int64_t{1000},
                                   std::int64_t{100000}}) {
    SCOPED_TRACE(asked);
    TiledCache c;
    c.tile = asked;
    c.update(k, v);
    const Tensor out = c.attend(q, 0.125f);
    EXPECT_EQ(c.max_tile, std::clamp<std::int64_t>(asked, 1, vq::kAttentionMaxTileTokens));
    EXPECT_EQ(c.key_tokens, 2 * 4500);
    const auto [d, m] = max_diff(out, vq::attend_ref(c, q, 0.125));
    EXPECT_GT(m, 0.1);
    EXPECT_LE(d, 2e-6 * (1.0 + m));
  }
  KVCache plain;
  plain.update(k, v);
  EXPECT_EQ(plain.attention_tile_tokens(), static_cast<std::int64_t>(vq::kAttentionTileBytes / 4 / 64));  // the default: unchanged
}

// The loop flushes subnormals (FTZ/DAZ) while it runs and gives the caller's floating-point mode
// back; scores far below a row's maximum (weights that would be subnormal) change nothing visible.
#if defined(__x86_64__) || defined(__i386__)
TEST(Attend, FlushesSubnormalsOnlyWhileItRuns) {
  const Tensor k = vqtest::random_walk({1, 2, 3000, 64}, 21, DType::F16, 2.0f), v = vqtest::random_walk({1, 2, 3000, 64}, 22, DType::F16);
  const Tensor q = vqtest::random_uniform({1, 4, 1, 64}, 23);
  KVCache c;
  c.update(k, v);
  const unsigned mode = 0xFFC0;  // MXCSR's control bits (the low six are sticky exception flags)
  const unsigned before = _mm_getcsr() & mode;
  for (const int threads : {1, 2}) {
    const int was = vq::set_attention_threads(threads);
    const Tensor out = c.attend(q, 1.0f);  // scale 1 over a steep walk: most weights far below e^-87
    vq::set_attention_threads(was);
    EXPECT_EQ(_mm_getcsr() & mode, before);
    const auto [d, m] = max_diff(out, vq::attend_ref(c, q, 1.0));
    EXPECT_GT(m, 0.1);
    EXPECT_LE(d, 2e-6 * (1.0 + m));
  }
}
#endif

// Long contexts of decode-sized calls run in token splits merged in order (attention.hpp,
// "Threads"): they equal the reference too, including a last split that some rows do not see at
// all (T = 2 * 2048 + 3, Sq = 16: query 0 sees up to token 4083).
// (Few heads and query rows: attend_ref costs T x D per row.)
const Case kLongShapes[] = {Case{1, 2, 4, 128, 4500, 1, DType::F16}, Case{2, 1, 2, 16, 4099, 16, DType::F32},
                            Case{1, 2, 4, 8, 4400, 1, DType::F32}, Case{1, 1, 2, 13, 2049, 3, DType::F16}};

TEST(Attend, LongContextsInSplitsMatchTheReference) {
  const int was = vq::set_attention_threads(2);
  for (const Case& c : kLongShapes) expect_attend_matches_ref(c);
  vq::set_attention_threads(was);
}

// Threads only share the pieces out: the result is the same bits for 1, 2 and 3 threads, for the
// token splits (Sq <= 16) and for the (batch, KV head) pairs of a prefill-sized call alike.
TEST(Attend, ThreadsGiveTheSameBitsAsOneThread) {
  const Case cases[] = {Case{1, 8, 32, 128, 5000, 1, DType::F16}, Case{2, 2, 4, 128, 4099, 16, DType::F32},
                        Case{1, 4, 16, 8, 4400, 1, DType::F32}, Case{2, 4, 8, 64, 600, 60, DType::F16}};
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "D=" << c.D << " T=" << c.T << " Sq=" << c.Sq);
    const Tensor k = vqtest::random_walk({c.B, c.Hkv, c.T, c.D}, 31, c.dtype), v = vqtest::random_walk({c.B, c.Hkv, c.T, c.D}, 32, c.dtype);
    KVCache cache;
    cache.update(k, v);
    const Tensor q = vqtest::random_uniform({c.B, c.Hq, c.Sq, c.D}, 33);
    const int was = vq::set_attention_threads(1);
    const Tensor one = cache.attend(q, 0.2f);
    for (int n : {2, 3}) {
      vq::set_attention_threads(n);
      EXPECT_TRUE(cache.attend(q, 0.2f).bit_equal(one)) << n << " threads";
    }
    vq::set_attention_threads(was);
  }
}

// The plain cache reads its head-major rows in runs of 2048 tokens of one KV head (attention.cpp,
// run_tiles); a head's arithmetic does not depend on that order, so attending
// over all heads gives the same bits as attending over each head alone in a cache of its own
// (where there is no other head to interleave). Contexts inside one run, across runs and splits
// (T > 2048), prefill-sized Sq, batches, D = 128 (the float16 register kernels), D = 13, and
// D = 8 (the small-head-dim kernel that the stories260K transformer's caches take).
TEST(Attend, HeadRunsGiveTheSameBitsAsOneHeadAtATime) {
  const Case cases[] = {Case{1, 4, 16, 128, 5000, 1, DType::F16}, Case{2, 3, 6, 128, 700, 3, DType::F16},
                        Case{1, 2, 4, 13, 4500, 2, DType::F32}, Case{1, 2, 2, 128, 2100, 40, DType::F32},
                        Case{1, 4, 8, 8, 2600, 1, DType::F32}, Case{2, 2, 4, 8, 700, 30, DType::F32}};
  for (const int threads : {1, 2}) {
    const int was = vq::set_attention_threads(threads);
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message() << "D=" << c.D << " T=" << c.T << " Sq=" << c.Sq << " threads=" << threads);
      const Tensor k = vqtest::random_walk({c.B, c.Hkv, c.T, c.D}, 41, c.dtype), v = vqtest::random_walk({c.B, c.Hkv, c.T, c.D}, 42, c.dtype);
      const Tensor q = vqtest::random_uniform({c.B, c.Hq, c.Sq, c.D}, 43);
      KVCache all;
      all.update(k, v);
      const Tensor out = all.attend(q, 0.15f);
      const std::int64_t G = c.Hq / c.Hkv;
      for (std::int64_t h = 0; h < c.Hkv; ++h) {
        KVCache one;
        one.update(k.slice(1, h, h + 1), v.slice(1, h, h + 1));
        EXPECT_TRUE(one.attend(q.slice(1, h * G, (h + 1) * G), 0.15f).bit_equal(out.slice(1, h * G, (h + 1) * G))) << "KV head " << h;
      }
    }
    vq::set_attention_threads(was);
  }
}

TEST(Attend, ThreadCountOutOfRangeIsAnError) {
  EXPECT_THROW(vq::set_attention_threads(-1), vq::InvalidArgument);
  EXPECT_THROW(vq::set_attention_threads(vq::kMaxAttentionThreads + 1), vq::InvalidArgument);
  EXPECT_EQ(vq::attention_threads(), 1);  // unchanged by the refusals (the default)
  const int was = vq::set_attention_threads(0);  // every hardware thread
  const int all = vq::attention_threads();
  EXPECT_GE(all, 1);
  EXPECT_EQ(vq::set_attention_threads(was), all);
  EXPECT_EQ(vq::attention_threads(), 1);
}

std::string attend_error(const KVCache& c, const Tensor& q, float scale) {
  const Tensor before = c.state().keys.contiguous(true);
  const std::int64_t offset = c.offset();
  try {
    c.attend(q, scale);
  } catch (const vq::InvalidArgument& e) {
    EXPECT_EQ(c.offset(), offset);
    EXPECT_TRUE(c.state().keys.bit_equal(before));
    return e.what();
  }
  return "(no error)";
}

TEST(Attend, BadQueriesGetAClearErrorAndLeaveTheCacheAlone) {
  KVCache c;
  EXPECT_NE(attend_error(c, Tensor::zeros({1, 2, 1, 8}, DType::F32), 1.0f).find("the cache is empty"), std::string::npos);
  c.update_and_fetch(vqtest::random_walk({2, 2, 5, 8}, 1, DType::F16), vqtest::random_walk({2, 2, 5, 8}, 2, DType::F16));
  auto has = [&](const Tensor& q, float scale, const char* text) {
    const std::string e = attend_error(c, q, scale);
    EXPECT_NE(e.find(text), std::string::npos) << e;
  };
  has(Tensor::zeros({2, 2, 1, 9}, DType::F32), 1.0f, "have head dim 9 but the cache's keys have 8");
  has(Tensor::zeros({2, 3, 1, 8}, DType::F32), 1.0f, "have 3 heads, not a positive multiple of the cache's 2 KV heads");
  has(Tensor::zeros({1, 2, 1, 8}, DType::F32), 1.0f, "have batch 1 but the cache holds batch 2");
  has(Tensor::zeros({2, 2, 6, 8}, DType::F32), 1.0f, "have 6 tokens but must have 1 .. offset = 5");
  has(Tensor::zeros({2, 2, 0, 8}, DType::F32), 1.0f, "have 0 tokens");
  has(Tensor::zeros({2, 2, 1, 8}, DType::BF16), 1.0f, "queries are bfloat16 but must be float32 or the cache's float16");
  has(Tensor::zeros({2, 2, 1, 8}, DType::F32), NAN, "scale must be finite");
  has(Tensor::zeros({2, 2, 1, 8}, DType::F32), INFINITY, "scale must be finite");
  Tensor nan = Tensor::zeros({2, 2, 1, 8}, DType::F32);
  nan.set(1, 1, 0, 3, NAN);
  has(nan, 1.0f, "queries must be finite");
  // The reference refuses the same queries.
  EXPECT_THROW(vq::attend_ref(c, Tensor::zeros({2, 3, 1, 8}, DType::F32), 1.0), vq::InvalidArgument);
  EXPECT_NO_THROW(c.attend(Tensor::zeros({2, 4, 5, 8}, DType::F16), 1.0f));  // the cache's own dtype is fine
}

}  // namespace
