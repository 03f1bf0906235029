// Resident memory of every KV cache method (issue 14): what a filled cache really holds.
//
//   ./build/bench/vq_bench_resident [--methods 'spec;spec;...'] [--tokens 4096] [--heads 8]
//                                   [--dim 128] [--caches 16] [--chunk 512]
//
// For each method spec it fills `caches` caches of one layer each with the same synthetic K/V
// (synth/synthetic_kv.hpp, float16), `chunk` tokens per update() call. The dense baselines are plain
// KVCaches: `fp32` fed the K/V as float32, `fp16` fed them as float16 (the `fp16` spec's own cache
// rounds float32 input and stores float32, so it is not the float16 baseline).
// Appending is update() (without fetching, what a host that attends calls). It prints:
//   bits/elem   nbytes * 8 / elements of K and V held (B * H * tokens * (D_k + D_v)), per cache
//   nbytes MB   summed nbytes() of the caches (the bytes they report holding)
//   RSS MB      growth of the process's resident set (/proc/self/statm) across creating and filling
//               them; freed heap is handed back (malloc_trim) before each method is measured
//   RSS/nbytes  the ratio (the goal: <= 1.1)
// A plain main, not Google Benchmark: nothing here is timed.
#include <malloc.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "veloxquant/cache/builder.hpp"
#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/synth/synthetic_kv.hpp"

namespace {

std::size_t rss_bytes() {
  std::ifstream f("/proc/self/statm");
  std::size_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, sep);)
    if (!item.empty()) out.push_back(item);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Resident memory of KV cache methods: bits per element, summed nbytes and RSS growth"};
  std::string methods =
      "fp32;fp16;vq:bits=2;cachegen:bits=4,schedule=off;cachegen:bits=4,flush=per_call,schedule=off;kivi:bits=2;kivi:bits=4;q8_0;q4_0;"
      "q4_1;fp8";
  std::int64_t tokens = 4096, heads = 8, dim = 128, chunk = 512;
  int n_caches = 16;
  app.add_option("--methods", methods, "';'-separated method specs")->capture_default_str();
  app.add_option("--tokens", tokens, "tokens per cache")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  app.add_option("--heads", heads, "KV heads")->capture_default_str()->check(CLI::Range(1, 1024));
  app.add_option("--dim", dim, "head dim (even: the synthetic keys are RoPE-rotated)")->capture_default_str()->check(CLI::Range(2, 4096));
  app.add_option("--caches", n_caches, "caches filled per method")->capture_default_str()->check(CLI::Range(1, 1024));
  app.add_option("--chunk", chunk, "tokens per update() call")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  CLI11_PARSE(app, argc, argv);
  try {
    vq::SyntheticKVConfig sc;
    sc.heads = heads;
    sc.tokens = tokens;
    sc.head_dim = dim;
    const vq::SyntheticKV kv16 = vq::make_synthetic_kv(sc);
    const double elements = static_cast<double>(heads * tokens * 2 * dim);
    std::printf("resident memory: %d caches x [1, %lld, %lld, %lld] float16 K/V (synthetic), %lld tokens per update()\n", n_caches,
                static_cast<long long>(heads), static_cast<long long>(tokens), static_cast<long long>(dim), static_cast<long long>(chunk));
    std::printf("%-46s %10s %12s %12s %11s\n", "method", "bits/elem", "nbytes MB", "RSS MB", "RSS/nbytes");
    for (const std::string& spec : split(methods, ';')) {
      const bool dense = spec == "fp32" || spec == "fp16", f32 = spec == "fp32";
      const vq::MethodSpec m = vq::MethodSpec::parse(dense ? std::string("fp32") : spec);
      const vq::Tensor k = f32 ? kv16.keys.to(vq::DType::F32) : kv16.keys, v = f32 ? kv16.values.to(vq::DType::F32) : kv16.values;
      malloc_trim(0);
      const std::size_t rss0 = rss_bytes();
      std::vector<std::shared_ptr<vq::KVCache>> caches;
      for (int i = 0; i < n_caches; ++i) {
        caches.push_back(dense ? std::make_shared<vq::KVCache>() : vq::make_caches(m, vq::ModelDescription::uniform(1, static_cast<int>(dim)))[0]);
        for (std::int64_t t = 0; t < tokens; t += chunk) {
          const std::int64_t e = std::min(tokens, t + chunk);
          caches.back()->update(k.slice(2, t, e), v.slice(2, t, e));
        }
      }
      const std::size_t rss1 = rss_bytes();
      std::size_t nbytes = 0;
      for (const auto& c : caches) nbytes += c->nbytes();
      const double growth = static_cast<double>(rss1) - static_cast<double>(rss0);
      std::printf("%-46s %10.3f %12.2f %12.2f %11.3f\n", spec.c_str(), static_cast<double>(nbytes) * 8.0 / n_caches / elements,
                  static_cast<double>(nbytes) / 1e6, growth / 1e6, growth / static_cast<double>(nbytes));
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
