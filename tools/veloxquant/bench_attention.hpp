// `veloxquant bench attention`: options and runner (cmd_bench_attention.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "veloxquant/methods/method_table.hpp"

namespace vqcli {

struct BenchAttentionOptions {
  std::vector<std::int64_t> contexts{1024, 16384, 65536};
  // Storage forms besides the fp32 and fp16 dense baselines (method specs; default: the method
  // table's bench_attention settings).
  std::vector<std::string> methods = vq::default_bench_attention_methods();
  // Threads attend uses (vq::set_attention_threads); 0 = every hardware thread.
  int threads = 0;
  // Rounds per context: each times memcpy and one step of every form (cmd_bench_attention.cpp).
  int rounds = 7;
  bool json = false;
};

int run_bench_attention(const BenchAttentionOptions& o);

}  // namespace vqcli
