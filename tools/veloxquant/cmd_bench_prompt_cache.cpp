// veloxquant bench prompt-cache: time to first token through `veloxquant prompt-cache` (a hit from
// each store) against the same llama-server recomputing the prompt, in one run, and the bytes the
// store holds per cached token against llama.cpp's own f16 and q8_0 KV cache.
//
// The bench starts everything itself on 127.0.0.1 at free ports and stops it by pid: the
// llama-server (--llama-server, default .llama/bin/llama-server from tools/llama/build-llama.sh),
// a redis-server when the stores name `redis:auto`, and the proxy (in this process). Models:
// stories260K converted from ../shared/models (default), or `--realistic`: a llama-shaped GGUF
// written from a seed (dim 768, 12 layers, 12 query / 4 KV heads of 64, FFN 2048, Q8_0 matrices;
// random weights: fine for speed, never for quality). The prompt is BOS and --tokens random token
// ids (seeded). One round: the slot erased, then the request (n_predict 1) through the proxy (a hit:
// lookup, fetch, decode, restore, the tail evaluated) and straight to the server (a recompute of the
// whole prompt); TTFT = the request's wall time. Each starts when the proxy is idle (it stores a
// request's slot after the reply went out). Rounds alternate the two; medians are reported.
#ifdef VQ_HAVE_PROMPT_CACHE
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "bench_prompt_cache.hpp"
#include "json_out.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/model/gguf.hpp"
#include "veloxquant/model/model_files.hpp"
#include "veloxquant/model/random_checkpoint.hpp"
#include "veloxquant/model/tokenizer.hpp"
#include "veloxquant/serve/local_process.hpp"
#include "veloxquant/serve/prompt_cache.hpp"
#include "veloxquant/store/kv_store.hpp"

namespace vqcli {

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// The realistic shape, random weights from `seed`, vocabulary of tok512 (512 tokens).
vq::Checkpoint realistic_checkpoint(int seq_len, std::uint64_t seed) {
  vq::ModelConfig c;
  c.dim = 768, c.hidden_dim = 2048, c.n_layers = 12, c.n_heads = 12, c.n_kv_heads = 4, c.vocab_size = 512, c.seq_len = seq_len;
  return vq::random_checkpoint(c, static_cast<std::uint32_t>(seed));
}

double post_ms(int port, const std::string& route, const json& body, json* reply = nullptr) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(3600, 0);
  const auto t0 = Clock::now();
  const auto r = c.Post(route, body.dump(), "application/json");
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  if (!r || r->status != 200)
    throw vq::IoError(fmt::format("POST 127.0.0.1:{}{} failed: {}", port, route, r ? std::to_string(r->status) + " " + r->body.substr(0, 200)
                                                                                     : httplib::to_string(r.error())));
  if (reply) *reply = json::parse(r->body);
  return ms;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

std::uint64_t dir_bytes(const std::filesystem::path& d) {
  std::uint64_t n = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(d))
    if (e.is_regular_file()) n += e.file_size();
  return n;
}

}  // namespace

