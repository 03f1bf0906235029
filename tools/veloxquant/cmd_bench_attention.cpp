// veloxquant bench attention: one decode step of attention over each storage form, in one run.
//
// The step: B = 1, Hq = 32 query heads over Hkv = 8 KV heads of D = 128 (a Llama-3-8B layer), one
// query token, over `context` tokens of synthetic K/V (synth/synthetic_kv.hpp, float16, seed 0)
// fed in chunks of 4096 tokens. Storage forms: "fp32" and "fp16" are plain KVCaches of that dtype
// (the dense baselines, the same attention loop), every other form is a method spec's cache
// (model/method_spec.hpp) fed float32. Each row times KVCache::attend (the fastest of repeats: at
// least 3 and at least ~0.3 s) and reports the cache's nbytes() as resident bytes. Threads
// (--threads, vq::set_attention_threads; default every core): with one, steps are timed on the
// thread's CPU clock; with more, on the wall clock (the CPU clock of the calling thread would miss
// the others' work), memcpy included. Baselines from the same process: the fp16 cache's step
// (speedup_vs_fp16 = its time / the row's) and memcpy of the fp16 cache's bytes on one thread
// (memcpy_gb_s, measured at the largest context; vs_memcpy in the table = the row's time / the
// time memcpy takes for the fp16 cache's bytes at that context).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "bench_attention.hpp"
#include "json_out.hpp"
#include "veloxquant/cache/attention.hpp"
#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/model/method_spec.hpp"
#include "veloxquant/synth/synthetic_kv.hpp"

