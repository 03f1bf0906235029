// `veloxquant rd` as a user runs it, on the real model with a few cheap methods and windows.
#include <algorithm>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../support/test_util.hpp"

namespace {

std::string models() { return std::string(VQ_SOURCE_DIR) + "/../shared/models"; }
std::string model_args() { return "--model " + models() + "/stories260K.bin --tokenizer " + models() + "/tok512.bin"; }
vqtest::CliRun rd(const std::string& args) { return vqtest::run_cli("rd " + model_args() + " " + args); }

using vqtest::slurp;

// Tags balance: every <x ...> is closed by </x> in order, or self-closed (<x .../>).
bool well_formed(const std::string& svg) {
  std::vector<std::string> open;
  for (std::size_t i = svg.find('<'); i != std::string::npos; i = svg.find('<', i + 1)) {
    const std::size_t end = svg.find('>', i);
    if (end == std::string::npos) return false;
    const std::string tag = svg.substr(i + 1, end - i - 1);
    if (tag.empty()) return false;
    if (tag[0] == '/') {
      if (open.empty() || open.back() != tag.substr(1)) return false;
      open.pop_back();
    } else if (tag.back() != '/') {
      open.push_back(tag.substr(0, tag.find_first_of(" \n")));
    }
  }
  return open.empty();
}

TEST(RdCli, JsonRowsParetoAndPlot) {
  const std::string svg = vqtest::temp_dir() + "/rd.svg";
  const auto r = rd("--methods 'fp16,q4_0;vq:bits=2,kivi' --windows 2 --json --plot " + svg);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["model"], "stories260K.bin");
  EXPECT_EQ(j["protocol"], "reuse");
  ASSERT_EQ(j.size(), 3u);
  const auto& rows = j["results"];
  ASSERT_EQ(rows.size(), 5u);  // fp16, q4_0, vq:bits=2, kivi:bits=2, kivi:bits=4
  std::vector<std::string> methods;
  for (const auto& row : rows) {
    ASSERT_EQ(row.size(), 7u) << row.dump();
    for (const char* key : {"method", "bits_per_element", "resident_bits_per_element", "delta_ppl_pct", "kl", "top1", "pareto"})
      EXPECT_TRUE(row.contains(key)) << key;
    EXPECT_GT(row["resident_bits_per_element"].get<double>(), 0.0) << row.dump();
    methods.push_back(row["method"]);
  }
  for (const char* m : {"fp16", "q4_0", "vq:bits=2", "kivi:bits=2", "kivi:bits=4"})
    EXPECT_NE(std::find(methods.begin(), methods.end(), m), methods.end()) << m;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (i > 0) {
      EXPECT_LE(rows[i - 1]["bits_per_element"].get<double>(), rows[i]["bits_per_element"].get<double>());
    }
    // Pareto on (bits, KL), recomputed from the numbers.
    bool dominated = false;
    for (const auto& other : rows) {
      const double b = other["bits_per_element"], k = other["kl"], b0 = rows[i]["bits_per_element"], k0 = rows[i]["kl"];
      dominated = dominated || (b <= b0 && k <= k0 && (b < b0 || k < k0));
    }
    EXPECT_EQ(rows[i]["pareto"].get<bool>(), !dominated) << rows[i].dump();
  }
  // Packed sizes as documented; fp16 exactly 16 bits, and ours the cheapest and on the frontier.
  for (const auto& row : rows) {
    if (row["method"] == "fp16") {
      EXPECT_DOUBLE_EQ(row["bits_per_element"].get<double>(), 16.0);
    }
    if (row["method"] == "q4_0") {
      EXPECT_DOUBLE_EQ(row["bits_per_element"].get<double>(), 4.5);
    }
  }
  EXPECT_EQ(rows[0]["method"], "vq:bits=2");
  EXPECT_TRUE(rows[0]["pareto"].get<bool>());
  EXPECT_NE(r.err.find("rd: 5 settings scored on 2 windows"), std::string::npos) << r.err;

  const std::string s = slurp(svg);
  ASSERT_FALSE(s.empty());
  EXPECT_EQ(s.rfind("<svg", 0), 0u);
  EXPECT_NE(s.find("</svg>"), std::string::npos);
  EXPECT_TRUE(well_formed(s));
  EXPECT_NE(s.find("bits per element"), std::string::npos);
  EXPECT_NE(s.find("KL"), std::string::npos);
  EXPECT_NE(s.find("<polyline"), std::string::npos);  // kivi's two points
  for (const char* legend : {">vq<", ">kivi<", ">q4_0<", ">fp16<"}) EXPECT_NE(s.find(legend), std::string::npos) << legend;
}

