// Real Redis servers for the integration tests: started on 127.0.0.1 only, on ports picked free by
// the kernel, without persistence, and stopped by pid. Each child is also bound to this process
// with PR_SET_PDEATHSIG, so a test binary that crashes or is killed takes its servers with it.
#pragma once
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/core.h>

namespace vqtest {

inline bool redis_installed() { return std::system("command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1") == 0; }

// A port nobody listens on now (the kernel's pick for an ephemeral bind).
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    throw std::runtime_error("free_port: cannot bind a loopback socket");
  const int port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

class RedisServers {
 public:
  struct Server {
    int port = 0;
    pid_t pid = -1;
  };

  explicit RedisServers(std::filesystem::path dir) : dir_(std::move(dir)) { std::filesystem::create_directories(dir_); }
  ~RedisServers() { stop_all(); }

  // One server; returns its index. extra: more redis-server arguments.
  std::size_t start(const std::vector<std::string>& extra = {}) {
    // A cluster node also listens on its bus port, port + 10000: the port must leave room for it
    // (an ephemeral port above 55535 would make redis-server refuse to start), and both be free.
    const bool cluster = std::find(extra.begin(), extra.end(), "--cluster-enabled") != extra.end();
    int port = free_port();
    for (int tries = 0; cluster && tries < 1000 && !(port <= 55535 && port_is_free(port + 10000)); ++tries) port = free_port();
    std::vector<std::string> args{"redis-server", "--port", std::to_string(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                  "--dir", dir_.string(), "--daemonize", "no", "--loglevel", "warning",
                                  "--logfile", (dir_ / fmt::format("redis-{}.log", port)).string()};
    args.insert(args.end(), extra.begin(), extra.end());
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execvp("redis-server", argv.data());
      ::_exit(127);
    }
    servers_.push_back({port, pid});
    wait_ping(port, pid);
    return servers_.size() - 1;
  }

  // A cluster of n masters without replicas, built with redis-cli --cluster create; returns the
  // indexes of its servers.
  std::vector<std::size_t> start_cluster(int n) {
    std::vector<std::size_t> idx;
    std::string hosts;
    for (int i = 0; i < n; ++i) {
      const std::size_t k = servers_.size();
      start({"--cluster-enabled", "yes", "--cluster-config-file", (dir_ / fmt::format("nodes-{}.conf", k)).string(),
             "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no"});
      idx.push_back(k);
      hosts += fmt::format(" 127.0.0.1:{}", servers_[k].port);
    }
    const std::string cmd = fmt::format("redis-cli --cluster create{} --cluster-replicas 0 --cluster-yes >{} 2>&1", hosts,
                                        (dir_ / "cluster-create.log").string());
    if (std::system(cmd.c_str()) != 0) throw std::runtime_error("redis-cli --cluster create failed: see " + (dir_ / "cluster-create.log").string());
    for (const auto k : idx) wait_cluster_ok(servers_[k].port);
    return idx;
  }

  int port(std::size_t i) const { return servers_.at(i).port; }

  void stop(std::size_t i) {
    auto& s = servers_.at(i);
    if (s.pid > 0) {
      ::kill(s.pid, SIGKILL);
      ::waitpid(s.pid, nullptr, 0);
      s.pid = -1;
    }
  }
  // A stalled server (SIGSTOP): connections stay open and nothing answers, until resumed (SIGCONT).
  void pause(std::size_t i, bool paused) {
    const auto& s = servers_.at(i);
    if (s.pid > 0) ::kill(s.pid, paused ? SIGSTOP : SIGCONT);
  }
  void stop_all() {
    for (std::size_t i = 0; i < servers_.size(); ++i) stop(i);
  }

  // redis-cli's answer to a command (for checks), e.g. cli(0, "DBSIZE").
  std::string cli(std::size_t i, const std::string& args) const {
    const std::string cmd = fmt::format("redis-cli -h 127.0.0.1 -p {} {} 2>&1", port(i), args);
    std::string out;
    if (FILE* f = ::popen(cmd.c_str(), "r")) {
      char buf[4096];
      std::size_t n;
      while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
      ::pclose(f);
    }
    return out;
  }

 private:
  static bool port_is_free(int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    const bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    if (fd >= 0) ::close(fd);
    return ok;
  }
  void wait_ping(int port, pid_t pid) const {
    // A wall-clock deadline, generous: on a loaded 2-core machine (ctest -j2 beside a build) a
    // server and each redis-cli call can take seconds to get scheduled.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < deadline) {
      if (std::system(fmt::format("redis-cli -h 127.0.0.1 -p {} PING 2>&1 | grep -qE 'PONG|NOAUTH'", port).c_str()) == 0) return;
      if (::waitpid(pid, nullptr, WNOHANG) == pid)  // it exited: say why (its log), do not wait on
        throw std::runtime_error(fmt::format("redis-server on 127.0.0.1:{} exited at start; see {}", port,
                                             (dir_ / fmt::format("redis-{}.log", port)).string()));
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    throw std::runtime_error(fmt::format("redis-server on 127.0.0.1:{} did not answer PING within 60 s", port));
  }
  void wait_cluster_ok(int port) const {
    for (int i = 0; i < 400; ++i) {
      if (std::system(fmt::format("redis-cli -h 127.0.0.1 -p {} CLUSTER INFO 2>/dev/null | grep -q 'cluster_state:ok'", port).c_str()) == 0)
        return;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    throw std::runtime_error(fmt::format("cluster node 127.0.0.1:{} not ok within 10 s", port));
  }

  std::filesystem::path dir_;
  std::vector<Server> servers_;
};

}  // namespace vqtest
