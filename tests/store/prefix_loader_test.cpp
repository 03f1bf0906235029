// The prefix loader's parallel decode (store/prefix_loader.hpp): chunks decoded on several threads
// and fed in order give the caches a one-thread load gives, bit for bit; faults still stop the load
// at the faulty chunk with one warning, whatever the number of decoder threads. Real stories260K
// model, file: backend.
#include "veloxquant/store/prefix_loader.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include <fmt/core.h>

#include "store_context.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/tokenizer.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/store/file_store.hpp"
#include "veloxquant/store/load_plan.hpp"

namespace fs = std::filesystem;

namespace {

constexpr int kC = 4;  // tokens per chunk: many chunks from one sentence, so many decode at once

using Context = vqtest::StoreContext;

const Context& context() {
  static const Context c = vqtest::make_store_context(kC);
  return c;
}

int whole_chunks() { return static_cast<int>(context().tokens.size() - 1) / kC; }

// A fresh file store holding the context at `levels` (exactly these, no fp32 added: the loader then
// has one choice per chunk, so runs are comparable).
struct Stored : vqtest::StoredContext {
  explicit Stored(const std::vector<std::string>& levels) : StoredContext(context(), kC, levels, "loader-test") {}
  // The key of `level` (index into scheme.levels) of chunk i, as the directory names it.
  std::string level_key(int i, std::size_t level) const {
    std::uint64_t h = 0;
    for (int k = 0; k <= i; ++k)
      h = vq::chain_hash(h, scheme.model_fingerprint, scheme.levels[level], std::span<const int>(context().tokens).subspan(k * kC, kC));
    return vq::chunk_key(scheme.levels[level], h);
  }
};

struct Loaded {
  vq::LoadReport report;
  std::vector<vq::KVState> state;
  std::vector<std::size_t> nbytes;  // per layer, after the load
};

Loaded load(const Stored& s, int threads, bool repair = true) {
  const Context& c = context();
  vq::LoaderOptions o;
  o.scheme = s.scheme;
  o.threads = threads;
  o.repair = repair;
  o.allow_recompute = false;  // timing must not decide what is loaded here
  auto caches = vq::make_caches("fp32", *c.model);
  Loaded out;
  out.report = vq::load_prefix(*s.store, *c.model, caches, c.tokens, o);
  for (const auto& k : caches) out.state.push_back(k->state()), out.nbytes.push_back(k->nbytes());
  return out;
}

void expect_same_caches(const std::vector<vq::KVState>& a, const std::vector<vq::KVState>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t l = 0; l < a.size(); ++l) {
    EXPECT_TRUE(a[l].keys.bit_equal(b[l].keys)) << "layer " << l;
    EXPECT_TRUE(a[l].values.bit_equal(b[l].values)) << "layer " << l;
  }
}

TEST(PrefixLoader, ParallelDecodeGivesTheCachesOfOneThread) {
  const int n = whole_chunks();
  ASSERT_GE(n, 8);
  for (const std::string level : {"vq:bits=2", "cachegen:bits=4,group=4", "fp16", "fp32"}) {
    SCOPED_TRACE(level);
    const Stored s({level});
    const Loaded one = load(s, 1);
    ASSERT_TRUE(one.report.warnings.empty()) << one.report.warnings.front();
    ASSERT_EQ(one.report.tokens_reused, n * kC);
    ASSERT_EQ(one.report.chunks.size(), static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(one.report.chunks[static_cast<std::size_t>(i)].index, i);
      EXPECT_EQ(one.report.chunks[static_cast<std::size_t>(i)].level, s.scheme.levels[0]);
      EXPECT_GT(one.report.chunks[static_cast<std::size_t>(i)].bytes, 0u);
    }
    if (level == "fp32") expect_same_caches(one.state, context().exact);  // the exact prefill, chunk by chunk
    // The dense fp32 hosts were told the prefix's length (KVCache::expect_tokens): one buffer of
    // exactly its tokens (fewer than a step of 256, so not rounded), not one grown by doubling.
    for (std::size_t l = 0; l < one.state.size(); ++l)
      EXPECT_EQ(one.nbytes[l], one.state[l].keys.nbytes() + one.state[l].values.nbytes()) << "layer " << l;
    for (const int threads : {2, 5, 0}) {
      SCOPED_TRACE(threads);
      const Loaded many = load(s, threads);
      ASSERT_TRUE(many.report.warnings.empty()) << many.report.warnings.front();
      EXPECT_EQ(many.report.tokens_reused, one.report.tokens_reused);
      ASSERT_EQ(many.report.chunks.size(), one.report.chunks.size());
      for (std::size_t i = 0; i < many.report.chunks.size(); ++i) {
        EXPECT_EQ(many.report.chunks[i].index, static_cast<int>(i));
        EXPECT_EQ(many.report.chunks[i].level, one.report.chunks[i].level);
        EXPECT_EQ(many.report.chunks[i].bytes, one.report.chunks[i].bytes);
      }
      expect_same_caches(many.state, one.state);
    }
  }
}

