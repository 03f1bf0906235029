// attend for every method: the cache's own tile loop equals dense attention over its
// reconstruction (attend_ref over state()) within float32 tolerance, at Sq = 1 and Sq > 1, grouped
// query heads, B > 1 and head dims 8, 13 and 128.
#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "veloxquant/cache/attention.hpp"
#include "veloxquant/cache/attention_kernels.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/transformer.hpp"
#include "../support/test_util.hpp"
#include "model_support.hpp"

namespace {

using vq::MethodSpec;
using vq::Tensor;

// One spec per method kind and variant (small windows so that short tests quantize something).
const std::vector<std::string>& method_specs() {
  static const std::vector<std::string> specs{
      "fp32",
      "fp16",
      "cachegen:bits=4,schedule=off",
      "cachegen:bits=3,group=16,flush=per_call,schedule=off",
      "kivi:bits=2,group=16,residual=32",
      "kivi:bits=4,group=16,residual=16",
      "q8_0",
      "q4_0",
      "q4_1",
      "q8_0:rotate=1",
      "q4_0:rotate=1",
      "fp8",
      "lmcache:chunk=32",
      "cachegen_paper:group=10,chunk=40,profile_tokens=256",
      "vq:bits=2,calib=16",
      "vq:bits=3,calib=16,residual=8",
      "vq:bits=2,calib=16,residual=4,sinks=2",
      "vq:bits=6,calib=8",
  };
  return specs;
}

TEST(AttendMethods, TheListCoversEveryMethodKind) {
  std::set<int> kinds;
  for (const auto& s : method_specs()) kinds.insert(static_cast<int>(MethodSpec::parse(s).kind));
  for (int k = 0; k <= static_cast<int>(MethodSpec::Kind::Vq); ++k) EXPECT_TRUE(kinds.count(k)) << "method kind " << k << " has no spec here";
}

struct Case {
  std::int64_t B, Hkv, Hq, D, T, Sq;
};

// The layer-0 cache of `spec`: built for stories260K (cachegen_paper profiles that model) but fed
// any layout; a model-less description for vq (identity transforms, any head dim).
std::shared_ptr<vq::KVCache> make_cache(const std::string& spec, std::int64_t D) {
  static const vq::Transformer model(vq::Checkpoint::load(vqtest::model_path()));
  const MethodSpec m = MethodSpec::parse(spec);
  if (m.kind == MethodSpec::Kind::CachegenPaper) return vq::make_caches(m, model)[0];
  return vq::make_caches(m, vq::ModelDescription::uniform(1, static_cast<int>(D)))[0];
}

void expect_attend_matches_dense(const std::string& spec, const Case& c) {
  SCOPED_TRACE(::testing::Message() << spec << " B=" << c.B << " Hkv=" << c.Hkv << " Hq=" << c.Hq << " D=" << c.D << " T=" << c.T
                                    << " Sq=" << c.Sq);
  auto cache = make_cache(spec, c.D);
  const Tensor k = vqtest::random_walk({c.B, c.Hkv, c.T, c.D}, 21), v = vqtest::random_walk({c.B, c.Hkv, c.T, c.D}, 22);
  // Prefill, then the queries' own tokens as a decode step.
  cache->update_and_fetch(k.slice(2, 0, c.T - c.Sq), v.slice(2, 0, c.T - c.Sq));
  cache->update_and_fetch(k.slice(2, c.T - c.Sq, c.T), v.slice(2, c.T - c.Sq, c.T));
  const Tensor q = vqtest::random_uniform({c.B, c.Hq, c.Sq, c.D}, 23);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
  const Tensor out = cache->attend(q, scale), ref = vq::attend_ref(*cache, q, scale);
  ASSERT_EQ(out.shape(), (vq::Shape4{c.B, c.Hq, c.Sq, c.D}));
  const auto x = out.to_f32_vector(), y = ref.to_f32_vector();
  double diff = 0, mag = 0;
  for (std::size_t i = 0; i < x.size(); ++i) diff = std::max(diff, std::fabs(double(x[i]) - y[i])), mag = std::max(mag, std::fabs(double(y[i])));
  EXPECT_GT(mag, 0.1);
  EXPECT_LE(diff, 2e-6 * (1.0 + mag));
}

// H*D is a multiple of 32 in every case (llama.cpp's blocks run along a token's row).
const Case kCases[] = {
    {1, 4, 4, 8, 70, 1},    // stories260K's layout, one decode step
    {2, 4, 8, 8, 70, 5},    // B > 1, GQA, Sq > 1
    {2, 32, 64, 13, 70, 3}, // an odd head dim
    {1, 2, 8, 128, 70, 1},  // GQA 4:1 at D = 128
    {2, 1, 3, 128, 45, 7},
    {1, 2, 6, 64, 100, 2},  // two blocks per head, a tile's tail of 4 tokens
    {1, 2, 6, 16, 600, 3},  // tiles of 256 tokens and a tail of 88
};

TEST(AttendMethods, EqualsDenseAttentionOverTheReconstruction) {
  for (const auto& spec : method_specs())
    for (const Case& c : kCases) {
      // cachegen_paper's profile (of stories260K) fixes the channels per token: its layout only.
      if (MethodSpec::parse(spec).kind == MethodSpec::Kind::CachegenPaper && c.Hkv * c.D != 4 * 8) continue;
      expect_attend_matches_dense(spec, c);
    }
}

// The scalar path (what a CPU without AVX2 runs, and the reference the caches' own SIMD kernels on
// blocks and codes are held against) equals dense attention as well, so the two paths agree
// within twice the float32 budget.
TEST(AttendMethods, ScalarPathEqualsDenseAttentionToo) {
  const bool was = vq::attn::set_simd_enabled(false);
  for (const auto& spec : method_specs())
    for (const Case& c : kCases) {
      if (MethodSpec::parse(spec).kind == MethodSpec::Kind::CachegenPaper && c.Hkv * c.D != 4 * 8) continue;
      expect_attend_matches_dense(spec, c);
    }
  vq::attn::set_simd_enabled(was);
}

// The AVX2 kernels where the CPU has AVX-512 (attn::set_avx512_enabled(false)): what a CPU without
// AVX-512 runs, held to dense attention too.
TEST(AttendMethods, Avx2PathEqualsDenseAttentionToo) {
  const bool was = vq::attn::set_avx512_enabled(false);
  for (const auto& spec : method_specs())
    for (const Case& c : kCases) {
      if (MethodSpec::parse(spec).kind == MethodSpec::Kind::CachegenPaper && c.Hkv * c.D != 4 * 8) continue;
      expect_attend_matches_dense(spec, c);
    }
  vq::attn::set_avx512_enabled(was);
}

// Threads (cache/attention.hpp, "Threads"): every method's hooks run from several threads at once,
// and the result is the same bits for any thread count, for a long decode-sized call (token splits,
// T past 2048) and a prefill-sized one ((batch, KV head) pairs); the split form equals dense
// attention as the single loop does.
TEST(AttendMethods, ThreadsGiveTheSameBitsAsOneThread) {
  const Case cases[] = {{1, 4, 8, 8, 4500, 1}, {1, 2, 8, 128, 4200, 3}, {2, 4, 8, 64, 400, 48}};
  for (const auto& spec : method_specs()) {
    if (MethodSpec::parse(spec).kind == MethodSpec::Kind::CachegenPaper) continue;  // stories260K's layout only: below
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message() << spec << " D=" << c.D << " T=" << c.T << " Sq=" << c.Sq);
      auto cache = make_cache(spec, c.D);
      const Tensor k = vqtest::random_walk({c.B, c.Hkv, c.T, c.D}, 51), v = vqtest::random_walk({c.B, c.Hkv, c.T, c.D}, 52);
      cache->update(k.slice(2, 0, c.T - c.Sq), v.slice(2, 0, c.T - c.Sq));
      cache->update(k.slice(2, c.T - c.Sq, c.T), v.slice(2, c.T - c.Sq, c.T));
      const Tensor q = vqtest::random_uniform({c.B, c.Hq, c.Sq, c.D}, 53);
      const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
      const int was = vq::set_attention_threads(1);
      const Tensor one = cache->attend(q, scale);
      vq::set_attention_threads(3);
      const Tensor three = cache->attend(q, scale);
      vq::set_attention_threads(2);
      const Tensor two = cache->attend(q, scale);
      vq::set_attention_threads(was);
      EXPECT_TRUE(three.bit_equal(one));
      EXPECT_TRUE(two.bit_equal(one));
      if (c.Sq == 1) {  // the split form against dense attention over the reconstruction
        const auto x = one.to_f32_vector(), y = vq::attend_ref(*cache, q, scale).to_f32_vector();
        double diff = 0, mag = 0;
        for (std::size_t i = 0; i < x.size(); ++i) diff = std::max(diff, std::fabs(double(x[i]) - y[i])), mag = std::max(mag, std::fabs(double(y[i])));
        EXPECT_GT(mag, 0.1);
        EXPECT_LE(diff, 2e-6 * (1.0 + mag));
      }
    }
  }
}

