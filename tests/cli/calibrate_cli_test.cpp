// `veloxquant calibrate` as a user runs it with our engine (the llama.cpp engine: tests/llama/
// engines.mjs): a profile fitted on stories260K's K/V over text the evaluation does not score, used
// by `eval` as `vq:...,profile=PATH`, and refused for another model; `eval --prefill exact`.
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../support/test_util.hpp"

namespace {

std::string models() { return std::string(VQ_SOURCE_DIR) + "/../shared/models"; }
std::string model_args(const char* model = "stories260K.bin") {
  return "--model " + models() + "/" + model + " --tokenizer " + models() + "/tok512.bin --text " + models() + "/tinystories_val.txt";
}

// KL of each method in eval's reuse protocol with an exact prefill (10 windows, ctx 256).
std::map<std::string, double> kl_of(const std::string& methods) {
  const auto r = vqtest::run_cli("eval " + model_args() + " --protocol reuse --prefill exact --ctx 256 --window 512 --max-tokens 2560 --json --methods '" +
                                 methods + "'");
  EXPECT_EQ(r.code, 0) << r.err;
  std::map<std::string, double> out;
  const nlohmann::json j = nlohmann::json::parse(r.out);  // named: a range-for over a temporary's member dangles
  for (const auto& row : j.at("results")) out[row.at("method").get<std::string>()] = row.at("kl").get<double>();
  return out;
}

TEST(CalibrateCli, AProfileGivesVqABasisWithoutWeightsAndOnlyForItsModel) {
  const std::string prof = vqtest::temp_dir() + "/s260.vqprof";
  // Calibration text after the first 30,000 tokens: eval scores the first 10 windows (~5,100 tokens).
  const auto c = vqtest::run_cli("calibrate " + model_args() + " --skip 30000 --tokens 4096 -o " + prof);
  ASSERT_EQ(c.code, 0) << c.err;
  EXPECT_NE(c.out.find("wrote " + prof + ": 5 layers x 4 KV heads x 8, keys with RoPE undone"), std::string::npos) << c.out;
  const std::string p = "profile=" + prof;
  const auto kl = kl_of("vq:bits=2,basis=identity;vq:bits=2," + p + ";vq:bits=1,basis=identity;vq:bits=1," + p);
  // Fitted axes beat no transform by a wide margin (KL 5.4x lower at bits=2, 10.7x at bits=1 over
  // 40 windows: docs/quality.md, "Calibrated profiles"); asserted at 2x on this test's few windows.
  EXPECT_LT(kl.at("vq:bits=2," + p) * 2, kl.at("vq:bits=2,basis=identity"));
  EXPECT_LT(kl.at("vq:bits=1," + p) * 2, kl.at("vq:bits=1,basis=identity"));

  // Another model (same tokenizer, another file): refused with one line before any scoring.
  const auto other = vqtest::run_cli("eval " + model_args("stories3M-h64.bin") + " --protocol reuse --max-tokens 256 --methods 'vq:bits=2," + p + "'");
  EXPECT_NE(other.code, 0);
  EXPECT_NE(other.err.find(prof + " was calibrated on another model file"), std::string::npos) << other.err;
  EXPECT_EQ(other.out, "");
  // A damaged profile: one line naming it.
  vqtest::spit(prof, vqtest::slurp(prof).substr(0, 100));
  const auto cut = vqtest::run_cli("eval " + model_args() + " --protocol reuse --max-tokens 256 --methods 'vq:bits=2," + p + "'");
  EXPECT_NE(cut.code, 0);
  EXPECT_NE(cut.err.find(prof + ": vq profile: "), std::string::npos) << cut.err;
}

TEST(CalibrateCli, BadInputIsOneClearLine) {
  const std::string out = vqtest::temp_dir() + "/x.vqprof";
  for (const auto& [args, says] : std::vector<std::pair<std::string, std::string>>{
           {"--engine bogus", "--engine bogus: give ours or llama"},
           {"--engine llama", "--engine llama: give the GGUF file"},
           {"--skip 100000000", "none left for a window"},
           {"--window 100000", "--window must be in 2..512"},
       }) {
    const auto r = vqtest::run_cli("calibrate " + model_args() + " -o " + out + " " + args);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_NE(r.err.find(says), std::string::npos) << args << ": " << r.err;
  }
  const auto missing = vqtest::run_cli("calibrate --model /nonexistent/m.gguf -o " + out);
  EXPECT_NE(missing.code, 0);
  EXPECT_NE(missing.err.find("/nonexistent/m.gguf: cannot open model"), std::string::npos) << missing.err;
  // --prefill is eval's reuse protocol only.
  const auto stream = vqtest::run_cli("eval " + model_args() + " --protocol stream --prefill exact --max-tokens 64");
  EXPECT_NE(stream.code, 0);
  EXPECT_NE(stream.err.find("--prefill exact needs --protocol reuse"), std::string::npos) << stream.err;
  const auto bogus = vqtest::run_cli("eval " + model_args() + " --protocol reuse --prefill sideways --max-tokens 64");
  EXPECT_NE(bogus.code, 0);
  EXPECT_NE(bogus.err.find("--prefill sideways: give exact or method"), std::string::npos) << bogus.err;
}

}  // namespace
