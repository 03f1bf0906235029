// A server process the caller starts on 127.0.0.1 and stops by its pid (llama-server, redis-server
// for `bench prompt-cache`): a free port, the child's output in a log file, a readiness check, and
// SIGTERM then SIGKILL on stop or destruction; the child also dies with this process
// (PR_SET_PDEATHSIG), however that ends.
#pragma once
#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

namespace vq {

// A port nothing listens on now: the one the OS gave a listener bound to 127.0.0.1:0, closed.
int free_local_port();

class LocalProcess {
 public:
  // Starts `argv` (argv[0] a path or a name on PATH), output to `log_path`; then calls `ready` every
  // 100 ms until it returns true (one-line IoError, with the log's last line, when the child exits
  // or `timeout_s` passes first).
  LocalProcess(const std::vector<std::string>& argv, const std::string& log_path, const std::function<bool()>& ready, double timeout_s = 120);
  ~LocalProcess();
  LocalProcess(const LocalProcess&) = delete;
  LocalProcess& operator=(const LocalProcess&) = delete;
  pid_t pid() const { return pid_; }
  void stop();  // SIGTERM, SIGKILL after 5 s; idempotent

 private:
  pid_t pid_ = -1;
  std::string log_;
};

// True when GET http://127.0.0.1:port/health answers 200 (llama-server's readiness).
bool http_health_ok(int port);

}  // namespace vq
