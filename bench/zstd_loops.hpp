// zstd -1 timing loops shared by the codec benchmarks (bench_rans.cpp, bench_vq_codec.cpp), so that
// every benchmark measures zstd the same way: one context reused across iterations, level 1, and
// the round trip checked after the loop (a mismatch fails the benchmark with SkipWithError).
// Only with VQ_HAVE_ZSTD (bench/CMakeLists.txt defines it where libzstd was found).
#pragma once
#ifdef VQ_HAVE_ZSTD
#include <cstddef>
#include <cstdint>
#include <vector>

#include <benchmark/benchmark.h>
#include <zstd.h>

namespace vqbench {

// Times zstd -1 compressing `raw`; returns the compressed size.
inline std::size_t zstd1_compress_loop(benchmark::State& state, const std::vector<std::uint8_t>& raw) {
  std::vector<std::uint8_t> out(ZSTD_compressBound(raw.size()));
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  std::size_t n = 0;
  for (auto _ : state) {
    n = ZSTD_compressCCtx(cctx, out.data(), out.size(), raw.data(), raw.size(), 1);
    benchmark::DoNotOptimize(out.data());
  }
  ZSTD_freeCCtx(cctx);
  return n;
}

// Times zstd -1 decompressing `raw` (compressed once, outside the loop); returns the compressed size.
inline std::size_t zstd1_decompress_loop(benchmark::State& state, const std::vector<std::uint8_t>& raw) {
  std::vector<std::uint8_t> comp(ZSTD_compressBound(raw.size())), out(raw.size());
  comp.resize(ZSTD_compress(comp.data(), comp.size(), raw.data(), raw.size(), 1));
  ZSTD_DCtx* dctx = ZSTD_createDCtx();
  for (auto _ : state) {
    benchmark::DoNotOptimize(ZSTD_decompressDCtx(dctx, out.data(), out.size(), comp.data(), comp.size()));
    benchmark::ClobberMemory();
  }
  ZSTD_freeDCtx(dctx);
  if (out != raw) state.SkipWithError("zstd round trip differs");
  return comp.size();
}

}  // namespace vqbench
#endif