// A corrupt blob at chunk k and a missing blob at chunk m > k: with any number of decoder threads
// (chunks after k decode while k is rejected), one warning naming chunk k, exactly k chunks fed, and
// the caches are the first k chunks of the clean load.
TEST(PrefixLoader, FaultsStopAtTheFaultyChunkWithThreads) {
  const int n = whole_chunks();
  const int k = n / 2, m = n - 2;
  const Stored clean({"vq:bits=2"});
  const Loaded full = load(clean, 1);
  ASSERT_EQ(full.report.tokens_reused, n * kC);
  for (const std::string fault : {"corrupt", "missing"}) {
    const Stored s({"vq:bits=2"});
    const int bad = fault == "corrupt" ? k : m;
    const std::string key = s.level_key(bad, 0);
    auto blob = s.store->get(key);
    ASSERT_TRUE(blob.has_value());
    s.store->remove(key);
    if (fault == "corrupt") {
      (*blob)[blob->size() / 2] ^= 0x10;
      s.store->put(key, *blob);
      s.store->remove(s.level_key(m, 0));  // a later fault is never reported: the load stopped at k
    }
    for (const int threads : {1, 4}) {
      SCOPED_TRACE(fault + " threads " + std::to_string(threads));
      const Loaded r = load(s, threads, /*repair=*/false);  // the same fault for every thread count
      ASSERT_EQ(r.report.warnings.size(), 1u);
      const std::string& w = r.report.warnings.front();
      EXPECT_EQ(w.rfind(fmt::format("chunk {}: ", bad), 0), 0u) << w;
      EXPECT_NE(w.find(fault == "corrupt" ? "blob rejected" : "missing"), std::string::npos) << w;
      EXPECT_NE(w.find("recomputing"), std::string::npos) << w;
      EXPECT_EQ(r.report.tokens_filled, bad * kC);
      EXPECT_EQ(r.report.chunks.size(), static_cast<std::size_t>(bad));
      ASSERT_EQ(r.state.size(), full.state.size());
      for (std::size_t l = 0; l < r.state.size(); ++l) {
        ASSERT_EQ(r.state[l].keys.dim(2), bad * kC);
        EXPECT_TRUE(r.state[l].keys.bit_equal(full.state[l].keys.slice(2, 0, bad * kC).contiguous(true))) << l;
        EXPECT_TRUE(r.state[l].values.bit_equal(full.state[l].values.slice(2, 0, bad * kC).contiguous(true))) << l;
      }
    }
  }
}

