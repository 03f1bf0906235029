// `veloxquant bench attention`: options and runner (cmd_bench_attention.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace vqcli {

struct BenchAttentionOptions {
  std::vector<std::int64_t> contexts{1024, 16384, 65536};
  // Storage forms besides the fp32 and fp16 dense baselines (method specs).
  std::vector<std::string> methods{"q8_0", "q4_0", "q4_1", "q8_0:rotate=1", "q4_0:rotate=1", "fp8"};
  // Threads attend uses (vq::set_attention_threads); 0 = every hardware thread.
  int threads = 0;
  // Rounds per context: each times memcpy and one step of every form (cmd_bench_attention.cpp).
  int rounds = 7;
  bool json = false;
};

int run_bench_attention(const BenchAttentionOptions& o);

}  // namespace vqcli
