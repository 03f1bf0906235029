// `veloxquant store put|ls|stats|rm` and `generate --store` as a user runs them, on the file:
// backend with the real stories260K model: exact reuse, reports, and faults that fall back to
// recomputing with one warning and exit 0.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>

#include <nlohmann/json.hpp>

#include "../model/model_support.hpp"
#include "../support/test_util.hpp"
#include "redis_servers.hpp"
#include "veloxquant/store/file_store.hpp"

namespace fs = std::filesystem;

namespace {

const std::string kPrompt =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends. "
    "One day, she saw a big red ball";

std::string model_args() { return "--model '" + vqtest::model_path() + "' --tokenizer '" + vqtest::tokenizer_path() + "'"; }

struct StoreDir {
  fs::path path = fs::path(vqtest::temp_dir()) / fmt::format("store-cli-{}", counter()++);
  StoreDir() { fs::remove_all(path); }
  ~StoreDir() { fs::remove_all(path); }
  std::string url() const { return "file:" + path.string(); }
  static int& counter() {
    static int c = 0;
    return c;
  }
};

vqtest::CliRun put(const StoreDir& s, const std::string& levels, int C = 8) {
  return vqtest::run_cli(fmt::format("store put --store '{}' {} --prompt '{}' --levels '{}' --chunk-tokens {} --json", s.url(), model_args(),
                                     kPrompt, levels, C));
}
vqtest::CliRun gen(const std::string& extra) {
  return vqtest::run_cli(fmt::format("generate {} --prompt '{}' --temperature 0 --steps 90 {}", model_args(), kPrompt, extra));
}

TEST(StoreCli, PutLsStatsRm) {
  StoreDir s;
  const auto p = put(s, "fp16");
  ASSERT_EQ(p.code, 0) << p.err;
  const auto j = nlohmann::json::parse(p.out);
  const int chunks = j.at("chunks").get<int>();
  EXPECT_EQ(chunks, j.at("tokens").get<int>() / 8);
  EXPECT_GE(chunks, 4);
  EXPECT_EQ(j.at("levels").size(), 2u);  // fp16 and fp32, always added
  const auto ls = vqtest::run_cli("store ls --store '" + s.url() + "' --json");
  ASSERT_EQ(ls.code, 0) << ls.err;
  // Per chunk fp16, fp32 and its directory; one chunk-sizes list.
  EXPECT_EQ(nlohmann::json::parse(ls.out).at("keys").size(), static_cast<std::size_t>(chunks) * 3 + 1);
  const auto st = vqtest::run_cli("store stats --store '" + s.url() + "' --json");
  ASSERT_EQ(st.code, 0) << st.err;
  EXPECT_EQ(nlohmann::json::parse(st.out).at("blobs").get<int>(), chunks * 3 + 1);
  EXPECT_EQ(nlohmann::json::parse(st.out).at("bytes").get<std::uint64_t>(), j.at("bytes_written").get<std::uint64_t>());
  // Again: idempotent, nothing new.
  const auto again = put(s, "fp16");
  EXPECT_EQ(nlohmann::json::parse(again.out).at("chunks_written").get<int>(), 0);
  const std::string key = nlohmann::json::parse(ls.out).at("keys")[0].get<std::string>();
  EXPECT_EQ(vqtest::run_cli("store rm --store '" + s.url() + "' " + key).code, 0);
  const auto missing = vqtest::run_cli("store rm --store '" + s.url() + "' " + key);
  EXPECT_EQ(missing.code, 1);
  EXPECT_NE(missing.err.find(key), std::string::npos);
  EXPECT_EQ(vqtest::run_cli("store rm --store '" + s.url() + "' --all").code, 0);
  EXPECT_EQ(vqtest::run_cli("store ls --store '" + s.url() + "'").out, "");
}

// A sealed store end to end (issue 36): a put with a secret is reused by a generate with it, and a
// generate without it (or with a namespace of its own) reuses nothing and prints the same text; the
// secret is never printed. ls/rm of a namespace work on its own keys.
TEST(StoreCli, ASecretAndANamespaceGuardTheStore) {
  StoreDir s;
  const std::string sealed = s.url() + "?secret=hunter2&namespace=team-a";
  const auto p = vqtest::run_cli(fmt::format("store put --store '{}' {} --prompt '{}' --levels fp16 --chunk-tokens 8 --json", sealed,
                                             model_args(), kPrompt));
  ASSERT_EQ(p.code, 0) << p.err;
  const auto plain = gen("");
  const auto with = gen("--store '" + sealed + "' --chunk-tokens 8 --no-recompute --json");
  ASSERT_EQ(with.code, 0) << with.err;
  EXPECT_GT(nlohmann::json::parse(with.out).at("tokens_reused").get<int>(), 0);
  for (const std::string other : {s.url(), s.url() + "?namespace=team-a", s.url() + "?secret=hunter2&namespace=team-b"}) {
    SCOPED_TRACE(other);
    const auto r = gen("--store '" + other + "' --chunk-tokens 8 --no-recompute");
    EXPECT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(r.out, plain.out);
    EXPECT_NE(r.err.find("0 of "), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("hunter2"), std::string::npos) << r.err;
  }
  const auto ls = vqtest::run_cli("store ls --store '" + sealed + "' --json");
  ASSERT_EQ(ls.code, 0) << ls.err;
  const auto keys = nlohmann::json::parse(ls.out).at("keys");
  ASSERT_FALSE(keys.empty());
  for (const auto& k : keys) EXPECT_EQ(k.get<std::string>().rfind("vq-ns", 0), 0u) << k;
  // team-b's generate above stored its prompt under its own names: none of them is team-a's.
  const auto other_keys = nlohmann::json::parse(vqtest::run_cli("store ls --store '" + s.url() + "?namespace=team-b' --json").out).at("keys");
  ASSERT_FALSE(other_keys.empty());
  for (const auto& k : other_keys) EXPECT_EQ(std::find(keys.begin(), keys.end(), k), keys.end()) << k;
  // rm --all of a namespace removes its keys only: the plain ones and team-b's stay.
  const auto all_before = vqtest::run_cli("store ls --store '" + s.url() + "'").out;
  EXPECT_EQ(vqtest::run_cli("store rm --store '" + sealed + "' --all").code, 0);
  EXPECT_EQ(nlohmann::json::parse(vqtest::run_cli("store ls --store '" + sealed + "' --json").out).at("keys").size(), 0u);
  const auto all_after = vqtest::run_cli("store ls --store '" + s.url() + "'").out;
  EXPECT_EQ(std::count(all_after.begin(), all_after.end(), '\n') + static_cast<std::ptrdiff_t>(keys.size()),
            std::count(all_before.begin(), all_before.end(), '\n'));
}

TEST(StoreCli, BadInputIsOneLineAndNonzero) {
  for (const std::string args : {"store put --prompt x --store s3://bucket", "store put --store file:/tmp/x", "store rm --store file:/tmp/x",
                                 "store put --prompt x --levels fp99", "store rm --all k1", "store ls --store redis://h",
                                 "generate --slo-ms 5", "generate --no-recompute", "generate --slo-guard 0.5",
                                 "generate --store file:/tmp/vq-never --slo-guard 0.5", "generate --store file:/tmp/vq-never --slo-ms 5 --slo-guard 0",
                                 "generate --store file:/tmp/vq-never --slo-ms 5 --slo-guard 2",
                                 "generate --store file:/tmp/vq-never --chunk-tokens 0", "generate --store file:/tmp/vq-never --levels fp99"}) {
    const auto r = vqtest::run_cli(args + " " + (args.rfind("store put", 0) == 0 || args.rfind("generate", 0) == 0 ? model_args() : ""));
    EXPECT_NE(r.code, 0) << args;
    EXPECT_NE(r.err.find("error"), std::string::npos) << args << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << ": " << r.err;
  }
}

// With only the exact level stored, generate --store prints the same text as generate, token for
// token, and reports every reused chunk.
TEST(StoreCli, GenerateWithOnlyFp32StoredMatchesPlainGenerate) {
  StoreDir s;
  ASSERT_EQ(put(s, "fp32").code, 0);
  const auto plain = gen("");
  ASSERT_EQ(plain.code, 0) << plain.err;
  const auto stored = gen("--store '" + s.url() + "' --levels fp32 --chunk-tokens 8 --json");
  ASSERT_EQ(stored.code, 0) << stored.err;
  const auto j = nlohmann::json::parse(stored.out);
  EXPECT_EQ(j.at("text").get<std::string>() + "\n", plain.out);
  EXPECT_GT(j.at("ttft_ms").get<double>(), 0.0);
  EXPECT_GT(j.at("prefill_ms_estimate").get<double>(), 0.0);
  // The whole stored prefix (>= 4 chunks of 8) is found. The loader may still recompute a chunk when
  // its timing says that is faster than fetching it (8 tokens of this tiny model take well under a
  // millisecond, so under load it sometimes does): every chunk is fp32 or a recompute, and the
  // tokens reused are exactly the fp32 chunks'.
  EXPECT_GE(j.at("chunks").size(), 4u);
  std::size_t loaded = 0;
  for (const auto& c : j.at("chunks")) {
    EXPECT_TRUE(c.at("level") == "fp32" || c.at("level") == "recompute") << c.dump();
    if (c.at("level") != "fp32") continue;
    ++loaded;
    EXPECT_GT(c.at("bytes").get<int>(), 0);
    EXPECT_TRUE(c.contains("index") && c.contains("fetch_ms") && c.contains("decode_ms"));
  }
  EXPECT_EQ(loaded * 8, static_cast<std::size_t>(j.at("tokens_reused").get<int>()));
  // stderr holds only generate's line on the caches' resident memory (no warning).
  EXPECT_EQ(stored.err.find("kv cache: peak resident"), 0u) << stored.err;
  EXPECT_EQ(std::count(stored.err.begin(), stored.err.end(), '\n'), 1) << stored.err;
  // --no-recompute: every stored chunk is loaded, none recomputed.
  const auto all = gen("--store '" + s.url() + "' --levels fp32 --chunk-tokens 8 --json --no-recompute");
  ASSERT_EQ(all.code, 0) << all.err;
  const auto ja = nlohmann::json::parse(all.out);
  EXPECT_EQ(ja.at("text"), j.at("text"));
  for (const auto& c : ja.at("chunks")) EXPECT_EQ(c.at("level"), "fp32") << c.dump();
  EXPECT_EQ(ja.at("tokens_reused").get<std::size_t>(), 8 * ja.at("chunks").size());
  EXPECT_EQ(ja.at("chunks").size(), j.at("chunks").size());
  // The streamed form prints the same text too.
  const auto streamed = gen("--store '" + s.url() + "' --levels fp32 --chunk-tokens 8");
  EXPECT_EQ(streamed.out, plain.out);
}

// A user stores at one level and chunk size, then generates naming neither: the prefix is found
// and reused, and the JSON says per chunk what was stored, what was loaded and why. A level list
// that leaves out what is stored is a miss that stderr explains in one line.
TEST(StoreCli, GenerateFindsTheLevelsAndChunkSizeOfThePut) {
  StoreDir s;
  ASSERT_EQ(put(s, "fp16", 8).code, 0);
  const auto plain = gen("");
  const auto r = gen("--store '" + s.url() + "' --json --no-recompute");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("text").get<std::string>() + "\n", plain.out);
  EXPECT_EQ(j.at("chunk_tokens").get<int>(), 8);
  ASSERT_GE(j.at("chunks").size(), 4u);
  EXPECT_EQ(j.at("tokens_reused").get<std::size_t>(), 8 * j.at("chunks").size());
  for (const auto& c : j.at("chunks")) {
    EXPECT_EQ(c.at("status"), "hit") << c.dump();
    EXPECT_EQ(c.at("level"), "fp32") << c.dump();  // the best level stored
    EXPECT_EQ(c.at("levels"), nlohmann::json({"fp16", "fp32"})) << c.dump();
    EXPECT_EQ(c.at("reason"), "plan: the best level stored") << c.dump();
  }
  EXPECT_EQ(j.at("not_used"), "");
  // Narrowed to a level not stored (vq:bits=2; fp32 stays allowed): fp32 still found.
  const auto narrowed = gen("--store '" + s.url() + "' --levels 'vq:bits=2' --json --no-recompute");
  ASSERT_EQ(narrowed.code, 0) << narrowed.err;
  EXPECT_EQ(nlohmann::json::parse(narrowed.out).at("tokens_reused"), j.at("tokens_reused"));
  // Another chunk size than stored: a miss; in text mode nothing is said (nothing of that size is
  // stored), and the text is the same as without a store.
  const auto other = gen("--store '" + s.url() + "' --chunk-tokens 16 --json");
  ASSERT_EQ(other.code, 0) << other.err;
  const auto jo = nlohmann::json::parse(other.out);
  EXPECT_EQ(jo.at("tokens_reused"), 0);
  EXPECT_EQ(jo.at("miss").at("reason"), "not stored");
  EXPECT_EQ(jo.at("text").get<std::string>() + "\n", plain.out);
}

