// `veloxquant generate` as a user runs it.
#include <array>
#include <cstdio>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "../support/test_util.hpp"
#include "model_support.hpp"

namespace {

using vqtest::CliRun;

CliRun run_generate(const std::string& args) { return vqtest::run_cli("generate " + args); }

std::string model_args() { return "--model '" + vqtest::model_path() + "' --tokenizer '" + vqtest::tokenizer_path() + "'"; }

TEST(GenerateCli, GreedyPrintsTheLlama2cSample) {
  const CliRun r = run_generate(model_args() + " --temperature 0");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, vqtest::expected_greedy_sample());
}

// stderr: the caches' peak resident bytes beside what fp16 would hold for the same tokens.
TEST(GenerateCli, PrintsPeakResidentBytesBesideFp16) {
  auto peak_line = [](const std::string& err, std::size_t& peak, std::size_t& fp16, std::size_t& tokens) {
    const auto at = err.find("kv cache: peak resident ");
    if (at == std::string::npos) return false;
    char method[128] = {0};
    return std::sscanf(err.c_str() + at, "kv cache: peak resident %zu bytes (%127[^)]); fp16 would hold %zu bytes for the same %zu tokens",
                       &peak, method, &fp16, &tokens) == 4;
  };
  std::size_t peak = 0, fp16 = 0, tokens = 0;
  const CliRun r = run_generate(model_args() + " --temperature 0");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, vqtest::expected_greedy_sample());  // the line goes to stderr only
  ASSERT_TRUE(peak_line(r.err, peak, fp16, tokens)) << r.err;
  EXPECT_EQ(tokens, 256u);
  EXPECT_EQ(fp16, 5u * 4 * 256 * (8 + 8) * 2);  // layers x KV heads x tokens x (D_k + D_v) x 2 bytes
  // fp32 grows by doubling from one token: 256 tokens of capacity at the end, twice fp16's bytes.
  EXPECT_EQ(peak, 2 * fp16);
  // A quantizing resident cache holds less than fp16 would.
  const CliRun q = run_generate(model_args() + " --temperature 0 --steps 100 --method q4_0");
  ASSERT_EQ(q.code, 0) << q.err;
  ASSERT_TRUE(peak_line(q.err, peak, fp16, tokens)) << q.err;
  EXPECT_LE(tokens, 100u);  // fewer if the model ends the story early
  EXPECT_GT(tokens, 10u);
  EXPECT_EQ(fp16, 5u * 4 * tokens * (8 + 8) * 2);
  EXPECT_GT(peak, 0u);
  EXPECT_LT(peak, fp16);
}

TEST(GenerateCli, FindsModelsThroughEnvironment) {
  const std::string cmd = "VELOXQUANT_MODEL_DIR='" + vqtest::models_dir() + "' " + std::string(VQ_CLI_PATH) +
                          " generate --temperature 0 --steps 20";
  FILE* p = popen(cmd.c_str(), "r");
  std::array<char, 4096> buf{};
  std::string out;
  std::size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  EXPECT_EQ(pclose(p), 0);
  EXPECT_EQ(out, vqtest::expected_greedy_sample().substr(0, out.size() - 1) + "\n");
  EXPECT_GT(out.size(), 40u);
}

TEST(GenerateCli, SamplingIsReproducibleWithASeed) {
  const CliRun a = run_generate(model_args() + " --temperature 1 --seed 42 --steps 60 --method cachegen:bits=4,flush=group_aligned");
  const CliRun b = run_generate(model_args() + " --temperature 1 --seed 42 --steps 60 --method cachegen:bits=4,flush=group_aligned");
  EXPECT_EQ(a.code, 0) << a.err;
  EXPECT_EQ(a.out, b.out);
  EXPECT_GT(a.out.size(), 20u);
}

TEST(GenerateCli, PromptAndMethods) {
  for (const char* method : {"fp32", "fp16", "cachegen", "cachegen:bits=2,group=8,flush=per_call,delta=0,schedule=off"}) {
    const CliRun r = run_generate(model_args() + " --temperature 0 --steps 30 --prompt 'Once upon a time' --method '" + method + "'");
    EXPECT_EQ(r.code, 0) << method << ": " << r.err;
    EXPECT_EQ(r.out.rfind("Once upon a time", 0), 0u) << r.out;
  }
}

TEST(GenerateCli, ClearErrors) {
  CliRun r = run_generate(model_args() + " --method cachegen:bits=4,colour=blue");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("unknown key 'colour'"), std::string::npos) << r.err;
  r = run_generate("--model /nonexistent/m.bin --tokenizer '" + vqtest::tokenizer_path() + "'");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("cannot open checkpoint /nonexistent/m.bin"), std::string::npos) << r.err;
  r = run_generate(model_args() + " --steps 0");
  EXPECT_EQ(r.code, 2);  // refused while parsing, before the model is loaded
  EXPECT_NE(r.err.find("--steps: must be an integer >=1"), std::string::npos) << r.err;
}

}  // namespace
