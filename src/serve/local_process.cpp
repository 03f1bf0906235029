#include "veloxquant/serve/local_process.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <httplib.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"

extern char** environ;

namespace vq {

int free_local_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  require(fd >= 0, "free_local_port: no socket");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  if (!ok) throw IoError("free_local_port: cannot bind 127.0.0.1:0");
  return ntohs(a.sin_port);
}

namespace {

std::string tail_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(in)), {});
  return s.size() > 2000 ? s.substr(s.size() - 2000) : s;
}

}  // namespace

LocalProcess::LocalProcess(const std::vector<std::string>& argv, const std::string& log_path, const std::function<bool()>& ready,
                           double timeout_s)
    : log_(log_path) {
  require(!argv.empty(), "LocalProcess: no command");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const int rc = posix_spawnp(&pid_, argv[0].c_str(), &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) throw IoError(fmt::format("{}: cannot start ({})", argv[0], std::strerror(rc)));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      throw IoError(fmt::format("{} exited before it was ready; its output ends:\n{}", argv[0], tail_of(log_)));
    }
    if (ready()) return;
    if (std::chrono::steady_clock::now() > deadline) {
      stop();
      throw IoError(fmt::format("{} was not ready in {} s; its output ends:\n{}", argv[0], timeout_s, tail_of(log_)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

LocalProcess::~LocalProcess() { stop(); }

void LocalProcess::stop() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGTERM);
  for (int i = 0; i < 50; ++i) {
    if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
      pid_ = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

bool http_health_ok(int port) {
  httplib::Client c("127.0.0.1", port);
  c.set_connection_timeout(1, 0);
  c.set_read_timeout(2, 0);
  const auto r = c.Get("/health");
  return r && r->status == 200;
}

}  // namespace vq
