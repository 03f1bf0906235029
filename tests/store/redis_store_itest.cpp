// Integration tests of the redis:// and redis-cluster:// backends against real servers (Debian's
// redis-server): one standalone server, one with a password, and a 3-master cluster, all started by
// this binary on 127.0.0.1 (tests/store/redis_servers.hpp) and stopped by pid when it ends.
// Skipped, with a message saying why, when redis-server is not installed.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <set>

#include "lookup_checks.hpp"
#include "redis_servers.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/store/redis_store.hpp"

namespace {

vqtest::RedisServers* g_servers = nullptr;
std::size_t g_plain = 0, g_auth = 0;
std::vector<std::size_t> g_cluster;
std::string g_skip;

class RedisEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    if (!vqtest::redis_installed()) {
      g_skip = "redis-server / redis-cli not installed (apt-get install redis-server): Redis integration tests skipped";
      return;
    }
    g_servers = new vqtest::RedisServers(std::filesystem::temp_directory_path() / fmt::format("vq-redis-itest-{}", ::getpid()));
    g_plain = g_servers->start();
    g_auth = g_servers->start({"--requirepass", "s3cret"});
    g_cluster = g_servers->start_cluster(3);
  }
  void TearDown() override {
    if (!g_servers) return;
    g_servers->stop_all();
    std::filesystem::remove_all(std::filesystem::temp_directory_path() / fmt::format("vq-redis-itest-{}", ::getpid()));
    delete g_servers;
    g_servers = nullptr;
  }
};

#define SKIP_WITHOUT_REDIS() \
  if (!g_servers) GTEST_SKIP() << g_skip

vq::Blob bytes_of(std::size_t n, std::uint8_t seed) {
  vq::Blob b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::uint8_t>(seed + i * 131 + (i >> 9));
  return b;
}

std::string plain_url(const std::string& query = "") { return fmt::format("redis://127.0.0.1:{}{}", g_servers->port(g_plain), query); }
std::string cluster_url(const std::string& query = "") {
  return fmt::format("redis-cluster://127.0.0.1:{}{}", g_servers->port(g_cluster[1]), query);  // one seed is enough
}

void basic_round_trip(vq::KVStore& s) {
  for (const auto& k : s.list()) s.remove(k);
  EXPECT_FALSE(s.exists("a"));
  EXPECT_FALSE(s.get("a").has_value());
  const auto a = bytes_of(5000, 1), e = bytes_of(0, 2);
  s.put("a", a);
  s.put("empty", e);
  s.put("a", bytes_of(10, 9));  // immutable: no change
  EXPECT_TRUE(s.exists("a"));
  EXPECT_EQ(*s.get("a"), a);
  EXPECT_EQ(*s.get("empty"), e);
  EXPECT_EQ(s.list(), (std::vector<std::string>{"a", "empty"}));
  EXPECT_EQ(s.stats().blobs, 2u);
  EXPECT_EQ(s.stats().bytes, 5000u);
  EXPECT_TRUE(s.remove("a"));
  EXPECT_FALSE(s.remove("a"));
  EXPECT_FALSE(s.get("a").has_value());
  s.remove("empty");
}

TEST(RedisStore, RoundTrip) {
  SKIP_WITHOUT_REDIS();
  auto s = vq::open_store(plain_url());
  basic_round_trip(*s);
}

TEST(RedisStore, PrefixesAndDatabasesSeparateStores) {
  SKIP_WITHOUT_REDIS();
  auto a = vq::open_store(plain_url("?prefix=one:")), b = vq::open_store(plain_url("?prefix=two:"));
  auto c = vq::open_store(fmt::format("redis://127.0.0.1:{}/2?prefix=one:", g_servers->port(g_plain)));
  a->put("k", bytes_of(10, 1));
  b->put("k", bytes_of(10, 2));
  EXPECT_EQ(*a->get("k"), bytes_of(10, 1));
  EXPECT_EQ(*b->get("k"), bytes_of(10, 2));
  EXPECT_FALSE(c->exists("k"));
  EXPECT_NE(g_servers->cli(g_plain, "EXISTS 'one:{k}'").find('1'), std::string::npos);
  a->remove("k");
  b->remove("k");
}

