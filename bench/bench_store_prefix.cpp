// Prefix loading benchmark (issue 16's goals 1-3): a 7B-shaped prefix (32 layers, 8 KV heads x 128,
// 4096 tokens; synthetic K/V from make_synthetic_kv) stored in a Redis server this bench starts
// (127.0.0.1, a free port, stopped by pid: tests/store/redis_servers.hpp), loaded by load_prefix
// in one run:
//   1. at vq:bits=2 into vq:bits=2 host caches (the code domain: the codes packed into the caches'
//      fields, no rows) and at fp16 (exact for fp16 K/V) into fp32 host caches, under an emulated
//      1 Gbps link, 10 Gbps and bare loopback: median load time of each, and the ratio fp16 / vq
//      (goals: >= 5x, >= 2x, >= 1x), and against the floor of any fp16 load: its blobs fetched
//      alone from the same server (no decode, no caches), or its link time where that is longer;
//   2. decode throughput of the load path: the vq:bits=2 prefix loaded from memory (an in-process
//      store, no network), GB/s of fp16-equivalent output (tokens x layers x heads x D x 2 sides x 2
//      bytes / s; goal >= 1.5 on all cores) with 1 thread and all, and the process CPU time, into
//      vq:bits=2 host caches (code domain) and, beside it, into fp32 host caches (rows);
//   3. --slo-runs loads (100) with levels vq:bits=1;2;4 and fp16, a deadline (--slo-ms, repeatable: the
//      runs once per deadline; default: the
//      time the 1 Gbps -> 100 Mbps link needs for the first half at vq:bits=2 and the second at
//      vq:bits=1, x 1.25, plus the vq:bits=2 load from memory into fp32 hosts on all threads measured
//      in step 2: the decode the link cannot hide, in the hosts goal 3 loads into) and a link that drops from 1 Gbps to 100 Mbps after
//      half the vq:bits=2 prefix's bytes: deadline hit rate (goal >= 95 %) and the levels chosen.
// The model is random weights of the 7B KV shape (dim 1024 = 8 heads x 128, a 64-wide FFN): it names
// the chunks (fingerprint), gives vq its layer transforms, and prices recomputes (far cheaper than a
// real 7B's, so recompute is chosen less often than it would be there).
//   vq_bench_store_prefix [--layers 32] [--tokens 4096] [--chunk-tokens 256] [--threads 0] [--reps 3]
//                         [--slo-runs 100] [--slo-ms MS]... [--slo-guard F]... [--slo-check 5] [--url redis://...] [--skip-links]
// (--slo-guard: goal 3 once per guard of the deadline against a link drop, LoaderOptions::slo_guard; 1 trusts the link)
// Goal 3 also prints: load ms p50 / p99, the plans the loader chose (levels per chunk, most frequent
// first), the clairvoyant plan (every per-chunk assignment of the levels and recompute, priced by
// the loader's own cost model with the costs this process measured and the drop known in advance:
// the best quality whose predicted load fits the deadline), and --slo-check loads with each level
// forced for every chunk under the same link and deadline (how often each uniform level meets it:
// a check that the loader did not leave a better level that fits).
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "../tests/store/redis_servers.hpp"
#include "bench_timing.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/model/random_checkpoint.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/vq_layer_models.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/store/kv_store.hpp"
#include "veloxquant/store/load_plan.hpp"
#include "veloxquant/store/prefix_chunks.hpp"
#include "veloxquant/store/prefix_loader.hpp"
#include "veloxquant/synth/synthetic_kv.hpp"

