// What the CLI does with the files it is given: outputs that are not regular files, links,
// permissions, two outputs on one file, racing writers, a full disk; inputs that are FIFOs or
// directories. Commands that could block on a FIFO run under `timeout` so that a regression fails
// instead of hanging the suite.
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <algorithm>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "../model/model_support.hpp"
#include "../support/file_mode.hpp"
#include "../support/test_util.hpp"
#include "veloxquant/core/npy.hpp"
#include "veloxquant/format/vqkv.hpp"

namespace fs = std::filesystem;

namespace {

std::string base() { return vqtest::temp_dir() + "/outputs_cli"; }
std::string p(const std::string& name) { return base() + "/" + name; }
vqtest::CliRun run(const std::string& args) { return vqtest::run_cli(args); }
std::string timeout_cli() { return std::string("timeout 20 ") + VQ_CLI_PATH + " "; }
std::string model_args() { return " --model " + vqtest::model_path() + " --tokenizer " + vqtest::tokenizer_path(); }

// Each command line fails with exit 1 and one line on stderr that says `says` (under a timeout, so
// a command that blocks on a FIFO fails instead of hanging the suite).
void expect_one_line_errors(const std::vector<std::pair<std::string, std::string>>& cases) {
  for (const auto& [args, says] : cases) {
    SCOPED_TRACE(args);
    const auto r = vqtest::run_shell(timeout_cli() + args);
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.err.find(says), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

using vqtest::mode_of;
// Names in a directory that look like a writer's temporary.
std::vector<std::string> temporaries(const std::string& d) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(d))
    if (e.path().filename().string().find(".tmp") != std::string::npos) out.push_back(e.path().filename().string());
  return out;
}
// A fresh directory for one test.
std::string fresh(const std::string& name) {
  const std::string d = p(name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

class OutputFilesCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    fs::remove_all(base());
    fs::create_directories(base());
    vq::write_npy(p("k.npy"), vqtest::random_walk({1, 2, 40, 8}, 1, vq::DType::F16));
    vq::write_npy(p("v.npy"), vqtest::random_walk({1, 2, 40, 8}, 2, vq::DType::F16));
    const auto r = vqtest::run_cli("compress --keys " + p("k.npy") + " --values " + p("v.npy") + " -o " + p("a.vqkv"));
    ASSERT_EQ(r.code, 0) << r.err;
  }
  static std::string compress_to(const std::string& out) {
    return "compress --keys " + p("k.npy") + " --values " + p("v.npy") + " -o " + out;
  }
};

TEST_F(OutputFilesCli, NonRegularOutputsAreRefusedAndLeftAsTheyWere) {
  const auto d = fresh("special");
  fs::create_directories(d + "/adir");
  ASSERT_EQ(::mkfifo((d + "/fifo").c_str(), 0644), 0);
  // A device node of our own where we may make one (root): the old writer replaced /dev/null so.
  const bool own_device = ::mknod((d + "/null").c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0;
  std::vector<std::pair<std::string, std::string>> cases = {
      {compress_to(d + "/adir"), "it is a directory, not a regular file"},
      {compress_to(d + "/fifo"), "it is a FIFO, not a regular file"},
      {"decompress " + p("a.vqkv") + " -o " + d + "/fifo", "it is a FIFO"},
      {"decompress " + p("a.vqkv") + " --keys-out " + d + "/fifo --values-out " + d + "/v.npy", "it is a FIFO"},
      {"synth --tokens 4 --keys-out " + d + "/k.npy --values-out " + d + "/adir", "it is a directory"},
      {"account --keys " + p("k.npy") + " --values " + p("v.npy") + " --recon-keys " + d + "/fifo", "it is a FIFO"},
      {"profile" + model_args() + " --tokens 300 -o " + d + "/fifo", "it is a FIFO"},
  };
  if (own_device) cases.push_back({compress_to(d + "/null"), "it is a character device, not a regular file"});
  expect_one_line_errors(cases);
  EXPECT_TRUE(fs::is_directory(d + "/adir"));
  EXPECT_TRUE(fs::is_empty(d + "/adir"));
  EXPECT_TRUE(S_ISFIFO(mode_of(d + "/fifo")));
  if (own_device) {
    EXPECT_TRUE(S_ISCHR(mode_of(d + "/null")));
  }
  EXPECT_EQ(temporaries(d), std::vector<std::string>{});
}

TEST_F(OutputFilesCli, LinkedAndPrivateOutputsKeepTheirLinkAndMode) {
  const auto d = fresh("links");
  fs::create_directories(d + "/store");
  for (const auto* name : {"a.vqkv", "k.npy", "s.safetensors"}) {
    vqtest::write_file(d + "/store/" + name, "old");
    ASSERT_EQ(::chmod((d + "/store/" + std::string(name)).c_str(), 0600), 0);
    fs::create_symlink(std::string("store/") + name, d + "/" + name);
  }
  ASSERT_EQ(run(compress_to(d + "/a.vqkv")).code, 0);
  ASSERT_EQ(run("decompress " + p("a.vqkv") + " --keys-out " + d + "/k.npy --values-out " + d + "/v.npy").code, 0);
  ASSERT_EQ(run("decompress " + p("a.vqkv") + " -o " + d + "/s.safetensors").code, 0);
  for (const auto* name : {"a.vqkv", "k.npy", "s.safetensors"}) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(S_ISLNK(mode_of(d + "/" + name)));
    EXPECT_EQ(mode_of(d + "/store/" + name) & 07777, 0600u);
    EXPECT_NE(vqtest::read_file(d + "/store/" + name), "old");
  }
  EXPECT_EQ(vq::load_prompt_cache(d + "/a.vqkv").caches.size(), 1u);
  EXPECT_EQ(vq::read_npy(d + "/k.npy").dim(2), 40);
  EXPECT_EQ(temporaries(d), std::vector<std::string>{});
  EXPECT_EQ(temporaries(d + "/store"), std::vector<std::string>{});
}

TEST_F(OutputFilesCli, TwoOutputsOnOneFileAreRefused) {
  const auto d = fresh("same");
  vqtest::write_file(d + "/real.npy", "old");
  fs::create_symlink("real.npy", d + "/alias.npy");
  fs::create_hard_link(d + "/real.npy", d + "/hard.npy");
  const std::string dec = "decompress " + p("a.vqkv");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {dec + " --keys-out " + d + "/x.npy --values-out " + d + "/x.npy", "--keys-out " + d + "/x.npy and --values-out"},
      {dec + " --keys-out " + d + "/x.npy --values-out " + d + "/./x.npy", "name the same file"},
      {dec + " --keys-out " + d + "/real.npy --values-out " + d + "/alias.npy", "name the same file"},
      {dec + " --keys-out " + d + "/real.npy --values-out " + d + "/hard.npy", "name the same file"},
      {"synth --tokens 4 --keys-out " + d + "/y.npy --values-out " + d + "/../same/y.npy", "name the same file"},
      {"account --keys " + p("k.npy") + " --values " + p("v.npy") + " --recon-keys " + d + "/z.npy --recon-values " + d + "/z.npy",
       "--recon-keys " + d + "/z.npy and --recon-values"},
  };
  expect_one_line_errors(cases);
  EXPECT_FALSE(fs::exists(d + "/x.npy"));
  EXPECT_FALSE(fs::exists(d + "/y.npy"));
  EXPECT_EQ(vqtest::read_file(d + "/real.npy"), "old");
}

