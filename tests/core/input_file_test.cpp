// InputFile: every reader opens its file through it; only regular files (or links to them) pass,
// and a FIFO is refused at once instead of blocking the reader.
#include "veloxquant/core/input_file.hpp"

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include <gtest/gtest.h>

#include "../support/test_util.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/core/npy.hpp"
#include "veloxquant/format/safetensors.hpp"
#include "veloxquant/format/vqkv.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/model/tokenizer.hpp"
#include "veloxquant/peers/cachegen_paper_profile.hpp"

namespace fs = std::filesystem;

namespace {

std::string dir() {
  static const std::string d = [] {
    const std::string d = vqtest::temp_dir() + "/input_file";
    fs::remove_all(d);
    fs::create_directories(d + "/adir");
    std::ofstream(d + "/file", std::ios::binary) << "0123456789";
    fs::create_symlink("file", d + "/link");
    ::mkfifo((d + "/fifo").c_str(), 0644);
    return d;
  }();
  return d;
}

std::string io_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const vq::IoError& e) {
    return e.what();
  }
  return "(no IoError)";
}

TEST(InputFile, ReadsRegularFilesAndLinksToThem) {
  for (const auto* name : {"/file", "/link"}) {
    vq::InputFile f(dir() + name);
    EXPECT_EQ(f.size(), 10u);
    char buf[4];
    ASSERT_TRUE(f.read(buf, 4));
    EXPECT_EQ(std::string(buf, 4), "0123");
    EXPECT_EQ(f.read_all_text(), "0123456789");
    std::uint8_t rest[11];
    EXPECT_FALSE(f.read(rest, 11));  // past the end
  }
  EXPECT_EQ(vq::read_input_file(dir() + "/file").size(), 10u);
}

TEST(InputFile, RefusesWhatIsNotARegularFileSayingWhatItIs) {
  struct Case {
    std::string path, says;
  };
  const std::vector<Case> cases = {{dir() + "/adir", "it is a directory, not a regular file"},
                                   {dir() + "/fifo", "it is a FIFO, not a regular file"},
                                   {"/dev/null", "it is a character device, not a regular file"},
                                   {dir() + "/missing", "No such file or directory"}};
  for (const auto& c : cases) {
    const std::string err = io_error([&] { vq::InputFile f(c.path, "checkpoint"); });
    EXPECT_EQ(err.find("cannot"), 0u) << err;
    EXPECT_NE(err.find("checkpoint " + c.path + ": " + c.says), std::string::npos) << err;
  }
  EXPECT_THROW(vq::InputFile(""), vq::InvalidArgument);
  EXPECT_THROW(vq::InputFile(std::string("a\0b", 3)), vq::InvalidArgument);
}

// Every reader of the library goes through it: a FIFO returns at once (it blocked before) and a
// directory is called a directory (a checkpoint directory said "out of memory").
TEST(InputFile, EveryReaderRefusesFifosAndDirectories) {
  const std::vector<std::pair<const char*, std::function<void(const std::string&)>>> readers = {
      {"npy", [](const std::string& p) { vq::read_npy(p); }},
      {"safetensors", [](const std::string& p) { vq::read_kv_safetensors(p); }},
      {"vqkv", [](const std::string& p) { vq::load_prompt_cache(p); }},
      {"vqkv bytes", [](const std::string& p) { vq::read_file_bytes(p); }},
      {"checkpoint", [](const std::string& p) { vq::Checkpoint::load(p); }},
      {"tokenizer", [](const std::string& p) { vq::Tokenizer::load(p); }},
      {"profile", [](const std::string& p) { vq::CachegenPaperProfile::load(p); }},
  };
  for (const auto& [name, read] : readers) {
    for (const auto& [node, kind] : {std::pair{"/fifo", "a FIFO"}, std::pair{"/adir", "a directory"}}) {
      const std::string err = io_error([&, r = read] { r(dir() + node); });
      EXPECT_NE(err.find(std::string("it is ") + kind + ", not a regular file"), std::string::npos) << name << " " << node << ": " << err;
    }
  }
}

}  // namespace
