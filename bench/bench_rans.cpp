// rANS codec throughput beside memcpy and zstd -1 in the same run, plus the table-precision and
// size measurements behind kDefaultScaleBits (docs/benchmarks.md, "rANS codec (issue 4)").
//   ./build/bench/vq_bench_rans
// Msym/s = items_per_second / 1e6. Sizes are reported as counters (bytes, ratio to the bound).
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <benchmark/benchmark.h>
#include <emmintrin.h>

#include "zstd_loops.hpp"

#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/entropy/context_coder.hpp"
#include "veloxquant/synth/synthetic_kv.hpp"
#include "veloxquant/entropy/rans.hpp"

namespace {

constexpr std::size_t kN = 1 << 20;      // one long stream: 1 Mi symbols
constexpr std::size_t kChannel = 4096;   // tokens per channel in a cache
constexpr std::size_t kChannels = 64;    // channels coded as segments of one stream

// Codes of `bits` bits: a discretised Laplacian around mid-range (what quantised KV deltas look
// like), scale chosen so 4-bit codes carry about 3.2 bits and 8-bit codes about 6.6 bits.
std::vector<std::uint16_t> make_codes(int bits, std::size_t n, std::uint64_t seed, double spread = 1.0) {
  std::mt19937_64 rng(seed);
  const int levels = 1 << bits;
  std::exponential_distribution<double> e(1.0 / (spread * levels / 12.0));
  std::vector<std::uint16_t> s(n);
  for (auto& v : s) {
    const double d = (rng() & 1 ? 1 : -1) * e(rng);
    v = static_cast<std::uint16_t>(std::clamp(static_cast<int>(std::lround(levels / 2 + d)), 0, levels - 1));
  }
  return s;
}

double shannon_bits(const std::vector<std::uint16_t>& s, int alphabet) {
  std::vector<double> h(static_cast<std::size_t>(alphabet));
  for (auto v : s) ++h[v];
  double bits = 0;
  for (double c : h)
    if (c) bits -= c * std::log2(c / static_cast<double>(s.size()));
  return bits;
}

vq::RansKernel kernel_of(std::int64_t k) { return k ? vq::RansKernel::Avx2 : vq::RansKernel::Scalar; }
const char* kernel_name(std::int64_t k) { return k ? "avx2" : "scalar"; }

// Bit-packed codes (what zstd is fed, and the fixed-width size).
std::vector<std::uint8_t> pack(const std::vector<std::uint16_t>& s, int bits) {
  std::vector<std::uint8_t> out((s.size() * static_cast<std::size_t>(bits) + 7) / 8, 0);
  std::size_t bit = 0;
  for (auto v : s)
    for (int b = 0; b < bits; ++b, ++bit)
      if (v >> b & 1) out[bit / 8] |= static_cast<std::uint8_t>(1u << (bit % 8));
  return out;
}

void BM_Memcpy(benchmark::State& state) {
  const auto s = make_codes(static_cast<int>(state.range(0)), kN, 1);
  std::vector<std::uint16_t> d(s.size());
  for (auto _ : state) {
    std::memcpy(d.data(), s.data(), s.size() * 2);
    benchmark::DoNotOptimize(d.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * s.size()));
  state.SetLabel("uint16 symbols");
}
BENCHMARK(BM_Memcpy)->Arg(4)->Arg(8)->Unit(benchmark::kMicrosecond);

void BM_RansEncode(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const auto s = make_codes(bits, kN, 1);
  const auto t = vq::FrequencyTable::from_symbols(s, 1 << bits);
  std::vector<std::uint8_t> out;
  for (auto _ : state) {
    out = vq::rans_encode(s, t, kernel_of(state.range(1)));
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * s.size()));
  state.counters["bits_per_sym"] = 8.0 * static_cast<double>(out.size()) / static_cast<double>(s.size());
  state.counters["shannon_bits"] = shannon_bits(s, 1 << bits) / static_cast<double>(s.size());
  state.SetLabel(kernel_name(state.range(1)));
}
BENCHMARK(BM_RansEncode)->ArgsProduct({{4, 8}, {0, 1}})->Unit(benchmark::kMicrosecond);

