// FileStore (file:) and the shared key/URL rules of KVStore.
#include "veloxquant/store/file_store.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <atomic>
#include <fstream>

#include <filesystem>
#include <thread>

#include "veloxquant/core/error.hpp"
#include "veloxquant/store/kv_store.hpp"
#include "veloxquant/store/redis_store.hpp"

namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / fmt::format("vq-store-test-{}-{}", ::getpid(), counter()++);
    fs::remove_all(path);
  }
  ~TempDir() { fs::remove_all(path); }
  static int& counter() {
    static int c = 0;
    return c;
  }
};

vq::Blob bytes_of(std::size_t n, std::uint8_t seed) {
  vq::Blob b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::uint8_t>(seed + i * 31 + (i >> 7));
  return b;
}

TEST(FileStore, PutGetExistsRemoveList) {
  TempDir d;
  auto store = vq::open_store("file:" + d.path.string());
  EXPECT_FALSE(store->exists("a"));
  EXPECT_FALSE(store->get("a").has_value());
  const auto a = bytes_of(1000, 1), b = bytes_of(0, 2), c = bytes_of(3, 3);
  store->put("a", a);
  store->put("b:with.dots-and_", b);  // an empty blob is a blob
  store->put("c", c);
  EXPECT_TRUE(store->exists("a"));
  EXPECT_EQ(*store->get("a"), a);
  EXPECT_EQ(*store->get("b:with.dots-and_"), b);
  EXPECT_EQ(store->list(), (std::vector<std::string>{"a", "b:with.dots-and_", "c"}));
  const std::vector<std::string> keys{"c", "missing", "a"};
  const auto many = store->get_many(keys);
  ASSERT_EQ(many.size(), 3u);
  EXPECT_EQ(*many[0], c);
  EXPECT_FALSE(many[1].has_value());
  EXPECT_EQ(*many[2], a);
  const auto s = store->stats();
  EXPECT_EQ(s.blobs, 3u);
  EXPECT_EQ(s.bytes, 1003u);
  EXPECT_TRUE(store->remove("a"));
  EXPECT_FALSE(store->remove("a"));
  EXPECT_FALSE(store->exists("a"));
  EXPECT_EQ(store->list(), (std::vector<std::string>{"b:with.dots-and_", "c"}));
}

TEST(FileStore, PutIsIdempotentAndBlobsImmutable) {
  TempDir d;
  vq::FileStore store(d.path);
  const auto a = bytes_of(100, 1);
  store.put("k", a);
  store.put("k", bytes_of(50, 9));  // the key exists: nothing changes
  EXPECT_EQ(*store.get("k"), a);
}

TEST(FileStore, ReplaceOverwrites) {
  TempDir d;
  vq::FileStore store(d.path);
  store.replace("k", bytes_of(100, 1));  // a missing key: written
  EXPECT_EQ(*store.get("k"), bytes_of(100, 1));
  store.replace("k", bytes_of(30, 2));
  EXPECT_EQ(*store.get("k"), bytes_of(30, 2));
  EXPECT_EQ(store.list(), std::vector<std::string>{"k"});
  EXPECT_THROW(store.replace("bad key", bytes_of(1, 1)), vq::InvalidArgument);
}

TEST(FileStore, IgnoresTemporariesAndForeignFiles) {
  TempDir d;
  vq::FileStore store(d.path);
  store.put("k", bytes_of(10, 1));
  // A temporary left by a writer that was killed, and a stray file: neither is a key.
  std::ofstream(d.path / "blobs" / ".tmp-abc") << "x";
  std::ofstream(d.path / "blobs" / "zz") << "x";
  EXPECT_EQ(store.list(), std::vector<std::string>{"k"});
}

