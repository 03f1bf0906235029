// `veloxquant demo` as a user runs it: the picture it draws carries the table it prints (each
// method's coded bits and KL in the SVG's tooltips), so the rings mark the frontier of the right
// columns. A positional Point once put top-1 agreement where KL belongs.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "../model/model_support.hpp"
#include "../support/test_util.hpp"

namespace {

TEST(DemoCli, ThePictureCarriesTheTablesNumbers) {
  const std::string svg = vqtest::temp_dir() + "/demo-cli-test.svg";
  std::filesystem::remove(svg);
  const auto r = vqtest::run_cli(fmt::format("demo --model '{}' --tokenizer '{}' --windows 2 --plot '{}'", vqtest::model_path(),
                                             vqtest::tokenizer_path(), svg));
  ASSERT_EQ(r.code, 0) << r.err;
  std::ifstream in(svg);
  ASSERT_TRUE(in.good()) << svg;
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string picture = ss.str();
  // The table's rows: method, coded, resident, x fp16, dPPL %, KL, top-1, what.
  std::istringstream table(r.out);
  std::string line;
  int checked = 0;
  while (std::getline(table, line)) {
    std::istringstream row(line);
    std::string method, coded, resident, x, dppl, kl;
    if (!(row >> method >> coded >> resident >> x >> dppl >> kl)) continue;
    if (method.find(':') == std::string::npos && method != "fp16" && method != "q8_0" && method != "q4_0" && method != "fp8") continue;
    static const std::regex number(R"(^[0-9]\.[0-9]{3}e[-+][0-9]+$)");
    if (!std::regex_match(kl, number) || std::stod(kl) <= 0) continue;  // not a row, or the exact cache (not drawn)
    const std::string tip = fmt::format("<title>{}: {} bits, KL {}</title>", method, coded, kl);
    EXPECT_NE(picture.find(tip), std::string::npos) << tip << "\n" << picture.substr(0, 2000);
    ++checked;
  }
  EXPECT_GE(checked, 5) << r.out;
  std::filesystem::remove(svg);
}

}  // namespace