namespace {

using vqbench::Clock;
using vqbench::ms_since;

struct Args {
  int layers = 32, tokens = 4096, chunk_tokens = 256, threads = 0, reps = 3, slo_runs = 100, slo_check = 5;
  std::vector<double> slo_ms;  // --slo-ms, repeatable: goal 3 once per deadline
  std::vector<double> slo_guards;  // --slo-guard, repeatable: goal 3 once per guard (LoaderOptions::slo_guard); default its default
  std::string url;
  bool skip_links = false;
};

// Random weights of the 7B KV shape: 8 heads (all KV heads) x 128 = dim 1024, tiny FFN and vocab.
vq::Checkpoint random_checkpoint(int layers, int seq_len) {
  vq::ModelConfig c;
  c.dim = 1024, c.hidden_dim = 64, c.n_layers = layers, c.n_heads = 8, c.n_kv_heads = 8, c.vocab_size = 512, c.seq_len = seq_len;
  return vq::random_checkpoint(c, 7);
}

// An in-process store: the load path without a network (decode throughput).
class MemoryStore final : public vq::KVStore {
 public:
  void put(std::string_view key, std::span<const std::uint8_t> blob) override {
    std::lock_guard<std::mutex> l(mu_);
    blobs_.emplace(std::string(key), vq::Blob(blob.begin(), blob.end()));
  }
  void replace(std::string_view key, std::span<const std::uint8_t> blob) override {
    std::lock_guard<std::mutex> l(mu_);
    blobs_[std::string(key)] = vq::Blob(blob.begin(), blob.end());
  }
  std::optional<vq::Blob> get(std::string_view key) override {
    std::lock_guard<std::mutex> l(mu_);
    const auto it = blobs_.find(std::string(key));
    if (it == blobs_.end()) return std::nullopt;
    return it->second;
  }
  bool exists(std::string_view key) override {
    std::lock_guard<std::mutex> l(mu_);
    return blobs_.count(std::string(key)) > 0;
  }
  bool remove(std::string_view key) override {
    std::lock_guard<std::mutex> l(mu_);
    return blobs_.erase(std::string(key)) > 0;
  }
  std::vector<std::string> list() override {
    std::lock_guard<std::mutex> l(mu_);
    std::vector<std::string> k;
    for (const auto& [key, b] : blobs_) k.push_back(key);
    return k;
  }
  vq::StoreStats stats() override { return {blobs_.size(), 0, 0, "memory"}; }
  std::string describe() const override { return "memory:"; }

