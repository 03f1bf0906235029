// The CLI as a user runs it: `veloxquant account` on .npy files.
#include <array>
#include <cstdio>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/core/npy.hpp"
#include "../support/test_util.hpp"

namespace {

vqtest::CliRun run(const std::string& args) { return vqtest::run_cli(args); }

std::string p(const std::string& name) { return vqtest::temp_dir() + "/" + name; }

class AccountCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    vq::write_npy(p("k.npy"), vqtest::random_walk({1, 4, 200, 16}, 1, vq::DType::F16));
    vq::write_npy(p("v.npy"), vqtest::random_walk({1, 4, 200, 16}, 2, vq::DType::F16));
  }
};

TEST_F(AccountCli, JsonEqualsTheLibrary) {
  for (const std::string flags : {"", " --flush per_call --chunk 7", " --bits 3 --group-size 16 --no-delta --pooled --chunk 1"}) {
    auto r = run("account --keys " + p("k.npy") + " --values " + p("v.npy") + flags + " --json");
    ASSERT_EQ(r.code, 0) << r.err;
    auto j = nlohmann::json::parse(r.out);
    vq::KVCacheConfig cfg;
    if (flags.find("per_call") != std::string::npos) cfg.cachegen_flush = vq::FlushMode::PerCall;
    if (flags.find("--bits 3") != std::string::npos) {
      cfg.cachegen_bits = 3;
      cfg.cachegen_group_size = 16;
      cfg.cachegen_use_delta = false;
      cfg.cachegen_per_channel = false;
    }
    const std::int64_t chunk = flags.find("--chunk 7") != std::string::npos ? 7 : flags.find("--chunk 1") != std::string::npos ? 1 : 200;
    vq::CacheGenKVCache cache(cfg);
    auto k = vq::read_npy(p("k.npy")), v = vq::read_npy(p("v.npy"));
    for (std::int64_t s = 0; s < 200; s += chunk) {
      const auto e = std::min<std::int64_t>(200, s + chunk);
      cache.update_and_fetch(k.slice(2, s, e), v.slice(2, s, e));
    }
    EXPECT_EQ(j.at("compressed_key_bytes").get<std::uint64_t>(), cache.compressed_key_bytes()) << flags;
    EXPECT_EQ(j.at("compressed_value_bytes").get<std::uint64_t>(), cache.compressed_value_bytes());
    EXPECT_EQ(j.at("fixed_width_key_bytes").get<std::uint64_t>(), cache.fixed_width_key_bytes());
    EXPECT_EQ(j.at("fixed_width_value_bytes").get<std::uint64_t>(), cache.fixed_width_value_bytes());
    EXPECT_EQ(j.at("fp16_key_bytes").get<std::uint64_t>(), cache.fp16_key_bytes());
    EXPECT_EQ(j.at("fp16_value_bytes").get<std::uint64_t>(), cache.fp16_value_bytes());
    EXPECT_DOUBLE_EQ(j.at("entropy_savings").get<double>(), cache.entropy_savings());
    EXPECT_DOUBLE_EQ(j.at("assigned_avg_bits").get<double>(), cache.assigned_avg_bits());
    EXPECT_EQ(j.at("offset").get<std::int64_t>(), 200);
    EXPECT_EQ(j.at("encoded_key_bytes").get<std::uint64_t>(), cache.encoded_key_bytes());
    EXPECT_EQ(j.at("encoded_value_bytes").get<std::uint64_t>(), cache.encoded_value_bytes());
  }
}

TEST_F(AccountCli, ReconFilesHoldTheLastFetchInTheInputDtype) {
  auto r = run("account --keys " + p("k.npy") + " --values " + p("v.npy") + " --chunk 50 --recon-keys " + p("rk.npy") +
               " --recon-values " + p("rv.npy"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("compressed"), std::string::npos);
  vq::CacheGenKVCache cache;
  auto k = vq::read_npy(p("k.npy")), v = vq::read_npy(p("v.npy"));
  std::pair<vq::Tensor, vq::Tensor> last;
  for (std::int64_t s = 0; s < 200; s += 50) last = cache.update_and_fetch(k.slice(2, s, s + 50), v.slice(2, s, s + 50));
  auto rk = vq::read_npy(p("rk.npy")), rv = vq::read_npy(p("rv.npy"));
  EXPECT_EQ(rk.dtype(), vq::DType::F16);
  EXPECT_TRUE(rk.bit_equal(last.first));
  EXPECT_TRUE(rv.bit_equal(last.second));
}

TEST_F(AccountCli, BadInputGetsOneLineAndNonzeroExit) {
  vq::write_npy(p("short.npy"), vqtest::random_walk({1, 4, 100, 16}, 3, vq::DType::F16));
  vq::write_npy(p("f32.npy"), vqtest::random_walk({1, 4, 200, 16}, 3, vq::DType::F32));
  {
    std::ofstream bad(p("junk.npy"));
    bad << "this is not numpy";
  }
  const std::string kv = " --keys " + p("k.npy") + " --values " + p("v.npy");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"account --keys " + p("missing.npy") + " --values " + p("v.npy"), "cannot open"},
      {"account --keys " + p("junk.npy") + " --values " + p("v.npy"), "not a valid .npy"},
      {"account --keys " + p("k.npy") + " --values " + p("short.npy"), "must agree"},
      {"account --keys " + p("k.npy") + " --values " + p("f32.npy"), "float16"},
      {"account" + kv + " --bits 9", "bits"},
      {"account" + kv + " --bits 0", "bits"},
      {"account" + kv + " --group-size 0", "--group-size"},
      {"account" + kv + " --flush sometimes", "flush mode"},
      {"account" + kv + " --chunk -3", "chunk"},
      {"account" + kv + " --bits four", "bits"},
      {"account --values " + p("v.npy"), "keys"},
      {"account" + kv + " --recon-keys /nonexistent-dir/x.npy", "cannot write"},
      {"frobnicate", "frobnicate"},
  };
  for (const auto& [args, needle] : cases) {
    auto r = run(args);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_NE(r.err.find(needle), std::string::npos) << args << " -> " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << " -> " << r.err;
    EXPECT_EQ(r.err.rfind("veloxquant: error: ", 0), 0u) << r.err;
  }
}

TEST_F(AccountCli, SynthWritesAnLlmLikePair) {
  auto r = run("synth --keys-out " + p("sk.npy") + " --values-out " + p("sv.npy") + " --tokens 64 --heads 2 --head-dim 16");
  ASSERT_EQ(r.code, 0) << r.err;
  auto k = vq::read_npy(p("sk.npy"));
  EXPECT_EQ(k.shape(), (vq::Shape4{1, 2, 64, 16}));
  EXPECT_TRUE(k.all_finite());
  EXPECT_NE(run("synth --keys-out " + p("sk.npy") + " --values-out " + p("sv.npy") + " --head-dim 7").code, 0);
}

}  // namespace
