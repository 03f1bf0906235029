// SIGINT, SIGTERM and SIGHUP during `veloxquant compress`: whenever the signal lands (before the
// output is opened, while its temporary is being written, after), the process dies of the signal
// or finishes, no temporary file remains, and the destination is the old file or the complete new
// one. Where the signal lands depends on timing; what is asserted does not.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <optional>
#include <filesystem>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "../model/model_support.hpp"
#include "../support/test_util.hpp"
#include "veloxquant/core/npy.hpp"

extern char** environ;

namespace fs = std::filesystem;

namespace {

std::string p(const std::string& name) { return vqtest::temp_dir() + "/interrupt_" + name; }

// The temporary beside out.vqkv, if one exists now.
std::optional<fs::path> temporary_in(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().filename().string().starts_with(".out.vqkv.tmp")) return e.path();
  return std::nullopt;
}

std::uintmax_t size_or_zero(const fs::path& f) {
  std::error_code ec;
  const auto n = fs::file_size(f, ec);
  return ec ? 0 : n;
}

pid_t spawn_cli(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  std::string cli = VQ_CLI_PATH;
  argv.push_back(cli.data());
  std::vector<std::string> copy = args;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  for (int s : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&defaults, s);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, VQ_CLI_PATH, &fa, &attr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  return rc == 0 ? pid : -1;
}

enum class When { AtOnce, TemporaryAppears, TemporaryHalfWritten };

TEST(InterruptCli, CompressLeavesNoTemporaryAndAWholeOrOldFile) {
  // fp32 of 8 heads x 8192 tokens x 128: a 33 MB output, written while it is encoded.
  const std::string dir = p("dir");
  fs::remove_all(dir);
  fs::create_directories(dir);
  const auto kv = vqtest::random_uniform({1, 8, 8192, 128}, 3, vq::DType::F16);
  vq::write_npy(p("k.npy"), kv);
  vq::write_npy(p("v.npy"), kv);
  const std::string out = dir + "/out.vqkv";
  const std::vector<std::string> args = {"compress", "--keys", p("k.npy"), "--values", p("v.npy"), "--method", "fp32", "-o", out};
  // The complete output, from an uninterrupted run.
  pid_t pid = spawn_cli(args);
  ASSERT_GT(pid, 0);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  const std::string complete = vqtest::read_file(out);
  const std::uintmax_t full = complete.size();
  ASSERT_GT(full, 30'000'000u);
  const std::string old = "the previous file";

  int signalled = 0, mid_write = 0;
  for (const int sig : {SIGTERM, SIGINT, SIGHUP})
    for (const When when : {When::AtOnce, When::TemporaryAppears, When::TemporaryHalfWritten})
      for (const bool had_old : {true, false}) {
        SCOPED_TRACE(::testing::Message() << "signal " << sig << " at point " << static_cast<int>(when) << (had_old ? ", old file" : ""));
        fs::remove(out);
        if (had_old) vqtest::write_file(out, old);
        pid = spawn_cli(args);
        ASSERT_GT(pid, 0);
        bool reaped = false;
        if (when != When::AtOnce) {
          // Wait for the temporary (or the end of the run), then for it to grow to half if asked.
          const std::uintmax_t want = when == When::TemporaryHalfWritten ? full / 2 : 0;
          while (!(reaped = ::waitpid(pid, &status, WNOHANG) == pid)) {
            const auto t = temporary_in(dir);
            if (t && size_or_zero(*t) >= want) {
              mid_write += when == When::TemporaryHalfWritten;
              break;
            }
            std::this_thread::sleep_for(std::chrono::microseconds(200));
          }
        }
        if (!reaped) {
          ::kill(pid, sig);
          ASSERT_EQ(::waitpid(pid, &status, 0), pid);
        }
        if (WIFSIGNALED(status)) {
          EXPECT_EQ(WTERMSIG(status), sig);
          ++signalled;
        } else {
          EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
        }
        EXPECT_EQ(temporary_in(dir), std::nullopt);
        if (fs::exists(out)) {
          const std::string got = vqtest::read_file(out);
          EXPECT_TRUE(got == complete || (had_old && got == old)) << got.size() << " bytes";
        } else {
          EXPECT_FALSE(had_old);
        }
      }
  EXPECT_GT(signalled, 0);  // at least some runs were really interrupted
  RecordProperty("signalled", signalled);
  RecordProperty("signalled_mid_write", mid_write);
}

}  // namespace
