// Every command answers --help with exit 0: its usage line, options (with defaults), a synopsis, an
// example that runs the command itself, and the exit codes. The command list is read from
// `veloxquant --help`, so a new command is checked without editing this test. Usage errors exit 2.
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "../support/test_util.hpp"

namespace {

// The names listed under "Subcommands:" of a --help text.
std::vector<std::string> subcommands(const std::string& help) {
  std::vector<std::string> names;
  const auto at = help.find("Subcommands:\n");
  if (at == std::string::npos) return names;
  const std::regex line(R"(^  ([a-z][a-z0-9_-]*) )");
  std::size_t pos = at + 13;
  while (pos < help.size() && help[pos] != '\n') {
    const auto end = help.find('\n', pos);
    const std::string l = help.substr(pos, end - pos);
    std::smatch m;
    if (std::regex_search(l, m, line)) names.push_back(m[1]);
    pos = end == std::string::npos ? help.size() : end + 1;
  }
  return names;
}

void expect_full_help(const std::string& command) {
  SCOPED_TRACE(command);
  const auto r = vqtest::run_cli(command + " --help");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_NE(r.out.find("Usage: veloxquant " + command), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Options:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Synopsis:\n  veloxquant " + command), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Example:\n  veloxquant " + command.substr(0, command.find(' '))), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Exit codes: 0 success; 1 bad input"), std::string::npos) << r.out;
}

TEST(HelpCli, EveryCommandHasSynopsisExampleAndExitCodes) {
  const auto top = vqtest::run_cli("--help");
  ASSERT_EQ(top.code, 0);
  EXPECT_NE(top.out.find("Example:\n  veloxquant demo"), std::string::npos) << top.out;
  const auto commands = subcommands(top.out);
  ASSERT_GE(commands.size(), 11u) << top.out;  // demo, eval, rd, ... at least the documented ones
  for (const auto& c : commands) {
    expect_full_help(c);
    // Nested commands (bench codec, bench attention) too.
    for (const auto& sub : subcommands(vqtest::run_cli(c + " --help").out)) expect_full_help(c + " " + sub);
  }
}

TEST(HelpCli, DefaultsAreShown) {
  const auto r = vqtest::run_cli("eval --help");
  EXPECT_NE(r.out.find("--window INT:[>=2]=256"), std::string::npos) << r.out;
  const auto d = vqtest::run_cli("demo --help");
  EXPECT_NE(d.out.find("=veloxquant_demo_rd.svg"), std::string::npos) << d.out;
  EXPECT_NE(d.out.find("--windows INT:[1..1048576]=16"), std::string::npos) << d.out;
}

TEST(HelpCli, UsageErrorsExitTwo) {
  for (const char* args : {"", "nosuch", "eval --no-such-option", "demo --windows 0", "rd --window abc", "bench",
                           "inspect", "synth --keys-out"}) {
    SCOPED_TRACE(args);
    const auto r = vqtest::run_cli(args);
    EXPECT_EQ(r.code, 2) << r.out << r.err;
    EXPECT_NE(r.err.find("veloxquant: error: "), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line: " << r.err;
  }
}

// A missing input is bad input (1) whether CLI11's file check or the library finds it.
TEST(HelpCli, BadInputExitsOne) {
  for (const char* args : {"inspect /nonexistent/x.vqkv", "account --keys /nonexistent/k.npy --values /nonexistent/v.npy",
                           "eval --model /nonexistent/m.bin"}) {
    SCOPED_TRACE(args);
    const auto r = vqtest::run_cli(args);
    EXPECT_EQ(r.code, 1) << r.err;
    EXPECT_NE(r.err.find("veloxquant: error: "), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line: " << r.err;
  }
}

}  // namespace
