// veloxquant generate: sample text from a llama2.c model through a chosen KV cache method, as run.c.
#include <chrono>
#include <cstdio>
#include <ctime>
#include <optional>
#include <string>

#include <fmt/core.h>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "json_out.hpp"
#include "model_options.hpp"
#include "numeric_options.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/model/generate.hpp"
#include "veloxquant/methods/method_table.hpp"
#include "veloxquant/model/model_files.hpp"
#include "veloxquant/model/tokenizer.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/store/kv_store.hpp"
#include "veloxquant/store/prefix_chunks.hpp"
#include "veloxquant/store/prefix_loader.hpp"

namespace vqcli {

namespace {
using vq::KVCache;
struct GenerateOptions {
  std::string model, tokenizer, prompt, method = "fp32";
  int steps = 256;
  float temperature = 1.0f, topp = 0.9f;
  std::uint64_t seed = 0;
  bool stats = false;
  // generate --store: reuse the longest stored prefix (store/prefix_loader.hpp).
  // --levels / --chunk-tokens: unset, the lookup takes every level and chunk size stored (and the
  // context is stored after at the defaults, the method table's store levels in chunks of the size found or 256).
  std::string store, levels;
  bool use_store = false, json = false, no_recompute = false;
  std::optional<int> chunk_tokens;
  std::optional<double> slo_ms, bandwidth_mbps, slo_guard;
  std::optional<int> threads;  // --threads: the loader's decoder threads (default: all cores)
};

// What generate --store did, for the report.
struct StoreRun {
  std::unique_ptr<vq::KVStore> store;
  vq::LoaderOptions options;
  vq::LoadReport report;
  vq::ChunkScheme put_scheme;  // what the context is stored at after generating
  bool exact_prefix = true;  // every filled chunk exact (fp32 or recomputed): the caches may be stored
};

void warn(const std::string& msg) { fmt::print(stderr, "veloxquant: warning: {}\n", msg); }

// After generating: store the context's whole chunks, when the live caches hold exact K/V.
void store_context(StoreRun& sr, vq::Transformer& model, const std::string& method, const std::vector<int>& tokens,
                   std::vector<std::shared_ptr<KVCache>>& caches) {
  // Lossy K/V never poison the exact chain; after a fault the store is left alone (one warning is enough).
  if (!sr.store || method != "fp32" || !sr.exact_prefix || !sr.report.warnings.empty()) return;
  const std::int64_t held = std::min<std::int64_t>(caches.front()->offset(), static_cast<std::int64_t>(tokens.size()));
  const std::int64_t C = sr.put_scheme.chunk_tokens;
  const std::int64_t n = held / C * C;
  if (n == 0) return;
  std::vector<vq::KVState> exact;
  for (const auto& c : caches) {
    const vq::KVState s = c->state();
    exact.push_back({s.keys.slice(2, 0, n), s.values.slice(2, 0, n)});
  }
  try {
    vq::put_context(*sr.store, model, sr.put_scheme, std::span<const int>(tokens.data(), static_cast<std::size_t>(n)), exact);
  } catch (const vq::IoError& e) {
    warn(fmt::format("storing the context failed: {}", e.what()));
  } catch (const vq::FormatError& e) {
    warn(fmt::format("storing the context failed: {}", e.what()));
  }
}

int run_generate(const GenerateOptions& o) {
  vq::require(o.use_store || (!o.slo_ms && !o.bandwidth_mbps && !o.threads && !o.no_recompute && !o.slo_guard),
              "--slo-ms, --slo-guard, --bandwidth, --threads and --no-recompute need --store");
  vq::require(o.slo_ms || !o.slo_guard, "--slo-guard needs --slo-ms");
  auto opt = [](const std::string& s) { return s.empty() ? std::nullopt : std::optional<std::filesystem::path>(s); };
  const vq::ModelFiles files = vq::resolve_model_files(opt(o.model), opt(o.tokenizer));
  vq::LoadedModel loaded = vq::load_model(files);
  vq::Transformer model(std::move(loaded.checkpoint));
  const vq::Tokenizer tok = std::move(loaded.tokenizer);
  auto caches = vq::make_caches(o.method, model);

  vq::GenerateConfig cfg;
  cfg.steps = o.steps;
  cfg.sampler.temperature = o.temperature;
  cfg.sampler.topp = o.topp;
  // As run.c: seed 0 means "seed from the clock".
  cfg.sampler.seed = o.seed != 0 ? o.seed : static_cast<std::uint64_t>(std::time(nullptr));
  StoreRun sr;
  const std::string method = vq::MethodSpec::parse(o.method).to_string();
  if (o.use_store) {
    sr.options.scheme.chunk_tokens = o.chunk_tokens.value_or(0);
    if (!o.levels.empty()) sr.options.scheme.levels = vq::parse_levels(o.levels);
    sr.options.scheme.model_fingerprint = vq::model_fingerprint(model);
    sr.put_scheme.model_fingerprint = sr.options.scheme.model_fingerprint;
    sr.put_scheme.levels = vq::parse_levels(o.levels.empty() ? vq::default_store_levels() : o.levels);
    sr.put_scheme.chunk_tokens = o.chunk_tokens.value_or(vq::kDefaultChunkTokens);
    sr.options.slo_ms = o.slo_ms;
    if (o.slo_guard) sr.options.slo_guard = *o.slo_guard;
    sr.options.bandwidth_mbps = o.bandwidth_mbps;
    sr.options.threads = o.threads.value_or(0);
    sr.options.allow_recompute = !o.no_recompute;
    try {
      sr.store = vq::open_store(o.store);
    } catch (const vq::IoError& e) {
      warn(fmt::format("store unavailable ({}); prefilling the whole prompt", e.what()));
    }
    if (sr.store)
      cfg.fill_prefix = [&](std::span<const int> tokens, std::vector<std::shared_ptr<KVCache>>& cs) {
        sr.report = vq::load_prefix(*sr.store, model, cs, tokens, sr.options, warn);
        sr.put_scheme.chunk_tokens = o.chunk_tokens.value_or(sr.report.chunk_tokens > 0 ? sr.report.chunk_tokens : vq::kDefaultChunkTokens);
        for (const auto& c : sr.report.chunks) sr.exact_prefix = sr.exact_prefix && (c.level == "fp32" || c.level == "recompute");
        return sr.report.tokens_filled;
      };
  }
  const auto t0 = std::chrono::steady_clock::now();
  const auto print_piece = [](std::string_view piece) {
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  };
  const vq::GenerateResult r = o.json ? vq::generate(model, tok, caches, o.prompt, cfg) : vq::generate(model, tok, caches, o.prompt, cfg, print_piece);
  if (o.json) {
    // The store's part is the loader's report (store/prefix_loader.hpp, load_report_json).
    const auto store = nlohmann::json::parse(vq::load_report_json(sr.report));
    fmt::print("{}\n", json_text({{"text", r.text},
                                  {"tokens", r.tokens},
                                  {"tokens_reused", sr.report.tokens_reused},
                                  {"ttft_ms", r.ttft_ms},
                                  {"prefill_ms_estimate", sr.report.prefill_ms_estimate},
                                  {"chunk_tokens", store.at("chunk_tokens")},
                                  {"chunks", store.at("chunks")},
                                  {"miss", store.at("miss")},
                                  {"not_used", store.at("not_used")}}));
  } else {
    std::fputc('\n', stdout);
    if (sr.store) {
      fmt::print(stderr, "store {}: {} of {} prompt tokens reused, time to first token {:.2f} ms (recomputing them: ~{:.2f} ms)\n",
                 sr.store->describe(), sr.report.tokens_reused, r.prompt_tokens, r.ttft_ms, sr.report.prefill_ms_estimate);
      for (const auto& c : sr.report.chunks)
        fmt::print(stderr, "  chunk {:>4}  {:<40} {:>10} bytes  fetch {:8.2f} ms  decode {:8.2f} ms\n", c.index, c.level, c.bytes, c.fetch_ms,
                   c.decode_ms);
      if (!sr.report.not_used.empty()) fmt::print(stderr, "veloxquant: note: a stored prefix was not used: {}\n", sr.report.not_used);
    }
  }
  fmt::print(stderr, "kv cache: peak resident {} bytes ({}); fp16 would hold {} bytes for the same {} tokens ({:.2f}x of fp16)\n",
             r.peak_resident_bytes, vq::MethodSpec::parse(o.method).to_string(), r.fp16_bytes, r.kv_tokens,
             r.fp16_bytes > 0 ? static_cast<double>(r.peak_resident_bytes) / static_cast<double>(r.fp16_bytes) : 0.0);
  store_context(sr, model, method, r.tokens, caches);
  if (o.stats) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fmt::print(stderr, "{} tokens ({} prompt incl. BOS) in {:.3f} s: {:.0f} tokens/s, method {}\n", r.tokens.size(), r.prompt_tokens, s,
               s > 0 ? static_cast<double>(r.tokens.size()) / s : 0.0, vq::MethodSpec::parse(o.method).to_string());
  }
  return 0;
}
}  // namespace