int run_bench_prompt_cache(const BenchPromptCacheOptions& o) {
  namespace fs = std::filesystem;
  const fs::path work = fs::temp_directory_path() / fmt::format("vq-bench-prompt-cache-{}", ::getpid());
  fs::create_directories(work);
  struct Cleanup {
    fs::path p;
    ~Cleanup() {
      std::error_code ec;
      if (!p.empty()) fs::remove_all(p, ec);
    }
  } cleanup{work};
  // Slot files are scratch that the server reads at once: on tmpfs a restore's 50 MB write is a
  // copy in memory rather than a disk's page cache (docs/prompt_cache.md, "Measured").
  const bool own_slots = o.slot_dir.empty();
  const fs::path slots = !own_slots ? fs::path(o.slot_dir)
                         : fs::is_directory("/dev/shm") ? fs::path("/dev/shm") / fmt::format("vq-bench-prompt-cache-slots-{}", ::getpid())
                                                        : work / "slots";
  vq::require(own_slots || fs::is_directory(slots), "--slot-dir {}: not a directory", o.slot_dir);
  fs::create_directories(slots);
  Cleanup cleanup_slots{own_slots ? slots : fs::path()};
  std::string server_bin = o.llama_server;
  if (server_bin.empty()) server_bin = fs::exists(".llama/bin/llama-server") ? ".llama/bin/llama-server" : "llama-server";

  // The model: stories260K as GGUF, or the realistic shape from a seed.
  const vq::ModelFiles files = vq::resolve_model_files(std::nullopt, std::nullopt);
  const vq::Tokenizer tok = vq::Tokenizer::load(files.tokenizer.string(), 512);
  const std::string gguf = (work / "model.gguf").string();
  int n_ctx = 0;
  std::string model_name;
  if (o.realistic) {
    n_ctx = o.tokens + 64;
    vq::write_gguf(gguf, realistic_checkpoint(n_ctx, o.seed), tok, {.pad_head = 0, .matrices = vq::GgufMatrixType::Q8_0});
    model_name = "realistic shape (dim 768, 12 layers, 12/4 heads of 64, Q8_0, random weights)";
  } else {
    const vq::Checkpoint ck = vq::Checkpoint::load(files.model.string());
    n_ctx = ck.config.seq_len;
    vq::write_gguf(gguf, ck, tok);
    model_name = files.model.filename().string();
  }
  vq::require(o.tokens + 2 <= n_ctx, "--tokens {}: the model's context is {} tokens", o.tokens, n_ctx);
  const vq::Checkpoint shape_ck = vq::load_gguf(gguf).checkpoint;
  const auto& sc = shape_ck.config;
  const double kv_elems_per_token = 2.0 * sc.n_layers * sc.n_kv_heads * sc.head_size();

  // Ids past tok512's byte tokens (3 .. 258): the text stays valid UTF-8, which the server's reply
  // parser needs; the one predicted token is biased to a plain piece for the same reason (random
  // weights predict anything).
  std::mt19937 rng(static_cast<unsigned>(o.seed));
  std::vector<int> prompt{1};
  for (int i = 0; i < o.tokens; ++i) prompt.push_back(259 + static_cast<int>(rng() % 253));

  const int sport = vq::free_local_port();
  fmt::print(stderr, "bench prompt-cache: starting {} on 127.0.0.1:{} ({})\n", server_bin, sport, model_name);
  vq::LocalProcess server({server_bin, "-m", gguf, "-c", std::to_string(n_ctx), "-np", "1", "-t", std::to_string(o.threads), "--cache-ram", "0",
                           "--slot-save-path", slots.string(), "--host", "127.0.0.1", "--port", std::to_string(sport)},
                          (work / "server.log").string(), [sport] { return vq::http_health_ok(sport); });
  std::unique_ptr<vq::LocalProcess> redis;
  json rows = json::array();
  std::vector<std::string> levels = o.levels;  // as the proxy resolved them (auto: its default)
  const json request = {{"prompt", prompt}, {"n_predict", 1}, {"temperature", 0}, {"cache_prompt", true}, {"id_slot", 0},
                        {"logit_bias", json::array({json::array({300, 100.0})})}};
  const auto erase = [&] { post_ms(sport, "/slots/0?action=erase", json::object()); };

  std::string redis_url;
  int file_stores = 0;
  for (std::string store : o.stores) {
    // "file:auto" / "redis:auto", with any options after them (e.g. `redis:auto?ram=512M`: the RAM
    // tier in front of the bench's Redis, docs/store.md).
    const auto q = store.find('?');
    const std::string base = store.substr(0, q), query = q == std::string::npos ? "" : store.substr(q);
    const std::string label = base == "file:auto" ? "file" : base == "redis:auto" ? "redis" : store;
    const bool ram = query.find("ram=") != std::string::npos;
    if (base == "file:auto") store = "file:" + (work / fmt::format("store-file-{}", file_stores++)).string() + query;
    if (base == "redis:auto") {
      if (!redis) {
        const int rport = vq::free_local_port();
        redis = std::make_unique<vq::LocalProcess>(
            std::vector<std::string>{"redis-server", "--port", std::to_string(rport), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"},
            (work / "redis.log").string(), [rport] {
              try {
                auto s = vq::open_store(fmt::format("redis://127.0.0.1:{}", rport));
                (void)s->get("probe");
                return true;
              } catch (const std::exception&) {
                return false;
              }
            });
        redis_url = fmt::format("redis://127.0.0.1:{}", rport);
      }
      store = redis_url + query;
    }
    vq::PromptCacheOptions po;
    po.upstream = fmt::format("http://127.0.0.1:{}", sport);
    po.listen_port = 0;
    po.model = gguf;
    po.slot_dir = slots.string();
    po.store = store;
    if (o.levels != std::vector<std::string>{"auto"}) po.levels = o.levels;
    po.chunk_tokens = o.chunk_tokens;
    po.log = [&o](const std::string& line) {
      if (o.verbose) fmt::print(stderr, "proxy: {}\n", line);
    };
    vq::PromptCacheProxy proxy(po);
    levels = proxy.levels();
    proxy.bind();
    std::thread serving([&] { proxy.serve(); });
    const int pport = proxy.port();
    struct Stop {
      vq::PromptCacheProxy& p;
      std::thread& t;
      ~Stop() {
        p.stop();
        t.join();
      }
    } stop{proxy, serving};
    // Populate: one request through the proxy stores the prompt's chunks (after its reply: each
    // timed request starts once the proxy is idle).
    erase();
    post_ms(pport, "/completion", request);
    std::vector<double> hit, recompute;
    json last;
    // Each timed request starts on an idle proxy and, after --settle-ms, an idle server.
    const auto settle = [&] { std::this_thread::sleep_for(std::chrono::milliseconds(o.settle_ms)); };
    for (int r = 0; r < o.rounds; ++r) {
      proxy.wait_idle();
      erase();
      settle();
      hit.push_back(post_ms(pport, "/completion", request, &last));
      proxy.wait_idle();
      erase();
      settle();
      json direct;
      recompute.push_back(post_ms(sport, "/completion", request, &direct));
    }
    const int cached = (o.tokens + 1 - 1) / o.chunk_tokens * o.chunk_tokens;
    std::uint64_t bytes = 0;
    if (store.rfind("file:", 0) == 0) bytes = dir_bytes(store.substr(5, store.find('?') == std::string::npos ? std::string::npos : store.find('?') - 5));
    const double per_token = cached > 0 && bytes > 0 ? static_cast<double>(bytes) / cached : 0.0;
    rows.push_back({{"store", ram ? "ram+" + label : label},
                    {"ttft_hit_ms", median(hit)},
                    {"ttft_recompute_ms", median(recompute)},
                    {"speedup", median(recompute) / median(hit)},
                    {"tail_tokens_evaluated", last["timings"].value("prompt_n", -1)},
                    {"cached_tokens", cached},
                    {"store_bytes_per_token", per_token},
                    {"llama_f16_bytes_per_token", kv_elems_per_token * 2.0},
                    {"llama_q8_0_bytes_per_token", kv_elems_per_token * 34.0 / 32.0}});
  }
  const json out = {{"model", model_name}, {"prompt_tokens", o.tokens + 1}, {"chunk_tokens", o.chunk_tokens}, {"levels", levels},
                    {"rounds", o.rounds}, {"threads", o.threads}, {"settle_ms", o.settle_ms}, {"rows", rows}};
  if (o.json) {
    fmt::print("{}\n", json_text(out));
    return 0;
  }
  fmt::print("{}: {} prompt tokens (BOS + {} random), chunks of {}, levels {}, {} rounds, llama-server -t {}, {} ms idle before each timed request\n",
             model_name, o.tokens + 1, o.tokens, o.chunk_tokens, fmt::join(levels, ";"), o.rounds, o.threads, o.settle_ms);
  fmt::print("{:<10} {:>14} {:>18} {:>9} {:>12} {:>16} {:>12} {:>12}\n", "store", "TTFT hit ms", "TTFT recompute ms", "speedup", "tail tokens",
             "store B/token", "f16 B/token", "q8_0 B/token");
  for (const auto& r : rows)
    fmt::print("{:<10} {:>14.1f} {:>18.1f} {:>8.1f}x {:>12} {:>16.0f} {:>12.0f} {:>12.0f}\n", r["store"].get<std::string>(), r["ttft_hit_ms"].get<double>(),
               r["ttft_recompute_ms"].get<double>(), r["speedup"].get<double>(), r["tail_tokens_evaluated"].get<int>(),
               r["store_bytes_per_token"].get<double>(), r["llama_f16_bytes_per_token"].get<double>(), r["llama_q8_0_bytes_per_token"].get<double>());
  fmt::print("(medians; a hit: the slot erased, the request through the proxy: lookup, fetch, decode, restore, the tail evaluated; a recompute: the\n"
             " slot erased, the request straight to the server; store B/token: the file store's bytes over the tokens it caches, 0 for Redis)\n");
  return 0;
}

}  // namespace vqcli
#endif  // VQ_HAVE_PROMPT_CACHE