TEST(RdCli, TableMarksTheFrontier) {
  const auto r = rd("--methods 'q4_1;vq:bits=3' --windows 1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("bits/elem"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("pareto"), std::string::npos);
  EXPECT_NE(r.out.find("windows 1"), std::string::npos);
  const auto line = r.out.find("vq:bits=3");
  ASSERT_NE(line, std::string::npos);
  EXPECT_EQ(r.out.substr(line, r.out.find('\n', line) - line).back(), '*');
}

// Windows' settings run on threads side by side (--threads, default every core): the table must be
// the single-threaded one byte for byte, whatever the threads (3: more than this machine's cores,
// so tasks interleave; 0: the default). Methods whose caches quantise, code and keep state.
TEST(RdCli, ThreadsGiveTheSameTable) {
  const std::string methods = "--methods 'fp16;q4_0;kivi:bits=2;vq:bits=2;cachegen:bits=4,schedule=off' --windows 2";
  const auto one = rd(methods + " --threads 1");
  ASSERT_EQ(one.code, 0) << one.err;
  EXPECT_NE(one.out.find("vq:bits=2"), std::string::npos) << one.out;
  for (const char* t : {" --threads 3", ""}) {
    const auto many = rd(methods + t);
    ASSERT_EQ(many.code, 0) << many.err;
    EXPECT_EQ(many.out, one.out) << t;
  }
  const auto bad = rd("--methods fp16 --windows 1 --threads -1");
  EXPECT_EQ(bad.code, 2) << bad.err;
}

// The stream protocol ranks live caches by the memory they hold: sorted by, and Pareto on,
// (resident bits, KL); reuse (above) stays on coded bits.
TEST(RdCli, StreamParetoUsesResidentBits) {
  const std::string svg = vqtest::temp_dir() + "/rd_stream.svg";
  const auto r = rd("--methods 'fp32;fp16;q4_0;q8_0;kivi:bits=2;cachegen:bits=4,schedule=off' --protocol stream --window 64 --ctx 16 "
                    "--windows 2 --json --plot " + svg);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto rows = nlohmann::json::parse(r.out)["results"];
  ASSERT_EQ(rows.size(), 6u);
  bool orders_differ = false;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const double b0 = rows[i]["resident_bits_per_element"], k0 = rows[i]["kl"];
    if (i > 0) {
      EXPECT_LE(rows[i - 1]["resident_bits_per_element"].get<double>(), b0);
      orders_differ = orders_differ || rows[i - 1]["bits_per_element"].get<double>() > rows[i]["bits_per_element"].get<double>();
    }
    bool dominated = false;
    for (const auto& other : rows) {
      const double b = other["resident_bits_per_element"], k = other["kl"];
      dominated = dominated || (b <= b0 && k <= k0 && (b < b0 || k < k0));
    }
    EXPECT_EQ(rows[i]["pareto"].get<bool>(), !dominated) << rows[i].dump();
    if (rows[i]["method"] == "fp32") {
      EXPECT_GE(b0, 32.0);  // its buffers: 32 bits per element and spare capacity
      EXPECT_EQ(rows[i]["kl"].get<double>(), 0.0);
      EXPECT_TRUE(rows[i]["pareto"].get<bool>());  // nothing beats KL 0 at its memory or less
    }
  }
  // fp32 holds more than its 32 coded bits, so the resident order is not the coded one: the test
  // would not notice a sort on coded bits otherwise.
  EXPECT_TRUE(orders_differ) << r.out;
  const std::string s = slurp(svg);
  EXPECT_TRUE(well_formed(s));
  EXPECT_NE(s.find("resident bits per element"), std::string::npos);
}

