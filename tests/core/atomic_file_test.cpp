// AtomicFile: the one writer of every output file. What it does with each kind of destination,
// its temporaries, and writers racing on one path.
#include "veloxquant/core/atomic_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "../support/file_mode.hpp"
#include "../support/test_util.hpp"
#include "veloxquant/core/error.hpp"

namespace fs = std::filesystem;

namespace {

// A fresh directory per test.
std::string dir(const std::string& name) {
  const std::string d = vqtest::temp_dir() + "/atomic_" + name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}
using vqtest::slurp;
using vqtest::spit;
using vqtest::mode_of;
// The names in a directory, sorted.
std::vector<std::string> names(const std::string& d) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(d)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}
std::string error_of(const std::string& path) {
  try {
    vq::write_file_atomically(path, std::string_view("new"));
  } catch (const vq::IoError& e) {
    return e.what();
  }
  return "(no error)";
}

class Umask {
 public:
  explicit Umask(mode_t m) : old_(::umask(m)) {}
  ~Umask() { ::umask(old_); }

 private:
  mode_t old_;
};

TEST(AtomicFile, MissingDestinationIsCreatedWithTheUmasksMode) {
  const auto d = dir("missing");
  for (mode_t mask : {mode_t{022}, mode_t{077}, mode_t{0}}) {
    Umask u(mask);
    const auto p = d + "/new" + std::to_string(mask);
    vq::write_file_atomically(p, std::string_view("hello"));
    EXPECT_EQ(slurp(p), "hello");
    EXPECT_TRUE(S_ISREG(mode_of(p)));
    EXPECT_EQ(mode_of(p) & 07777, 0666 & ~mask) << "umask " << mask;
  }
}

TEST(AtomicFile, RegularFileIsReplacedKeepingItsPermissionBits) {
  const auto d = dir("regular");
  Umask u(022);
  for (mode_t m : {mode_t{0600}, mode_t{0640}, mode_t{0664}, mode_t{0755}}) {
    const auto p = d + "/f" + std::to_string(m);
    spit(p, "old contents, longer than the new");
    ASSERT_EQ(::chmod(p.c_str(), m), 0);
    vq::write_file_atomically(p, std::string_view("new"));
    EXPECT_EQ(slurp(p), "new");
    EXPECT_EQ(mode_of(p) & 07777, m);
  }
}

TEST(AtomicFile, SymlinkIsFollowedAndStaysALink) {
  const auto d = dir("symlink");
  fs::create_directories(d + "/real");
  spit(d + "/real/target", "old");
  ASSERT_EQ(::chmod((d + "/real/target").c_str(), 0600), 0);
  fs::create_symlink("real/target", d + "/link");
  fs::create_symlink("link", d + "/link2");  // a chain of links
  vq::AtomicFile f(d + "/link2");
  EXPECT_EQ(f.target(), fs::canonical(d + "/real/target"));
  EXPECT_EQ(f.temporary().parent_path(), fs::canonical(d + "/real"));  // beside the target: rename stays on one file system
  f.write(std::string_view("new"));
  f.commit();
  EXPECT_TRUE(S_ISLNK(mode_of(d + "/link")));
  EXPECT_TRUE(S_ISLNK(mode_of(d + "/link2")));
  EXPECT_EQ(fs::read_symlink(d + "/link"), "real/target");
  EXPECT_EQ(slurp(d + "/real/target"), "new");
  EXPECT_EQ(mode_of(d + "/real/target") & 07777, 0600);
  EXPECT_EQ(names(d), (std::vector<std::string>{"link", "link2", "real"}));
  EXPECT_EQ(names(d + "/real"), (std::vector<std::string>{"target"}));
}

TEST(AtomicFile, DanglingSymlinkIsRefusedNotWrittenThrough) {
  const auto d = dir("dangling");
  fs::create_symlink(d + "/nowhere", d + "/link");
  EXPECT_NE(error_of(d + "/link").find("symbolic link to a missing file"), std::string::npos) << error_of(d + "/link");
  EXPECT_FALSE(fs::exists(d + "/nowhere"));
  EXPECT_TRUE(S_ISLNK(mode_of(d + "/link")));
  EXPECT_EQ(names(d), (std::vector<std::string>{"link"}));
}

