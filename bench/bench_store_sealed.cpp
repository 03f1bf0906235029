// What a store secret costs a load (issue 36: "the MAC and prefix checks cost under 2 % of a RAM-hit
// load"). One prefix of synthetic K/V (KV heads x head size, layers, tokens as given) is put at a
// level into two file: stores under /dev/shm (RAM), one plain and one sealed (a secret: a keyed
// BLAKE2b MAC per blob); then loads alternate between them, round after round, in one process, and
// the medians are compared. The prefix check (each blob's prefix hash against the prompt's) runs in
// both; its cost is timed alone too (decode_chunk with and without it is the same call, so it is
// timed as the 16-hex-digit compare it adds, per chunk).
//   vq_bench_store_sealed [--layers 12] [--kv-heads 4] [--head-dim 64] [--tokens 4096] [--chunk-tokens 256]
//                         [--level fp16] [--rounds 15] [--threads 0 (all)] [--verbose (each load's fetch and decode)]
// The goal is held to the MAC's own cost, "get of every blob": the same reads from both stores, so
// their difference is the tag checks alone; whole loads on this shared machine vary by more than it.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <unistd.h>
#include <vector>

#include <fmt/core.h>

#include "veloxquant/cache/builder.hpp"
#include "bench_timing.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/store/file_store.hpp"
#include "veloxquant/store/prefix_loader.hpp"
#include "veloxquant/store/sealed_store.hpp"

using vqbench::Clock;
using vqbench::median;
using vqbench::ms_since;

