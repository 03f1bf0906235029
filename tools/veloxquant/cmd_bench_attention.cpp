// veloxquant bench attention: one decode step of attention over each storage form, in one run.
//
// The step: B = 1, Hq = 32 query heads over Hkv = 8 KV heads of D = 128 (a Llama-3-8B layer), one
// query token, over `context` tokens of synthetic K/V (synth/synthetic_kv.hpp, float16, seed 0)
// fed in chunks of 4096 tokens. Storage forms: "fp32" and "fp16" are plain KVCaches of that dtype
// (the dense baselines, the same attention loop), every other form is a method spec's cache
// (methods/method_spec.hpp) fed float32. Threads (--threads, vq::set_attention_threads; default every
// core): with one, steps are timed on the thread's CPU clock; with more, on the wall clock (the CPU
// clock of the calling thread would miss the others' work), memcpy included.
//
// How a context is measured, so that one run's ratios hold on a shared, noisy machine: every
// form's cache is filled first, then --rounds rounds each time memcpy of the fp16 cache's bytes
// (one thread) and one decode step of every form, the forms in an order rotated by one each round
// (a slow spell of the machine falls on different forms). A round's time of a form is the fastest
// of its repeats in that round (at least 2, and ~20 ms). Reported: us_per_step = the median over
// rounds; speedup_vs_fp16 = the median over rounds of (fp16's time / the form's time in the same
// round), with its smallest and largest round; vs_memcpy likewise with that round's memcpy (the
// form's time / memcpy's). Paired ratios cancel what the machine's load does to both sides of a
// round; the spread between rounds shows what it does not. memcpy_gb_s: the median round's memcpy
// at the largest context.
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
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/synth/synthetic_kv.hpp"

namespace vqcli {

namespace {

constexpr std::int64_t kHq = 32, kHkv = 8, kD = 128, kChunk = 4096;

constexpr std::size_t U(std::int64_t x) { return static_cast<std::size_t>(x); }

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

// The fastest of f()'s repeats (>= min_repeats, and until ~min_s has passed), in seconds of `clock`.
template <class F>
double best_seconds(double (*clock)(), F&& f, double min_s, std::size_t min_repeats) {
  std::vector<double> t;
  const double start = clock();
  while (t.size() < min_repeats || (clock() - start < min_s && t.size() < 1000)) {
    const double t0 = clock();
    f();
    t.push_back(clock() - t0);
  }
  return *std::min_element(t.begin(), t.end());
}

// The median of x (the mean of the middle two for an even count); x is reordered.
double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  const std::size_t n = x.size();
  return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
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

  vq::require(o.rounds >= 1 && o.rounds <= 1000, "bench attention: --rounds {} must be 1 .. 1000", o.rounds);
  const std::int64_t max_ctx = *std::max_element(o.contexts.begin(), o.contexts.end());

