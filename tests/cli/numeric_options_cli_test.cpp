// Every numeric option of every subcommand is range-checked when the command line is parsed: an
// empty string, nan/inf, a value out of range or one that overflows is one line and exit 2, before
// anything is loaded. And sizes no buffer can hold are a clear error (exit 1), never "internal".
#include <algorithm>
#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "veloxquant/core/npy.hpp"
#include "../support/test_util.hpp"

namespace {

std::string p(const std::string& name) { return vqtest::temp_dir() + "/" + name; }

void expect_one_line_error(const vqtest::CliRun& r, int code, const std::string& needle, const std::string& args) {
  EXPECT_EQ(r.code, code) << args << " -> " << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << args << " -> " << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << " -> " << r.err;
  EXPECT_EQ(r.err.rfind("veloxquant: error: ", 0), 0u) << args << " -> " << r.err;
  EXPECT_EQ(r.err.find("internal error"), std::string::npos) << args << " -> " << r.err;
}

class NumericOptionsCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    vq::write_npy(p("nk.npy"), vqtest::random_walk({1, 2, 40, 8}, 1, vq::DType::F16));
    vq::write_npy(p("nv.npy"), vqtest::random_walk({1, 2, 40, 8}, 2, vq::DType::F16));
  }
};

TEST_F(NumericOptionsCli, BadNumbersAreRefusedAtParseTime) {
  const std::string kv = " --keys " + p("nk.npy") + " --values " + p("nv.npy");
  const std::string synth = "synth --keys-out " + p("never_k.npy") + " --values-out " + p("never_v.npy");
  const std::string compress = "compress" + kv + " -o " + p("never.vqkv");
  // {command line, the option named in the error}
  const std::vector<std::pair<std::string, std::string>> cases = {
      // empty strings once parsed as 0
      {"generate --steps ''", "--steps"},
      {"generate --seed ''", "--seed"},
      {"eval --max-tokens ''", "--max-tokens"},
      {"eval --ctx ''", "--ctx"},
      {"rd --windows ''", "--windows"},
      {"profile --skip ''", "--skip"},
      {"account" + kv + " --chunk ''", "--chunk"},
      {"account" + kv + " --group-size ''", "--group-size"},
      {synth + " --tokens ''", "--tokens"},
      {synth + " --batch ''", "--batch"},
      {compress + " --chunk ''", "--chunk"},
      {compress + " --bits ''", "--bits"},
      {"decompress " + p("nk.npy") + " --layer ''", "--layer"},
      {"bench codec --synthetic --bits ''", "--bits"},
      // nan and inf where no such value means anything
      {"generate --topp nan", "--topp"},
      {"generate --topp inf", "--topp"},
      {"generate --temperature nan", "--temperature"},
      {"generate --temperature -inf", "--temperature"},
      {"generate --temperature -0.5", "--temperature"},
      {synth + " --seed nan", "--seed"},
      // out of range, overflowing, or not a plain decimal integer
      {"eval --max-tokens 9223372036854775807", "--max-tokens"},
      {"eval --max-tokens 9223372036854775000", "--max-tokens"},
      {"eval --max-tokens 99999999999999999999", "--max-tokens"},
      {"eval --max-tokens -1", "--max-tokens"},
      {"eval --window 1", "--window"},
      {"eval --chunk 0", "--chunk"},
      {"generate --steps 0", "--steps"},
      {"generate --steps 2147483648", "--steps"},
      {"generate --steps 0x10", "--steps"},
      {"generate --steps 1e3", "--steps"},
      {"generate --steps ' 5'", "--steps"},
      {"generate --seed -1", "--seed"},
      {"generate --seed 18446744073709551616", "--seed"},
      {"rd --windows 0", "--windows"},
      {"rd --ctx -1", "--ctx"},
      {"profile --tokens 0", "--tokens"},
      {"profile --tokens 9223372036854775807", "--tokens"},
      {"profile --window 1", "--window"},
      {"bench codec --synthetic --windows 0", "--windows"},
      {"bench codec --synthetic --bits 9", "--bits"},
      {synth + " --tokens 9223372036854775807", "--tokens"},
      {synth + " --heads 0", "--heads"},
      {synth + " --head-dim -2", "--head-dim"},
      {compress + " --chunk-tokens 0", "--chunk-tokens"},
      {compress + " --group-size 0", "--group-size"},
      {compress + " --chunk -1", "--chunk"},
      {"compress --ctx 0 -o " + p("never.vqkv"), "--ctx"},
      {"decompress " + p("nk.npy") + " --layer -1", "--layer"},
      {"account" + kv + " --bits 1.5", "--bits"},
  };
  for (const auto& [args, option] : cases) expect_one_line_error(vqtest::run_cli(args), 2, option, args);
  EXPECT_FALSE(std::ifstream(p("never_k.npy")).good());
  EXPECT_FALSE(std::ifstream(p("never.vqkv")).good());
}

// What the check accepts is the number CLI11 then stores: a leading zero is decimal (CLI11 alone
// reads "010" as octal 8), and a leading '+' is allowed.
TEST_F(NumericOptionsCli, AcceptedNumbersAreReadAsDecimal) {
  const auto r = vqtest::run_cli("synth --keys-out " + p("ok_k.npy") + " --values-out " + p("ok_v.npy") +
                                 " --tokens 010 --heads +2 --head-dim 08 --seed 007");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(vq::read_npy(p("ok_k.npy")).shape(), (vq::Shape4{1, 2, 10, 8}));
}

// Sizes no buffer can hold once reached std::vector and came out as "internal error: cannot create
// std::vector larger than max_size()" (exit 3). They are refused, exit 1, before allocating.
TEST_F(NumericOptionsCli, ImpossibleSizesAreAClearErrorNotAnInternalOne) {
  // synth: each option in range, the shape [1, 8, 2^40, 128] is not
  const std::string synth = "synth --keys-out " + p("huge_k.npy") + " --values-out " + p("huge_v.npy");
  std::string args = synth + " --tokens 1099511627776";
  expect_one_line_error(vqtest::run_cli(args), 1, "too large", args);
  args = synth + " --batch 1099511627776 --heads 1099511627776 --tokens 0 --head-dim 4";
  expect_one_line_error(vqtest::run_cli(args), 1, "too large", args);
  EXPECT_FALSE(std::ifstream(p("huge_k.npy")).good());

  // account: a 128-byte .npy of shape [1, 1, 0, 999999999999] (no data, an absurd head dim)
  {
    const std::string header = "{'descr': '<f2', 'fortran_order': False, 'shape': (1, 1, 0, 999999999999), }";
    std::string padded = header + std::string(117 - header.size(), ' ') + "\n";
    std::ofstream f(p("wide.npy"), std::ios::binary);
    f << "\x93NUMPY" << '\x01' << '\x00' << static_cast<char>(padded.size()) << '\x00' << padded;
  }
  args = "account --keys " + p("wide.npy") + " --values " + p("wide.npy");
  expect_one_line_error(vqtest::run_cli(args), 1, "head dim", args);
  args = "compress --keys " + p("wide.npy") + " --values " + p("wide.npy") + " -o " + p("never.vqkv");
  expect_one_line_error(vqtest::run_cli(args), 1, "head dim", args);
}

}  // namespace
