// Private to the methods stage: what the rows share (option parsing, error messages naming the
// spec, the per-layer factory) and the functions that make each group of rows.
#pragma once
#include <string>
#include <vector>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/methods/method_table.hpp"

namespace vq::detail {

// Calls set(key, value) for each `key=value` item of a spec's comma-separated options; throws
// InvalidArgument naming `keys` for an item without '='.
template <class Set>
inline void for_each_option(const std::string& spec, const std::string& args, bool has_colon, const std::string& keys, Set set) {
  std::size_t start = 0;
  while (has_colon && start <= args.size()) {
    const auto comma = args.find(',', start);
    const std::string item = args.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    start = comma == std::string::npos ? args.size() + 1 : comma + 1;
    const auto eq = item.find('=');
    if (eq == std::string::npos)
      throw InvalidArgument(fmt::format("method '{}': option '{}' needs the form key=value (keys: {})", spec, item, keys));
    set(item.substr(0, eq), item.substr(eq + 1));
  }
}

// Runs f (a config's validate(), a name lookup); an InvalidArgument it throws comes back prefixed
// with "method '<spec>': ", so the message names the spec the user wrote.
template <class F>
inline void naming_spec(const std::string& spec, F f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("method '{}': {}", spec, e.what()));
  }
}

// A key's value as an int, a real number, or one of two words (true for `t`); throw InvalidArgument
// naming the spec and the key.
int parse_int(const std::string& key, const std::string& value, const std::string& spec);
double parse_double(const std::string& key, const std::string& value, const std::string& spec);
bool parse_bool(const std::string& key, const std::string& value, const std::string& spec, const char* t, const char* f);

// Caches for every layer of `model`: `make(layer, n_attention)` for an attention layer (its index
// among the attention layers), a plain KVCache for the others.
template <class Make>
LayerCaches per_attention_layer(const ModelDescription& model, Make make) {
  int n_attention = 0;
  for (const auto& d : model.layer_head_dims) n_attention += d.has_value();
  LayerCaches caches;
  int a = 0;
  for (const auto& d : model.layer_head_dims) caches.push_back(d ? make(a++, n_attention) : std::make_shared<KVCache>());
  return caches;
}

// The rows, by group, in table order.
std::vector<MethodRow> baseline_rows();   // fp32, fp16
std::vector<MethodRow> reference_rows();  // cachegen
std::vector<MethodRow> peer_rows();       // kivi, q8_0, q4_0, q4_1, fp8, lmcache, cachegen_paper
MethodRow vq_row();                       // ours

}  // namespace vq::detail