 private:
  std::mutex mu_;
  std::map<std::string, vq::Blob> blobs_;
};

using vqbench::median;

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress shows as it happens
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "vq_bench_store_prefix: %s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--layers") a.layers = std::stoi(next());
    else if (k == "--tokens") a.tokens = std::stoi(next());
    else if (k == "--chunk-tokens") a.chunk_tokens = std::stoi(next());
    else if (k == "--threads") a.threads = std::stoi(next());
    else if (k == "--reps") a.reps = std::stoi(next());
    else if (k == "--slo-runs") a.slo_runs = std::stoi(next());
    else if (k == "--slo-ms") a.slo_ms.push_back(std::stod(next()));
    else if (k == "--slo-check") a.slo_check = std::stoi(next());
    else if (k == "--slo-guard") a.slo_guards.push_back(std::stod(next()));
    else if (k == "--url") a.url = next();
    else if (k == "--skip-links") a.skip_links = true;
    else {
      std::fprintf(stderr, "usage: vq_bench_store_prefix [--layers L] [--tokens N] [--chunk-tokens C] [--threads T] [--reps R] "
                           "[--slo-runs N] [--slo-ms MS] [--slo-guard F] [--slo-check K] [--url URL] [--skip-links]\n");
      return 2;
    }
  }
  try {
    const int threads = a.threads > 0 ? a.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    const auto tb = Clock::now();
    vq::Transformer model(random_checkpoint(a.layers, a.tokens + 8));
    const std::uint64_t fp = vq::model_fingerprint(model);
    std::vector<int> tokens(static_cast<std::size_t>(a.tokens) + 1);
    for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int>((i * 7919 + 1) % 512);
    std::vector<vq::KVState> exact;
    for (int l = 0; l < a.layers; ++l) {
      vq::SyntheticKVConfig sc;
      sc.heads = 8, sc.head_dim = 128, sc.tokens = a.tokens, sc.seed = static_cast<std::uint64_t>(l) + 1, sc.dtype = vq::DType::F32;
      const auto kv = vq::make_synthetic_kv(sc);
      // fp16 K/V, as a 7B model's cache holds them: the fp16 level is then exact.
      exact.push_back({kv.keys.to(vq::DType::F16).to(vq::DType::F32), kv.values.to(vq::DType::F16).to(vq::DType::F32)});
    }
    const double fp16_bytes = 2.0 * 2.0 * a.layers * 8.0 * 128.0 * (a.tokens / a.chunk_tokens * a.chunk_tokens);
    fmt::print("shape: {} layers x 8 KV heads x 128, {} tokens, chunks of {}: fp16 {:.1f} MB; {} decoder threads; setup {:.1f} s\n", a.layers,
               a.tokens, a.chunk_tokens, fp16_bytes / 1e6, threads, ms_since(tb) / 1e3);

    const auto server_dir = std::filesystem::temp_directory_path() / fmt::format("vq-bench-prefix-{}", ::getpid());
    struct RemoveDir {  // after the servers stopped (declared first, destroyed last): their logs go too
      std::filesystem::path p;
      ~RemoveDir() {
        std::error_code ec;
        std::filesystem::remove_all(p, ec);
      }
    } remove_dir{a.url.empty() ? server_dir : std::filesystem::path()};
    std::unique_ptr<vqtest::RedisServers> servers;
    std::string url = a.url;
    if (url.empty()) {
      servers = std::make_unique<vqtest::RedisServers>(server_dir);
      const auto s = servers->start();
      url = fmt::format("redis://127.0.0.1:{}", servers->port(s));
    }
    auto store = vq::open_store(url);
    const auto scheme_of = [&](std::vector<std::string> levels) {
      vq::ChunkScheme s;
      s.model_fingerprint = fp;
      s.chunk_tokens = a.chunk_tokens;
      for (const auto& l : levels) s.levels.push_back(vq::MethodSpec::parse(l).to_string());
      return s;
    };
    const auto prefix = std::span<const int>(tokens).first(static_cast<std::size_t>(a.tokens));
    const vq::ChunkScheme vq2 = scheme_of({"vq:bits=2"}), f16 = scheme_of({"fp16"}), rest = scheme_of({"vq:bits=1", "vq:bits=4"});
    std::map<std::string, std::vector<vq::ChunkDirectory>> dirs;
    // The vq layer models, built once for the whole run and held here: the puts of every vq level
    // and the loads share them (make_caches / vq_layer_models share a layer model while it is held).
    const auto tm = Clock::now();
    const auto held_layer_models = vq::make_caches(vq2.levels.front(), model);
    fmt::print("vq layer models ({} layers): {:.1f} s\n", a.layers, ms_since(tm) / 1e3);
    // The other vq levels serve goal 3 only.
    const std::vector<const vq::ChunkScheme*> put_schemes =
        a.slo_runs > 0 ? std::vector<const vq::ChunkScheme*>{&vq2, &f16, &rest} : std::vector<const vq::ChunkScheme*>{&vq2, &f16};
    for (const auto* s : put_schemes) {
      const auto tp = Clock::now();
      const auto r = vq::put_context(*store, model, *s, prefix, exact);
      fmt::print("put {}: {} chunks, {:.1f} MB, {:.1f} s\n", fmt::join(s->levels, ";"), r.chunks, r.bytes_written / 1e6, ms_since(tp) / 1e3);
      dirs[s->levels.front()] = r.directories;
    }
    // The SLO scheme (vq:bits=1;2;4 and fp16): the directories list every level put above (a lookup
    // finds them all); slo_dirs is the same list for the clairvoyant plan below.
    const vq::ChunkScheme slo_scheme = scheme_of({"vq:bits=1", "vq:bits=2", "vq:bits=4", "fp16"});
    std::uint64_t vq2_bytes = 0;
    for (const auto& d : dirs[vq2.levels[0]]) vq2_bytes += d.entries[0].bytes;
    std::vector<vq::ChunkDirectory> slo_dirs;  // the SLO scheme's directories (the clairvoyant plan below)
    if (a.slo_runs > 0) {
      for (std::size_t i = 0; i < dirs[vq2.levels[0]].size(); ++i) {
        const auto& r = dirs[rest.levels[0]][i].entries;
        slo_dirs.push_back(vq::ChunkDirectory{{r[0], dirs[vq2.levels[0]][i].entries[0], r[1], dirs[f16.levels[0]][i].entries[0]}, a.chunk_tokens});
      }
    }
    std::map<std::string, std::uint64_t> level_bytes;
    for (const auto& [name, ds] : dirs)
      for (const auto& d : ds)
        for (const auto& e : d.entries) level_bytes[e.level] += e.bytes;
    for (const auto& [l, b] : level_bytes) fmt::print("  level {}: {:.1f} MB ({:.2f}x smaller than fp16)\n", l, b / 1e6, fp16_bytes / static_cast<double>(b));

    // The loader's source of vq layer models (a host keeps one per model): it finds the held ones.
    const vq::VqLayerModelSource vq_models = vq::chunk_vq_models(model);

    double host_bytes = 0;  // nbytes() of the last load's host caches, summed over layers
    double slo_guard = vq::LoaderOptions{}.slo_guard;  // goal 3's loads: the guard of the deadline
    // host: the method of the caches loaded into ("fp32": rows; "vq:bits=2": the code domain for vq:bits=2 chunks).
    const auto load = [&](vq::KVStore& st, const vq::ChunkScheme& s, std::optional<double> mbps, int nthreads, bool recompute = false,
                          std::optional<double> slo = std::nullopt, std::optional<double> after = std::nullopt, std::uint64_t drop = 0,
                          const std::string& host = "fp32") {
      vq::LoaderOptions o;
      o.scheme = s;
      o.bandwidth_mbps = mbps;
      o.bandwidth_after_mbps = after;
      o.drop_after_bytes = drop;
      o.slo_ms = slo;
      o.slo_guard = slo_guard;
      o.threads = nthreads;
      o.allow_recompute = recompute;
      o.vq_models = vq_models;
      auto caches = vq::make_caches(host, model);
      auto r = vq::load_prefix(st, model, caches, tokens, o, [](const std::string& w) { fmt::print(stderr, "warning: {}\n", w); });
      host_bytes = 0;
      for (const auto& c : caches) host_bytes += static_cast<double>(c->nbytes());
      if (!slo && r.tokens_reused != a.tokens / a.chunk_tokens * a.chunk_tokens)
        throw vq::Error(fmt::format("load of {} reused {} tokens only", s.levels.front(), r.tokens_reused));
      return r;
    };
    // A first, untimed vq load: warms the server and the loader (the layer models are held above).
    {
      const auto tc = Clock::now();
      load(*store, vq2, std::nullopt, threads, false, std::nullopt, std::nullopt, 0, vq2.levels[0]);
      fmt::print("first vq:bits=2 load: {:.0f} ms\n", ms_since(tc));
    }

    // median vq:bits=2 load from memory into fp32 hosts on all threads (step 2): the decode-bound part of goal 3's deadline
    double rows_vq_ms = 0;
    if (!a.skip_links) {
      fmt::print("\ngoal 1: load time, median of {} loads ({} decoder threads): vq:bits=2 fetch + decode of the codes into vq:bits=2 "
                 "host caches (code domain: no rows), fp16 fetch + decode into fp32 host caches\n", a.reps, threads);
      // The floor of any fp16 load: its bytes fetched, nothing decoded or stored. On loopback the
      // fp16 blobs' gets alone, one after another as the loader's fetcher makes them; on an emulated
      // link the larger of that and the link's time for the bytes.
      std::vector<double> fetch_alone;
      for (int r = 0; r < a.reps; ++r) {
        const auto tg = Clock::now();
        for (const auto& d : dirs[f16.levels[0]])
          for (const auto& e : d.entries)
            if (!store->get(e.key)) throw vq::IoError("fp16 blob missing: " + e.key);
        fetch_alone.push_back(ms_since(tg));
      }
      const double fetch_ms = median(fetch_alone);
      fmt::print("fp16 blobs fetched alone on loopback (no decode, no caches): {:.0f} ms\n", fetch_ms);
      fmt::print("| link | vq:bits=2 ms | fp16 ms | fp16 / vq | fp16 floor ms (link or fetch alone) | floor / vq |\n|---|---:|---:|---:|---:|---:|\n");
      for (const std::optional<double> mbps : {std::optional<double>(1000.0), std::optional<double>(10000.0), std::optional<double>()}) {
        std::vector<double> tv, tf;
        for (int r = 0; r < a.reps; ++r) {
          tv.push_back(load(*store, vq2, mbps, threads, false, std::nullopt, std::nullopt, 0, vq2.levels[0]).load_ms);
          tf.push_back(load(*store, f16, mbps, threads).load_ms);
        }
        const double floor_ms = mbps ? std::max(fetch_ms, static_cast<double>(level_bytes[f16.levels[0]]) * 8.0 / (*mbps * 1e3)) : fetch_ms;
        fmt::print("| {} | {:.0f} | {:.0f} | {:.2f}x | {:.0f} | {:.2f}x |\n", mbps ? fmt::format("{:.0f} Mbps (emulated)", *mbps) : std::string("loopback"),
                   median(tv), median(tf), median(tf) / median(tv), floor_ms, floor_ms / median(tv));
        std::fflush(stdout);
      }
    }

    {
      MemoryStore mem;
      for (const auto& d : dirs[vq2.levels[0]])
        for (const auto& e : d.entries) mem.put(e.key, *store->get(e.key));
      std::uint64_t dprev = 0;
      for (std::size_t i = 0; i < dirs[vq2.levels[0]].size(); ++i) {
        dprev = vq::directory_hash(dprev, a.chunk_tokens, prefix.subspan(i * static_cast<std::size_t>(a.chunk_tokens), static_cast<std::size_t>(a.chunk_tokens)));
        mem.put(vq::directory_key(dprev), vq::encode_directory(dirs[vq2.levels[0]][i]));
      }
      // CPU seconds of the process per wall second during each load: ~threads when the decoder threads
      // got the cores (on a shared machine they may not; then the ratio says why the speedup is low).
      const auto cpu_ms = [] {
        timespec ts{};
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
        return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
      };
      // Goal 2 two ways: into vq:bits=2 host caches (the code domain: rANS decode + packing the codes
      // into the host's fields) and, beside it, into fp32 host caches (codes -> rows: the inverse
      // transform per head, then the copy into the caches).
      // Minor page faults of the process (each a trap; on a virtual machine ~10 us apiece).
      const auto faults = [] {
        rusage u{};
        getrusage(RUSAGE_SELF, &u);
        return static_cast<double>(u.ru_minflt);
      };
      for (const std::string& host : {vq2.levels[0], std::string("fp32")}) {
        std::vector<double> t1, tn, c1, cn, cpu1, cpun, overlap, flt1;
        for (int r = 0; r < a.reps; ++r) {
          double c = cpu_ms();
          const double f0 = faults();
          t1.push_back(load(mem, vq2, std::nullopt, 1, false, std::nullopt, std::nullopt, 0, host).load_ms);
          cpu1.push_back(cpu_ms() - c);
          flt1.push_back(faults() - f0);
          c1.push_back(cpu1.back() / t1.back());
          c = cpu_ms();
          const auto rep = load(mem, vq2, std::nullopt, threads, false, std::nullopt, std::nullopt, 0, host);
          tn.push_back(rep.load_ms);
          cpun.push_back(cpu_ms() - c);
          cn.push_back(cpun.back() / tn.back());
          double dsum = 0;  // chunk decodes overlapping: their sum exceeds the wall time
          for (const auto& ch : rep.chunks) dsum += ch.decode_ms;
          overlap.push_back(dsum / rep.load_ms);
        }
        fmt::print("\ngoal 2: vq:bits=2 load path from memory into {} host caches{} (median of {}): 1 thread {:.0f} ms = {:.3f} GB/s of fp16 "
                   "output; {} threads {:.0f} ms = {:.3f} GB/s ({:.2f}x)\n",
                   host, host == "fp32" ? " (rows)" : " (code domain)", a.reps, median(t1), fp16_bytes / median(t1) / 1e6, threads,
                   median(tn), fp16_bytes / median(tn) / 1e6, median(t1) / median(tn));
        fmt::print("  process CPU time: 1 thread {:.0f} ms = {:.3f} GB/s per core-second; {} threads {:.0f} ms; cores busy (CPU / wall): "
                   "1 thread {:.2f}, {} threads {:.2f}; chunk decode ms summed / load ms with {} threads: {:.2f}\n",
                   median(cpu1), fp16_bytes / median(cpu1) / 1e6, threads, median(cpun), median(c1), threads, median(cn), threads,
                   median(overlap));
        fmt::print("  the host caches hold {:.2f} MB after a load (nbytes); minor page faults per 1-thread load {:.0f}\n", host_bytes / 1e6,
                   median(flt1));
        if (host == "fp32") rows_vq_ms = median(tn);
        std::fflush(stdout);
      }
    }

    if (a.slo_runs > 0) {
      // The default deadline: 1.25 x the link time of the first half of the vq:bits=2 bytes at 1 Gbps
      // and of the second half at vq:bits=1 at 100 Mbps, plus the measured vq:bits=2 load from memory
      // into fp32 hosts (the decode the link cannot hide: goal 3 loads into fp32 hosts, since its
      // chunks come at several levels).
      const double half = static_cast<double>(vq2_bytes) / 2;
      const double vq1_half = static_cast<double>(level_bytes[rest.levels[0]]) / 2;
      std::vector<double> deadlines = a.slo_ms;
      if (deadlines.empty()) {
        const double link_ms = 1.25 * (half / 125e3 + vq1_half / 12.5e3);
        deadlines.push_back(link_ms + rows_vq_ms);
        fmt::print("\ndefault deadline: 1.25 x link {:.0f} ms + decode (vq:bits=2 from memory into fp32 hosts, {} threads) {:.0f} ms = {:.0f} ms\n",
                   link_ms / 1.25, threads, rows_vq_ms, deadlines.back());
      }
      std::vector<std::pair<double, double>> runs;  // (deadline, guard)
      for (const double slo : deadlines)
        for (const double g : a.slo_guards.empty() ? std::vector<double>{slo_guard} : a.slo_guards) runs.emplace_back(slo, g);
      for (std::size_t ri = 0; ri < runs.size(); ++ri) {
        const auto [slo, guard] = runs[ri];
        const bool last_of_deadline = ri + 1 == runs.size() || runs[ri + 1].first != slo;
        slo_guard = guard;
        fmt::print("\ngoal 3: {} loads, --slo-ms {:.0f}, guard {}, link 1000 Mbps dropping to 100 Mbps after {:.1f} MB (half the vq:bits=2 prefix)\n",
                   a.slo_runs, slo, guard, half / 1e6);
        int met = 0;
        std::vector<double> times;
        std::map<std::string, int> before, after;  // levels chosen before / after the drop
        std::map<std::string, int> plans;          // the whole plan of each load
        const int n_chunks = a.tokens / a.chunk_tokens;
        const auto short_name = [](const std::string& l) { return l == "recompute" ? std::string("R") : l.substr(0, 9); };
        for (int r = 0; r < a.slo_runs; ++r) {
          const auto rep = load(*store, slo_scheme, 1000.0, threads, true, slo, 100.0, static_cast<std::uint64_t>(half));
          times.push_back(rep.load_ms);
          met += rep.load_ms <= slo && rep.tokens_filled == n_chunks * a.chunk_tokens;
          std::uint64_t sent = 0;
          std::string levels;
          for (const auto& c : rep.chunks) {
            (sent < static_cast<std::uint64_t>(half) ? before : after)[c.level]++;
            sent += c.bytes;
            levels += fmt::format("{}{}", levels.empty() ? "" : " ", short_name(c.level));
          }
          plans[levels]++;
          if (r == 0 || r + 1 == a.slo_runs) {
            std::string detail;
            for (const auto& c : rep.chunks) detail += fmt::format(" [{} {:.0f}+{:.0f}]", short_name(c.level), c.fetch_ms, c.decode_ms);
            fmt::print("  run {}: {:.0f} ms, chunks (level fetch+decode ms):{}\n", r, rep.load_ms, detail);
          }
        }
        std::sort(times.begin(), times.end());
        const auto pct = [&](double p) { return times[static_cast<std::size_t>(std::ceil(p * static_cast<double>(times.size()))) - 1]; };
        fmt::print("deadline {:.0f} ms met in {} of {} loads ({:.0f} %); load ms p50 {:.0f} p95 {:.0f} p99 {:.0f} max {:.0f}\n", slo, met,
                   a.slo_runs, 100.0 * met / a.slo_runs, pct(0.5), pct(0.95), pct(0.99), times.back());
        const auto show = [](const std::map<std::string, int>& m) {
          std::string s;
          for (const auto& [l, c] : m) s += fmt::format("{}{} x{}", s.empty() ? "" : ", ", l, c);
          return s;
        };
        fmt::print("levels chosen before the drop: {}\nlevels chosen after the drop: {}\n", show(before), show(after));
        std::vector<std::pair<int, std::string>> by_count;
        for (const auto& [p, c] : plans) by_count.push_back({c, p});
        std::sort(by_count.rbegin(), by_count.rend());
        for (std::size_t k = 0; k < by_count.size() && k < 5; ++k) fmt::print("  plan [{}] x{}\n", by_count[k].second, by_count[k].first);

        // The clairvoyant plan: the loader's cost model with this process's measured costs and the drop
        // known in advance, over every assignment of levels (and recompute) to the chunks.
        vq::PlanCosts pc;
        pc.link_bytes_per_ms = 125e3;
        pc.link_after_bytes_per_ms = 12.5e3;
        pc.drop_after_bytes = static_cast<std::uint64_t>(half);
        pc.threads = threads;
        const std::string shape = vq::cost_shape_key(static_cast<std::size_t>(a.layers), 8, a.chunk_tokens, 128);
        std::string cost_line;
        for (const auto& l : slo_scheme.levels)
          if (const auto c = vq::process_load_costs().get(l, shape)) {
            pc.decode_ms[l] = c->decode_ms;
            pc.feed_ms[l] = c->feed_ms;
            cost_line += fmt::format("{}{} {:.1f}+{:.1f}", cost_line.empty() ? "" : ", ", l, c->decode_ms, c->feed_ms);
          }
        if (const auto c = vq::process_load_costs().get("recompute", shape)) {
          pc.recompute_ms = c->decode_ms;
          cost_line += fmt::format(", recompute {:.1f}", c->decode_ms);
        }
        fmt::print("costs measured (ms per chunk, decode + feed): {}\n", cost_line);
        const auto order = vq::quality_order(slo_dirs[0]);
        std::vector<int> options(order.begin(), order.end());
        if (pc.recompute_ms) options.insert(options.begin(), vq::kRecompute);  // exact: the best quality
        const auto n_opt = options.size();
        std::size_t combos = 1;
        for (int i = 0; i < n_chunks && combos <= 2000000; ++i) combos *= n_opt;
        if (combos <= 2000000) {
          std::vector<int> best;
          int best_rank = 1 << 30;
          double best_ms = 0;
          std::vector<int> plan(static_cast<std::size_t>(n_chunks));
          for (std::size_t code = 0; code < combos; ++code) {
            std::size_t x = code;
            int rank = 0;
            for (auto& p : plan) {
              const std::size_t o = x % n_opt;
              x /= n_opt;
              p = options[o];
              rank += static_cast<int>(o) - (pc.recompute_ms && o > 0 ? 1 : 0);  // recompute ranks with the best level
            }
            const double ms = vq::predict_ms(slo_dirs, 0, plan, pc);
            if (ms <= slo && (rank < best_rank || (rank == best_rank && ms < best_ms))) {
              best = plan, best_rank = rank, best_ms = ms;
            }
          }
          std::string b;
          for (const int k : best)
            b += fmt::format("{}{}", b.empty() ? "" : " ", k == vq::kRecompute ? std::string("R") : short_name(slo_dirs[0].entries[static_cast<std::size_t>(k)].level));
          fmt::print("clairvoyant plan (drop known, same cost model, no margin): [{}], predicted {:.0f} ms\n", best.empty() ? "none fits" : b, best_ms);
        }

        // Each level forced for every chunk, same link and deadline.
        // (once per deadline: a forced level has no plan to guard)
        for (int k = 0; k < static_cast<int>(order.size()) && a.slo_check > 0 && last_of_deadline; ++k) {
          const std::string& level = slo_dirs[0].entries[static_cast<std::size_t>(order[static_cast<std::size_t>(k)])].level;
          std::vector<double> t;
          int ok = 0;
          for (int r = 0; r < a.slo_check; ++r) {
            vq::LoaderOptions o;
            o.scheme = slo_scheme;
            o.bandwidth_mbps = 1000.0;
            o.bandwidth_after_mbps = 100.0;
            o.drop_after_bytes = static_cast<std::uint64_t>(half);
            o.threads = threads;
            o.level = level;
            o.vq_models = vq_models;
            auto caches = vq::make_caches("fp32", model);
            const auto rep = vq::load_prefix(*store, model, caches, tokens, o);
            t.push_back(rep.load_ms);
            ok += rep.load_ms <= slo && rep.tokens_filled == n_chunks * a.chunk_tokens;
          }
          fmt::print("  every chunk at {}: met {} of {}, median {:.0f} ms\n", level, ok, a.slo_check, median(t));
        }
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vq_bench_store_prefix: %s\n", e.what());
    return 1;
  }
}
