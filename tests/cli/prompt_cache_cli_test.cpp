// `veloxquant prompt-cache`'s bad input: each is one clear line and exit 1 before anything listens
// (a missing model, an upstream that is not http://HOST:PORT, a slot folder that is not one, a
// server that does not answer, a bad listen address or level). Its work with a real llama-server:
// tests/llama/server_prompt_cache.mjs.
#include <string>

#include <gtest/gtest.h>

#include "../model/model_support.hpp"
#include "../support/test_util.hpp"

namespace {

TEST(PromptCacheCli, BadInputIsOneClearLineAndExitOne) {
  if (vqtest::run_cli("prompt-cache --help").code != 0) GTEST_SKIP() << "built without cpp-httplib: no prompt-cache command";
  const std::string dir = vqtest::temp_dir();
  const std::string gguf = dir + "/pc_model.gguf";
  ASSERT_EQ(vqtest::run_cli("convert " + vqtest::model_path() + " --tokenizer " + vqtest::tokenizer_path() + " -o " + gguf).code, 0);
  // A port nothing listens on: a listener's free port, closed (the OS does not hand it out again at once).
  const std::string dead = "http://127.0.0.1:1";
  const struct {
    std::string args, fragment;
  } cases[] = {
      {"--upstream " + dead + " --model " + dir + "/missing.gguf --slot-dir " + dir, "cannot open model"},
      {"--upstream ftp://127.0.0.1:8080 --model " + gguf + " --slot-dir " + dir, "give the llama-server as http://HOST:PORT"},
      {"--upstream http://127.0.0.1:99999 --model " + gguf + " --slot-dir " + dir, "is not in 1..65535"},
      {"--upstream " + dead + " --model " + gguf + " --slot-dir " + dir + "/nope", "not a directory"},
      {"--upstream " + dead + " --model " + gguf + " --slot-dir " + dir + " --levels vq:bits=99", "bits=99"},
      {"--upstream " + dead + " --model " + gguf + " --slot-dir " + dir + " --levels ';'", "give at least one method spec (or auto)"},
      {"--upstream " + dead + " --model " + gguf + " --slot-dir " + dir + " --levels vq:block=head,profile=" + dir + "/p.vqprof", "block=head does not apply"},
      {"--upstream " + dead + " --model " + gguf + " --slot-dir " + dir + " --listen nowhere", "give it as HOST:PORT"},
      {"--upstream " + dead + " --model " + gguf + " --slot-dir " + dir, "POST /completion failed"},
  };
  for (const auto& c : cases) {
    const auto r = vqtest::run_cli("prompt-cache " + c.args);
    SCOPED_TRACE(c.args);
    EXPECT_EQ(r.code, 1) << r.err;
    EXPECT_NE(r.err.find(c.fragment), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line: " << r.err;
    EXPECT_EQ(r.out, "") << "nothing listened";
  }
  // Slot counts out of range are usage errors (exit 2) naming the option; nothing listens.
  for (const char* slots : {"0", "1025", "two"}) {
    const auto r = vqtest::run_cli("prompt-cache --upstream " + dead + " --model " + gguf + " --slot-dir " + dir + " --slots " + slots);
    SCOPED_TRACE(slots);
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_NE(r.err.find("--slots"), std::string::npos) << r.err;
    EXPECT_EQ(r.out, "");
  }
}

// bench prompt-cache's bad input: a prompt longer than the model's context is refused before any
// server starts; a llama-server that cannot start, or a --slot-dir that is not a directory, is one
// line naming it.
TEST(PromptCacheCli, BenchBadInputIsOneClearLineAndExitOne) {
  if (vqtest::run_cli("prompt-cache --help").code != 0) GTEST_SKIP() << "built without cpp-httplib: no prompt-cache command";
  const std::string env = "VELOXQUANT_MODEL_DIR=" + vqtest::models_dir() + " " + std::string(VQ_CLI_PATH);
  const struct {
    std::string args, fragment;
  } cases[] = {
      {"bench prompt-cache --tokens 100000 --stores file:auto", "--tokens 100000: the model's context is 512 tokens"},
      {"bench prompt-cache --llama-server " + vqtest::temp_dir() + "/no-such-llama-server --stores file:auto --rounds 1",
       "no-such-llama-server: cannot start (not found, or not executable)"},
      {"bench prompt-cache --slot-dir " + vqtest::temp_dir() + "/no-such-slot-dir --stores file:auto --rounds 1",
       "no-such-slot-dir: not a directory"},
  };
  for (const auto& c : cases) {
    const auto r = vqtest::run_shell(env + " " + c.args);
    SCOPED_TRACE(c.args);
    EXPECT_EQ(r.code, 1) << r.err;
    EXPECT_NE(r.err.find(c.fragment), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("veloxquant: error: "), std::string::npos) << r.err;
    EXPECT_EQ(r.out, "");
  }
}

}  // namespace
