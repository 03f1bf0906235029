// `veloxquant bench codec` as a user runs it.
#include <algorithm>
#include <initializer_list>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../model/model_support.hpp"
#include "../support/test_util.hpp"
#include "veloxquant/core/npy.hpp"

namespace {

std::string p(const std::string& name) { return vqtest::temp_dir() + "/" + name; }

// Every coder row of a report has bytes, speeds and a round trip, and the coders `want` are there.
void expect_coders(const nlohmann::json& j, std::initializer_list<const char*> want) {
  ASSERT_TRUE(j.at("coders").is_array());
  std::vector<std::string> names;
  for (const auto& c : j.at("coders")) {
    names.push_back(c.at("name").get<std::string>());
    EXPECT_GT(c.at("bytes").get<std::uint64_t>(), 0u) << names.back();
    EXPECT_GT(c.at("encode_msym_s").get<double>(), 0.0) << names.back();
    EXPECT_GT(c.at("decode_msym_s").get<double>(), 0.0) << names.back();
    EXPECT_TRUE(c.at("roundtrip_ok").get<bool>()) << names.back();
  }
  for (const char* w : want) EXPECT_NE(std::find(names.begin(), names.end(), w), names.end()) << w;
}

void expect_report(const nlohmann::json& j) {
  ASSERT_TRUE(j.contains("shannon_bytes"));
  ASSERT_TRUE(j.contains("fixed_width_bytes"));
  expect_coders(j, {"veloxquant-rans", "htscodecs-rans4x16-o0", "htscodecs-rans4x16-o1", "zstd-1", "zstd-3", "zstd-19", "lz4"});
}

std::uint64_t bytes_of(const nlohmann::json& j, const std::string& name) {
  for (const auto& c : j.at("coders"))
    if (c.at("name") == name) return c.at("bytes").get<std::uint64_t>();
  return 0;
}

nlohmann::json synthetic_report() {
  static const nlohmann::json j = [] {
    const auto r = vqtest::run_cli("bench codec --synthetic --json");
    EXPECT_EQ(r.code, 0) << r.err;
    return r.code == 0 ? nlohmann::json::parse(r.out) : nlohmann::json::object();
  }();
  return j;
}

// The default coder against its model's bound (the codes' empirical entropy under the classes its
// model chose) plus the model's bytes: issue 4's size goal, <= 1.005 on >= 4096-token channels.
TEST(BenchCodecCli, SyntheticJson) {
  const auto j = synthetic_report();
  expect_report(j);
  const std::uint64_t ours = bytes_of(j, "veloxquant-rans");
  EXPECT_EQ(ours, bytes_of(j, "veloxquant-rans-context"));  // the default at 4 bits
  EXPECT_EQ(j.at("shannon_bytes").get<std::uint64_t>(), j.at("shannon_context_bytes").get<std::uint64_t>());
  EXPECT_GE(static_cast<double>(ours), 0.999 * j.at("shannon_bytes").get<double>());
  EXPECT_LE(j.at("default_vs_bound").get<double>(), 1.005);
}

// Issue 4's goal for the cache's default coder (the context coder at 4 bits): fewer bytes than
// every peer, on the synthetic K/V and on stories260K's real codes (sizes are deterministic), and
// fewer than per-channel tables.
TEST(BenchCodecCli, DefaultCoderBeatsEveryPeerOnSyntheticAndRealCodes) {
  const auto real = vqtest::run_cli("bench codec --json --model " + vqtest::models_dir() + "/stories260K.bin");
  ASSERT_EQ(real.code, 0) << real.err;
  for (const auto& j : {synthetic_report(), nlohmann::json::parse(real.out)}) {
    const std::uint64_t ours = bytes_of(j, "veloxquant-rans");
    ASSERT_GT(ours, 0u);
    EXPECT_LT(ours, bytes_of(j, "veloxquant-rans-codes"));
    for (const char* peer : {"htscodecs-rans4x16-o0", "htscodecs-rans4x16-o1", "zstd-1", "zstd-3", "zstd-19", "lz4"})
      EXPECT_LT(ours, bytes_of(j, peer)) << peer << " on " << j.at("source");
  }
}

TEST(BenchCodecCli, NpyInputAndTable) {
  vq::write_npy(p("bk.npy"), vqtest::random_walk({1, 2, 300, 16}, 9, vq::DType::F16));
  vq::write_npy(p("bv.npy"), vqtest::random_walk({1, 2, 300, 16}, 10, vq::DType::F16));
  auto r = vqtest::run_cli("bench codec --keys " + p("bk.npy") + " --values " + p("bv.npy") + " --bits 3 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  expect_report(nlohmann::json::parse(r.out));
  r = vqtest::run_cli("bench codec --keys " + p("bk.npy") + " --values " + p("bv.npy"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("veloxquant-rans"), std::string::npos);
  EXPECT_NE(r.out.find("Shannon"), std::string::npos);
}

// Issue 15: our method's codes (--method vq:...) against the peers on the same codes, one run.
TEST(BenchCodecCli, VqMethodCodesAgainstThePeers) {
  vq::write_npy(p("vk.npy"), vqtest::random_walk({2, 2, 200, 16}, 19, vq::DType::F16));
  vq::write_npy(p("vv.npy"), vqtest::random_walk({2, 2, 200, 16}, 20, vq::DType::F16));
  for (const char* method : {"vq:bits=2,calib=16", "vq:bits=9,calib=16"}) {
    SCOPED_TRACE(method);
    const auto r = vqtest::run_cli("bench codec --keys " + p("vk.npy") + " --values " + p("vv.npy") + " --method " + method + " --json");
    ASSERT_EQ(r.code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j.at("layers").get<int>(), 1);
    EXPECT_EQ(j.at("symbols").get<std::uint64_t>(), 2u * 2 * 200 * 32);  // B x rows x (n_k + n_v), every token quantized
    // 9 bits: codes beyond int8, so the peers get int16.
    EXPECT_EQ(j.at("peer_input").get<std::string>(), std::string(method).find("bits=9") != std::string::npos ? "int16" : "int8");
    expect_coders(j, {"veloxquant-vq", "htscodecs-rans4x16-o0", "htscodecs-rans4x16-o1", "zstd-1", "zstd-19"});
  }
  const auto table = vqtest::run_cli("bench codec --keys " + p("vk.npy") + " --values " + p("vv.npy") + " --method vq:bits=2,calib=16");
  ASSERT_EQ(table.code, 0) << table.err;
  EXPECT_NE(table.out.find("veloxquant-vq"), std::string::npos);
  for (const std::string& args : {std::string("bench codec --synthetic --method cachegen:bits=4"), std::string("bench codec --synthetic --method vq:bits=0"),
                                  std::string("bench codec --method vq:bits=2"),
                                  "bench codec --keys " + p("vk.npy") + " --values " + p("vv.npy") + " --method vq:bits=2,calib=1000"}) {
    const auto r = vqtest::run_cli(args);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_NE(r.err.find("error"), std::string::npos) << args << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << ": " << r.err;
  }
}

TEST(BenchCodecCli, BadInputIsOneLineAndNonzero) {
  for (const std::string& args : std::vector<std::string>{"bench codec", "bench codec --synthetic --bits 9", "bench codec --keys /nonexistent.npy --values /nonexistent.npy",
                                 "bench codec --synthetic --model /nonexistent.bin", "bench codec --model /nonexistent.bin",
                                 "bench codec --keys " + p("bk.npy")}) {
    const auto r = vqtest::run_cli(args);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_NE(r.err.find("error"), std::string::npos) << args << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << ": " << r.err;
  }
  const auto r = vqtest::run_cli("bench");
  EXPECT_NE(r.code, 0);
}

}  // namespace