// Float16 input: block and fp8 caches, whose tiles round through float16, take the tile path;
// it equals dense attention over the (float16) reconstruction with the SIMD kernels on and off.
// (Rotated caches read float32 rotated rows, within float16 rounding of state(): docs/cache.md.)
TEST(AttendMethods, Float16InputEqualsDenseAttention) {
  for (const char* spec : {"q8_0", "q4_0", "q4_1", "fp8"})
    for (bool simd : {true, false}) {
      SCOPED_TRACE(::testing::Message() << spec << (simd ? " simd" : " scalar"));
      const bool was = vq::attn::set_simd_enabled(simd);
      auto cache = make_cache(spec, 128);
      const Tensor k = vqtest::random_walk({1, 2, 77, 128}, 41, vq::DType::F16), v = vqtest::random_walk({1, 2, 77, 128}, 42, vq::DType::F16);
      cache->update(k, v);
      const Tensor q = vqtest::random_uniform({1, 8, 3, 128}, 43);
      const Tensor out = cache->attend(q, 0.09f), ref = vq::attend_ref(*cache, q, 0.09);
      const auto x = out.to_f32_vector(), y = ref.to_f32_vector();
      double diff = 0, mag = 0;
      for (std::size_t i = 0; i < x.size(); ++i) diff = std::max(diff, std::fabs(double(x[i]) - y[i])), mag = std::max(mag, std::fabs(double(y[i])));
      EXPECT_GT(mag, 0.1);
      EXPECT_LE(diff, 2e-6 * (1.0 + mag));
      vq::attn::set_simd_enabled(was);
    }
}

}  // namespace

