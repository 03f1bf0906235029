// MethodSpec's parser and canonical text, make_caches, and the table they go through.
#include "veloxquant/methods/method_spec.hpp"

#include <algorithm>
#include <charconv>

#include "method_rows.hpp"
#include "veloxquant/model/transformer.hpp"

namespace vq {

namespace detail {

namespace {

// A whole-text number of type T, or InvalidArgument naming the spec, the key and `what` it must be.
template <class T>
T parse_number(const std::string& key, const std::string& value, const std::string& spec, const char* what) {
  T v = 0;
  const auto* end = value.data() + value.size();
  auto [p, ec] = std::from_chars(value.data(), end, v);
  if (ec != std::errc() || p != end || value.empty())
    throw InvalidArgument(fmt::format("method '{}': {}={} is not {}", spec, key, value, what));
  return v;
}

}  // namespace

int parse_int(const std::string& key, const std::string& value, const std::string& spec) {
  return parse_number<int>(key, value, spec, "an integer");
}

double parse_double(const std::string& key, const std::string& value, const std::string& spec) {
  return parse_number<double>(key, value, spec, "a number");
}

bool parse_bool(const std::string& key, const std::string& value, const std::string& spec, const char* t, const char* f) {
  if (value == t) return true;
  if (value == f) return false;
  throw InvalidArgument(fmt::format("method '{}': {}={} is not valid; use {}={} or {}={}", spec, key, value, key, t, key, f));
}

}  // namespace detail

namespace {

std::string key_names(const MethodRow& row) {
  std::string out;
  for (const auto& k : row.keys) out += (out.empty() ? "" : ", ") + std::string(k.name);
  return out;
}

}  // namespace

const char* method_family_name(MethodFamily f) {
  switch (f) {
    case MethodFamily::Baseline: return "baseline";
    case MethodFamily::Ours: return "ours";
    case MethodFamily::Reference: return "reference";
    case MethodFamily::Peer: return "peer";
  }
  return "?";
}

const std::vector<MethodRow>& method_table() {
  static const std::vector<MethodRow> table = [] {
    std::vector<MethodRow> t = detail::baseline_rows();
    for (auto&& group : {detail::reference_rows(), detail::peer_rows(), std::vector<MethodRow>{detail::vq_row()}})
      t.insert(t.end(), group.begin(), group.end());
    return t;
  }();
  return table;
}

const MethodRow& method_row(MethodSpec::Kind kind) {
  const auto& t = method_table();
  const auto it = std::find_if(t.begin(), t.end(), [&](const MethodRow& r) { return r.kind == kind; });
  require(it != t.end(), "method kind {} has no row in the method table", static_cast<int>(kind));
  return *it;
}

const MethodRow* find_method(std::string_view name) {
  for (const auto& r : method_table())
    if (name == r.name) return &r;
  return nullptr;
}

std::string method_usage(const MethodRow& row) {
  if (row.keys.empty()) return row.name;
  std::string opts;
  for (const auto& k : row.keys) opts += fmt::format("{}{}={}", opts.empty() ? "" : ",", k.name, k.range);
  return fmt::format("{}[:{}]", row.name, opts);
}

std::string methods_text() {
  std::string out;
  for (const auto& r : method_table()) {
    out += fmt::format("{}  ({}) {}\n    cache: {}{}\n", method_usage(r), method_family_name(r.family), r.summary, r.cache,
                       r.saves_vqkv ? "; saves to .vqkv" : "");
    for (const auto& k : r.keys)
      out += fmt::format("    {:<15} {:<26} {}{}\n", k.name, k.range, k.help, *k.fallback ? fmt::format(" [{}]", k.fallback) : "");
  }
  return out;
}

namespace {

// One settings list of every row (eval's, bench attention's, the store's), in table order.
std::vector<std::string> every_row(std::vector<std::string> MethodRow::*list) {
  std::vector<std::string> out;
  for (const auto& r : method_table()) out.insert(out.end(), (r.*list).begin(), (r.*list).end());
  return out;
}

}  // namespace

std::vector<std::string> default_eval_methods() { return every_row(&MethodRow::eval); }

std::vector<MethodSetting> default_demo_methods() {
  std::vector<MethodSetting> out;
  for (const MethodFamily f : {MethodFamily::Baseline, MethodFamily::Ours, MethodFamily::Reference, MethodFamily::Peer})
    for (const auto& r : method_table())
      if (r.family == f) out.insert(out.end(), r.demo.begin(), r.demo.end());
  return out;
}

std::vector<std::string> default_bench_attention_methods() { return every_row(&MethodRow::bench_attention); }

std::string default_store_levels() {
  std::string out;
  for (const auto& l : every_row(&MethodRow::store)) out += (out.empty() ? "" : ";") + l;
  return out;
}

MethodSpec MethodSpec::parse(const std::string& spec) {
  // Messages echo the spec: a runaway one (a file pasted by mistake) is named by its start only.
  if (spec.size() > kMaxMethodSpecBytes)
    throw InvalidArgument(fmt::format("method spec of {} bytes is longer than {} ('{}...')", spec.size(), kMaxMethodSpecBytes, spec.substr(0, 40)));
  const auto colon = spec.find(':');
  const bool has_colon = colon != std::string::npos;
  const std::string name = spec.substr(0, colon);
  const std::string args = has_colon ? spec.substr(colon + 1) : std::string();
  const MethodRow* row = find_method(name);
  if (!row) {
    std::string valid;
    for (const auto& r : method_table()) valid += (valid.empty() ? "" : ", ") + method_usage(r);
    throw InvalidArgument(fmt::format("unknown method '{}': valid methods are {}", name, valid));
  }
  if (row->keys.empty() && has_colon) throw InvalidArgument(fmt::format("method '{}': {} takes no options (remove ':{}')", spec, name, args));
  MethodSpec m;
  m.kind = row->kind;
  const std::string keys = key_names(*row);
  detail::for_each_option(spec, args, has_colon, keys, [&](const std::string& key, const std::string& value) {
    if (std::none_of(row->keys.begin(), row->keys.end(), [&](const MethodKey& k) { return key == k.name; }))
      throw InvalidArgument(fmt::format("method '{}': unknown key '{}' for {}; valid keys are {}", spec, key, name, keys));
    row->set(m, key, value, spec);
  });
  if (row->validate) detail::naming_spec(spec, [&] { row->validate(m); });
  return m;
}

std::string MethodSpec::to_string() const { return method_row(kind).canonical(*this); }

std::vector<std::shared_ptr<KVCache>> make_caches(const MethodSpec& spec, const ModelDescription& model) {
  return method_row(spec.kind).make(spec, model, nullptr);
}

std::vector<std::shared_ptr<KVCache>> make_caches(const MethodSpec& spec, const Transformer& model) {
  return method_row(spec.kind).make(spec, model.description(), &model);
}

std::vector<std::shared_ptr<KVCache>> make_caches(const std::string& spec, const Transformer& model) {
  return make_caches(MethodSpec::parse(spec), model);
}

std::vector<std::shared_ptr<const VqProfile>> check_method_profiles(const std::vector<std::string>& specs, std::uint64_t model_fingerprint,
                                                                    const std::string& model_name) {
  std::vector<std::shared_ptr<const VqProfile>> out;
  for (const auto& s : specs) {
    const MethodSpec m = MethodSpec::parse(s);
    if (m.kind != MethodSpec::Kind::Vq || m.vq_profile.empty()) continue;
    auto p = load_vq_profile(m.vq_profile);
    check_vq_profile_model(*p, m.vq_profile, model_fingerprint, model_name);
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace vq