// Issue 36's cache poisoning: prompt B differs from prompt A in its first chunk only, so B's later
// chunks hold A's tokens but other K/V. B's blobs written under A's keys (as a writer of a shared
// store could) are refused as "of another prefix" (each blob carries the hash of its whole prefix),
// with one warning, and only A's own first chunk is used. The refused blob leaves the store, so the
// next put of A stores it again and A loads whole, bit for bit as from a clean store.
TEST(PrefixLoader, ABlobOfAnotherPrefixIsRefusedAndRepairedByTheNextPut) {
  const Context& c = context();
  const int n = whole_chunks();
  ASSERT_GE(n, 3);
  const std::string level = "fp16";
  const Stored a({level});
  std::vector<int> b_tokens = c.tokens;
  for (int t = 1; t < kC; ++t) b_tokens[static_cast<std::size_t>(t)] = (b_tokens[static_cast<std::size_t>(t)] + 7) % 500 + 3;
  auto b_caches = vq::make_caches("fp32", *c.model);
  c.model->forward(std::span<const int>(b_tokens).first(b_tokens.size() - 1), b_caches);
  std::vector<vq::KVState> b_exact;
  for (const auto& k : b_caches) b_exact.push_back(k->state());
  vq::FileStore b_store(a.dir / "b");
  vq::put_context(b_store, *c.model, a.scheme, std::span<const int>(b_tokens).first(b_tokens.size() - 1), b_exact);
  ASSERT_FALSE(b_exact.back().keys.slice(2, kC, 2 * kC).contiguous(true).bit_equal(c.exact.back().keys.slice(2, kC, 2 * kC).contiguous(true)));  // layer 0 holds the tokens alone
  // B's chunk i blob under A's key of chunk i, for every chunk after the first.
  for (int i = 1; i < n; ++i) {
    std::uint64_t hb = 0;
    for (int k = 0; k <= i; ++k) hb = vq::chain_hash(hb, c.fp, a.scheme.levels[0], std::span<const int>(b_tokens).subspan(k * kC, kC));
    const auto blob = b_store.get(vq::chunk_key(a.scheme.levels[0], hb));
    ASSERT_TRUE(blob.has_value());
    a.store->replace(a.level_key(i, 0), *blob);
  }
  const Loaded poisoned = load(a, 2);
  ASSERT_EQ(poisoned.report.warnings.size(), 1u);
  const std::string& w = poisoned.report.warnings.front();
  EXPECT_EQ(w.rfind("chunk 1: ", 0), 0u) << w;
  EXPECT_NE(w.find("blob of another prefix"), std::string::npos) << w;
  EXPECT_NE(w.find("removed from the store: the next put stores it again"), std::string::npos) << w;
  EXPECT_EQ(poisoned.report.tokens_reused, kC);
  EXPECT_FALSE(a.store->exists(a.level_key(1, 0)));
  // The next put of A stores chunk 1 again (chunks 2.. are still B's: refused in turn, one per load
  // and put, until A is whole again).
  const Loaded clean = [&] {
    const Stored fresh({level});
    return load(fresh, 1);
  }();
  for (int round = 0; round < n; ++round) {
    vq::put_context(*a.store, *c.model, a.scheme, std::span<const int>(c.tokens).first(c.tokens.size() - 1), c.exact);
    const Loaded r = load(a, 2);
    if (r.report.tokens_reused == n * kC) {
      EXPECT_TRUE(r.report.warnings.empty()) << r.report.warnings.front();
      expect_same_caches(r.state, clean.state);
      return;
    }
    ASSERT_EQ(r.report.warnings.size(), 1u);
    EXPECT_NE(r.report.warnings.front().find("blob of another prefix"), std::string::npos) << r.report.warnings.front();
    EXPECT_EQ(r.report.tokens_reused, (round + 2) * kC) << "each put repairs the chunk the load before it refused";
  }
  ADD_FAILURE() << "A never loaded whole again";
}