  struct Row {
    std::string method;
    std::int64_t context;
    double us;
    std::size_t resident;
    double speedup = 0, speedup_min = 0, speedup_max = 0, vs_memcpy = 0;
  };
  std::vector<Row> rows;
  double memcpy_gb_s = 0;
  constexpr double kRoundSeconds = 0.02;
  constexpr std::size_t kRoundRepeats = 2;
  for (const std::int64_t ctx : o.contexts) {
    vq::SyntheticKVConfig sc;
    sc.heads = kHkv, sc.tokens = ctx, sc.head_dim = kD, sc.dtype = vq::DType::F16;
    const vq::SyntheticKV kv = vq::make_synthetic_kv(sc);
    vq::SyntheticKVConfig qc = sc;
    qc.heads = kHq, qc.tokens = 1, qc.seed = 1, qc.dtype = vq::DType::F32;
    const vq::Tensor q = vq::make_synthetic_kv(qc).keys;
    const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
    std::vector<std::shared_ptr<vq::KVCache>> caches;
    for (const auto& method : methods) {
      std::shared_ptr<vq::KVCache> cache =
          method == "fp32" || method == "fp16" ? std::make_shared<vq::KVCache>()
                                               : vq::make_caches(vq::MethodSpec::parse(method), vq::ModelDescription::uniform(1, kD))[0];
      const vq::DType in = method == "fp16" ? vq::DType::F16 : vq::DType::F32;
      for (std::int64_t s = 0; s < ctx; s += kChunk) {
        const std::int64_t e = std::min(ctx, s + kChunk);
        cache->update_and_fetch(kv.keys.slice(2, s, e).to(in), kv.values.slice(2, s, e).to(in));
      }
      caches.push_back(std::move(cache));
    }
    const std::size_t fp16_bytes = static_cast<std::size_t>(2 * kHkv * ctx * kD * 2);
    std::vector<std::byte> src(fp16_bytes, std::byte{1}), dst(fp16_bytes, std::byte{0});
    const std::size_t M = methods.size(), fp16_index = 1;  // methods[1] == "fp16"
    std::vector<double> memcpy_s(U(o.rounds));
    std::vector<std::vector<double>> step_s(M, std::vector<double>(U(o.rounds)));
    for (int r = 0; r < o.rounds; ++r) {
      memcpy_s[U(r)] = best_seconds(clock, [&] { std::memcpy(dst.data(), src.data(), src.size()); }, kRoundSeconds, kRoundRepeats);
      for (std::size_t i = 0; i < M; ++i) {
        const std::size_t m = (i + U(r)) % M;
        step_s[m][U(r)] = best_seconds(clock, [&] { (void)caches[m]->attend(q, scale); }, kRoundSeconds, kRoundRepeats);
      }
    }
    if (ctx == max_ctx) memcpy_gb_s = static_cast<double>(fp16_bytes) / median(memcpy_s) / 1e9;
    for (std::size_t m = 0; m < M; ++m) {
      std::vector<double> speedup(U(o.rounds)), vs_memcpy(U(o.rounds));
      for (int r = 0; r < o.rounds; ++r) {
        speedup[U(r)] = step_s[fp16_index][U(r)] / step_s[m][U(r)];
        vs_memcpy[U(r)] = step_s[m][U(r)] / memcpy_s[U(r)];
      }
      const auto [lo, hi] = std::minmax_element(speedup.begin(), speedup.end());
      rows.push_back({methods[m], ctx, 1e6 * median(step_s[m]), caches[m]->nbytes(), m == fp16_index ? 1.0 : median(speedup),
                      m == fp16_index ? 1.0 : *lo, m == fp16_index ? 1.0 : *hi, median(vs_memcpy)});
    }
  }

  if (o.json) {
    nlohmann::json j;
    j["memcpy_gb_s"] = memcpy_gb_s;
    j["threads"] = threads;
    j["clock"] = clock_name;
    j["rounds"] = o.rounds;
    j["rows"] = nlohmann::json::array();
    for (const auto& r : rows)
      j["rows"].push_back({{"method", r.method}, {"context", r.context}, {"us_per_step", r.us}, {"resident_bytes", r.resident},
                           {"speedup_vs_fp16", r.speedup}, {"speedup_vs_fp16_min", r.speedup_min}, {"speedup_vs_fp16_max", r.speedup_max},
                           {"vs_memcpy", r.vs_memcpy}});
    fmt::print("{}\n", json_text(j));
    return 0;
  }
  fmt::print("attention, one decode step: B=1, Hq={}, Hkv={}, D={}, 1 query token, synthetic K/V; memcpy {:.2f} GB/s (1 thread)\n",
             kHq, kHkv, kD, memcpy_gb_s);
  fmt::print("attend threads: {} ({} clock), {} rounds\n", threads, clock_name, o.rounds);
  std::size_t width = 16;
  for (const auto& r : rows) width = std::max(width, r.method.size());
  fmt::print("{:<{}} {:>8} {:>12} {:>15} {:>10} {:>15} {:>10}\n", "method", width, "context", "us/step", "resident bytes", "vs fp16",
             "(rounds)", "vs memcpy");
  for (const auto& r : rows)
    fmt::print("{:<{}} {:>8} {:>12.1f} {:>15} {:>9.2f}x {:>15} {:>9.2f}x\n", r.method, width, r.context, r.us, r.resident, r.speedup,
               fmt::format("{:.2f}-{:.2f}x", r.speedup_min, r.speedup_max), r.vs_memcpy);
  fmt::print(
      "(medians over rounds; vs fp16: the fp16 dense cache's time / this row's in the same round, its lowest-highest round in "
      "brackets; vs memcpy: this row's time / the same round's memcpy of the fp16 cache's bytes)\n");
  return 0;
}

}  // namespace vqcli