TEST(RedisStore, LargeBlobsSplitAndReassemble) {
  SKIP_WITHOUT_REDIS();
  auto s = vq::open_store(plain_url("?prefix=split:&part_bytes=1000"));
  const auto big = bytes_of(10500, 3);
  s->put("big", big);
  EXPECT_EQ(*s->get("big"), big);
  EXPECT_EQ(s->list(), std::vector<std::string>{"big"});  // parts are not keys
  EXPECT_EQ(s->stats().bytes, 10500u);
  // Eleven parts plus the head, all under the same hash tag.
  EXPECT_NE(g_servers->cli(g_plain, "EXISTS 'split:{big}#10'").find('1'), std::string::npos);
  // A missing part is a clear FormatError, never a short blob.
  g_servers->cli(g_plain, "DEL 'split:{big}#4'");
  EXPECT_THROW(s->get("big"), vq::FormatError);
  // A part of other bytes fails the manifest's checksum.
  s->remove("big");
  s->put("big", big);
  g_servers->cli(g_plain, "SET 'split:{big}#2' " + std::string(1000, 'x'));
  EXPECT_THROW(s->get("big"), vq::FormatError);
  EXPECT_TRUE(s->remove("big"));
  EXPECT_NE(g_servers->cli(g_plain, "EXISTS 'split:{big}#3'").find('0'), std::string::npos);
}

TEST(RedisStore, ForeignValuesAreFormatErrors) {
  SKIP_WITHOUT_REDIS();
  auto s = vq::open_store(plain_url("?prefix=foreign:"));
  g_servers->cli(g_plain, "SET 'foreign:{x}' hello");
  EXPECT_THROW(s->get("x"), vq::FormatError);
  // A forged manifest (2^64-1 parts of 2^64-1 bytes): refused before anything is sized by it.
  std::string ff;
  for (int k = 0; k < 24; ++k) ff += "\\377";
  ASSERT_EQ(std::system(fmt::format("printf 'M{}' | redis-cli -h 127.0.0.1 -p {} -x SET 'foreign:{{x}}' >/dev/null", ff,
                                    g_servers->port(g_plain)).c_str()),
            0);
  EXPECT_EQ(g_servers->cli(g_plain, "STRLEN 'foreign:{x}'"), "25\n");
  EXPECT_THROW(s->get("x"), vq::FormatError);
  g_servers->cli(g_plain, "DEL 'foreign:{x}'");
}

// Bounded reads (issue 36): a value longer than the reader allows is refused from its first bytes
// (GETRANGE), a split blob from its manifest, before any part is read; and remove of a forged
// manifest's 2^40 parts deletes at most the most parts a put writes (it once took 18 GB of RSS).
void bounded_reads(vq::KVStore& s, bool split) {
  const auto blob = bytes_of(split ? 5000 : 300000, 5);
  s.remove("bounded");
  s.put("bounded", blob);
  EXPECT_EQ(*s.get_at_most("bounded", blob.size()), blob);
  try {
    s.get_at_most("bounded", blob.size() - 1);
    ADD_FAILURE() << "a blob over the bound was read";
  } catch (const vq::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("refused unread"), std::string::npos) << e.what();
  }
  const std::vector<std::string> keys{"bounded", "absent"};
  const auto many = s.get_many_at_most(keys, blob.size());
  EXPECT_EQ(*many[0], blob);
  EXPECT_FALSE(many[1].has_value());
  EXPECT_THROW(s.get_many_at_most(keys, 100), vq::FormatError);
  EXPECT_TRUE(s.remove("bounded"));
}

