// veloxquant methods: the method table (methods/method_table.hpp) as text or JSON: every method's
// spec syntax, whose it is, its cache, its keys with defaults and ranges, and the settings eval,
// rd, demo and bench attention run by default.
#include <string>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "json_out.hpp"
#include "veloxquant/methods/method_table.hpp"

namespace vqcli {

namespace {

nlohmann::json row_json(const vq::MethodRow& r) {
  nlohmann::json keys = nlohmann::json::array();
  for (const auto& k : r.keys) keys.push_back({{"name", k.name}, {"default", k.fallback}, {"range", k.range}, {"help", k.help}});
  nlohmann::json demo = nlohmann::json::array();
  for (const auto& d : r.demo) demo.push_back({{"spec", d.spec}, {"note", d.note}});
  return {{"name", r.name},
          {"family", vq::method_family_name(r.family)},
          {"usage", vq::method_usage(r)},
          {"summary", r.summary},
          {"cache", r.cache},
          {"canonical_default", vq::MethodSpec::parse(r.name).to_string()},
          {"saves_vqkv", r.saves_vqkv},
          {"keys", keys},
          {"eval", r.eval},
          {"rd", r.rd},
          {"demo", demo},
          {"bench_attention", r.bench_attention},
          {"store", r.store}};
}

}  // namespace

Runner add_methods(CLI::App& app) {
  auto json = std::make_shared<bool>(false);
  app.add_flag("--json", *json, "print {\"methods\": [{\"name\", \"family\", \"usage\", \"keys\": [...], ...}]} instead of the text");
  return [json] {
    if (*json) {
      nlohmann::json rows = nlohmann::json::array();
      for (const auto& r : vq::method_table()) rows.push_back(row_json(r));
      fmt::print("{}\n", json_text({{"methods", rows}}));
    } else {
      fmt::print("{}", vq::methods_text());
    }
    return 0;
  };
}

}  // namespace vqcli