// A stored prefix left unused says why on stderr, in one line (text mode): here it was stored for
// another model (stories260K's prefix, generated from with stories3M-h64, the same tokenizer).
TEST(StoreCli, APrefixOfAnotherModelIsAMissSaidInOneLine) {
  StoreDir s;
  ASSERT_EQ(put(s, "fp32", 8).code, 0);
  const std::string other = fmt::format("--model '{}/stories3M-h64.bin' --tokenizer '{}'", vqtest::models_dir(), vqtest::tokenizer_path());
  const auto plain = vqtest::run_cli(fmt::format("generate {} --prompt '{}' --temperature 0 --steps 60", other, kPrompt));
  ASSERT_EQ(plain.code, 0) << plain.err;
  const auto r = vqtest::run_cli(fmt::format("generate {} --prompt '{}' --temperature 0 --steps 60 --store '{}'", other, kPrompt, s.url()));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, plain.out);
  const std::regex note(R"(veloxquant: note: a stored prefix was not used: chunk 0 stored for another model only \(fingerprint [0-9a-f]{16}; this model's is [0-9a-f]{16}\)\n)");
  EXPECT_TRUE(std::regex_search(r.err, note)) << r.err;
  EXPECT_EQ(r.err.find("warning"), std::string::npos) << r.err;
  // (generate stored its own context after: a fresh store for the JSON run)
  StoreDir s2;
  ASSERT_EQ(put(s2, "fp32", 8).code, 0);
  const auto j = vqtest::run_cli(fmt::format("generate {} --prompt '{}' --temperature 0 --steps 60 --store '{}' --json", other, kPrompt, s2.url()));
  ASSERT_EQ(j.code, 0) << j.err;
  const auto jj = nlohmann::json::parse(j.out);
  EXPECT_EQ(jj.at("tokens_reused"), 0) << s.url() << " " << s2.url() << " " << j.out.substr(j.out.find("\"tokens_reused")) << j.err;
  ASSERT_FALSE(jj.at("miss").is_null());
  EXPECT_EQ(jj.at("miss").at("status"), "miss");
  EXPECT_NE(jj.at("miss").at("reason").get<std::string>().find("another model"), std::string::npos) << j.out;
  EXPECT_NE(jj.at("not_used").get<std::string>().find("another model"), std::string::npos) << j.out;
  EXPECT_EQ(j.err.find("note:"), std::string::npos) << j.err;  // JSON mode: in the JSON, not on stderr
}