// Steady state: rans_encode_append into the caller's buffer, whose capacity is kept between calls
// (what a cache that reuses its output buffer sees; BM_RansEncode also times allocating the output).
void BM_RansEncodeAppend(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const auto s = make_codes(bits, kN, 1);
  const auto t = vq::FrequencyTable::from_symbols(s, 1 << bits);
  const vq::RansEncodeSegment seg{s, &t};
  std::vector<std::uint8_t> out;
  out.reserve(vq::rans_encode_bound(s.size()));
  for (auto _ : state) {
    out.clear();
    vq::rans_encode_append(out, std::span<const vq::RansEncodeSegment>(&seg, 1), kernel_of(state.range(1)));
    benchmark::DoNotOptimize(out.data());
  }
  if (out != vq::rans_encode(s, t, vq::RansKernel::Scalar)) state.SkipWithError("bytes differ from the reference");
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * s.size()));
  state.counters["bits_per_sym"] = 8.0 * static_cast<double>(out.size()) / static_cast<double>(s.size());
  state.SetLabel(kernel_name(state.range(1)));
}
BENCHMARK(BM_RansEncodeAppend)->ArgsProduct({{4, 8}, {0, 1}})->Unit(benchmark::kMicrosecond);

void BM_RansDecode(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const auto s = make_codes(bits, kN, 1);
  const auto t = vq::FrequencyTable::from_symbols(s, 1 << bits);
  const auto enc = vq::rans_encode(s, t);
  std::vector<std::uint16_t> out(s.size());
  for (auto _ : state) {
    vq::rans_decode(enc, t, out, kernel_of(state.range(1)));
    benchmark::DoNotOptimize(out.data());
  }
  if (out != s) state.SkipWithError("round trip failed");
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * s.size()));
  state.SetLabel(kernel_name(state.range(1)));
}
BENCHMARK(BM_RansDecode)->ArgsProduct({{4, 8}, {0, 1}})->Unit(benchmark::kMicrosecond);

#ifdef VQ_HAVE_ZSTD
void BM_Zstd1Compress(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const std::size_t n = vqbench::zstd1_compress_loop(state, pack(make_codes(bits, kN, 1), bits));
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * kN));
  state.counters["bits_per_sym"] = 8.0 * static_cast<double>(n) / kN;
  state.SetLabel("bit-packed codes");
}
BENCHMARK(BM_Zstd1Compress)->Arg(4)->Arg(8)->Unit(benchmark::kMicrosecond);

// Times zstd -1 decompressing `packed` (vqbench::zstd1_decompress_loop); `symbols` codes per pass.
// Returns the compressed size.
std::size_t zstd1_decompress_loop(benchmark::State& state, const std::vector<std::uint8_t>& packed, std::size_t symbols) {
  const std::size_t comp = vqbench::zstd1_decompress_loop(state, packed);
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * symbols));
  state.SetLabel("bit-packed codes");
  return comp;
}

void BM_Zstd1Decompress(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  zstd1_decompress_loop(state, pack(make_codes(bits, kN, 1), bits), kN);
}
BENCHMARK(BM_Zstd1Decompress)->Arg(4)->Arg(8)->Unit(benchmark::kMicrosecond);
#endif

// The cache's case: kChannels channels of kChannel tokens, one table per channel (serialised and
// counted), all channels as segments of one stream. Args: bits, scale_bits. Decode time includes
// building each channel's slot table; sizes are compared with sum(Shannon) + table bytes.
struct Channels {
  std::vector<std::vector<std::uint16_t>> syms;
  std::vector<vq::FrequencyTable> tables;
  double shannon_bytes = 0;
  std::size_t table_bytes = 0;
  Channels(int bits, int scale) {
    for (std::size_t c = 0; c < kChannels; ++c) {
      syms.push_back(make_codes(bits, kChannel, 100 + c, 0.6 + 0.02 * static_cast<double>(c)));
      tables.push_back(vq::FrequencyTable::from_symbols(syms.back(), 1 << bits, scale));
      shannon_bytes += shannon_bits(syms.back(), 1 << bits) / 8;
      table_bytes += tables.back().serialized_size();
    }
  }
};

void BM_ChannelsDecode(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0)), scale = static_cast<int>(state.range(1));
  const Channels ch(bits, scale);
  std::vector<vq::RansEncodeSegment> enc;
  for (std::size_t c = 0; c < kChannels; ++c) enc.push_back({ch.syms[c], &ch.tables[c]});
  const auto bytes = vq::rans_encode(enc);
  std::vector<std::vector<std::uint16_t>> out(kChannels, std::vector<std::uint16_t>(kChannel));
  std::vector<vq::RansDecodeSegment> dec;
  for (std::size_t c = 0; c < kChannels; ++c) dec.push_back({out[c], &ch.tables[c]});
  for (auto _ : state) {
    vq::rans_decode(bytes, dec);
    benchmark::DoNotOptimize(out[0].data());
  }
  if (out != ch.syms) state.SkipWithError("round trip failed");
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * kChannels * kChannel));
  const double coded = static_cast<double>(bytes.size() + ch.table_bytes);
  state.counters["coded_vs_shannon_plus_table"] = coded / (ch.shannon_bytes + static_cast<double>(ch.table_bytes));
  state.counters["payload_vs_shannon"] = static_cast<double>(bytes.size()) / ch.shannon_bytes;
  state.counters["table_share"] = static_cast<double>(ch.table_bytes) / coded;
}
BENCHMARK(BM_ChannelsDecode)
    ->ArgsProduct({{4, 8}, {10, 11, 12, 13, 14, 15}})
    ->Unit(benchmark::kMicrosecond);