// Bounded reads (issue 36): a level blob longer than its directory records, and a 1 GiB directory
// (its JSON then zeros, sparse), are refused unread with one warning; the blob is repaired as any
// refused blob.
TEST(PrefixLoader, BlobsLargerThanRecordedAreRefusedUnread) {
  const Context& c = context();
  {
    const Stored s({"fp16"});
    auto blob = *s.store->get(s.level_key(1, 0));
    blob.push_back(0);
    s.store->replace(s.level_key(1, 0), blob);
    const Loaded r = load(s, 2);
    ASSERT_EQ(r.report.warnings.size(), 1u);
    EXPECT_NE(r.report.warnings[0].find("refused unread"), std::string::npos) << r.report.warnings[0];
    EXPECT_NE(r.report.warnings[0].find("removed from the store"), std::string::npos) << r.report.warnings[0];
    EXPECT_EQ(r.report.tokens_reused, kC);
  }
  {
    const Stored s({"fp16"});
    const std::string dkey = vq::directory_key(vq::directory_hash(0, kC, std::span<const int>(c.tokens).first(kC)));
    ASSERT_TRUE(s.store->exists(dkey));
    fs::resize_file(s.store->blob_path(dkey), std::uint64_t{1} << 30);
    const Loaded r = load(s, 2);
    EXPECT_EQ(r.report.tokens_reused, 0);
    ASSERT_EQ(r.report.warnings.size(), 1u);
    EXPECT_NE(r.report.warnings[0].find("refused unread"), std::string::npos) << r.report.warnings[0];
  }
}

// Eviction never strands reachable chunks (issue 36: `file:?capacity=` evicted chunk 0 first, so
// every later chunk stayed stored and unreachable). A store holding about half of a put: what is
// left is a prefix of whole chunks (blob and directory), and a load reuses all of it; a second put
// after the load still keeps a prefix.
TEST(PrefixLoader, EvictionTakesAPrefixFromItsEnd) {
  const Context& c = context();
  const int n = whole_chunks();
  const std::span<const int> prefill = std::span<const int>(c.tokens).first(c.tokens.size() - 1);
  vq::ChunkScheme scheme{c.fp, kC, {"fp16"}};
  const fs::path big = fs::temp_directory_path() / fmt::format("vq-evict-full-{}", ::getpid());
  fs::remove_all(big);
  std::uint64_t total = 0;
  {
    vq::FileStore full(big);
    vq::put_context(full, *c.model, scheme, prefill, c.exact);
    total = full.stats().bytes;
  }
  fs::remove_all(big);
  const fs::path dir = fs::temp_directory_path() / fmt::format("vq-evict-{}", ::getpid());
  fs::remove_all(dir);
  vq::FileStore store(dir, total / 2);
  const auto present = [&] {  // chunks whose level blob and directory are both stored
    std::vector<bool> p;
    std::uint64_t h = 0, dh = 0;
    for (int i = 0; i < n; ++i) {
      const auto toks = prefill.subspan(static_cast<std::size_t>(i) * kC, kC);
      h = vq::chain_hash(h, c.fp, scheme.levels[0], toks);
      dh = vq::directory_hash(dh, kC, toks);
      p.push_back(store.exists(vq::chunk_key(scheme.levels[0], h)) && store.exists(vq::directory_key(dh)));
    }
    return p;
  };
  const auto expect_prefix = [&](const char* when) -> int {
    const auto p = present();
    const int m = static_cast<int>(std::find(p.begin(), p.end(), false) - p.begin());
    EXPECT_GE(m, 1) << when;
    EXPECT_LT(m, n) << when << ": the capacity holds about half";
    for (int i = m; i < n; ++i) EXPECT_FALSE(p[static_cast<std::size_t>(i)]) << when << ": chunk " << i << " stranded after a gap at " << m;
    return m;
  };
  vq::put_context(store, *c.model, scheme, prefill, c.exact);
  const int m = expect_prefix("after the put");
  EXPECT_LE(store.stats().bytes, total / 2);
  vq::LoaderOptions o;
  o.scheme = scheme;
  o.allow_recompute = false;
  auto caches = vq::make_caches("fp32", *c.model);
  const auto rep = vq::load_prefix(store, *c.model, caches, c.tokens, o);
  EXPECT_EQ(rep.tokens_reused, m * kC);
  EXPECT_TRUE(rep.warnings.empty()) << rep.warnings.front();
  vq::put_context(store, *c.model, scheme, prefill, c.exact);
  expect_prefix("after a second put");
  fs::remove_all(dir);
}

}  // namespace