TEST(StoreCli, LossyLevelsUnderADeadlineReport) {
  StoreDir s;
  ASSERT_EQ(put(s, "fp16;cachegen:bits=2,group=8").code, 0);
  // A slow emulated link (0.2 Mbps = 25 bytes/ms) and a tight deadline: no chunk can come at fp32.
  const auto r = gen("--store '" + s.url() + "' --levels 'fp16;cachegen:bits=2,group=8' --chunk-tokens 8 --json --slo-ms 50 --bandwidth 0.2");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_FALSE(j.at("chunks").empty());
  for (const auto& c : j.at("chunks")) EXPECT_NE(c.at("level"), "fp32") << c.dump();
}

TEST(StoreCli, FaultsWarnRecomputeAndExitZero) {
  StoreDir s;
  ASSERT_EQ(put(s, "fp32").code, 0);
  const auto plain = gen("");
  vq::FileStore fs_store(s.path);
  std::vector<std::string> level_keys;
  for (const auto& k : fs_store.list())
    if (k.rfind("vq-dir-", 0) != 0) level_keys.push_back(k);
  ASSERT_FALSE(level_keys.empty());
  // --no-recompute: the planner fetches chunk 0 (else it may recompute the first chunks, where that
  // is faster on this machine, and the fault would show at a later chunk or not at all).
  const std::string args = "--store '" + s.url() + "' --levels fp32 --chunk-tokens 8 --no-recompute";
  // A corrupt blob (one flipped byte in every level blob): checksums catch it.
  for (const auto& k : level_keys) {
    const auto p = fs_store.blob_path(k);
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(p) / 2));
    f.put('\x5a');
  }
  auto r = gen(args);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, plain.out);
  const std::regex rejected(
      R"(warning: chunk 0: level fp32 blob rejected \(vqkv: [^\n]*checksum mismatch[^\n]*\) \(removed from the store: the next put stores it again\); recomputing)");
  EXPECT_TRUE(std::regex_search(r.err, rejected)) << r.err;
  const auto level_blobs = [&] {
    const auto all = fs_store.list();
    return std::count_if(all.begin(), all.end(), [](const std::string& k) { return k.rfind("vq-dir-", 0) != 0; });
  };
  EXPECT_EQ(level_blobs(), static_cast<std::ptrdiff_t>(level_keys.size()) - 1);  // chunk 0's, where the load stopped
  // The next put stores chunk 0 again, and it loads.
  ASSERT_EQ(put(s, "fp32").code, 0);
  r = gen(args);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, plain.out);
  EXPECT_EQ(r.err.find("warning: chunk 0"), std::string::npos) << r.err;
  // A missing blob.
  for (const auto& k : fs_store.list())
    if (k.rfind("vq-dir-", 0) != 0) fs_store.remove(k);
  r = gen(args);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, plain.out);
  const std::regex missing(R"(warning: chunk 0: blob '[^']+' missing \(removed from the store: the next put stores it again\); recomputing)");
  EXPECT_TRUE(std::regex_search(r.err, missing)) << r.err;
  // A store that is down (nothing listens on a fresh free port).
  r = gen(fmt::format("--store redis://127.0.0.1:{}?timeout_ms=200 --chunk-tokens 8", vqtest::free_port()));
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 3) << r.err;  // the warning, the report line, the memory line
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, plain.out);
  EXPECT_NE(r.err.find("warning: chunk 0"), std::string::npos) << r.err;
}

}  // namespace
