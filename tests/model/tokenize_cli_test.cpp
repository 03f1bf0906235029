// `veloxquant tokenize` prints the ids of the project's tokenizer (the ones eval and generate use;
// tests/llama compares them with llama.cpp's), and `generate --json` lists the ids it ran.
#include <algorithm>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../support/test_util.hpp"
#include "model_support.hpp"
#include "veloxquant/model/tokenizer.hpp"

namespace {

std::string model_args() { return "--model '" + vqtest::model_path() + "' --tokenizer '" + vqtest::tokenizer_path() + "'"; }

const vq::Tokenizer& tokenizer() {
  static const vq::Tokenizer tok = vq::Tokenizer::load(vqtest::tokenizer_path(), 512);
  return tok;
}

std::vector<int> ids_of_line(const std::string& out) {
  std::istringstream in(out);
  std::vector<int> ids;
  for (int id; in >> id;) ids.push_back(id);
  return ids;
}

TEST(TokenizeCli, PromptIdsAreTheTokenizersOnOneLine) {
  const std::string prompt = "Once upon a time, Lily saw a big red ball.";
  auto r = vqtest::run_cli("tokenize " + model_args() + " --prompt '" + prompt + "'");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  EXPECT_EQ(ids_of_line(r.out), tokenizer().encode(prompt, /*bos=*/false));
  r = vqtest::run_cli("tokenize " + model_args() + " --prompt '" + prompt + "' --bos");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto with_bos = ids_of_line(r.out);
  ASSERT_FALSE(with_bos.empty());
  EXPECT_EQ(with_bos.front(), vq::Tokenizer::kBos);
  EXPECT_EQ(with_bos, tokenizer().encode(prompt, /*bos=*/true));
}

TEST(TokenizeCli, TextFileAsJsonAndFromTheGgufVocabulary) {
  const std::string dir = vqtest::temp_dir() + "/tokenize_cli";
  std::filesystem::create_directories(dir);
  const std::string val = vqtest::read_file(vqtest::models_dir() + "/tinystories_val.txt");
  const std::string text = val.substr(0, 20000);  // cut mid-story: any bytes are text
  vqtest::write_file(dir + "/t.txt", text);
  const std::vector<int> want = tokenizer().encode(text, /*bos=*/false);
  auto r = vqtest::run_cli("tokenize " + model_args() + " --text " + dir + "/t.txt --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("tokens").get<std::vector<int>>(), want);
  EXPECT_EQ(j.at("count").get<std::size_t>(), want.size());
  // A GGUF model carries its vocabulary: no tokenizer file, the same ids.
  r = vqtest::run_cli("convert " + vqtest::model_path() + " --tokenizer " + vqtest::tokenizer_path() + " -o " + dir + "/m.gguf");
  ASSERT_EQ(r.code, 0) << r.err;
  r = vqtest::run_cli("tokenize --model " + dir + "/m.gguf --text " + dir + "/t.txt");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(ids_of_line(r.out), want);
}

TEST(TokenizeCli, BadInputIsOneLineAndNonzero) {
  auto r = vqtest::run_cli("tokenize " + model_args());  // no text
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(r.err, "veloxquant: error: give the text to tokenize: --text FILE or --prompt TEXT\n");
  EXPECT_EQ(r.out, "");
  r = vqtest::run_cli("tokenize " + model_args() + " --prompt a --text /dev/null");  // both
  EXPECT_EQ(r.code, 2) << r.err;
  r = vqtest::run_cli("tokenize " + model_args() + " --text " + vqtest::temp_dir() + "/no_such_text.txt");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("no_such_text.txt"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  r = vqtest::run_cli("tokenize --model " + vqtest::temp_dir() + "/no_such_model.bin --prompt a");
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST(GenerateCli, JsonListsTheIdsItRan) {
  const std::string prompt = "The little dog";
  const auto r = vqtest::run_cli("generate " + model_args() + " --prompt '" + prompt + "' --temperature 0 --steps 40 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  const auto ids = j.at("tokens").get<std::vector<int>>();
  const auto prompt_ids = tokenizer().encode(prompt, /*bos=*/true);
  ASSERT_GT(ids.size(), prompt_ids.size());
  EXPECT_LE(ids.size(), 41u);  // 40 positions run, the token sampled at the last kept
  EXPECT_TRUE(std::equal(prompt_ids.begin(), prompt_ids.end(), ids.begin()));
  EXPECT_EQ(j.at("text").get<std::string>(), tokenizer().decode(ids));
}

}  // namespace
