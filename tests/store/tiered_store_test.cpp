// The tiered store (store/tiered_store.hpp, issue 30): immutable blobs in bounded RAM and on a local
// disk in front of a file: backend; the prefix index always from the backend; the loader through it
// (real stories260K).
#include "veloxquant/store/tiered_store.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include <fmt/core.h>

#include "store_context.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/store/file_store.hpp"
#include "veloxquant/store/prefix_loader.hpp"

namespace fs = std::filesystem;

namespace {

struct Dir : vqtest::ScratchDir {
  Dir() : ScratchDir("tiered-test") {}
};

vq::Blob blob(std::size_t n, std::uint8_t seed) {
  vq::Blob b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::uint8_t>(seed + i);
  return b;
}

TEST(TieredStore, TheRamTierKeepsTheMostRecentBlobsWithinItsBound) {
  Dir d;
  vq::TieredStore s(std::make_unique<vq::FileStore>(d.path), 100, nullptr);
  s.put("vq-a", blob(40, 1));
  s.put("vq-b", blob(40, 2));
  EXPECT_EQ(*s.get_immutable_at_most("vq-a", 40), blob(40, 1));  // a hit: a is now the most recent
  EXPECT_EQ(s.tier_stats().ram_hits, 1u);
  s.put("vq-c", blob(40, 3));  // 120 > 100: b, the least recently used, leaves RAM
  auto st = s.tier_stats();
  EXPECT_EQ(st.ram_evictions, 1u);
  EXPECT_LE(st.ram_bytes, 100u);
  EXPECT_EQ(st.ram_blobs, 2u);
  EXPECT_EQ(*s.get_immutable_at_most("vq-b", 40), blob(40, 2));  // from the backend, kept again
  EXPECT_EQ(s.tier_stats().backend_reads, 1u);
  EXPECT_EQ(*s.get_immutable_at_most("vq-c", 40), blob(40, 3));
  EXPECT_EQ(s.tier_stats().ram_hits, 2u);
  EXPECT_THROW(s.get_immutable_at_most("vq-c", 39), vq::FormatError);  // bounded from RAM too
  s.put("vq-big", blob(200, 4));  // larger than the tier: the backend only
  EXPECT_LE(s.tier_stats().ram_bytes, 100u);
  EXPECT_EQ(*s.get_immutable_at_most("vq-big", 200), blob(200, 4));
}

TEST(TieredStore, TheIndexAlwaysComesFromTheBackendAndReplaceOrRemoveDropTheTiers) {
  Dir d, disk;
  vq::TieredStore s(std::make_unique<vq::FileStore>(d.path), 1000, std::make_unique<vq::FileStore>(disk.path));
  vq::FileStore backend(d.path), local(disk.path);
  s.put("vq-dir-x", blob(10, 1));
  backend.replace("vq-dir-x", blob(10, 9));  // another server merged the index
  EXPECT_EQ(*s.get("vq-dir-x"), blob(10, 9));
  EXPECT_EQ(*s.get_at_most("vq-dir-x", 10), blob(10, 9));
  s.replace("vq-dir-x", blob(12, 5));
  EXPECT_FALSE(local.exists("vq-dir-x"));
  EXPECT_EQ(*s.get_immutable_at_most("vq-dir-x", 12), blob(12, 5));  // not the stale copy
  s.put("vq-k", blob(30, 7));
  EXPECT_TRUE(local.exists("vq-k"));
  EXPECT_TRUE(s.remove("vq-k"));  // a loader's repair: gone from every tier
  EXPECT_FALSE(local.exists("vq-k"));
  EXPECT_FALSE(backend.exists("vq-k"));
  EXPECT_FALSE(s.get_immutable_at_most("vq-k", 30).has_value());
}

TEST(TieredStore, TheDiskTierServesWhatRamDropped) {
  Dir d, disk;
  vq::FileStore backend(d.path), local(disk.path);
  backend.put("vq-k", blob(50, 3));
  {
    vq::TieredStore s(std::make_unique<vq::FileStore>(d.path), 0, std::make_unique<vq::FileStore>(disk.path));
    EXPECT_EQ(*s.get_immutable_at_most("vq-k", 50), blob(50, 3));  // from the backend, kept on disk
    EXPECT_TRUE(local.exists("vq-k"));
  }
  backend.remove("vq-k");  // the shared store lost it (evicted): the local disk still serves it
  vq::TieredStore s(std::make_unique<vq::FileStore>(d.path), 1000, std::make_unique<vq::FileStore>(disk.path));
  EXPECT_EQ(*s.get_immutable_at_most("vq-k", 50), blob(50, 3));
  EXPECT_EQ(s.tier_stats().disk_hits, 1u);
  EXPECT_EQ(*s.get_immutable_at_most("vq-k", 50), blob(50, 3));
  EXPECT_EQ(s.tier_stats().ram_hits, 1u);
  // A disk copy that does not fit the bound is dropped and the backend asked.
  backend.put("vq-j", blob(20, 1));
  local.put("vq-j", blob(25, 1));
  EXPECT_EQ(*s.get_immutable_at_most("vq-j", 20), blob(20, 1));
  EXPECT_EQ(local.get("vq-j")->size(), 20u);  // replaced by the backend's
}

TEST(TieredStore, UrlOptions) {
  Dir d, disk;
  const auto s = vq::open_store(fmt::format("file:{}?ram=1M&disk={}&disk_bytes=2M", d.path.string(), disk.path.string()));
  EXPECT_NE(s->describe().find("RAM tier 1048576 bytes"), std::string::npos) << s->describe();
  EXPECT_NE(s->describe().find("disk tier file:" + disk.path.string() + "?capacity=2097152"), std::string::npos) << s->describe();
  EXPECT_THROW(vq::open_store(fmt::format("file:{}?disk_bytes=5", d.path.string())), vq::InvalidArgument);
  EXPECT_THROW(vq::open_store(fmt::format("file:{}?ram=12X", d.path.string())), vq::InvalidArgument);
  EXPECT_THROW(vq::open_store(fmt::format("file:{}?ram=", d.path.string())), vq::InvalidArgument);
}

// A load through the tiers: the second load of a prefix takes every level blob from RAM and gives
// the caches of a load from the backend alone, bit for bit.
TEST(TieredStore, ASecondLoadComesFromRam) {
  const auto c = vqtest::make_store_context(4);
  const std::span<const int> prefill = std::span<const int>(c.tokens).first(c.tokens.size() - 1);
  const vq::ChunkScheme scheme{c.fp, 4, {"vq:bits=2"}};
  Dir d;
  auto* tiered = new vq::TieredStore(std::make_unique<vq::FileStore>(d.path), 64 << 20, nullptr);
  const std::unique_ptr<vq::KVStore> owned(tiered);
  vq::put_context(*tiered, *c.model, scheme, prefill, c.exact);
  const auto load = [&](vq::KVStore& s) {
    vq::LoaderOptions o;
    o.scheme = scheme;
    o.allow_recompute = false;
    auto caches = vq::make_caches("fp32", *c.model);
    const auto rep = vq::load_prefix(s, *c.model, caches, c.tokens, o);
    EXPECT_TRUE(rep.warnings.empty()) << rep.warnings.front();
    EXPECT_EQ(rep.tokens_reused, static_cast<int>(prefill.size()));
    return caches;
  };
  const int chunks = static_cast<int>(prefill.size()) / 4;
  const auto before = tiered->tier_stats().ram_hits;
  const auto from_ram = load(*tiered);
  EXPECT_EQ(tiered->tier_stats().ram_hits - before, static_cast<std::uint64_t>(chunks));  // the put kept them
  vq::FileStore backend(d.path);
  const auto from_backend = load(backend);
  for (std::size_t l = 0; l < from_ram.size(); ++l) {
    EXPECT_TRUE(from_ram[l]->state().keys.bit_equal(from_backend[l]->state().keys)) << l;
    EXPECT_TRUE(from_ram[l]->state().values.bit_equal(from_backend[l]->state().values)) << l;
  }
}

}  // namespace