TEST(RdCli, FamiliesExpandAndStreamWorks) {
  const auto r = rd("--methods kivi --protocol stream --window 64 --ctx 16 --windows 2 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["protocol"], "stream");
  ASSERT_EQ(j["results"].size(), 2u);
  EXPECT_EQ(j["results"][0]["method"], "kivi:bits=2");
  EXPECT_EQ(j["results"][1]["method"], "kivi:bits=4");
  // In a stream table the vq family brings its live (resident=coded) settings; in reuse it does not.
  const auto count_coded = [](const vqtest::CliRun& run) {
    int n = 0;
    const auto j = nlohmann::json::parse(run.out);  // named: a range-for over a temporary's member dangles
    for (const auto& row : j["results"])
      n += row["method"].get<std::string>().find("resident=coded") != std::string::npos;
    return n;
  };
  const auto stream = rd("--methods vq --protocol stream --window 64 --ctx 16 --windows 1 --json");
  ASSERT_EQ(stream.code, 0) << stream.err;
  EXPECT_EQ(count_coded(stream), 5);
  const auto reuse = rd("--methods vq --window 64 --ctx 16 --windows 1 --json");
  ASSERT_EQ(reuse.code, 0) << reuse.err;
  EXPECT_EQ(count_coded(reuse), 0);
}

// A setting that fails while it runs (here: a profile file that is not there) is a row with its
// error, last, off the frontier; every other row is scored as without it. eval does the same.
TEST(RdCli, AFailingSettingIsARowNotAnAbort) {
  const std::string methods = "--methods 'fp16;cachegen_paper:profile=/nonexistent/x.prof;vq:bits=2'";
  const auto r = rd("--windows 2 --json " + methods);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("rd: warning: 1 of 3 settings failed"), std::string::npos) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["results"].size(), 3u);
  const auto& failed = j["results"][2];
  EXPECT_EQ(failed["method"], "cachegen_paper:profile=/nonexistent/x.prof");
  EXPECT_NE(failed["error"].get<std::string>().find("/nonexistent/x.prof"), std::string::npos);
  EXPECT_TRUE(failed["kl"].is_null());
  EXPECT_FALSE(failed["pareto"].get<bool>());
  const auto alone = nlohmann::json::parse(rd("--windows 2 --json --methods 'fp16;vq:bits=2'").out);
  for (int i = 0; i < 2; ++i) {
    EXPECT_FALSE(j["results"][i].contains("error"));
    EXPECT_EQ(j["results"][i]["method"], alone["results"][i]["method"]);
    EXPECT_EQ(j["results"][i]["kl"], alone["results"][i]["kl"]);
    EXPECT_TRUE(j["results"][i]["pareto"].get<bool>());
  }
  const auto e = vqtest::run_cli("eval " + model_args() + " --protocol reuse --max-tokens 256 --json " + methods);
  ASSERT_EQ(e.code, 0) << e.err;
  EXPECT_NE(e.err.find("eval: warning: 1 of 3 methods failed"), std::string::npos) << e.err;
  const auto ej = nlohmann::json::parse(e.out);
  ASSERT_EQ(ej["results"].size(), 3u);
  EXPECT_TRUE(ej["results"][1]["ppl"].is_null());
  EXPECT_NE(ej["results"][1]["error"].get<std::string>().find("/nonexistent/x.prof"), std::string::npos);
  EXPECT_GT(ej["results"][2]["kl"].get<double>(), 0.0);
}

TEST(RdCli, BadInputIsOneClearLineAndANonzeroExit) {
  struct Case {
    std::string args, says;
  };
  const std::vector<Case> cases = {
      {"--methods nosuch --windows 1", "unknown method 'nosuch'"},
      {"--methods 'vq:bits=99' --windows 1", "bits=99"},
      {"--methods vq --protocol sideways", "unknown protocol 'sideways'"},
      {"--methods vq --windows 0", "--windows: must be an integer in 1..1048576"},
      {"--methods vq --ctx 600", "reuse needs 1 <= --ctx < --window"},
      {"--methods vq --plot /nonexistent/dir/rd.svg", "no such directory"},
      {"--methods vq --text /nonexistent.txt", "cannot open text /nonexistent.txt"},
      {"--methods vq --windows", "--windows"},
  };
  for (const auto& c : cases) {
    const auto r = rd(c.args);
    EXPECT_NE(r.code, 0) << c.args;
    EXPECT_NE(r.err.find(c.says), std::string::npos) << c.args << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << c.args << ": " << r.err;
    EXPECT_TRUE(r.out.empty()) << c.args;
  }
  const auto missing = vqtest::run_cli("rd --model /nonexistent/model.bin --methods vq");
  EXPECT_EQ(missing.code, 1);
  EXPECT_NE(missing.err.find("cannot open model"), std::string::npos) << missing.err;
}

}  // namespace