TEST(AtomicFile, NonRegularDestinationsAreRefusedAndLeftAlone) {
  const auto d = dir("special");
  fs::create_directories(d + "/adir");
  ASSERT_EQ(::mkfifo((d + "/fifo").c_str(), 0644), 0);
  fs::create_symlink("fifo", d + "/link_to_fifo");
  struct Case {
    std::string path, says;
  };
  std::vector<Case> cases = {{d + "/adir", "it is a directory, not a regular file"},
                             {d + "/fifo", "it is a FIFO, not a regular file"},
                             {d + "/link_to_fifo", "its target " + fs::canonical(d + "/fifo").string() + " is a FIFO"},
                             {"/dev/null", "it is a character device, not a regular file"}};
  // A character device of our own where we may make one (root): the old writer replaced it.
  const bool own_device = ::mknod((d + "/null").c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0;
  if (own_device) cases.push_back({d + "/null", "it is a character device, not a regular file"});
  for (const auto& c : cases) {
    const std::string err = error_of(c.path);
    EXPECT_TRUE(err.starts_with("cannot write " + c.path + ": ")) << err;
    EXPECT_NE(err.find(c.says), std::string::npos) << c.path << ": " << err;
  }
  EXPECT_TRUE(fs::is_directory(d + "/adir"));
  EXPECT_TRUE(fs::is_empty(d + "/adir"));
  EXPECT_TRUE(S_ISFIFO(mode_of(d + "/fifo")));
  EXPECT_TRUE(S_ISCHR(mode_of("/dev/null")));
  if (own_device) {
    EXPECT_TRUE(S_ISCHR(mode_of(d + "/null")));
  }
  std::vector<std::string> want = {"adir", "fifo", "link_to_fifo"};
  if (own_device) want.push_back("null");
  EXPECT_EQ(names(d), want);  // no temporary left behind
}

TEST(AtomicFile, DestroyedWithoutCommitLeavesTheOldFileAndNoTemporary) {
  const auto d = dir("abandon");
  spit(d + "/f", "old");
  {
    vq::AtomicFile f(d + "/f");
    f.write(std::string_view("partial"));
    EXPECT_TRUE(fs::exists(f.temporary()));
  }
  EXPECT_EQ(slurp(d + "/f"), "old");
  EXPECT_EQ(names(d), (std::vector<std::string>{"f"}));
}

TEST(AtomicFile, TemporaryIsFreshAndPlantedLinksAreNotFollowed) {
  const auto d = dir("planted");
  spit(d + "/victim", "precious");
  // Links at every name an older writer used: "<out>.tmp" and ".<out>.tmp.<pid>".
  fs::create_symlink(d + "/victim", d + "/out.tmp");
  fs::create_symlink(d + "/victim", d + "/.out.tmp." + std::to_string(::getpid()));
  vq::AtomicFile a(d + "/out");
  vq::AtomicFile b(d + "/out");
  EXPECT_NE(a.temporary(), b.temporary());  // unpredictable, one per writer
  for (const auto* f : {&a, &b}) {
    EXPECT_EQ(f->temporary().parent_path(), fs::path(d));
    EXPECT_TRUE(f->temporary().filename().string().starts_with(".out.tmp.")) << f->temporary();
    EXPECT_TRUE(S_ISREG(mode_of(f->temporary())));
  }
  a.write(std::string_view("a"));
  a.commit();
  EXPECT_EQ(slurp(d + "/victim"), "precious");
  EXPECT_EQ(slurp(d + "/out"), "a");
  // The temporary is created exclusively: a name that exists is never opened.
  const int fd = ::open(b.temporary().c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
  EXPECT_EQ(fd, -1);
  EXPECT_EQ(errno, EEXIST);
}

TEST(AtomicFile, ConcurrentWritersToOnePathAllSucceedAndTheFileIsWhole) {
  const auto d = dir("concurrent");
  const auto p = d + "/out";
  constexpr int kWriters = 8;
  std::vector<std::string> contents;
  for (int i = 0; i < kWriters; ++i) contents.push_back(std::string(100000 + i, static_cast<char>('a' + i)));
  std::vector<std::string> errors(kWriters);
  {
    std::vector<std::jthread> threads;
    for (int i = 0; i < kWriters; ++i)
      threads.emplace_back([&, i] {
        try {
          vq::AtomicFile f(p);
          for (std::size_t at = 0; at < contents[static_cast<std::size_t>(i)].size(); at += 4096)
            f.write(std::string_view(contents[static_cast<std::size_t>(i)]).substr(at, 4096));
          f.commit();
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(i)] = e.what();
        }
      });
  }
  for (const auto& e : errors) EXPECT_EQ(e, "");
  const std::string got = slurp(p);
  EXPECT_NE(std::find(contents.begin(), contents.end(), got), contents.end()) << "a mix of writers, " << got.size() << " bytes";
  EXPECT_EQ(names(d), (std::vector<std::string>{"out"}));
}

TEST(AtomicFile, BadPathsAreClearErrors) {
  EXPECT_THROW(vq::AtomicFile(""), vq::InvalidArgument);
  EXPECT_THROW(vq::AtomicFile(std::string("a\0b", 3)), vq::InvalidArgument);
  const auto d = dir("bad");
  EXPECT_NE(error_of(d + "/no/such/dir/f").find("cannot write " + d + "/no/such/dir/f: No such file or directory"), std::string::npos)
      << error_of(d + "/no/such/dir/f");
  spit(d + "/file", "x");
  EXPECT_NE(error_of(d + "/file/f").find("Not a directory"), std::string::npos) << error_of(d + "/file/f");
}

}  // namespace
