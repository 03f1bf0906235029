// Store load benchmark (issue 16's goal 4, scaled by the command line): C concurrent clients, each
// with its own store connection, put then get blobs of B bytes for S seconds against one store URL;
// prints p50/p99 latency of put and get, MB/s, and checks that every get returns the bytes put.
//   vq_bench_store_load URL [--clients C=16] [--seconds S=30] [--bytes B=1048576]
// Baseline in the same run: memcpy of the same blob (MB/s), so the ratio is machine-independent.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <fmt/core.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/store/kv_store.hpp"

namespace {
using Clock = std::chrono::steady_clock;

struct ClientResult {
  std::vector<double> put_ms, get_ms;
  std::uint64_t bytes = 0, wrong = 0, errors = 0;
};

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(p * static_cast<double>(v.size() - 1))];
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: vq_bench_store_load URL [--clients C] [--seconds S] [--bytes B]\n");
    return 2;
  }
  const std::string url = argv[1];
  int clients = 16;
  double seconds = 30;
  std::size_t bytes = 1 << 20;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--clients") clients = std::stoi(argv[i + 1]);
    else if (k == "--seconds") seconds = std::stod(argv[i + 1]);
    else if (k == "--bytes") bytes = std::stoul(argv[i + 1]);
  }
  const auto run_id = std::to_string(Clock::now().time_since_epoch().count());
  std::vector<ClientResult> results(static_cast<std::size_t>(clients));
  std::vector<std::thread> threads;
  const auto t0 = Clock::now();
  const auto end = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  for (int c = 0; c < clients; ++c)
    threads.emplace_back([&, c] {
      ClientResult& r = results[static_cast<std::size_t>(c)];
      auto store = vq::open_store(url);
      std::vector<std::uint8_t> blob(bytes);
      for (int n = 0; Clock::now() < end; ++n) {
        for (std::size_t i = 0; i < bytes; i += 64) blob[i] = static_cast<std::uint8_t>(c * 131 + n * 7 + i);
        const std::string key = fmt::format("bench-{}-{}-{}", run_id, c, n);
        try {
          auto t = Clock::now();
          store->put(key, blob);
          r.put_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t).count());
          t = Clock::now();
          const auto got = store->get(key);
          r.get_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t).count());
          if (!got || *got != blob) ++r.wrong;
          r.bytes += 2 * bytes;
          store->remove(key);
        } catch (const vq::Error& e) {
          if (r.errors++ == 0) std::fprintf(stderr, "client %d: %s\n", c, e.what());
        }
      }
    });
  for (auto& t : threads) t.join();
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  ClientResult all;
  for (const auto& r : results) {
    all.put_ms.insert(all.put_ms.end(), r.put_ms.begin(), r.put_ms.end());
    all.get_ms.insert(all.get_ms.end(), r.get_ms.begin(), r.get_ms.end());
    all.bytes += r.bytes;
    all.wrong += r.wrong;
    all.errors += r.errors;
  }
  // Baseline: memcpy of the blob, single thread, same run.
  std::vector<std::uint8_t> a(bytes, 1), b(bytes);
  const auto tm = Clock::now();
  int copies = 0;
  while (Clock::now() - tm < std::chrono::milliseconds(300)) {
    std::memcpy(b.data(), a.data(), bytes);
    a[static_cast<std::size_t>(copies) % bytes] = b[0];
    ++copies;
  }
  const double memcpy_mbs = static_cast<double>(copies) * static_cast<double>(bytes) / 1e6 /
                            std::chrono::duration<double>(Clock::now() - tm).count();
  const double mbs = static_cast<double>(all.bytes) / 1e6 / wall;
  fmt::print("{}: {} clients, {} s, {} B blobs: {} put+get pairs, put p50 {:.2f} ms p99 {:.2f} ms, get p50 {:.2f} ms p99 {:.2f} ms, "
             "{:.1f} MB/s moved ({:.4f}x of one memcpy thread, {:.0f} MB/s), wrong gets {}, errors {}\n",
             url, clients, seconds, bytes, all.get_ms.size(), pct(all.put_ms, 0.5), pct(all.put_ms, 0.99), pct(all.get_ms, 0.5),
             pct(all.get_ms, 0.99), mbs, mbs / memcpy_mbs, memcpy_mbs, all.wrong, all.errors);
  return all.wrong == 0 ? 0 : 1;
}