TEST_F(OutputFilesCli, ConcurrentDecompressesToOnePathAllSucceed) {
  const auto d = fresh("race");
  std::string script;
  constexpr int kRuns = 4;
  for (int i = 0; i < kRuns; ++i)
    script += fmt::format("( {} decompress {} --keys-out {}/k.npy --values-out {}/v{}.npy; echo $? > {}/rc{} ) & ", VQ_CLI_PATH, p("a.vqkv"),
                          d, d, i, d, i);
  script += "wait";
  const auto r = vqtest::run_shell(script);
  ASSERT_EQ(r.code, 0) << r.err;
  for (int i = 0; i < kRuns; ++i) EXPECT_EQ(vqtest::read_file(fmt::format("{}/rc{}", d, i)), "0\n") << "run " << i << ": " << r.err;
  const auto want = vq::load_prompt_cache(p("a.vqkv")).caches[0]->state();
  EXPECT_TRUE(vq::read_npy(d + "/k.npy").bit_equal(want.keys.contiguous()));
  EXPECT_EQ(temporaries(d), std::vector<std::string>{});
}

// A full disk (here: a file size limit) fails the write and leaves the previous file whole; the
// plot and the profile were written in place and came out cut.
TEST_F(OutputFilesCli, AFailedWriteKeepsThePreviousFile) {
  const auto d = fresh("full");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"plot.svg", "rd" + model_args() + " --methods vq --windows 1 --plot " + d + "/plot.svg"},
      {"c.prof", "profile" + model_args() + " --tokens 300 -o " + d + "/c.prof"},
      {"a.vqkv", compress_to(d + "/a.vqkv")},
      {"k.npy", "synth --tokens 64 --keys-out " + d + "/k.npy --values-out " + d + "/v.npy"},
  };
  for (const auto& [file, args] : cases) {
    SCOPED_TRACE(args);
    vqtest::write_file(d + "/" + file, "the previous file");
    const auto r = vqtest::run_shell("trap '' XFSZ; ulimit -f 1; " + std::string(VQ_CLI_PATH) + " " + args + " > /dev/null");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.err.find("cannot write " + d + "/" + file + ": File too large"), std::string::npos) << r.err;
    EXPECT_EQ(vqtest::read_file(d + "/" + file), "the previous file");
  }
  EXPECT_EQ(temporaries(d), std::vector<std::string>{});
}

