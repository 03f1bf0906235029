// store/prefix_lookup.hpp: a lookup finds the chunk sizes and levels a store holds (file: here;
// Redis and Redis Cluster run the same checks in store_redis_integration), says why reuse ends,
// and a fault in the index is a warning and a recompute that the next put repairs.
#include <gtest/gtest.h>

#include <filesystem>

#include "lookup_checks.hpp"
#include "store_context.hpp"
#include "veloxquant/store/file_store.hpp"
#include "veloxquant/store/load_plan.hpp"
#include "veloxquant/store/prefix_lookup.hpp"

namespace fs = std::filesystem;

namespace {

struct TempStore {
  fs::path dir;
  std::unique_ptr<vq::FileStore> store;
  explicit TempStore(const char* tag) {
    static int counter = 0;
    dir = fs::temp_directory_path() / fmt::format("vq-{}-{}-{}", tag, ::getpid(), counter++);
    fs::remove_all(dir);
    store = std::make_unique<vq::FileStore>(dir);
  }
  ~TempStore() { fs::remove_all(dir); }
};

TEST(PrefixLookup, DiscoversSizesLevelsAndModelsOnAFileStore) {
  TempStore t("lookup");
  vqtest::check_lookup_discovers(*t.store);
}

TEST(PrefixLookup, ABlobOfAnotherPrefixIsRefusedOnAFileStore) {
  TempStore t("poison");
  vqtest::check_refuses_another_prefix(*t.store);
}

// The chunk-sizes list and a directory, corrupted: one warning, nothing loaded (the host
// recomputes); the next put of the prompt rewrites them and the prefix is found again.
TEST(PrefixLookup, ACorruptIndexIsAFaultThatTheNextPutRepairs) {
  TempStore t("lookup-corrupt");
  vq::KVStore& store = *t.store;
  const std::uint64_t fp = 99;
  const auto c = vqtest::synth_context(41, 3);
  vqtest::synth_put(store, c, fp, 8, {"fp16"});
  ASSERT_EQ(vqtest::synth_get(store, c.tokens, fp).report.tokens_reused, 40);
  const std::string garbage = "{\"vqkv_chunk_sizes\": 1, \"sizes\": [\"eight\"]}";
  store.replace(vq::kChunkSizesKey, vq::Blob(garbage.begin(), garbage.end()));
  auto r = vqtest::synth_get(store, c.tokens, fp);
  EXPECT_EQ(r.report.tokens_reused, 0);
  ASSERT_EQ(r.report.warnings.size(), 1u);
  EXPECT_TRUE(vqtest::contains(r.report.warnings[0], "chunk 0: corrupt chunk-sizes blob")) << r.report.warnings[0];
  vqtest::synth_put(store, c, fp, 8, {"fp16"});
  EXPECT_EQ(vqtest::synth_get(store, c.tokens, fp).report.tokens_reused, 40);
  // Chunk 2's directory: the prefix ends before it, with its fault.
  std::uint64_t h = 0;
  for (int i = 0; i <= 2; ++i) h = vq::directory_hash(h, 8, std::span<const int>(c.tokens).subspan(static_cast<std::size_t>(i) * 8, 8));
  store.replace(vq::directory_key(h), vq::Blob{'{', '}'});
  r = vqtest::synth_get(store, c.tokens, fp);
  EXPECT_EQ(r.report.tokens_reused, 16);
  ASSERT_EQ(r.report.warnings.size(), 1u);
  EXPECT_TRUE(vqtest::contains(r.report.warnings[0], "chunk 2: corrupt directory blob")) << r.report.warnings[0];
  ASSERT_TRUE(r.report.end.has_value());
  EXPECT_EQ(r.report.end->status, "fault");
  vqtest::expect_chunks_at(r, c, 8, "fp16");
  vqtest::synth_put(store, c, fp, 8, {"fp16"});
  r = vqtest::synth_get(store, c.tokens, fp);
  EXPECT_EQ(r.report.tokens_reused, 40);
  EXPECT_TRUE(r.report.warnings.empty());
  // An index blob larger than any directory is refused unparsed.
  vq::Blob huge(vq::kMaxIndexBlobBytes + 1, ' ');
  EXPECT_THROW(vq::decode_directory(huge), vq::FormatError);
  EXPECT_THROW(vq::decode_chunk_sizes(huge), vq::FormatError);
}

// A directory entry of this model whose key is not the chain's for this prefix (a forged or
// misplaced entry) is a fault, never a fetch of that key.
TEST(PrefixLookup, AnEntryWithAForeignKeyIsAFault) {
  TempStore t("lookup-forged");
  vq::KVStore& store = *t.store;
  const std::uint64_t fp = 5;
  const auto a = vqtest::synth_context(33, 1), b = vqtest::synth_context(33, 2);
  vqtest::synth_put(store, a, fp, 8, {"fp32"});
  vqtest::synth_put(store, b, fp, 8, {"fp32"});
  // Prompt a's chunk 1 directory, pointing at prompt b's chunk 1 blob.
  std::uint64_t ha = 0, hb = 0;
  for (int i = 0; i <= 1; ++i) {
    ha = vq::directory_hash(ha, 8, std::span<const int>(a.tokens).subspan(static_cast<std::size_t>(i) * 8, 8));
    hb = vq::directory_hash(hb, 8, std::span<const int>(b.tokens).subspan(static_cast<std::size_t>(i) * 8, 8));
  }
  vq::ChunkDirectory da = vq::decode_directory(*store.get(vq::directory_key(ha)));
  const vq::ChunkDirectory db = vq::decode_directory(*store.get(vq::directory_key(hb)));
  da.entries[0] = db.entries[0];
  store.replace(vq::directory_key(ha), vq::encode_directory(da));
  const auto r = vqtest::synth_get(store, a.tokens, fp);
  EXPECT_EQ(r.report.tokens_reused, 8);
  ASSERT_EQ(r.report.warnings.size(), 1u);
  EXPECT_TRUE(vqtest::contains(r.report.warnings[0], "chunk 1: corrupt directory blob")) << r.report.warnings[0];
  vqtest::expect_chunks_at(r, a, 8, "fp32");
}

// With the real model: chunks the plan recomputes are reported with that reason, and the report's
// note says a stored prefix was not (all) used and why.
TEST(PrefixLookup, ChunksThePlanRecomputesAreSaid) {
  const vqtest::StoreContext c = vqtest::make_store_context(8);
  const vqtest::StoredContext s(c, 8, {"fp16"}, "lookup-plan");
  const auto& mc = c.model->config();
  vq::LoadCostTable costs;  // fp16 priced as if each chunk took 1000 s to decode: recompute wins
  costs.record("fp16", vq::cost_shape_key(static_cast<std::size_t>(mc.n_layers), mc.n_kv_heads, 8, mc.head_size()), 1e6, 0.0);
  vq::LoaderOptions o;
  o.scheme.model_fingerprint = c.fp;  // size and levels found in the store
  o.costs = &costs;
  o.threads = 1;  // one decoder: each chunk's 1000 s is on the plan's critical path
  auto caches = vq::make_caches("fp32", *c.model);
  const auto r = vq::load_prefix(*s.store, *c.model, caches, c.tokens, o);
  ASSERT_FALSE(r.chunks.empty());
  EXPECT_EQ(r.tokens_reused, 0);
  EXPECT_EQ(r.tokens_filled, static_cast<int>(r.chunks.size()) * 8);
  for (const auto& ch : r.chunks) {
    EXPECT_EQ(ch.level, "recompute");
    EXPECT_EQ(ch.reason, "plan: recomputing is predicted sooner than fetching");
    EXPECT_EQ(ch.levels, std::vector<std::string>{"fp16"});
  }
  EXPECT_TRUE(vqtest::contains(r.not_used, "stored chunks recomputed")) << r.not_used;
  EXPECT_TRUE(r.warnings.empty());
  // Without recompute the same store loads every chunk at fp16.
  o.allow_recompute = false;
  auto again = vq::make_caches("fp32", *c.model);
  const auto all = vq::load_prefix(*s.store, *c.model, again, c.tokens, o);
  EXPECT_EQ(all.tokens_reused, static_cast<int>(r.chunks.size()) * 8);
  EXPECT_EQ(all.not_used, "");
}

}  // namespace
