// `veloxquant bench prompt-cache`: options and runner (cmd_bench_prompt_cache.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace vqcli {

struct BenchPromptCacheOptions {
  std::string llama_server;  // "" : .llama/bin/llama-server, else llama-server on PATH
  bool realistic = false;    // the llama-shaped GGUF from a seed instead of stories260K
  int tokens = 448;          // prompt tokens after BOS
  int chunk_tokens = 64;
  std::vector<std::string> levels{"auto"};  // auto: the proxy's default (prompt_cache_default_levels)
  std::vector<std::string> stores{"file:auto", "redis:auto"};  // auto: a folder / a redis-server of the bench's own
  int rounds = 3;
  int threads = 2;
  // The server's --slot-save-path (the proxy's scratch slot files): "" : a folder of the bench's own
  // in /dev/shm (tmpfs, as docs/prompt_cache.md advises) where the machine has it, else in the work dir.
  std::string slot_dir;
  // Idle time before each timed request (hit and recompute alike): llama.cpp's worker threads poll
  // for work (--poll, default 50) for a while after a request, and on two shared cores that spinning
  // took the proxy's decoder threads' time on a hit sent right after a recompute (docs/prompt_cache.md).
  int settle_ms = 1000;
  std::uint64_t seed = 1;
  bool json = false;
  bool verbose = false;  // the proxy's line per request on stderr
};

int run_bench_prompt_cache(const BenchPromptCacheOptions& o);

}  // namespace vqcli