TEST_F(OutputFilesCli, FifoAndDirectoryInputsAreRefusedAtOnce) {
  const auto d = fresh("inputs");
  fs::create_directories(d + "/adir");
  ASSERT_EQ(::mkfifo((d + "/fifo").c_str(), 0644), 0);
  const std::string f = d + "/fifo";
  const std::string tok = " --tokenizer " + vqtest::tokenizer_path();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"compress --keys " + f + " --values " + p("v.npy") + " -o " + d + "/x.vqkv", "cannot read " + f + ": it is a FIFO, not a regular file"},
      {"compress --keys " + p("k.npy") + " --values " + f + " -o " + d + "/x.vqkv", "it is a FIFO"},
      {"compress --kv " + f + " -o " + d + "/x.vqkv", "it is a FIFO"},
      {"decompress " + f + " -o " + d + "/x.safetensors", "it is a FIFO"},
      {"inspect " + f, "it is a FIFO"},
      {"account --keys " + f + " --values " + p("v.npy"), "it is a FIFO"},
      {"compress --model " + d + "/adir" + tok + " --ctx 4 -o " + d + "/x.vqkv",
       "cannot read checkpoint " + d + "/adir: it is a directory, not a regular file"},
      {"compress --model " + f + tok + " --ctx 4 -o " + d + "/x.vqkv", "cannot read checkpoint " + f + ": it is a FIFO"},
      {"compress --model " + vqtest::model_path() + " --tokenizer " + f + " --ctx 4 -o " + d + "/x.vqkv", "cannot read tokenizer " + f},
      {"compress" + model_args() + " --text " + f + " --ctx 4 -o " + d + "/x.vqkv", "cannot read text " + f + ": it is a FIFO"},
      {"compress" + model_args() + " --text " + d + "/adir --ctx 4 -o " + d + "/x.vqkv", "it is a directory"},
      {"profile" + model_args() + " --text " + f + " -o " + d + "/x.prof", "cannot read text " + f},
      {"generate" + model_args() + " --steps 2 --method 'cachegen_paper:profile=" + f + "'", "cannot read cachegen_paper profile " + f},
  };
  expect_one_line_errors(cases);
  EXPECT_FALSE(fs::exists(d + "/x.vqkv"));
}

}  // namespace
