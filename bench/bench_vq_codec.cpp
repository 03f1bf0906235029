// Our method's codec (vq/codec.hpp) on a 7B-shaped layer beside memcpy and zstd -1 on the same
// codes, in one run (docs/benchmarks.md, "The vq codec (issue 15)"):
//   ./build/bench/vq_bench_codec
// Codes: what VqKVCache (vq:bits=2, no model: identity transforms) makes of synthetic K/V of
// 8 KV heads x 128 = 1024 coefficients per side and 4096 tokens (make_synthetic_kv, seed 7): 2 x 4 Mi
// codes. Msym/s = items_per_second / 1e6 over all codes of both sides. zstd gets the row-major codes
// as bytes when every code fits int8 (it does at 2 bits), else as int16.
// BM_VqEncode/kernel:K, BM_VqDecode/kernel:K and BM_VqDecodeInto/kernel:K: K = 0 Auto (the best the CPU has), 1 Scalar
// (the reference), 2 AVX2, 3 AVX-512 (skipped with a message where the CPU lacks it).
#include <algorithm>
#include <cstring>
#include <vector>

#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include "zstd_loops.hpp"

#include "veloxquant/core/error.hpp"
#include "veloxquant/synth/synthetic_kv.hpp"
#include "veloxquant/vq/codec.hpp"
#include "veloxquant/vq/codec_decode_into.hpp"
#include "veloxquant/vq/vq_cache.hpp"