void BM_ChannelsEncode(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const Channels ch(bits, vq::kDefaultScaleBits);
  std::vector<vq::RansEncodeSegment> enc;
  for (std::size_t c = 0; c < kChannels; ++c) enc.push_back({ch.syms[c], &ch.tables[c]});
  for (auto _ : state) benchmark::DoNotOptimize(vq::rans_encode(enc).data());
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * kChannels * kChannel));
}
BENCHMARK(BM_ChannelsEncode)->Arg(4)->Arg(8)->Unit(benchmark::kMicrosecond);

// One channel alone, as a self-describing block (table + 32 states + payload).
void BM_SingleChannelBlock(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const auto s = make_codes(bits, kChannel, 7);
  std::vector<std::uint8_t> b;
  for (auto _ : state) {
    b = vq::encode_block(s, 1 << bits);
    benchmark::DoNotOptimize(b.data());
  }
  const auto t = vq::FrequencyTable::from_symbols(s, 1 << bits);
  state.counters["coded_vs_shannon_plus_table"] =
      static_cast<double>(b.size()) / (shannon_bits(s, 1 << bits) / 8 + static_cast<double>(t.serialized_size()));
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * s.size()));
}
BENCHMARK(BM_SingleChannelBlock)->Arg(4)->Arg(8)->Unit(benchmark::kMicrosecond);

// The context coder (entropy/context_coder.hpp) on cache-like 4-bit codes: 8 slices x 4096 tokens x
// D = 128, groups of 32, each channel an AR(1) walk (rho 0.9) run through every group (the quantizer,
// not the data, restarts at a group start: the codes keep their level across it); zstd
// -1 gets the same codes channel-major and bit-packed, in the same run (as `bench codec` feeds it).
struct DriftCodes {
  vq::ContextLayout layout{8, 4096, 128, 4, {}};
  std::vector<std::uint8_t> codes;
  DriftCodes() {
    layout.group_start = vq::group_starts(std::vector<std::int64_t>{4096}, 32);
    codes.resize(layout.size());
    std::mt19937_64 rng(3);
    std::normal_distribution<double> nd(0, 1);
    for (std::size_t s = 0; s < layout.slices; ++s)
      for (std::size_t c = 0; c < layout.dim; ++c) {
        double v = 0;
        for (std::size_t t = 0; t < layout.tokens; ++t) {
          v = 0.9 * v + nd(rng);
          codes[(s * layout.tokens + t) * layout.dim + c] = static_cast<std::uint8_t>(std::clamp(static_cast<int>(std::lround(v * 2 + 7.5)), 0, 15));
        }
      }
  }
};

void BM_ContextEncode(benchmark::State& state) {
  const DriftCodes d;
  std::vector<std::uint8_t> b;
  for (auto _ : state) {
    b = vq::context_encode(d.codes, d.layout);
    benchmark::DoNotOptimize(b.data());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * d.codes.size()));
  state.counters["bits_per_symbol"] = static_cast<double>(b.size()) * 8.0 / static_cast<double>(d.codes.size());
}
BENCHMARK(BM_ContextEncode)->Unit(benchmark::kMicrosecond);

// Times context_decode of `codes` (encoded once, outside the loop) and checks the round trip.
void context_decode_loop(benchmark::State& state, const std::vector<std::uint8_t>& codes, const vq::ContextLayout& layout) {
  const auto b = vq::context_encode(codes, layout);
  std::vector<std::uint8_t> out(codes.size());
  for (auto _ : state) {
    vq::context_decode(b, layout, out);
    benchmark::DoNotOptimize(out.data());
  }
  if (out != codes) state.SkipWithError("round trip failed");
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * codes.size()));
  state.counters["bits_per_symbol"] = static_cast<double>(b.size()) * 8.0 / static_cast<double>(codes.size());
}

void BM_ContextDecode(benchmark::State& state) {
  const DriftCodes d;
  context_decode_loop(state, d.codes, d.layout);
}
BENCHMARK(BM_ContextDecode)->Unit(benchmark::kMicrosecond);

