// `veloxquant methods`: the method table as text and JSON, the same as the library's table, and
// docs/methods.md quoting the text exactly (so the docs cannot drift from the keys the parser takes).
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "veloxquant/methods/method_table.hpp"
#include "../support/test_util.hpp"

namespace {

TEST(MethodsCli, TextIsTheTablesText) {
  const auto r = vqtest::run_cli("methods");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, vq::methods_text());
}

TEST(MethodsCli, JsonListsEveryRowWithItsKeys) {
  const auto r = vqtest::run_cli("methods --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  const auto& rows = vq::method_table();
  ASSERT_EQ(j.at("methods").size(), rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto& m = j["methods"][i];
    EXPECT_EQ(m.at("name"), rows[i].name);
    EXPECT_EQ(m.at("usage"), vq::method_usage(rows[i]));
    EXPECT_EQ(m.at("family"), vq::method_family_name(rows[i].family));
    EXPECT_EQ(m.at("keys").size(), rows[i].keys.size());
    EXPECT_EQ(m.at("canonical_default"), vq::MethodSpec::parse(rows[i].name).to_string());
    // What a report would run from this row parses.
    for (const auto& s : m.at("rd")) EXPECT_NO_THROW(vq::MethodSpec::parse(s.get<std::string>())) << s;
  }
}

TEST(MethodsCli, SpecTakingCommandsListTheMethodsInTheirHelp) {
  for (const char* command : {"eval", "rd", "generate", "compress", "bench attention"}) {
    const auto r = vqtest::run_cli(std::string(command) + " --help");
    SCOPED_TRACE(command);
    ASSERT_EQ(r.code, 0);
    for (const auto& row : vq::method_table()) EXPECT_NE(r.out.find("  " + vq::method_usage(row) + "\n"), std::string::npos) << row.name;
  }
}

TEST(MethodsCli, DocsQuoteTheTable) {
  const std::string docs = vqtest::slurp(std::string(VQ_SOURCE_DIR) + "/docs/methods.md");
  EXPECT_NE(docs.find("```\n" + vq::methods_text() + "```\n"), std::string::npos)
      << "docs/methods.md, \"The table\": paste the output of `veloxquant methods` there";
}

}  // namespace