namespace vqcli {

namespace {

constexpr std::int64_t kHq = 32, kHkv = 8, kD = 128, kChunk = 4096;

// This thread's CPU time in seconds. Steps are timed on the CPU clock, not the wall clock: on a
// shared machine the wall clock mostly measures the scheduler's share of the cores, while the CPU
// clock counts what the step itself costs (memory stalls included).
double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The fastest of f()'s repeats (>= 3, and until ~min_s has passed), in seconds of `clock`.
template <class F>
double best_seconds(double (*clock)(), F&& f, double min_s = 0.3) {
  std::vector<double> t;
  const double start = clock();
  while (t.size() < 3 || (clock() - start < min_s && t.size() < 1000)) {
    const double t0 = clock();
    f();
    t.push_back(clock() - t0);
  }
  return *std::min_element(t.begin(), t.end());
}

}  // namespace

int run_bench_attention(const BenchAttentionOptions& o) {
  vq::require(!o.contexts.empty(), "bench attention: give at least one --context");
  for (auto c : o.contexts) vq::require(c >= 1 && c <= (std::int64_t{1} << 20), "bench attention: --context {} must be 1 .. 1048576", c);
  std::vector<std::string> methods = {"fp32", "fp16"};
  for (const auto& m : o.methods)
    if (m != "fp32" && m != "fp16") methods.push_back(vq::MethodSpec::parse(m).to_string());  // refuses a bad spec before any work

  vq::require(o.threads >= 0 && o.threads <= vq::kMaxAttentionThreads, "bench attention: --threads {} must be 0 .. {}", o.threads,
              vq::kMaxAttentionThreads);
  const int previous_threads = vq::set_attention_threads(o.threads);
  const int threads = vq::attention_threads();
  struct RestoreThreads {
    int n;
    ~RestoreThreads() { vq::set_attention_threads(n); }
  } restore{previous_threads};
  double (*const clock)() = threads > 1 ? wall_seconds : cpu_seconds;
  const char* clock_name = threads > 1 ? "wall" : "thread CPU";

  // memcpy of the fp16 cache's bytes at the largest context.
  const std::int64_t max_ctx = *std::max_element(o.contexts.begin(), o.contexts.end());
  const std::size_t fp16_bytes_max = static_cast<std::size_t>(2 * kHkv * max_ctx * kD * 2);
  double memcpy_gb_s = 0;
  {
    std::vector<std::byte> src(fp16_bytes_max, std::byte{1}), dst(fp16_bytes_max, std::byte{0});
    const double s = best_seconds(clock, [&] { std::memcpy(dst.data(), src.data(), src.size()); });
    memcpy_gb_s = static_cast<double>(fp16_bytes_max) / s / 1e9;
  }

  struct Row {
    std::string method;
    std::int64_t context;
    double us;
    std::size_t resident;
    double speedup = 0, vs_memcpy = 0;
  };
  std::vector<Row> rows;
  for (const std::int64_t ctx : o.contexts) {
    vq::SyntheticKVConfig sc;
    sc.heads = kHkv, sc.tokens = ctx, sc.head_dim = kD, sc.dtype = vq::DType::F16;
    const vq::SyntheticKV kv = vq::make_synthetic_kv(sc);
    vq::SyntheticKVConfig qc = sc;
    qc.heads = kHq, qc.tokens = 1, qc.seed = 1, qc.dtype = vq::DType::F32;
    const vq::Tensor q = vq::make_synthetic_kv(qc).keys;
    const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
    double fp16_us = 0;
    for (const auto& method : methods) {
      std::shared_ptr<vq::KVCache> cache =
          method == "fp32" || method == "fp16" ? std::make_shared<vq::KVCache>()
                                               : vq::make_caches(vq::MethodSpec::parse(method), vq::ModelDescription::uniform(1, kD))[0];
      const vq::DType in = method == "fp16" ? vq::DType::F16 : vq::DType::F32;
      for (std::int64_t s = 0; s < ctx; s += kChunk) {
        const std::int64_t e = std::min(ctx, s + kChunk);
        cache->update_and_fetch(kv.keys.slice(2, s, e).to(in), kv.values.slice(2, s, e).to(in));
      }
      const double us = 1e6 * best_seconds(clock, [&] { (void)cache->attend(q, scale); });
      if (method == "fp16") fp16_us = us;
      rows.push_back({method, ctx, us, cache->nbytes()});
    }
    const double memcpy_us = 1e6 * static_cast<double>(2 * kHkv * ctx * kD * 2) / (memcpy_gb_s * 1e9);
    for (auto& r : rows)
      if (r.context == ctx) r.speedup = fp16_us / r.us, r.vs_memcpy = r.us / memcpy_us;
  }

  if (o.json) {
    nlohmann::json j;
    j["memcpy_gb_s"] = memcpy_gb_s;
    j["threads"] = threads;
    j["clock"] = clock_name;
    j["rows"] = nlohmann::json::array();
    for (const auto& r : rows)
      j["rows"].push_back({{"method", r.method}, {"context", r.context}, {"us_per_step", r.us}, {"resident_bytes", r.resident},
                           {"speedup_vs_fp16", r.speedup}});
    fmt::print("{}\n", json_text(j));
    return 0;
  }
  fmt::print("attention, one decode step: B=1, Hq={}, Hkv={}, D={}, 1 query token, synthetic K/V; memcpy {:.2f} GB/s (1 thread)\n",
             kHq, kHkv, kD, memcpy_gb_s);
  fmt::print("attend threads: {} ({} clock)\n", threads, clock_name);
  fmt::print("{:<16} {:>8} {:>12} {:>15} {:>10} {:>10}\n", "method", "context", "us/step", "resident bytes", "vs fp16", "vs memcpy");
  for (const auto& r : rows)
    fmt::print("{:<16} {:>8} {:>12.1f} {:>15} {:>9.2f}x {:>9.2f}x\n", r.method, r.context, r.us, r.resident, r.speedup, r.vs_memcpy);
  fmt::print("(vs fp16: the fp16 dense cache's time / this row's; vs memcpy: this row's time / memcpy of the fp16 cache's bytes)\n");
  return 0;
}

}  // namespace vqcli