#ifdef VQ_HAVE_ZSTD
// zstd -1 over codes [slice][token][D] fed channel-major and bit-packed (as `bench codec` feeds
// it); with `unpack`, also back to one code per byte (SSE2, 32 codes per 16 packed bytes; still
// channel-major: the cache's layout would need a transpose on top), the output the context decoder
// delivers.
void zstd1_context_codes(benchmark::State& state, const std::vector<std::uint8_t>& codes, const vq::ContextLayout& l, bool unpack) {
  const std::size_t T = l.tokens, D = l.dim, n = codes.size();
  std::vector<std::uint16_t> cm(n);
  for (std::size_t s = 0; s < l.slices; ++s)
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t c = 0; c < D; ++c) cm[(s * D + c) * T + t] = codes[(s * T + t) * D + c];
  const auto packed = pack(cm, 4);
  if (!unpack) {
    const std::size_t comp = zstd1_decompress_loop(state, packed, n);
    state.counters["bits_per_symbol"] = static_cast<double>(comp) * 8.0 / static_cast<double>(n);
    return;
  }
  std::vector<std::uint8_t> comp(ZSTD_compressBound(packed.size())), raw(packed.size()), out(n);
  comp.resize(ZSTD_compress(comp.data(), comp.size(), packed.data(), packed.size(), 1));
  ZSTD_DCtx* dctx = ZSTD_createDCtx();
  const __m128i low = _mm_set1_epi8(15);
  for (auto _ : state) {
    benchmark::DoNotOptimize(ZSTD_decompressDCtx(dctx, raw.data(), raw.size(), comp.data(), comp.size()));
    for (std::size_t i = 0; i + 16 <= raw.size(); i += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(raw.data() + i));
      const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.data() + 2 * i), _mm_unpacklo_epi8(lo, hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.data() + 2 * i + 16), _mm_unpackhi_epi8(lo, hi));
    }
    benchmark::ClobberMemory();
  }
  ZSTD_freeDCtx(dctx);
  for (std::size_t i = 0; i < n; ++i)
    if (out[i] != cm[i]) {
      state.SkipWithError("zstd + unpack round trip failed");
      break;
    }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * n));
  state.counters["bits_per_symbol"] = static_cast<double>(comp.size()) * 8.0 / static_cast<double>(n);
}

void BM_ContextZstd1Decompress(benchmark::State& state) {
  const DriftCodes d;
  zstd1_context_codes(state, d.codes, d.layout, state.range(0) != 0);
}
BENCHMARK(BM_ContextZstd1Decompress)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);
#endif

// The cache's own codes: one side (arg 0 keys, 1 values) of a CacheGenKVCache (4 bits, group 32,
// group_aligned) over the synthetic K/V, 1 x 8 heads x 4096 tokens x D = 128 (the synthetic K/V of
// `bench codec`), as one layout of 8 slices.
struct CacheCodes {
  vq::ContextLayout layout{8, 4096, 128, 4, {}};
  std::vector<std::uint8_t> codes;
  explicit CacheCodes(int side) {
    vq::SyntheticKVConfig sc;
    sc.tokens = 4096;
    const auto kv = vq::make_synthetic_kv(sc);
    vq::CacheGenKVCache cache;
    cache.update_and_fetch(kv.keys, kv.values);
    const auto& st = side == 0 ? cache.key_stream() : cache.value_stream();
    layout.group_start = vq::group_starts(st.segment_tokens(), st.group_size());
    for (std::int64_t s = 0; s < st.slices(); ++s) {
      const auto c = st.codes(s);
      codes.insert(codes.end(), c.begin(), c.end());
    }
  }
};

void BM_CacheCodesContextDecode(benchmark::State& state) {
  const CacheCodes d(static_cast<int>(state.range(0)));
  context_decode_loop(state, d.codes, d.layout);
}
BENCHMARK(BM_CacheCodesContextDecode)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

void BM_CacheCodesContextEncode(benchmark::State& state) {
  const CacheCodes d(static_cast<int>(state.range(0)));
  std::vector<std::uint8_t> b;
  for (auto _ : state) {
    b = vq::context_encode(d.codes, d.layout);
    benchmark::DoNotOptimize(b.data());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * d.codes.size()));
}
BENCHMARK(BM_CacheCodesContextEncode)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

#ifdef VQ_HAVE_ZSTD
void BM_CacheCodesZstd1Decompress(benchmark::State& state) {
  const CacheCodes d(static_cast<int>(state.range(0) % 2));
  zstd1_context_codes(state, d.codes, d.layout, state.range(0) >= 2);
}
// 0, 1: keys, values; 2, 3: the same, unpacked to bytes.
BENCHMARK(BM_CacheCodesZstd1Decompress)->DenseRange(0, 3)->Unit(benchmark::kMicrosecond);
#endif

}  // namespace

BENCHMARK_MAIN();