namespace {

const vq::VqLayerCodes& layer_codes() {
  static const vq::VqLayerCodes codes = [] {
    vq::SyntheticKVConfig sc;
    sc.heads = 8;
    sc.head_dim = 128;
    sc.tokens = 4096;
    sc.seed = 7;
    const auto kv = vq::make_synthetic_kv(sc);
    vq::VqConfig config;
    config.bits = 2.0;
    vq::VqKVCache cache(config);
    cache.update_and_fetch(kv.keys, kv.values);
    return cache.codes();
  }();
  return codes;
}

std::int64_t code_count() {
  const auto& c = layer_codes();
  return c.rows() * (c.k.n + c.v.n);
}

// The codes of both sides, row-major, as bytes (int8 where all fit) or int16 little-endian.
std::vector<std::uint8_t> raw_codes() {
  const auto& c = layer_codes();
  bool fits = true;
  for (const auto* s : {&c.k, &c.v})
    for (auto q : s->codes) fits &= q >= -128 && q <= 127;
  std::vector<std::uint8_t> out;
  for (const auto* s : {&c.k, &c.v})
    for (auto q : s->codes) {
      out.push_back(static_cast<std::uint8_t>(q));
      if (!fits) out.push_back(static_cast<std::uint8_t>(static_cast<std::uint16_t>(q) >> 8));
    }
  return out;
}

void report(benchmark::State& state, std::size_t bytes) {
  state.SetItemsProcessed(state.iterations() * code_count());
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["bits_per_code"] = 8.0 * static_cast<double>(bytes) / static_cast<double>(code_count());
}

void BM_VqMemcpy(benchmark::State& state) {
  const auto& c = layer_codes();
  std::vector<std::int16_t> k(c.k.codes.size()), v(c.v.codes.size());
  for (auto _ : state) {
    std::memcpy(k.data(), c.k.codes.data(), 2 * k.size());
    std::memcpy(v.data(), c.v.codes.data(), 2 * v.size());
    benchmark::DoNotOptimize(k.data());
    benchmark::DoNotOptimize(v.data());
    benchmark::ClobberMemory();
  }
  report(state, 2 * (k.size() + v.size()));
}
BENCHMARK(BM_VqMemcpy)->Unit(benchmark::kMillisecond);

// The kernel of a BM_VqEncode / BM_VqDecode run (its argument): 0 Auto, 1 Scalar, 2 Avx2, 3 Avx512.
// false (the run skipped with a message) where the CPU lacks it.
bool pick_kernel(benchmark::State& state, vq::RansKernel& kernel) {
  constexpr vq::RansKernel kKernels[] = {vq::RansKernel::Auto, vq::RansKernel::Scalar, vq::RansKernel::Avx2, vq::RansKernel::Avx512};
  kernel = kKernels[state.range(0)];
  if ((kernel == vq::RansKernel::Avx2 && !vq::rans_avx2_available()) || (kernel == vq::RansKernel::Avx512 && !vq::rans_avx512_available())) {
    state.SkipWithError("this CPU lacks the kernel");
    return false;
  }
  return true;
}

void BM_VqEncode(benchmark::State& state) {
  const auto& c = layer_codes();
  vq::RansKernel kernel;
  if (!pick_kernel(state, kernel)) return;
  std::size_t n = 0;
  for (auto _ : state) {
    const auto b = vq::vq_encode(c, kernel);
    n = b.size();
    benchmark::DoNotOptimize(b.data());
  }
  if (vq::vq_encode(c, kernel) != vq::vq_encode(c, vq::RansKernel::Scalar)) state.SkipWithError("bytes differ from the reference's");
  report(state, n);
}
BENCHMARK(BM_VqEncode)->ArgName("kernel")->Arg(0)->Arg(1)->Arg(2)->Arg(3)->Unit(benchmark::kMillisecond);

void BM_VqDecode(benchmark::State& state) {
  const auto& c = layer_codes();
  vq::RansKernel kernel;
  if (!pick_kernel(state, kernel)) return;
  const auto b = vq::vq_encode(c);
  for (auto _ : state) {
    auto back = vq::vq_decode(b, static_cast<std::uint64_t>(code_count()), kernel);
    benchmark::DoNotOptimize(back.k.codes.data());
  }
  const auto back = vq::vq_decode(b, static_cast<std::uint64_t>(code_count()), kernel);
  if (back.k.codes != c.k.codes || back.v.codes != c.v.codes) state.SkipWithError("round trip differs");
  report(state, b.size());
}
BENCHMARK(BM_VqDecode)->ArgName("kernel")->Arg(0)->Arg(1)->Arg(2)->Arg(3)->Unit(benchmark::kMillisecond);

// The same into one VqLayerCodes kept across calls (vq_decode's overload that reuses the caller's
// code buffers: no allocation, no zero fill), as a loader decoding layer after layer would.
void BM_VqDecodeInto(benchmark::State& state) {
  const auto& c = layer_codes();
  vq::RansKernel kernel;
  if (!pick_kernel(state, kernel)) return;
  const auto b = vq::vq_encode(c);
  vq::VqLayerCodes back;
  for (auto _ : state) {
    vq::vq_decode(b, static_cast<std::uint64_t>(code_count()), back, kernel);
    benchmark::DoNotOptimize(back.k.codes.data());
  }
  if (back.k.codes != c.k.codes || back.v.codes != c.v.codes) state.SkipWithError("round trip differs");
  report(state, b.size());
}
BENCHMARK(BM_VqDecodeInto)->ArgName("kernel")->Arg(0)->Arg(1)->Arg(2)->Arg(3)->Unit(benchmark::kMillisecond);

#ifdef VQ_HAVE_ZSTD
void BM_VqZstd1Compress(benchmark::State& state) { report(state, vqbench::zstd1_compress_loop(state, raw_codes())); }
BENCHMARK(BM_VqZstd1Compress)->Unit(benchmark::kMillisecond);

void BM_VqZstd1Decompress(benchmark::State& state) { report(state, vqbench::zstd1_decompress_loop(state, raw_codes())); }
BENCHMARK(BM_VqZstd1Decompress)->Unit(benchmark::kMillisecond);
#endif

// Issue 15 item 2: a bound check over every code (arg 0: a branch and a throw with a fixed message;
// arg 1: require with the lazy message, the arguments formatted only when a check fails; arg 2:
// the eager form require(ok, fmt::format(...)) that formatted one message per passing check before
// commit 6e4014e). 0 and 1 must run at the same speed.
void BM_VqCheckLoop(benchmark::State& state) {
  const auto& codes = layer_codes().k.codes;
  const auto mode = state.range(0);
  for (auto _ : state) {
    for (std::size_t i = 0; i < codes.size(); ++i) {
      const bool ok = codes[i] >= -vq::kVqMaxCode && codes[i] <= vq::kVqMaxCode;
      if (mode == 0) {
        if (!ok) [[unlikely]]
          vq::throw_invalid_argument("code outside the range");
      } else if (mode == 1) {
        vq::require(ok, "code {} at {} is outside +-{}", codes[i], i, vq::kVqMaxCode);
      } else {
        vq::require(ok, fmt::format("code {} at {} is outside +-{}", codes[i], i, vq::kVqMaxCode));
      }
    }
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(codes.size()));
}
BENCHMARK(BM_VqCheckLoop)->Arg(0)->Arg(1)->Arg(2)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