// The level choice follows the cost table (store/load_plan.hpp): a level whose decode the table
// prices far above the deadline is never loaded when another fits; priced cheaply, the best quality
// is. Costs are injected (LoaderOptions::costs), the deadline generous: deterministic.
TEST(PrefixLoaderCosts, PicksWhatTheCostTableSaysFits) {
  const Context& c = context();
  const int n = whole_chunks();
  const Stored s({"fp32", "fp16"});
  const std::string shape = vq::cost_shape_key(c.exact.size(), c.model->config().n_kv_heads, kC, c.model->config().head_size());
  for (const double fp32_ms : {1e7, 0.0}) {
    SCOPED_TRACE(fp32_ms);
    vq::LoadCostTable costs;
    costs.record("fp32", shape, fp32_ms, 0);
    costs.record("fp16", shape, 0, 0);
    vq::LoaderOptions o;
    o.scheme = s.scheme;
    o.threads = 2;
    o.allow_recompute = false;
    o.slo_ms = 60000;
    o.costs = &costs;
    auto caches = vq::make_caches("fp32", *c.model);
    const auto r = vq::load_prefix(*s.store, *c.model, caches, c.tokens, o);
    ASSERT_TRUE(r.warnings.empty()) << r.warnings.front();
    ASSERT_EQ(r.chunks.size(), static_cast<std::size_t>(n));
    for (const auto& ch : r.chunks) EXPECT_EQ(ch.level, fp32_ms > 0 ? "fp16" : "fp32") << ch.index;
    // the table learned the level loaded; the other kept its injected price
    EXPECT_EQ(costs.get(fp32_ms > 0 ? "fp16" : "fp32", shape)->samples, 1 + n);
    EXPECT_EQ(costs.get(fp32_ms > 0 ? "fp32" : "fp16", shape)->samples, 1);
  }
}

// With a deadline and an empty cost table, every level is measured once (a probe of chunk 0) before
// the first choice, and not again by later loads: a level never chosen keeps its one probe.
TEST(PrefixLoaderCosts, ProbesEachLevelOnce) {
  const Context& c = context();
  const Stored s({"vq:bits=2", "fp16"});
  const std::string shape = vq::cost_shape_key(c.exact.size(), c.model->config().n_kv_heads, kC, c.model->config().head_size());
  vq::LoadCostTable costs;
  vq::LoaderOptions o;
  o.scheme = s.scheme;
  o.allow_recompute = false;
  o.slo_ms = 60000;
  o.costs = &costs;
  std::string chosen;
  for (int load = 0; load < 2; ++load) {
    auto caches = vq::make_caches("fp32", *c.model);
    const auto r = vq::load_prefix(*s.store, *c.model, caches, c.tokens, o);
    ASSERT_TRUE(r.warnings.empty()) << r.warnings.front();
    ASSERT_FALSE(r.chunks.empty());
    chosen = r.chunks.front().level;
    for (const auto& ch : r.chunks) EXPECT_EQ(ch.level, chosen);  // everything fits: the best quality throughout
  }
  for (const auto& level : s.scheme.levels) {
    const auto got = costs.get(level, shape);
    ASSERT_TRUE(got.has_value()) << level;
    if (level != chosen) EXPECT_EQ(got->samples, 1) << level;
    else EXPECT_EQ(got->samples, 1 + 2 * whole_chunks()) << level;
  }
}