TEST(RedisStore, ReadsAreBoundedAndRemoveCapsForgedParts) {
  SKIP_WITHOUT_REDIS();
  auto s = vq::open_store(plain_url("?prefix=bounded:"));
  bounded_reads(*s, false);
  auto split = vq::open_store(plain_url("?prefix=bounded:&part_bytes=1000"));
  bounded_reads(*split, true);
  // A manifest claiming 2^40 parts (of one byte each).
  std::string m = "M";
  const auto le = [](std::uint64_t v) {
    std::string o;
    for (int k = 0; k < 8; ++k) o += fmt::format("\\{:03o}", (v >> (8 * k)) & 0xff);
    return o;
  };
  m += le(std::uint64_t{1} << 40) + le(std::uint64_t{1} << 40) + le(0);
  ASSERT_EQ(std::system(fmt::format("printf '{}' | redis-cli -h 127.0.0.1 -p {} -x SET 'bounded:{{forged}}' >/dev/null", m,
                                    g_servers->port(g_plain)).c_str()),
            0);
  EXPECT_EQ(g_servers->cli(g_plain, "STRLEN 'bounded:{forged}'"), "25\n");
  EXPECT_THROW(s->get("forged"), vq::FormatError);
  EXPECT_TRUE(s->remove("forged"));  // quick, and bounded in memory
  EXPECT_FALSE(s->exists("forged"));
}

TEST(RedisCluster, ReadsAreBounded) {
  SKIP_WITHOUT_REDIS();
  auto s = vq::open_store(cluster_url("?prefix=bounded:"));
  bounded_reads(*s, false);
}

