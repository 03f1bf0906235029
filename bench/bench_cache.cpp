// Benchmarks of CacheGenKVCache::update_and_fetch, each beside a memcpy of the same bytes measured
// in the same run (this machine is shared: read the ratios, not the absolute numbers).
//   ./build/bench/vq_bench --benchmark_filter=Cache
#include <cstring>
#include <memory>
#include <vector>

#include <benchmark/benchmark.h>

#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/synth/synthetic_kv.hpp"

namespace {

constexpr std::int64_t kHeads = 8, kDim = 128;

vq::SyntheticKV synth(std::int64_t tokens, std::uint64_t seed) {
  vq::SyntheticKVConfig c;
  c.heads = kHeads;
  c.head_dim = kDim;
  c.tokens = tokens;
  c.seed = seed;
  c.dtype = vq::DType::F16;
  return vq::make_synthetic_kv(c);
}

// memcpy of the K and V bytes of a 4096-token f16 prefill: the bandwidth baseline.
void BM_Memcpy_Prefill4096(benchmark::State& state) {
  const std::size_t bytes = 2 * 4096 * kHeads * kDim * 2;
  std::vector<char> src(bytes, 1), dst(bytes);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}
BENCHMARK(BM_Memcpy_Prefill4096)->Unit(benchmark::kMillisecond);

// A plain KVCache prefill (append only): what the cache protocol itself costs.
void BM_PlainCache_Prefill4096(benchmark::State& state) {
  const auto kv = synth(4096, 1);
  for (auto _ : state) {
    vq::KVCache cache;
    auto out = cache.update_and_fetch(kv.keys, kv.values);
    benchmark::DoNotOptimize(out.first.row(0, 0, 0));
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * (kv.keys.nbytes() + kv.values.nbytes())));
}
BENCHMARK(BM_PlainCache_Prefill4096)->Unit(benchmark::kMillisecond);

// CacheGen prefill of 4096 tokens, arg 0 = per_call, 1 = group_aligned.
void BM_CacheGen_Prefill4096(benchmark::State& state) {
  const auto kv = synth(4096, 1);
  vq::KVCacheConfig cfg;
  cfg.cachegen_flush = state.range(0) ? vq::FlushMode::GroupAligned : vq::FlushMode::PerCall;
  for (auto _ : state) {
    vq::CacheGenKVCache cache(cfg);
    auto out = cache.update_and_fetch(kv.keys, kv.values);
    benchmark::DoNotOptimize(out.first.row(0, 0, 0));
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * (kv.keys.nbytes() + kv.values.nbytes())));
}
BENCHMARK(BM_CacheGen_Prefill4096)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);

// The same prefill into a cache that is reused (trim(offset) keeps its buffers), as a server
// reusing caches across requests does, and as the memcpy baseline reuses its destination: no
// fresh pages to fault in and zero.
void BM_CacheGen_Prefill4096_Reused(benchmark::State& state) {
  const auto kv = synth(4096, 1);
  vq::CacheGenKVCache cache;
  cache.update_and_fetch(kv.keys, kv.values);
  for (auto _ : state) {
    cache.trim(cache.offset());
    auto out = cache.update_and_fetch(kv.keys, kv.values);
    benchmark::DoNotOptimize(out.first.row(0, 0, 0));
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * (kv.keys.nbytes() + kv.values.nbytes())));
}
BENCHMARK(BM_CacheGen_Prefill4096_Reused)->Unit(benchmark::kMillisecond);

// The same group_aligned prefill followed by one read of the byte counters, which brings the
// lazily kept entropy histograms up to date: what a caller that reports sizes pays in total.
void BM_CacheGen_Prefill4096_ThenCounters(benchmark::State& state) {
  const auto kv = synth(4096, 1);
  for (auto _ : state) {
    vq::CacheGenKVCache cache;
    auto out = cache.update_and_fetch(kv.keys, kv.values);
    benchmark::DoNotOptimize(out.first.row(0, 0, 0));
    benchmark::DoNotOptimize(cache.compressed_key_bytes() + cache.compressed_value_bytes());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * (kv.keys.nbytes() + kv.values.nbytes())));
}
BENCHMARK(BM_CacheGen_Prefill4096_ThenCounters)->Unit(benchmark::kMillisecond);

// One-token decode steps (group_aligned) at a given context, in steady state: the cache is
// prefilled with context + 1024 tokens and trimmed back to `context` outside the timing (trim
// keeps the buffer's capacity), then each iteration decodes 1024 steps (32 whole groups).
// Reported per token; buffer growth is measured separately below.
void BM_CacheGen_Decode(benchmark::State& state) {
  const std::int64_t context = state.range(0);
  const std::int64_t steps = 1024;
  const auto prefill = synth(context + steps, 2);
  const auto decode = synth(steps, 3);
  std::vector<vq::Tensor> ks, vs;
  for (std::int64_t s = 0; s < steps; ++s) {
    ks.push_back(decode.keys.slice(2, s, s + 1).contiguous(true));
    vs.push_back(decode.values.slice(2, s, s + 1).contiguous(true));
  }
  vq::CacheGenKVCache cache;
  for (auto _ : state) {
    state.PauseTiming();
    cache.trim(cache.offset());
    cache.update_and_fetch(prefill.keys, prefill.values);
    cache.trim(steps);
    benchmark::DoNotOptimize(cache.compressed_key_bytes());  // histograms current before timing
    state.ResumeTiming();
    for (std::int64_t s = 0; s < steps; ++s) {
      auto out = cache.update_and_fetch(ks[static_cast<std::size_t>(s)], vs[static_cast<std::size_t>(s)]);
      benchmark::DoNotOptimize(out.first.row(0, 0, 0));
      // a host that reports sizes every step reads the counters (O(new tokens) each)
      if (state.range(1)) benchmark::DoNotOptimize(cache.compressed_key_bytes());
    }
  }
  state.counters["us_per_token"] = benchmark::Counter(static_cast<double>(state.iterations() * steps),
                                                      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_CacheGen_Decode)->Args({1024, 0})->Args({16384, 0})->Args({1024, 1})->Args({16384, 1})->Unit(benchmark::kMillisecond)->Iterations(20);

// Whole decode from an empty cache to 16384 tokens, one token per call: per-token cost including
// the buffer's geometric growth (amortised O(1)).
void BM_CacheGen_DecodeFromEmpty16k(benchmark::State& state) {
  const std::int64_t steps = 16384;
  const auto decode = synth(steps, 4);
  std::vector<vq::Tensor> ks, vs;
  for (std::int64_t s = 0; s < steps; ++s) {
    ks.push_back(decode.keys.slice(2, s, s + 1).contiguous(true));
    vs.push_back(decode.values.slice(2, s, s + 1).contiguous(true));
  }
  for (auto _ : state) {
    auto cache = std::make_unique<vq::CacheGenKVCache>();
    for (std::int64_t s = 0; s < steps; ++s) {
      auto out = cache->update_and_fetch(ks[static_cast<std::size_t>(s)], vs[static_cast<std::size_t>(s)]);
      benchmark::DoNotOptimize(out.first.row(0, 0, 0));
    }
    state.PauseTiming();
    cache.reset();
    state.ResumeTiming();
  }
  state.counters["us_per_token"] = benchmark::Counter(static_cast<double>(state.iterations() * steps),
                                                      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_CacheGen_DecodeFromEmpty16k)->Unit(benchmark::kMillisecond)->Iterations(2);

}  // namespace

BENCHMARK_MAIN();
