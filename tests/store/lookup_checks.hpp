// A store lookup finds what the store holds (store/prefix_lookup.hpp), checked on any backend: the
// file: store in vq_tests, Redis and Redis Cluster in vq_store_redis_tests. Model-free (the C API's
// path: caches made from a layer shape, loads into a ChunkShape), so the Redis binary needs no model.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "veloxquant/cache/builder.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/store/prefix_chunks.hpp"
#include "veloxquant/store/prefix_loader.hpp"

namespace vqtest {

// A context of n tokens: random token ids and K/V of 2 layers, 2 KV heads of 8.
struct SynthContext {
  static constexpr int kLayers = 2, kHeads = 2, kDim = 8;
  std::vector<int> tokens;
  std::vector<vq::KVState> exact;  // [1, kHeads, n, kDim] per layer
};

inline SynthContext synth_context(int n, std::uint32_t seed) {
  SynthContext c;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> tok(3, 500);
  std::normal_distribution<float> val(0.0f, 1.0f);
  for (int i = 0; i < n; ++i) c.tokens.push_back(tok(rng));
  for (int l = 0; l < SynthContext::kLayers; ++l) {
    std::vector<float> k(static_cast<std::size_t>(SynthContext::kHeads * n * SynthContext::kDim)), v(k.size());
    for (auto& x : k) x = val(rng);
    for (auto& x : v) x = val(rng);
    const vq::Shape4 shape{1, SynthContext::kHeads, n, SynthContext::kDim};
    c.exact.push_back({vq::Tensor::from_f32(shape, k), vq::Tensor::from_f32(shape, v)});
  }
  return c;
}

inline vq::PutReport synth_put(vq::KVStore& store, const SynthContext& c, std::uint64_t fp, int C, const std::vector<std::string>& levels) {
  const auto model = vq::ModelDescription::uniform(SynthContext::kLayers, SynthContext::kDim);
  const vq::LevelCaches fresh = [&](const std::string& level) { return vq::make_caches(vq::MethodSpec::parse(level), model); };
  vq::ChunkScheme scheme;
  scheme.model_fingerprint = fp;
  scheme.chunk_tokens = C;
  for (const auto& l : levels) scheme.levels.push_back(vq::MethodSpec::parse(l).to_string());
  const std::size_t n = c.tokens.size() / static_cast<std::size_t>(C) * static_cast<std::size_t>(C);
  std::vector<vq::KVState> exact;
  for (const auto& s : c.exact)
    exact.push_back({s.keys.slice(2, 0, static_cast<std::int64_t>(n)).contiguous(true), s.values.slice(2, 0, static_cast<std::int64_t>(n)).contiguous(true)});
  return vq::put_context(store, fresh, scheme, std::span<const int>(c.tokens).first(n), exact);
}

// A load of `tokens` into fresh fp32 caches, naming neither chunk size nor levels unless given.
struct SynthLoad {
  vq::LoadReport report;
  std::vector<vq::KVState> state;
};
inline SynthLoad synth_get(vq::KVStore& store, std::span<const int> tokens, std::uint64_t fp, int C = 0,
                           const std::vector<std::string>& levels = {}) {
  vq::LoaderOptions o;
  o.scheme.model_fingerprint = fp;
  o.scheme.chunk_tokens = C;
  for (const auto& l : levels) o.scheme.levels.push_back(vq::MethodSpec::parse(l).to_string());
  auto caches = vq::make_caches(vq::MethodSpec::parse("fp32"), vq::ModelDescription::uniform(SynthContext::kLayers, SynthContext::kDim));
  SynthLoad out;
  out.report = vq::load_prefix(store, vq::ChunkShape{SynthContext::kHeads, SynthContext::kDim}, caches, tokens, o);
  for (const auto& c : caches) out.state.push_back(c->state());
  return out;
}

// What a chunk holds at `level`, as the loader must give it: a fresh cache of the level fed it.
inline void expect_chunks_at(const SynthLoad& got, const SynthContext& c, int C, const std::string& level) {
  const auto model = vq::ModelDescription::uniform(SynthContext::kLayers, SynthContext::kDim);
  const int n = got.report.tokens_reused / C;
  for (int i = 0; i < n; ++i) {
    auto fresh = vq::make_caches(vq::MethodSpec::parse(level), model);
    for (std::size_t l = 0; l < fresh.size(); ++l) {
      fresh[l]->update(c.exact[l].keys.slice(2, i * C, (i + 1) * C).contiguous(true), c.exact[l].values.slice(2, i * C, (i + 1) * C).contiguous(true));
      const vq::KVState want = fresh[l]->state();
      EXPECT_TRUE(got.state[l].keys.slice(2, i * C, (i + 1) * C).contiguous(true).bit_equal(want.keys.to(vq::DType::F32)))
          << level << " chunk " << i << " layer " << l;
      EXPECT_TRUE(got.state[l].values.slice(2, i * C, (i + 1) * C).contiguous(true).bit_equal(want.values.to(vq::DType::F32)))
          << level << " chunk " << i << " layer " << l;
    }
  }
}

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// The cases on one store (emptied first): put at one level, get without naming it; several
// levels at several chunk sizes; a prefix of another model is a miss with its reason.
inline void check_lookup_discovers(vq::KVStore& store) {
  for (const auto& k : store.list()) store.remove(k);
  const std::uint64_t fp = 0x1234, other = 0x5678;
  const SynthContext c = synth_context(50, 7);
  const auto all = std::span<const int>(c.tokens);

  // Nothing stored: a miss, said plainly, and no note (nothing stored was left unused).
  auto r = synth_get(store, all, fp);
  EXPECT_EQ(r.report.tokens_reused, 0);
  ASSERT_TRUE(r.report.end.has_value());
  EXPECT_EQ(r.report.end->status, "miss");
  EXPECT_TRUE(contains(r.report.end->reason, "not stored")) << r.report.end->reason;
  EXPECT_EQ(r.report.not_used, "");

  // Put at one level (fp16 alone, chunks of 8); get without naming level or size.
  synth_put(store, c, fp, 8, {"fp16"});
  r = synth_get(store, all, fp);
  EXPECT_TRUE(r.report.warnings.empty()) << r.report.warnings.front();
  EXPECT_EQ(r.report.chunk_tokens, 8);
  EXPECT_EQ(r.report.tokens_reused, 48);  // 6 whole chunks, 2 tokens left to the host
  ASSERT_EQ(r.report.chunks.size(), 6u);
  for (const auto& ch : r.report.chunks) {
    EXPECT_EQ(ch.level, "fp16");
    EXPECT_EQ(ch.levels, std::vector<std::string>{"fp16"});
    EXPECT_EQ(ch.reason, "plan: the best level stored");
  }
  expect_chunks_at(r, c, 8, "fp16");
  EXPECT_FALSE(r.report.end.has_value());  // no whole chunk after the prefix
  // The report as JSON (generate --json, vq_store_report) carries the same.
  const std::string json = vq::load_report_json(r.report);
  EXPECT_TRUE(contains(json, "\"chunk_tokens\":8")) << json;
  EXPECT_TRUE(contains(json, "\"status\":\"hit\"")) << json;

  // A second level at the same size is added beside the first; a third level at another size.
  synth_put(store, c, fp, 8, {"cachegen:bits=4,group=4"});
  synth_put(store, c, fp, 12, {"fp32"});
  r = synth_get(store, all, fp);
  EXPECT_EQ(r.report.tokens_reused, 48);  // 6 x 8 beats 4 x 12 (48 too): a tie goes to the larger size
  EXPECT_EQ(r.report.chunk_tokens, 12);
  for (const auto& ch : r.report.chunks) EXPECT_EQ(ch.level, "fp32");
  expect_chunks_at(r, c, 12, "fp32");
  // Narrowed to the size of 8: both of its levels are found, the larger blob loaded (the better
  // quality by the plan's order; here cachegen's 4-bit groups of 4 carry more metadata than fp16).
  r = synth_get(store, all, fp, 8);
  EXPECT_EQ(r.report.tokens_reused, 48);
  ASSERT_FALSE(r.report.chunks.empty());
  const std::vector<std::string> both{"fp16", vq::MethodSpec::parse("cachegen:bits=4,group=4").to_string()};
  EXPECT_EQ(r.report.chunks[0].levels, both);
  for (const auto& ch : r.report.chunks) {
    EXPECT_EQ(ch.level, r.report.chunks[0].level);
    EXPECT_TRUE(ch.level == both[0] || ch.level == both[1]) << ch.level;
    EXPECT_EQ(ch.reason, "plan: the best level stored");
  }
  expect_chunks_at(r, c, 8, r.report.chunks[0].level);
  // Narrowed to a level: only it is loaded.
  r = synth_get(store, all, fp, 0, {"cachegen:bits=4,group=4"});
  EXPECT_EQ(r.report.chunk_tokens, 8);
  EXPECT_EQ(r.report.tokens_reused, 48);
  expect_chunks_at(r, c, 8, vq::MethodSpec::parse("cachegen:bits=4,group=4").to_string());
  // Narrowed to a level nobody stored: a miss that says what is stored.
  r = synth_get(store, all, fp, 8, {"vq:bits=2"});
  EXPECT_EQ(r.report.tokens_reused, 0);
  ASSERT_TRUE(r.report.end.has_value());
  EXPECT_EQ(r.report.end->index, 0);
  EXPECT_TRUE(contains(r.report.end->reason, "none is among the levels asked for")) << r.report.end->reason;
  EXPECT_TRUE(contains(r.report.not_used, "fp16")) << r.report.not_used;
  // A longer prompt sharing the prefix: the prefix is found, and the miss after it is "not stored".
  const SynthContext longer = synth_context(80, 7);  // same seed: the first 50 tokens and K/V are c's
  ASSERT_TRUE(std::equal(c.tokens.begin(), c.tokens.end(), longer.tokens.begin()));
  r = synth_get(store, longer.tokens, fp, 8);
  EXPECT_EQ(r.report.tokens_reused, 48);
  ASSERT_TRUE(r.report.end.has_value());
  EXPECT_EQ(r.report.end->index, 6);
  EXPECT_EQ(r.report.end->reason, "not stored");
  EXPECT_EQ(r.report.not_used, "");
  // The prompt that was put, cut to whole chunks: its last chunk holds the last token, which the
  // host computes; that chunk is stored but not used, and the note says so.
  r = synth_get(store, all.first(48), fp, 8);
  EXPECT_EQ(r.report.tokens_reused, 40);
  ASSERT_TRUE(r.report.end.has_value());
  EXPECT_EQ(r.report.end->index, 5);
  EXPECT_TRUE(contains(r.report.end->reason, "last token")) << r.report.end->reason;
  EXPECT_FALSE(r.report.not_used.empty());

  // Another model: its prefix is found and named, never loaded.
  r = synth_get(store, all, other);
  EXPECT_EQ(r.report.tokens_reused, 0);
  EXPECT_EQ(r.report.tokens_filled, 0);
  ASSERT_TRUE(r.report.end.has_value());
  EXPECT_EQ(r.report.end->status, "miss");
  EXPECT_TRUE(contains(r.report.end->reason, "another model")) << r.report.end->reason;
  EXPECT_TRUE(contains(r.report.end->reason, "0000000000001234")) << r.report.end->reason;
  EXPECT_TRUE(contains(r.report.not_used, "another model")) << r.report.not_used;
  for (const auto& s : r.state) EXPECT_EQ(s.keys.dim(2), 0);
  // Once that model stores its own, both are found, each by its model.
  synth_put(store, c, other, 8, {"fp32"});
  r = synth_get(store, all, other);
  EXPECT_EQ(r.report.tokens_reused, 48);
  for (const auto& ch : r.report.chunks) EXPECT_EQ(ch.levels, std::vector<std::string>{"fp32"});
  r = synth_get(store, all, fp, 8);
  ASSERT_FALSE(r.report.chunks.empty());
  EXPECT_EQ(r.report.chunks[0].levels.size(), 2u);  // fp's two levels, not the other model's
  for (const auto& k : store.list()) store.remove(k);
}

// Issue 36's poisoning, on any backend: prompt B differs from A in its first chunk only; B's chunk
// blobs written under A's keys are refused ("blob of another prefix"), only A's own chunk 0 is
// used, and the refused blob leaves the store so the next put of A stores it again. Then A loads
// whole, each chunk exactly what its level holds for A.
inline void check_refuses_another_prefix(vq::KVStore& store) {
  for (const auto& k : store.list()) store.remove(k);
  const std::uint64_t fp = 0x36;
  const int C = 8;
  const SynthContext a = synth_context(41, 11);
  SynthContext b = synth_context(41, 12);  // other K/V everywhere (another prefix changes every later row)
  for (std::size_t t = static_cast<std::size_t>(C); t < a.tokens.size(); ++t) b.tokens[t] = a.tokens[t];
  synth_put(store, a, fp, C, {"fp16"});
  synth_put(store, b, fp, C, {"fp16"});
  const std::string level = vq::MethodSpec::parse("fp16").to_string();
  const int n = static_cast<int>(a.tokens.size() - 1) / C;  // whole chunks a load may use (the last token stays)
  std::uint64_t ha = 0, hb = 0;
  for (int i = 0; i < n; ++i) {
    ha = vq::chain_hash(ha, fp, level, std::span<const int>(a.tokens).subspan(static_cast<std::size_t>(i * C), C));
    hb = vq::chain_hash(hb, fp, level, std::span<const int>(b.tokens).subspan(static_cast<std::size_t>(i * C), C));
    if (i == 0) continue;
    const auto blob = store.get(vq::chunk_key(level, hb));
    ASSERT_TRUE(blob.has_value()) << i;
    store.replace(vq::chunk_key(level, ha), *blob);  // B's chunk i under A's key
  }
  auto r = synth_get(store, a.tokens, fp);
  EXPECT_EQ(r.report.tokens_reused, C);
  ASSERT_EQ(r.report.warnings.size(), 1u);
  EXPECT_TRUE(contains(r.report.warnings[0], "chunk 1: ") && contains(r.report.warnings[0], "blob of another prefix") &&
              contains(r.report.warnings[0], "removed from the store"))
      << r.report.warnings[0];
  expect_chunks_at(r, a, C, "fp16");
  // Each put of A repairs the chunk the load before it refused, until A loads whole.
  for (int round = 0; round < n && r.report.tokens_reused < n * C; ++round) {
    synth_put(store, a, fp, C, {"fp16"});
    r = synth_get(store, a.tokens, fp);
  }
  EXPECT_EQ(r.report.tokens_reused, n * C);
  EXPECT_TRUE(r.report.warnings.empty()) << r.report.warnings.front();
  expect_chunks_at(r, a, C, "fp16");
  for (const auto& k : store.list()) store.remove(k);
}

}  // namespace vqtest