// --slo-ms bounds the whole load, the directory's fetch included (issue 36: a stalled Redis made a
// 50 ms deadline return after 4.8 s: a 2 s timeout and a retry). With the server stopped (SIGSTOP),
// a load under a 200 ms deadline gives up within a fraction of one timeout, with one warning that
// names the deadline, and the store serves normally once the server resumes.
TEST(RedisStore, AStalledStoreCostsOnlyTheDeadline) {
  SKIP_WITHOUT_REDIS();
  auto s = vq::open_store(plain_url("?prefix=slo:&timeout_ms=2000"));
  const auto c = vqtest::synth_context(64, 7);
  const std::uint64_t fp = 0x5107;
  vqtest::synth_put(*s, c, fp, 16, {"fp16"});
  const int reused = vqtest::synth_get(*s, c.tokens, fp).report.tokens_reused;
  ASSERT_GT(reused, 0);
  vq::LoaderOptions o;
  o.scheme.model_fingerprint = fp;
  o.slo_ms = 200;
  auto caches = vq::make_caches(vq::MethodSpec::parse("fp32"),
                                vq::ModelDescription::uniform(vqtest::SynthContext::kLayers, vqtest::SynthContext::kDim));
  g_servers->pause(g_plain, true);
  const auto t = std::chrono::steady_clock::now();
  vq::LoadReport rep;
  try {
    rep = vq::load_prefix(*s, vq::ChunkShape{vqtest::SynthContext::kHeads, vqtest::SynthContext::kDim}, caches, c.tokens, o);
  } catch (...) {
    g_servers->pause(g_plain, false);
    throw;
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
  // Without a deadline, a stalled server is a timeout that says so (it read "Resource temporarily
  // unavailable"), after timeout_ms and one retry.
  std::string timeout_message;
  try {
    vq::open_store(plain_url("?prefix=slo:&timeout_ms=150"))->get("anything");
  } catch (const vq::IoError& e) {
    timeout_message = e.what();
  }
  g_servers->pause(g_plain, false);
  EXPECT_NE(timeout_message.find("no reply within 150 ms (timeout_ms)"), std::string::npos) << timeout_message;
  EXPECT_EQ(rep.tokens_reused, 0);
  ASSERT_EQ(rep.warnings.size(), 1u);
  EXPECT_NE(rep.warnings[0].find("deadline"), std::string::npos) << rep.warnings[0];
  EXPECT_LT(ms, 1900.0) << "the load waited for the store's own timeout, not its deadline";
  // The deadline ended with the load: the store answers as before.
  EXPECT_EQ(vqtest::synth_get(*s, c.tokens, fp).report.tokens_reused, reused);
  for (const auto& k : s->list()) s->remove(k);
}

TEST(RedisStore, GetManyPipelines) {
  SKIP_WITHOUT_REDIS();
  auto s = vq::open_store(plain_url("?prefix=many:&part_bytes=300"));
  std::vector<std::string> keys;
  for (int i = 0; i < 20; ++i) {
    keys.push_back(fmt::format("k{}", i));
    if (i % 3 != 0) s->put(keys.back(), bytes_of(static_cast<std::size_t>(100 * i), static_cast<std::uint8_t>(i)));
  }
  const auto got = s->get_many(keys);
  for (int i = 0; i < 20; ++i) {
    if (i % 3 == 0) EXPECT_FALSE(got[i].has_value());
    else EXPECT_EQ(*got[i], bytes_of(static_cast<std::size_t>(100 * i), static_cast<std::uint8_t>(i)));
  }
  for (const auto& k : keys) s->remove(k);
}

TEST(RedisStore, ReconnectsAfterTheServerDropsTheConnection) {
  SKIP_WITHOUT_REDIS();
  auto s = vq::open_store(plain_url("?prefix=re:"));
  s->put("k", bytes_of(100, 1));
  g_servers->cli(g_plain, "CLIENT KILL TYPE normal");
  EXPECT_EQ(*s->get("k"), bytes_of(100, 1));
  s->remove("k");
}

TEST(RedisStore, PasswordAndErrors) {
  SKIP_WITHOUT_REDIS();
  auto ok = vq::open_store(fmt::format("redis://:s3cret@127.0.0.1:{}", g_servers->port(g_auth)));
  basic_round_trip(*ok);
  auto bad = vq::open_store(fmt::format("redis://:wrong@127.0.0.1:{}", g_servers->port(g_auth)));
  try {
    bad->get("k");
    FAIL() << "a wrong password must fail";
  } catch (const vq::IoError& e) {
    EXPECT_NE(std::string(e.what()).find("AUTH"), std::string::npos) << e.what();
  }
  auto none = vq::open_store(fmt::format("redis://127.0.0.1:{}", g_servers->port(g_auth)));
  EXPECT_THROW(none->get("k"), vq::IoError);  // NOAUTH
  // Nothing listens on a fresh free port: a clear "cannot connect".
  auto down = vq::open_store(fmt::format("redis://127.0.0.1:{}?timeout_ms=200", vqtest::free_port()));
  try {
    down->exists("k");
    FAIL() << "no server must fail";
  } catch (const vq::IoError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot connect"), std::string::npos) << e.what();
  }
}

// A lookup finds the levels, chunk sizes and models stored (tests/store/lookup_checks.hpp).
TEST(RedisStore, LookupFindsWhatTheStoreHolds) {
  SKIP_WITHOUT_REDIS();
  auto s = vq::open_store(plain_url("?prefix=lookup:"));
  vqtest::check_lookup_discovers(*s);
}

TEST(RedisCluster, LookupFindsWhatTheStoreHolds) {
  SKIP_WITHOUT_REDIS();
  auto s = vq::open_store(cluster_url("?prefix=lookup:"));
  vqtest::check_lookup_discovers(*s);
}

TEST(RedisStore, ABlobOfAnotherPrefixIsRefused) {
  SKIP_WITHOUT_REDIS();
  auto s = vq::open_store(plain_url("?prefix=poison:"));
  vqtest::check_refuses_another_prefix(*s);
}

TEST(RedisCluster, ABlobOfAnotherPrefixIsRefused) {
  SKIP_WITHOUT_REDIS();
  auto s = vq::open_store(cluster_url("?prefix=poison:"));
  vqtest::check_refuses_another_prefix(*s);
}

// replace() overwrites, put() does not; a replaced multi-part blob reads back whole.
TEST(RedisStore, ReplaceOverwrites) {
  SKIP_WITHOUT_REDIS();
  for (const auto& url : {plain_url("?prefix=replace:&part_bytes=1000"), cluster_url("?prefix=replace:&part_bytes=1000")}) {
    auto s = vq::open_store(url);
    s->put("k", bytes_of(10, 1));
    s->put("k", bytes_of(20, 2));
    EXPECT_EQ(*s->get("k"), bytes_of(10, 1)) << url;
    s->replace("k", bytes_of(2500, 3));
    EXPECT_EQ(*s->get("k"), bytes_of(2500, 3)) << url;
    s->replace("k", bytes_of(7, 4));
    EXPECT_EQ(*s->get("k"), bytes_of(7, 4)) << url;
    s->remove("k");
  }
}

TEST(RedisCluster, RoundTripOverEveryNode) {
  SKIP_WITHOUT_REDIS();
  auto s = vq::open_store(cluster_url("?part_bytes=700"));
  basic_round_trip(*s);
  std::vector<std::string> keys;
  std::set<int> slots;
  for (int i = 0; i < 60; ++i) {
    keys.push_back(fmt::format("key-{}", i));
    slots.insert(vq::redis_cluster_slot("vqkv:{" + keys.back() + "}"));
    s->put(keys.back(), bytes_of(static_cast<std::size_t>(50 * i), static_cast<std::uint8_t>(i)));
  }
  const auto got = s->get_many(keys);
  for (int i = 0; i < 60; ++i) EXPECT_EQ(*got[i], bytes_of(static_cast<std::size_t>(50 * i), static_cast<std::uint8_t>(i))) << i;
  auto listed = s->list();
  EXPECT_EQ(listed.size(), 60u);
  // Every master holds some of them (60 keys over 3 masters).
  for (const auto n : g_cluster) EXPECT_NE(g_servers->cli(n, "DBSIZE"), "0\n") << g_servers->port(n);
  for (const auto& k : keys) s->remove(k);
  EXPECT_TRUE(s->list().empty());
}

TEST(RedisCluster, FollowsMovedAfterAReshard) {
  SKIP_WITHOUT_REDIS();
  auto s = vq::open_store(cluster_url());
  std::vector<std::string> keys;
  for (int i = 0; i < 40; ++i) {
    keys.push_back(fmt::format("moved-{}", i));
    s->put(keys.back(), bytes_of(100, static_cast<std::uint8_t>(i)));
  }
  // Move 2000 slots from the first master to the second, keys and all: the store's map is now stale.
  auto id = [&](std::size_t n) {
    std::string out = g_servers->cli(n, "CLUSTER MYID");
    out.erase(out.find_last_not_of("\n ") + 1);
    return out;
  };
  const std::string cmd = fmt::format(
      "redis-cli --cluster reshard 127.0.0.1:{} --cluster-from {} --cluster-to {} --cluster-slots 2000 --cluster-yes >/dev/null 2>&1",
      g_servers->port(g_cluster[0]), id(g_cluster[0]), id(g_cluster[1]));
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  for (int i = 0; i < 40; ++i) EXPECT_EQ(*s->get(keys[i]), bytes_of(100, static_cast<std::uint8_t>(i))) << keys[i];
  const auto many = s->get_many(keys);
  for (int i = 0; i < 40; ++i) EXPECT_EQ(*many[i], bytes_of(100, static_cast<std::uint8_t>(i)));
  for (const auto& k : keys) s->remove(k);
}

// Last: it stops a master for good.
TEST(RedisCluster, ZzADownNodeFailsOnlyItsKeys) {
  SKIP_WITHOUT_REDIS();
  auto s = vq::open_store(cluster_url("?timeout_ms=300"));
  std::vector<std::string> keys;
  for (int i = 0; i < 30; ++i) {
    keys.push_back(fmt::format("down-{}", i));
    s->put(keys.back(), bytes_of(64, static_cast<std::uint8_t>(i)));
  }
  const std::size_t victim = g_cluster[2];
  const std::string victim_name = fmt::format("127.0.0.1:{}", g_servers->port(victim));
  g_servers->stop(victim);
  int failed = 0, served = 0;
  for (int i = 0; i < 30; ++i) {
    try {
      EXPECT_EQ(*s->get(keys[i]), bytes_of(64, static_cast<std::uint8_t>(i)));
      ++served;
    } catch (const vq::IoError& e) {
      ++failed;
      EXPECT_NE(std::string(e.what()).find(victim_name), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("down"), std::string::npos) << e.what();
    }
  }
  EXPECT_GT(failed, 0);
  EXPECT_GT(served, 0);
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::AddGlobalTestEnvironment(new RedisEnvironment);
  return RUN_ALL_TESTS();
}
