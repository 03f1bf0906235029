// `veloxquant bench attention` as a user runs it (small contexts: no timings are asserted).
#include <unistd.h>

#include <cmath>
#include <map>
#include <string>
#include <utility>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "veloxquant/core/page_vector.hpp"
#include "../support/test_util.hpp"

namespace {

TEST(BenchAttentionCli, JsonHasOneRowPerMethodAndContext) {
  const auto r = vqtest::run_cli("bench attention --context 64 --context 300 --methods 'q4_0;q8_0:rotate=1' --threads 2 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j.size(), 5u);  // exactly memcpy_gb_s, rows, and the threads, clock and rounds they were timed with
  EXPECT_GT(j.at("memcpy_gb_s").get<double>(), 0.0);
  EXPECT_EQ(j.at("threads").get<int>(), 2);
  EXPECT_EQ(j.at("clock").get<std::string>(), "wall");
  const auto& rows = j.at("rows");
  ASSERT_EQ(rows.size(), 8u);  // fp32, fp16, q4_0, q8_0:rotate=1 at two contexts
  std::map<std::pair<std::string, std::int64_t>, nlohmann::json> by;
  for (const auto& row : rows) {
    ASSERT_EQ(row.size(), 8u);
    for (const char* key : {"method", "context", "us_per_step", "resident_bytes", "speedup_vs_fp16", "speedup_vs_fp16_min",
                            "speedup_vs_fp16_max", "vs_memcpy"})
      ASSERT_TRUE(row.contains(key)) << key;
    EXPECT_GT(row.at("us_per_step").get<double>(), 0.0);
    EXPECT_GT(row.at("speedup_vs_fp16").get<double>(), 0.0);
    EXPECT_GT(row.at("vs_memcpy").get<double>(), 0.0);
    // The median of the rounds' paired ratios lies within their range.
    EXPECT_LE(row.at("speedup_vs_fp16_min").get<double>(), row.at("speedup_vs_fp16").get<double>());
    EXPECT_GE(row.at("speedup_vs_fp16_max").get<double>(), row.at("speedup_vs_fp16").get<double>());
    by[{row.at("method").get<std::string>(), row.at("context").get<std::int64_t>()}] = row;
  }
  for (std::int64_t ctx : {64, 300}) {
    const auto row = [&](const char* m) { return by[std::make_pair(std::string(m), ctx)]; };
    for (const char* m : {"fp32", "fp16", "q4_0", "q8_0:rotate=1"}) ASSERT_EQ(by.count(std::make_pair(std::string(m), ctx)), 1u) << m << " " << ctx;
    EXPECT_EQ(row("fp16").at("speedup_vs_fp16").get<double>(), 1.0);
    const auto bytes = [&](const char* m) { return row(m).at("resident_bytes").get<double>(); };
    // 8 KV heads x 128 x ctx tokens, K and V: the dense caches hold at least that at 4 and 2 bytes;
    // q4_0 holds its blocks only (18 bytes per 32 values), q8_0 34 per 32 (a single call: no spare
    // capacity), each side's array on the heap up to 64 KiB, else in whole pages of its own mapping.
    const double elements = 2.0 * 8 * 128 * static_cast<double>(ctx);
    const auto held = [](double side) {
      const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
      return side <= static_cast<double>(vq::kPageVectorHeapBytes) ? side : std::ceil(side / page) * page;
    };
    EXPECT_GE(bytes("fp32"), 4 * elements);
    EXPECT_GE(bytes("fp16"), 2 * elements);
    EXPECT_EQ(bytes("q4_0"), 2 * held(elements / 2 / 32 * 18));
    EXPECT_EQ(bytes("q8_0:rotate=1"), 2 * held(elements / 2 / 32 * 34) + 2 * 128 * 4);  // + the K and V rotations' signs
  }
}

TEST(BenchAttentionCli, TextTableAndBadInput) {
  const auto r = vqtest::run_cli("bench attention --context 40 --methods q4_1 --threads 1 --rounds 3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("3 rounds"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("memcpy"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("attend threads: 1 (thread CPU clock)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("q4_1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("vs fp16"), std::string::npos) << r.out;
  const auto bad_method = vqtest::run_cli("bench attention --context 40 --methods q5_0");
  EXPECT_NE(bad_method.code, 0);
  EXPECT_NE(bad_method.err.find("unknown method 'q5_0'"), std::string::npos) << bad_method.err;
  const auto bad_context = vqtest::run_cli("bench attention --context 0");
  EXPECT_NE(bad_context.code, 0);
  EXPECT_NE(bad_context.err.find("--context"), std::string::npos) << bad_context.err;
  const auto bad_threads = vqtest::run_cli("bench attention --context 40 --threads -1");
  EXPECT_NE(bad_threads.code, 0);
  EXPECT_NE(bad_threads.err.find("--threads"), std::string::npos) << bad_threads.err;
  const auto bad_rounds = vqtest::run_cli("bench attention --context 40 --rounds 0");
  EXPECT_NE(bad_rounds.code, 0);
  EXPECT_NE(bad_rounds.err.find("--rounds"), std::string::npos) << bad_rounds.err;
}

}  // namespace
