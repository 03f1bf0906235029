// The table of methods: one row per KV cache method, as ggml's type_traits has one row per type.
//
// - A row says what a method is called, which keys its spec takes (with defaults and ranges: the
//   text `veloxquant methods`, `--help` and docs/methods.md print), how a spec's options are set and
//   written back as canonical text, how its caches are built, whose method it is (ours, the
//   reference's, a peer's), and the settings each report shows by default (eval, rd, the demo,
//   bench attention).
// - MethodSpec::parse / to_string and make_caches (methods/method_spec.hpp) go through the rows;
//   the CLI, the store, the C API and the Python module take their lists from here, and the tests
//   loop over the table (tests/methods/method_table_test.cpp).
// - Adding a method: one row (src/methods/) plus its cache, and a Kind for its settings.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "veloxquant/methods/method_spec.hpp"

namespace vq {

// Whose method a row is; the demo orders its rows by it (baseline first, then ours, the reference's,
// the peers').
enum class MethodFamily { Baseline, Ours, Reference, Peer };
const char* method_family_name(MethodFamily f);  // "baseline", "ours", "reference", "peer"

// One key of a spec: `name=value`.
struct MethodKey {
  const char* name;
  const char* fallback;  // the default, as a spec would write it ("" where there is none)
  const char* range;     // the values it takes, e.g. "1..8", "per_call|group_aligned"
  const char* help;      // one line
};

// A setting a report shows, and what it stands for there.
struct MethodSetting {
  std::string spec;
  std::string note;
};

using LayerCaches = std::vector<std::shared_ptr<KVCache>>;

struct MethodRow {
  MethodSpec::Kind kind = MethodSpec::Kind::Fp32;
  const char* name = "";  // the spec's name, before ':'
  MethodFamily family = MethodFamily::Peer;
  const char* summary = "";  // one line: what the method is and where it comes from
  const char* cache = "";    // the cache class and its header
  std::vector<MethodKey> keys{};
  // Sets one key of `m` (its kind already this row's) from its text; throws InvalidArgument naming
  // `spec` for a bad value. Keys not in `keys` never reach it. Null when `keys` is empty.
  void (*set)(MethodSpec& m, const std::string& key, const std::string& value, const std::string& spec) = nullptr;
  // Checks the combination of values (a config's validate()); null when any combination is valid.
  void (*validate)(const MethodSpec& m) = nullptr;
  // The canonical text of a spec of this row.
  std::string (*canonical)(const MethodSpec& m) = nullptr;
  // One cache per layer of `model` (a plain KVCache where a layer has no attention); `weights` (may
  // be null) is the model a method derives its transforms or tables from.
  LayerCaches (*make)(const MethodSpec& m, const ModelDescription& model, const Transformer* weights) = nullptr;
  // `veloxquant compress` writes its caches to .vqkv and loads them back exactly.
  bool saves_vqkv = false;
  // The settings each report runs by default, in order.
  std::vector<std::string> eval{};           // `veloxquant eval`
  std::vector<std::string> rd{};             // `veloxquant rd` (the family's usual settings)
  std::vector<MethodSetting> demo{};          // `veloxquant demo`'s rows
  std::vector<std::string> bench_attention{};  // `veloxquant bench attention`'s storage forms
  std::vector<std::string> store{};            // the levels `store put` (and a put after generate) stores
};

// Every method, in table order.
const std::vector<MethodRow>& method_table();
// The row of a kind (every kind has one).
const MethodRow& method_row(MethodSpec::Kind kind);
// The row named `name` (the part of a spec before ':'), or null.
const MethodRow* find_method(std::string_view name);

// "kivi[:bits=2|4,group=N,residual=N]": a row's usage, keys with their ranges.
std::string method_usage(const MethodRow& row);
// The table as `veloxquant methods` prints it: per row its name, family, summary and cache, then
// each key with its default, range and help. docs/methods.md holds the same text.
std::string methods_text();

// A report's default settings, in table order (eval: the rows' `eval` lists, and so on).
std::vector<std::string> default_eval_methods();
std::vector<MethodSetting> default_demo_methods();  // ordered by family, then table order
std::vector<std::string> default_bench_attention_methods();
// The store's default levels, ';'-separated (store/prefix_chunks.hpp's parse_levels takes it).
std::string default_store_levels();

}  // namespace vq
