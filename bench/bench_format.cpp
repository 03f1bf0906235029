// The .vqkv container on issue 5's goal case: a 4096-token cache of a 32-layer model with 8 KV
// heads of D = 128 (synthetic LLM-like K/V, float16), CacheGen 4 bits group_aligned. Throughput is
// in bytes of fp16 K/V (the input of compress, the output of decompress), beside a memcpy of the
// same bytes measured in the same run (read the ratios: this machine is shared).
//   ./build/bench/vq_bench_format
#include <cstring>
#include <memory>
#include <vector>

#include <benchmark/benchmark.h>

#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/format/vqkv.hpp"
#include "veloxquant/synth/synthetic_kv.hpp"

namespace {

constexpr int kLayers = 32;
constexpr std::int64_t kTokens = 4096, kHeads = 8, kDim = 128;
constexpr std::int64_t kFp16Bytes = kLayers * 2 * kTokens * kHeads * kDim * 2;

// Each layer gets its own synthetic K/V (a different seed), as real layers differ.
const std::vector<vq::SyntheticKV>& inputs() {
  static const std::vector<vq::SyntheticKV> kv = [] {
    std::vector<vq::SyntheticKV> out;
    for (int l = 0; l < kLayers; ++l) {
      vq::SyntheticKVConfig c;
      c.heads = kHeads;
      c.head_dim = kDim;
      c.tokens = kTokens;
      c.seed = static_cast<std::uint64_t>(l);
      out.push_back(vq::make_synthetic_kv(c));
    }
    return out;
  }();
  return kv;
}

std::vector<std::shared_ptr<vq::KVCache>> prefill() {
  std::vector<std::shared_ptr<vq::KVCache>> caches;
  for (const auto& kv : inputs()) {
    caches.push_back(std::make_shared<vq::CacheGenKVCache>());
    caches.back()->update_and_fetch(kv.keys, kv.values);
  }
  return caches;
}

void BM_Memcpy_Fp16KV(benchmark::State& state) {
  std::vector<char> src(static_cast<std::size_t>(kFp16Bytes), 1), dst(src.size());
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), src.size());
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kFp16Bytes);
}
BENCHMARK(BM_Memcpy_Fp16KV)->Unit(benchmark::kMillisecond);

// compress = quantize (the caches' prefill) + serialise to bytes in memory.
void BM_Compress(benchmark::State& state) {
  (void)inputs();
  std::size_t bytes = 0;
  for (auto _ : state) {
    const auto caches = prefill();
    const auto file = vq::serialize_prompt_cache(caches);
    bytes = file.size();
    benchmark::DoNotOptimize(file.data());
  }
  state.SetBytesProcessed(state.iterations() * kFp16Bytes);
  state.counters["file_MB"] = static_cast<double>(bytes) / 1e6;
  state.counters["bits_per_elem"] = 8.0 * static_cast<double>(bytes) / (static_cast<double>(kFp16Bytes) / 2);
}
BENCHMARK(BM_Compress)->Unit(benchmark::kMillisecond)->Iterations(2);

// The serialisation alone (tables, rANS, blocks, checksums) of prefilled caches.
void BM_Serialize(benchmark::State& state) {
  const auto caches = prefill();
  for (auto _ : state) {
    const auto file = vq::serialize_prompt_cache(caches);
    benchmark::DoNotOptimize(file.data());
  }
  state.SetBytesProcessed(state.iterations() * kFp16Bytes);
}
BENCHMARK(BM_Serialize)->Unit(benchmark::kMillisecond)->Iterations(3);

// decompress = parse, verify, decode and rebuild the caches (dense fp16 K/V ready to fetch).
void BM_Decompress(benchmark::State& state) {
  const auto file = vq::serialize_prompt_cache(prefill());
  for (auto _ : state) {
    const auto loaded = vq::deserialize_prompt_cache(file);
    benchmark::DoNotOptimize(loaded.caches.back()->state().keys.row(0, 0, 0));
  }
  state.SetBytesProcessed(state.iterations() * kFp16Bytes);
}
BENCHMARK(BM_Decompress)->Unit(benchmark::kMillisecond)->Iterations(3);

}  // namespace

BENCHMARK_MAIN();