int main(int argc, char** argv) try {
  int layers = 12, heads = 4, dim = 64, tokens = 4096, C = 256, rounds = 15, threads = 0;
  bool verbose = false;
  std::string level = "fp16";
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--verbose") {
      verbose = true;
      --i;
      continue;
    }
    if (i + 1 >= argc) throw vq::InvalidArgument(k + " needs a value");
    const std::string v = argv[i + 1];
    if (k == "--layers") layers = std::stoi(v);
    else if (k == "--kv-heads") heads = std::stoi(v);
    else if (k == "--head-dim") dim = std::stoi(v);
    else if (k == "--tokens") tokens = std::stoi(v);
    else if (k == "--chunk-tokens") C = std::stoi(v);
    else if (k == "--level") level = v;
    else if (k == "--rounds") rounds = std::stoi(v);
    else if (k == "--threads") threads = std::stoi(v);
    else throw vq::InvalidArgument("unknown option " + k);
  }
  level = vq::MethodSpec::parse(level).to_string();
  const auto model = vq::ModelDescription::uniform(layers, dim);
  const vq::LevelCaches fresh = [&](const std::string& l) { return vq::make_caches(vq::MethodSpec::parse(l), model); };
  std::mt19937 rng(36);
  std::normal_distribution<float> nd;
  std::vector<int> ids(static_cast<std::size_t>(tokens) + 1);
  for (auto& t : ids) t = static_cast<int>(rng() % 30000) + 3;
  std::vector<vq::KVState> exact;
  for (int l = 0; l < layers; ++l) {
    std::vector<float> k(static_cast<std::size_t>(heads) * tokens * dim), v(k.size());
    for (auto& x : k) x = nd(rng);
    for (auto& x : v) x = nd(rng);
    exact.push_back({vq::Tensor::from_f32({1, heads, tokens, dim}, k), vq::Tensor::from_f32({1, heads, tokens, dim}, v)});
  }
  const std::filesystem::path base = std::filesystem::exists("/dev/shm") ? "/dev/shm" : std::filesystem::temp_directory_path();
  const auto plain_dir = base / fmt::format("vq-bench-sealed-plain-{}", ::getpid());
  const auto sealed_dir = base / fmt::format("vq-bench-sealed-mac-{}", ::getpid());
  std::filesystem::remove_all(plain_dir);
  std::filesystem::remove_all(sealed_dir);
  vq::FileStore plain(plain_dir);
  vq::SealedStore sealed(std::make_unique<vq::FileStore>(sealed_dir), vq::StoreGuards{std::string("bench secret"), std::nullopt});
  vq::ChunkScheme scheme{0xbe7c, C, {level}};
  const auto prefix = std::span<const int>(ids).first(static_cast<std::size_t>(tokens));
  const auto rp = vq::put_context(plain, fresh, scheme, prefix, exact);
  vq::put_context(sealed, fresh, scheme, prefix, exact);
  const auto load = [&](vq::KVStore& s) {
    vq::LoaderOptions o;
    o.scheme = scheme;
    o.allow_recompute = false;
    o.threads = threads;
    auto caches = vq::make_caches(vq::MethodSpec::parse("fp32"), model);
    const auto t = Clock::now();
    const auto rep = vq::load_prefix(s, vq::ChunkShape{heads, dim}, caches, ids, o);
    const double ms = ms_since(t);
    if (rep.tokens_reused != tokens) throw vq::Error(fmt::format("a load reused {} of {} tokens", rep.tokens_reused, tokens));
    if (verbose) {
      double f = 0, d = 0;
      for (const auto& c : rep.chunks) f += c.fetch_ms, d += c.decode_ms;
      fmt::print(stderr, "{}: {:.1f} ms, chunks' fetch {:.1f} ms, decode+feed {:.1f} ms\n", s.describe(), ms, f, d);
    }
    return ms;
  };
  load(plain), load(sealed);  // warm: page cache, cost tables
  std::vector<double> a, b;
  for (int r = 0; r < rounds; ++r) {
    a.push_back(load(plain));
    b.push_back(load(sealed));
  }
  // The MAC alone: every blob of the prefix got from each store (the same files, the same reads),
  // the sealed one also checking tags; the difference of the medians is what the MAC adds to a load.
  std::vector<std::string> keys;
  for (const auto& k : plain.list()) keys.push_back(k);
  std::vector<std::string> sealed_keys = keys;
  const auto get_all = [&](vq::KVStore& s) {
    const auto t = Clock::now();
    std::uint64_t n = 0;
    for (const auto& k : keys) n += s.get(k)->size();
    const double ms = ms_since(t);
    return n ? ms : -1.0;
  };
  std::vector<double> ga, gb;
  for (int r = 0; r < 3 * rounds; ++r) {
    ga.push_back(get_all(plain));
    gb.push_back(get_all(sealed));
  }
  // The prefix check alone: the compare decode_chunk adds, per chunk (hex of the chain, compared).
  const int chunks = tokens / C;
  const auto tc = Clock::now();
  int same = 0;
  for (int r = 0; r < 1000; ++r)
    for (int i = 0; i < chunks; ++i) same += fmt::format("{:016x}", static_cast<std::uint64_t>(r * 7919 + i)) == fmt::format("{:016x}", 0xc0ffeeULL);
  const double check_ms = ms_since(tc) / 1000.0;
  const double pa = median(a), pb = median(b);
  fmt::print("{} layers x {} KV heads x {} dims, {} tokens in {} chunks of {}, level {}: {:.1f} MB stored (files under {})\n", layers, heads,
             dim, tokens, chunks, C, level, static_cast<double>(rp.bytes_written) / 1e6, base.string());
  fmt::print("load from RAM, median of {}: plain {:.2f} ms, sealed {:.2f} ms: the MAC costs {:+.2f} % of the load\n", rounds, pa, pb,
             100.0 * (pb - pa) / pa);
  fmt::print("get of every blob, median of {}: plain {:.2f} ms, sealed {:.2f} ms: the MAC adds {:.2f} ms = {:.2f} % of the plain load\n",
             3 * rounds, median(ga), median(gb), median(gb) - median(ga), 100.0 * (median(gb) - median(ga)) / pa);
  fmt::print("prefix check ({} compares of 16 hex digits): {:.4f} ms = {:.3f} % of the plain load{}\n", chunks, check_ms, 100.0 * check_ms / pa,
             same < 0 ? "!" : "");
  std::filesystem::remove_all(plain_dir);
  std::filesystem::remove_all(sealed_dir);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "vq_bench_store_sealed: %s\n", e.what());
  return 1;
}