Runner add_generate(CLI::App& app) {
  auto o = std::make_shared<GenerateOptions>();
  add_model_options(app, o->model, o->tokenizer);
  app.add_option("--prompt", o->prompt, "text to start from (after BOS)");
  app.add_option("--steps", o->steps, "positions to run including BOS, as run.c (clamped to seq_len)")
      ->capture_default_str()
      ->transform(integer_in(1, std::numeric_limits<int>::max()));
  app.add_option("--temperature", o->temperature, "0 = greedy argmax")->capture_default_str()->transform(finite_at_least(0.0));
  app.add_option("--topp", o->topp, "nucleus sampling mass; <= 0 or >= 1 samples the full distribution")
      ->capture_default_str()
      ->transform(any_finite());
  app.add_option("--seed", o->seed, "random seed for sampling (0 = from the clock, as run.c)")->capture_default_str()->transform(any_uint64());
  app.add_option("--method", o->method,
                 "KV cache: fp32, fp16, cachegen[:bits=N,group=G,flush=per_call|group_aligned,delta=0|1,schedule=on|off]")
      ->capture_default_str();
  app.add_flag("--stats", o->stats, "print tokens/s to stderr");
  app.add_option_function<std::string>(
         "--store", [o](const std::string& url) { o->store = url, o->use_store = true; },
         "reuse the longest stored prefix of the prompt from this store (veloxquant store put), and store the context after")
      ->type_name("URL");
  app.add_option("--slo-ms", o->slo_ms, "with --store: deadline for loading the prefix (levels chosen per chunk to meet it)")
      ->transform(finite_at_least(0.0));
  app.add_option("--slo-guard", o->slo_guard,
                 "with --slo-ms: meet the deadline even if the link falls to this fraction of its measured rate mid-load, when any plan can "
                 "(default 0.1; 1: trust the measured link)")
      ->transform(finite_in(0.001, 1.0));
  app.add_option("--bandwidth", o->bandwidth_mbps, "with --store: emulate a link of this many megabits per second (client-side token bucket)")
      ->transform(finite_at_least(0.001));
  app.add_option("--threads", o->threads, "with --store: threads decoding the loaded chunks (default: all cores)")
      ->transform(integer_in(1, 1024));
  app.add_flag("--no-recompute", o->no_recompute,
               "with --store: load every stored chunk, never recompute one by choice (a fault still falls back to prefill)");
  app.add_option("--levels", o->levels,
                 "with --store: load only these levels (';'-separated; fp32 always allowed). Default: every level stored, found in the "
                 "store; the context is stored after at vq:bits=1;vq:bits=2;vq:bits=4 (and fp32) or at these");
  app.add_option("--chunk-tokens", o->chunk_tokens,
                 "with --store: load only chunks of this size. Default: every size stored, found in the store; the context is stored "
                 "after in chunks of the size found, else 256")
      ->transform(integer_in(1, 1 << 20));
  app.add_flag("--json", o->json,
               "print {text, tokens, tokens_reused, ttft_ms, prefill_ms_estimate, chunk_tokens, chunks, miss, not_used} as JSON instead "
               "of streaming the text");
  return [o] { return run_generate(*o); };
}

}  // namespace vqcli
