// The prompt cache's hit path without the server (issue 30's TTFT goals): a prefix of a
// realistic-shape model (dim 768, 12 layers, 4 KV heads of 64, random weights; K/V from its own
// forward pass) stored at one level in a RAM file store, then, round after round, each stage of
// what `veloxquant prompt-cache` does on a hit, timed apart:
//   load    load_prefix into the slot image (format/llama_state_image.hpp: lookup, fetch, decode,
//           rows converted into llama.cpp's F16 layout, V transposed)
//   write   the slot file written from the image into --slot-dir (tmpfs by default)
// Usage: vq_bench_slot_restore [--tokens 4096] [--chunk-tokens 256] [--level vq:bits=2]
//                              [--rounds 5] [--threads 0] [--slot-dir /dev/shm]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <unistd.h>

#include "bench_timing.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/format/llama_state.hpp"
#include "veloxquant/format/llama_state_image.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/random_checkpoint.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/store/file_store.hpp"
#include "veloxquant/store/prefix_chunks.hpp"
#include "veloxquant/store/prefix_loader.hpp"

using vqbench::Clock;
using vqbench::median;
using vqbench::ms_since;

int main(int argc, char** argv) try {
  int tokens = 4096, C = 256, rounds = 5, threads = 0;
  std::string level = "vq:bits=2", slot_dir = "/dev/shm";
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (i + 1 >= argc) throw vq::InvalidArgument(k + " needs a value");
    const std::string v = argv[i + 1];
    if (k == "--tokens") tokens = std::stoi(v);
    else if (k == "--chunk-tokens") C = std::stoi(v);
    else if (k == "--level") level = v;
    else if (k == "--rounds") rounds = std::stoi(v);
    else if (k == "--threads") threads = std::stoi(v);
    else if (k == "--slot-dir") slot_dir = v;
    else throw vq::InvalidArgument("unknown option " + k);
  }
  level = vq::MethodSpec::parse(level).to_string();
  vq::ModelConfig c;
  c.dim = 768, c.hidden_dim = 2048, c.n_layers = 12, c.n_heads = 12, c.n_kv_heads = 4, c.vocab_size = 512, c.seq_len = tokens + 64;
  vq::Transformer model(vq::random_checkpoint(c, 7));
  std::mt19937 rng(30);
  std::vector<int> ids(static_cast<std::size_t>(tokens) + 1);
  for (auto& t : ids) t = static_cast<int>(rng() % 500) + 3;
  const auto prefix = std::span<const int>(ids).first(static_cast<std::size_t>(tokens));
  auto t = Clock::now();
  auto exact_caches = vq::make_caches("fp32", model);
  model.forward(prefix, exact_caches);
  std::vector<vq::KVState> exact;
  for (const auto& ec : exact_caches) exact.push_back(ec->state());
  fmt::print(stderr, "prefill of {} tokens: {:.0f} ms\n", tokens, ms_since(t));
  const auto models = vq::chunk_vq_models(model);
  const auto dir = std::filesystem::path("/dev/shm") / fmt::format("vq-bench-slot-restore-{}", ::getpid());
  std::filesystem::remove_all(dir);
  vq::FileStore store(dir);
  const vq::ChunkScheme scheme{0x5107, C, {level}};
  t = Clock::now();
  const auto put = vq::put_context(store, model, scheme, prefix, exact);
  fmt::print(stderr, "put at {}: {} bytes in {:.0f} ms (layer models included)\n", level, put.bytes_written, ms_since(t));
  exact.clear();
  exact_caches.clear();
  const vq::LlamaState layout{.tokens = {}, .server_tokens = true, .n_stream = 1, .stream = 0, .seq_id = 0, .v_trans = true, .dtype = vq::DType::F16, .layers = {}};
  const std::string slot_path = (std::filesystem::path(slot_dir) / fmt::format("vq-bench-slot-{}.bin", ::getpid())).string();
  vq::LlamaStateImage image(layout, {c.n_layers, c.n_kv_heads, c.head_size(), c.head_size()});
  const std::vector<std::int32_t> slot_tokens(prefix.begin(), prefix.end());
  std::vector<double> load_ms, write_ms, total_ms;
  for (int r = 0; r < rounds + 1; ++r) {
    vq::LoaderOptions lo;
    lo.scheme = scheme;
    lo.allow_recompute = false;
    lo.threads = threads;
    lo.vq_models = models;
    auto& caches = image.begin(static_cast<std::int64_t>(ids.size()));
    const auto t0 = Clock::now();
    const auto rep = vq::load_prefix(store, model, caches, ids, lo);
    const double a = ms_since(t0);
    if (rep.tokens_reused != tokens) throw vq::Error(fmt::format("a load reused {} of {} tokens", rep.tokens_reused, tokens));
    const auto t2 = Clock::now();
    image.write(slot_path, slot_tokens);
    const double w = ms_since(t2);
    double fetch = 0, dec = 0;
    for (const auto& ch : rep.chunks) fetch += ch.fetch_ms, dec += ch.decode_ms;
    fmt::print(stderr, "round {}: load {:.1f} ms (chunks' fetch {:.1f}, decode+feed {:.1f}), write {:.1f} ms ({} bytes)\n", r, a, fetch, dec, w,
               std::filesystem::file_size(slot_path));
    if (r == 0) continue;  // warm-up
    load_ms.push_back(a), write_ms.push_back(w), total_ms.push_back(a + w);
  }
  std::filesystem::remove(slot_path);
  std::filesystem::remove_all(dir);
  fmt::print("{} tokens in chunks of {}, level {}, medians of {}: load {:.1f} ms, write ({}) {:.1f} ms, total {:.1f} ms\n", tokens, C, level,
             rounds, median(load_ms), slot_dir, median(write_ms), median(total_ms));
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "vq_bench_slot_restore: {}\n", e.what());
  return 1;
}
