#include "veloxquant/serve/local_process.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <cerrno>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <httplib.h>

#include "llama_http.hpp"

#include <chrono>
#include <cstring>
#include <fstream>
#include <thread>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"

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

// The last non-empty line of a log ("" when there is none), for a one-line message.
std::string last_line_of(const std::string& path) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return last.size() > 300 ? last.substr(0, 300) + "..." : last;
}

}  // namespace

LocalProcess::LocalProcess(const std::vector<std::string>& argv, const std::string& log_path, const std::function<bool()>& ready,
                           double timeout_s)
    : log_(log_path) {
  require(!argv.empty(), "LocalProcess: no command");
  // Opened before the fork, so a failure is an error here and the child only dup2s and execs.
  const int log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log_fd < 0) throw IoError(fmt::format("{}: cannot write the log ({})", log_path, std::strerror(errno)));
  const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = ::getpid();
  pid_ = ::fork();
  if (pid_ == 0) {
    // The child dies with this process, even when it is killed (a benchmark stopped with ^C or a
    // crash leaves no server behind).
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    if (null_fd >= 0) ::dup2(null_fd, 0);
    ::dup2(log_fd, 1);
    ::dup2(log_fd, 2);
    ::execvp(args[0], args.data());
    ::_exit(127);
  }
  ::close(log_fd);
  if (null_fd >= 0) ::close(null_fd);
  if (pid_ < 0) throw IoError(fmt::format("{}: cannot start ({})", argv[0], std::strerror(errno)));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      if (WIFEXITED(status) && WEXITSTATUS(status) == 127)
        throw IoError(fmt::format("{}: cannot start (not found, or not executable)", argv[0]));
      const std::string last = last_line_of(log_);
      throw IoError(fmt::format("{} exited before it was ready{}", argv[0], last.empty() ? "" : " (its last line: " + last + ")"));
    }
    if (ready()) return;
    if (std::chrono::steady_clock::now() > deadline) {
      stop();
      const std::string last = last_line_of(log_);
      throw IoError(fmt::format("{} was not ready in {} s{}", argv[0], timeout_s, last.empty() ? "" : " (its last line: " + last + ")"));
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
  httplib::Request get;
  get.method = "GET";
  get.path = "/health";
  return serve_detail::send_bounded(c, std::move(get), 64 * 1024).status == 200;
}

}  // namespace vq