namespace {

// update() (append without fetching, what a host that attends calls) builds the same cache as
// update_and_fetch: the same offset and the same state, bit for bit, over several calls.
TEST(AttendMethods, UpdateWithoutFetchBuildsTheSameCache) {
  for (const auto& spec : method_specs()) {
    SCOPED_TRACE(spec);
    const Case c{2, 4, 8, 8, 70, 1};
    if (MethodSpec::parse(spec).kind == MethodSpec::Kind::CachegenPaper) continue;  // fixed layout, covered below
    auto a = make_cache(spec, c.D), b = make_cache(spec, c.D);
    const Tensor k = vqtest::random_walk({c.B, c.Hkv, c.T, c.D}, 31), v = vqtest::random_walk({c.B, c.Hkv, c.T, c.D}, 32);
    for (auto [t0, t1] : {std::pair<std::int64_t, std::int64_t>{0, 40}, {40, 41}, {41, 70}}) {
      a->update_and_fetch(k.slice(2, t0, t1), v.slice(2, t0, t1));
      b->update(k.slice(2, t0, t1), v.slice(2, t0, t1));
    }
    ASSERT_EQ(a->offset(), b->offset());
    const vq::KVState sa = a->state(), sb = b->state();
    EXPECT_EQ(sa.keys.to_f32_vector(), sb.keys.to_f32_vector());
    EXPECT_EQ(sa.values.to_f32_vector(), sb.values.to_f32_vector());
    // A bad chunk is refused by update() as by update_and_fetch, and changes nothing.
    EXPECT_THROW(b->update(k.slice(2, 0, 1).contiguous(true), v.slice(2, 0, 2).contiguous(true)), vq::InvalidArgument);
    EXPECT_EQ(b->offset(), c.T);
  }
}

}  // namespace
