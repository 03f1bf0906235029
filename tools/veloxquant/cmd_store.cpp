// veloxquant store put|ls|stats|rm: fill and look after a prefix KV store (store/kv_store.hpp,
// store/prefix_chunks.hpp). `put` runs the model over a text once (exact fp32 caches) and stores
// each whole chunk of C tokens at every level; generate --store then reuses the longest stored prefix.
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "json_out.hpp"
#include "model_options.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/methods/method_table.hpp"
#include "veloxquant/model/model_files.hpp"
#include "veloxquant/model/tokenizer.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/store/kv_store.hpp"
#include "veloxquant/store/prefix_chunks.hpp"

namespace vqcli {

namespace {
struct StoreOptions {
  std::string store, model, tokenizer, text, prompt, levels = vq::default_store_levels();
  bool prompt_given = false;
  int chunk_tokens = vq::kDefaultChunkTokens;
  bool json = false, all = false;
  std::vector<std::string> keys;
};

int run_put(const StoreOptions& o) {
  auto opt = [](const std::string& s) { return s.empty() ? std::nullopt : std::optional<std::filesystem::path>(s); };
  vq::require(!o.text.empty() || o.prompt_given, "store put needs --text FILE or --prompt TEXT");
  vq::require(o.text.empty() || !o.prompt_given, "store put takes --text or --prompt, not both");
  vq::ChunkScheme scheme;
  scheme.chunk_tokens = o.chunk_tokens;
  scheme.levels = vq::parse_levels(o.levels);  // bad specs fail before the model loads
  const vq::ModelFiles files = vq::resolve_model_files(opt(o.model), opt(o.tokenizer));
  vq::LoadedModel loaded = vq::load_model(files);
  vq::Transformer model(std::move(loaded.checkpoint));
  const vq::Tokenizer tok = std::move(loaded.tokenizer);
  const std::string text = o.prompt_given ? o.prompt : read_text(o.text);
  std::vector<int> tokens = tok.encode(text, /*bos=*/true, /*eos=*/false);
  const int seq_len = model.config().seq_len;
  if (static_cast<int>(tokens.size()) > seq_len) {
    fmt::print(stderr, "note: the text is {} tokens; the model's context is {}: storing its first {}\n", tokens.size(), seq_len, seq_len);
    tokens.resize(static_cast<std::size_t>(seq_len));
  }
  scheme.model_fingerprint = vq::model_fingerprint(model);
  const std::size_t stored_tokens = tokens.size() / static_cast<std::size_t>(o.chunk_tokens) * static_cast<std::size_t>(o.chunk_tokens);
  auto store = vq::open_store(o.store);
  vq::PutReport rep;
  if (stored_tokens > 0) {
    // The exact K/V of the stored part: plain fp32 caches after one prefill, as generate runs it.
    auto caches = vq::make_caches("fp32", model);
    model.forward(std::span<const int>(tokens.data(), stored_tokens), caches);
    std::vector<vq::KVState> exact;
    for (const auto& c : caches) exact.push_back(c->state());
    rep = vq::put_context(*store, model, scheme, std::span<const int>(tokens.data(), stored_tokens), exact);
  }
  if (o.json) {
    nlohmann::json levels = nlohmann::json::array();
    for (std::size_t l = 0; l < scheme.levels.size(); ++l) {
      std::uint64_t bytes = 0;
      for (const auto& d : rep.directories) bytes += l < d.entries.size() ? d.entries[l].bytes : 0;
      levels.push_back({{"level", scheme.levels[l]}, {"bytes", bytes}});
    }
    nlohmann::json chunks = nlohmann::json::array();
    for (std::size_t i = 0; i < rep.directories.size(); ++i) {
      nlohmann::json lv = nlohmann::json::array();
      for (const auto& e : rep.directories[i].entries) lv.push_back({{"level", e.level}, {"key", e.key}, {"bytes", e.bytes}});
      chunks.push_back({{"index", i}, {"levels", lv}});
    }
    fmt::print("{}\n", json_text({{"store", store->describe()},
                                  {"tokens", tokens.size()},
                                  {"tokens_stored", stored_tokens},
                                  {"chunk_tokens", o.chunk_tokens},
                                  {"chunks", rep.chunks},
                                  {"chunks_written", rep.chunks_written},
                                  {"bytes_written", rep.bytes_written},
                                  {"levels", levels},
                                  {"chunk_levels", chunks}}));
  } else {
    fmt::print("{}: {} tokens, {} chunk(s) of {} stored ({} new, {} bytes written) at {} level(s)\n", store->describe(), tokens.size(),
               rep.chunks, o.chunk_tokens, rep.chunks_written, rep.bytes_written, scheme.levels.size());
    for (std::size_t l = 0; l < scheme.levels.size(); ++l) {
      std::uint64_t bytes = 0;
      for (const auto& d : rep.directories) bytes += l < d.entries.size() ? d.entries[l].bytes : 0;
      fmt::print("  {:<40} {:>12} bytes\n", scheme.levels[l], bytes);
    }
    if (rep.chunks == 0)
      fmt::print("  (nothing stored: the text is {} tokens, fewer than one chunk of {})\n", tokens.size(), o.chunk_tokens);
  }
  return 0;
}

int run_ls(const StoreOptions& o) {
  auto store = vq::open_store(o.store);
  const auto keys = store->list();
  if (o.json) {
    fmt::print("{}\n", json_text({{"store", store->describe()}, {"keys", keys}}));
  } else {
    for (const auto& k : keys) fmt::print("{}\n", k);
  }
  return 0;
}

int run_stats(const StoreOptions& o) {
  auto store = vq::open_store(o.store);
  const auto s = store->stats();
  if (o.json) {
    fmt::print("{}\n", json_text({{"store", store->describe()}, {"backend", s.backend}, {"blobs", s.blobs}, {"bytes", s.bytes},
                                  {"capacity", s.capacity}}));
  } else {
    fmt::print("{}: {} blob(s), {} bytes{}\n", store->describe(), s.blobs, s.bytes,
               s.capacity ? fmt::format(", capacity {} bytes", s.capacity) : std::string());
  }
  return 0;
}

int run_rm(const StoreOptions& o) {
  vq::require(o.all != !o.keys.empty(), "store rm takes --all or KEY..., one of them");
  auto store = vq::open_store(o.store);
  const std::vector<std::string> keys = o.all ? store->list() : o.keys;
  for (const auto& k : keys) vq::check_store_key(k);
  int removed = 0, missing = 0;
  for (const auto& k : keys) {
    if (store->remove(k)) ++removed;
    else {
      ++missing;
      fmt::print(stderr, "veloxquant: warning: no blob '{}' in {}\n", k, store->describe());
    }
  }
  fmt::print("removed {} blob(s) from {}\n", removed, store->describe());
  return missing ? 1 : 0;
}
}  // namespace

Runner add_store(CLI::App& app) {
  auto o = std::make_shared<StoreOptions>();
  app.require_subcommand(1);
  const auto add_url = [&](CLI::App& sub) {
    sub.add_option("--store", o->store,
                   "file:DIR[?capacity=BYTES] (default file:./.vqkv-store), redis://[:password@]host:port[/db][?prefix=P], "
                   "redis-cluster://host:port[,host:port...]");
  };
  CLI::App* put = app.add_subcommand("put", "run the model over a text and store its KV in chunks, at every level");
  add_url(*put);
  add_model_options(*put, o->model, o->tokenizer);
  put->add_option("--text", o->text, "text file to store the context of");
  put->add_option_function<std::string>(
      "--prompt", [o](const std::string& p) { o->prompt = p, o->prompt_given = true; }, "text to store the context of");
  put->add_option("--levels", o->levels, "';'-separated method specs, each chunk is stored at every one (fp32, the exact level, is always added)")
      ->capture_default_str();
  put->add_option("--chunk-tokens", o->chunk_tokens, "tokens per chunk")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  put->add_flag("--json", o->json, "print a JSON report");
  CLI::App* ls = app.add_subcommand("ls", "list the store's keys");
  add_url(*ls);
  ls->add_flag("--json", o->json, "print JSON");
  CLI::App* stats = app.add_subcommand("stats", "blobs and bytes in the store");
  add_url(*stats);
  stats->add_flag("--json", o->json, "print JSON");
  CLI::App* rm = app.add_subcommand("rm", "remove blobs by key, or --all");
  add_url(*rm);
  rm->add_flag("--all", o->all, "remove every blob");
  rm->add_option("keys", o->keys, "keys to remove");
  return [o, put, ls, stats, rm] {
    if (put->parsed()) return run_put(*o);
    if (ls->parsed()) return run_ls(*o);
    if (stats->parsed()) return run_stats(*o);
    if (rm->parsed()) return run_rm(*o);
    return 2;
  };
}

}  // namespace vqcli