// A deadline's guard outside (0, 1] is refused before anything is loaded: the caches stay empty.
TEST(PrefixLoaderCosts, AGuardOutsideZeroToOneIsRefused) {
  const Context& c = context();
  const Stored s({"fp16"});
  for (const double guard : {0.0, -0.5, 1.5}) {
    SCOPED_TRACE(guard);
    vq::LoaderOptions o;
    o.scheme = s.scheme;
    o.slo_ms = 60000;
    o.slo_guard = guard;
    auto caches = vq::make_caches("fp32", *c.model);
    EXPECT_THROW(vq::load_prefix(*s.store, *c.model, caches, c.tokens, o), vq::InvalidArgument);
    for (const auto& cache : caches) EXPECT_EQ(cache->offset(), 0);
  }
}

// A store with one node down (a cluster): every batch fails, and so do the keys of that node. The
// loader keeps the chunks before the first directory on it (directories then come one by one), warns
// once naming that chunk, and the caches hold exactly those chunks; when a chunk before it fails
// too, that chunk is the one warning.
class OneKeyDownStore final : public vq::KVStore {
 public:
  OneKeyDownStore(vq::KVStore& inner, std::vector<std::string> down) : inner_(inner), down_(std::move(down)) {}
  void put(std::string_view k, std::span<const std::uint8_t> b) override { inner_.put(k, b); }
  void replace(std::string_view k, std::span<const std::uint8_t> b) override { inner_.replace(k, b); }
  std::optional<vq::Blob> get(std::string_view k) override {
    if (std::find(down_.begin(), down_.end(), k) != down_.end()) throw vq::IoError("node of '" + std::string(k) + "' is down");
    return inner_.get(k);
  }
  std::vector<std::optional<vq::Blob>> get_many(std::span<const std::string>) override { throw vq::IoError("a node is down"); }
  bool exists(std::string_view k) override { return inner_.exists(k); }
  bool remove(std::string_view k) override { return inner_.remove(k); }
  std::vector<std::string> list() override { return inner_.list(); }
  vq::StoreStats stats() override { return inner_.stats(); }
  std::string describe() const override { return "one-key-down:"; }

 private:
  vq::KVStore& inner_;
  std::vector<std::string> down_;
};

TEST(PrefixLoader, ANodeDownKeepsTheChunksBeforeIt) {
  const Context& c = context();
  const int n = whole_chunks(), k = n / 2;
  const Stored s({"fp32"});
  std::uint64_t h = 0;
  for (int i = 0; i <= k; ++i) h = vq::directory_hash(h, s.scheme.chunk_tokens, std::span<const int>(c.tokens).subspan(static_cast<std::size_t>(i * kC), kC));
  OneKeyDownStore store(*s.store, {vq::directory_key(h)});
  vq::LoaderOptions o;
  o.scheme = s.scheme;
  o.allow_recompute = false;
  auto caches = vq::make_caches("fp32", *c.model);
  const auto r = vq::load_prefix(store, *c.model, caches, c.tokens, o);
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_EQ(r.warnings.front().rfind(fmt::format("chunk {}: store one-key-down: failed", k), 0), 0u) << r.warnings.front();
  EXPECT_EQ(r.chunks_stored, k);
  EXPECT_EQ(r.tokens_reused, k * kC);
  for (std::size_t l = 0; l < caches.size(); ++l) {
    const auto st = caches[l]->state();
    EXPECT_TRUE(st.keys.bit_equal(c.exact[l].keys.slice(2, 0, k * kC).contiguous(true))) << l;
    EXPECT_TRUE(st.values.bit_equal(c.exact[l].values.slice(2, 0, k * kC).contiguous(true))) << l;
  }
  // Chunk 0's blob on that node too: one warning, for chunk 0.
  OneKeyDownStore worse(*s.store, {vq::directory_key(h), s.level_key(0, 0)});
  auto fresh = vq::make_caches("fp32", *c.model);
  const auto r0 = vq::load_prefix(worse, *c.model, fresh, c.tokens, o);
  ASSERT_EQ(r0.warnings.size(), 1u);
  EXPECT_EQ(r0.warnings.front().rfind("chunk 0: store one-key-down: failed", 0), 0u) << r0.warnings.front();
  EXPECT_EQ(r0.tokens_filled, 0);
}