TEST(FileStore, ConcurrentWritersAndReadersSeeWholeBlobs) {
  TempDir d;
  vq::FileStore store(d.path);
  const auto big = bytes_of(1 << 20, 7);
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 8; ++i) {
        store.put(fmt::format("k{}", i), big);
        if (auto g = store.get(fmt::format("k{}", (i + 3) % 8)); g && *g != big) ++bad;
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(store.list().size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(*store.get(fmt::format("k{}", i)), big);
}

TEST(FileStore, CapacityEvictsLeastRecentlyUsed) {
  TempDir d;
  vq::FileStore store(d.path, 2500);
  store.put("a", bytes_of(1000, 1));
  store.put("b", bytes_of(1000, 2));
  // Make "a" the most recently used (modification times can tie within one tick: set them).
  const auto set_time = [&](const char* key, long sec) {
    const struct timespec ts[2] = {{sec, 0}, {sec, 0}};
    ASSERT_EQ(::utimensat(AT_FDCWD, store.blob_path(key).c_str(), ts, 0), 0);
  };
  set_time("a", 2000);
  set_time("b", 1000);
  ASSERT_TRUE(store.get("a").has_value());  // get refreshes "a" to now
  store.put("c", bytes_of(1000, 3));        // 3000 > 2500: the LRU blob ("b") goes
  EXPECT_TRUE(store.exists("a"));
  EXPECT_FALSE(store.exists("b"));
  EXPECT_TRUE(store.exists("c"));
  EXPECT_LE(store.stats().bytes, 2500u);
  EXPECT_THROW(store.put("huge", bytes_of(3000, 4)), vq::IoError);
}

TEST(StoreKeys, BadKeysAreRefused) {
  TempDir d;
  vq::FileStore store(d.path);
  for (const std::string& bad : {std::string(), std::string("a b"), std::string("a{b}"), std::string(101, 'x'), std::string("\x01"),
                                std::string("caf\xc3\xa9")})
    EXPECT_THROW(store.put(bad, bytes_of(1, 1)), vq::InvalidArgument) << bad;
  EXPECT_NO_THROW(store.put(std::string(100, 'x'), bytes_of(1, 1)));
}

TEST(StoreUrl, ParsesAndRefuses) {
  EXPECT_THROW(vq::open_store("s3://bucket"), vq::InvalidArgument);
  EXPECT_THROW(vq::open_store("file:"), vq::InvalidArgument);
  EXPECT_THROW(vq::open_store("file:/tmp/x?capacity=lots"), vq::InvalidArgument);
  EXPECT_THROW(vq::open_store("file:/tmp/x?size=1"), vq::InvalidArgument);
  auto o = vq::parse_redis_url("redis://:s3cret@127.0.0.1:7000/3?prefix=p:&timeout_ms=50&part_bytes=1000");
  EXPECT_FALSE(o.cluster);
  ASSERT_EQ(o.nodes.size(), 1u);
  EXPECT_EQ(o.nodes[0].first, "127.0.0.1");
  EXPECT_EQ(o.nodes[0].second, 7000);
  EXPECT_EQ(o.password, "s3cret");
  EXPECT_EQ(o.db, 3);
  EXPECT_EQ(o.prefix, "p:");
  EXPECT_EQ(o.timeout_ms, 50);
  EXPECT_EQ(o.part_bytes, 1000u);
  o = vq::parse_redis_url("redis-cluster://127.0.0.1:7000,127.0.0.1:7001");
  EXPECT_TRUE(o.cluster);
  EXPECT_EQ(o.nodes.size(), 2u);
  EXPECT_EQ(o.prefix, "vqkv:");
  for (const char* bad : {"redis://", "redis://host", "redis://h:0", "redis://h:99999", "redis://h:1,h:2", "redis-cluster://h:1/2",
                          "redis://user:pw@h:1", "redis://h:1?prefix={x}", "redis://h:1?bogus=1", "redis://h:1/x"})
    EXPECT_THROW(vq::parse_redis_url(bad), vq::InvalidArgument) << bad;
}

TEST(StoreUrl, ClusterSlotsFollowRedis) {
  // Values from the Redis Cluster specification (CRC16-XMODEM of "123456789" is 0x31C3) and
  // CLUSTER KEYSLOT of a live server: "foo" -> 12182, "bar" -> 5061; hash tags hash only the tag.
  EXPECT_EQ(vq::redis_cluster_slot("123456789"), 0x31C3 % 16384);
  EXPECT_EQ(vq::redis_cluster_slot("foo"), 12182);
  EXPECT_EQ(vq::redis_cluster_slot("bar"), 5061);
  EXPECT_EQ(vq::redis_cluster_slot("x{foo}y"), 12182);
  EXPECT_EQ(vq::redis_cluster_slot("{foo}#7"), 12182);
  EXPECT_EQ(vq::redis_cluster_slot("{}foo"), vq::redis_cluster_slot("{}foo"));
  EXPECT_NE(vq::redis_cluster_slot("{}foo"), 12182);  // empty tag: the whole key
}


// Bounded reads (issue 36): an 8 GiB blob (sparse) is refused from its size, unread; a bound it
// fits is read whole.
TEST(FileStore, ReadsAreBoundedBeforeTheyAreMade) {
  TempDir d;
  vq::FileStore s(d.path);
  s.put("small", vq::Blob(100, 7));
  EXPECT_EQ(s.get_at_most("small", 100)->size(), 100u);
  EXPECT_FALSE(s.get_at_most("absent", 10).has_value());
  s.put("huge", vq::Blob(1, 1));
  fs::resize_file(s.blob_path("huge"), std::uint64_t{8} << 30);
  try {
    s.get_at_most("huge", std::uint64_t{1} << 20);
    ADD_FAILURE() << "an 8 GiB blob was read";
  } catch (const vq::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("holds 8589934592 bytes, more than the 1048576 expected; refused unread"), std::string::npos)
        << e.what();
  }
  const std::vector<std::string> keys{"small", "huge"};
  EXPECT_THROW(s.get_many_at_most(keys, 1000), vq::FormatError);
}

// Issue 36's messages: a store folder that is a dangling symbolic link says so (it read "File exists").
TEST(FileStore, ADanglingSymlinkIsNamed) {
  TempDir d;
  fs::create_directories(d.path);
  const fs::path link = d.path / "store";
  fs::create_symlink(d.path / "gone", link);
  try {
    vq::FileStore s(link);
    ADD_FAILURE() << "opened a dangling link";
  } catch (const vq::IoError& e) {
    EXPECT_NE(std::string(e.what()).find("symbolic link to"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("does not exist"), std::string::npos) << e.what();
  }
}
}  // namespace
