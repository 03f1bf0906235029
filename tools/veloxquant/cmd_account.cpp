// veloxquant account: feed K and V from .npy files through one CacheGenKVCache, print its counters.
#include <algorithm>
#include <cstdio>
#include <string>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "json_out.hpp"
#include "output_paths.hpp"
#include "numeric_options.hpp"
#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/core/npy.hpp"

namespace vqcli {

namespace {
struct AccountOptions {
  std::string keys, values, recon_keys, recon_values, flush = "group_aligned";
  int bits = 4, group_size = 32;
  bool no_delta = false, pooled = false, json = false;
  std::int64_t chunk = 0;
};

int run_account(const AccountOptions& o) {
  vq::KVCacheConfig cfg;
  cfg.cachegen_bits = o.bits;
  cfg.cachegen_group_size = o.group_size;
  cfg.cachegen_use_delta = !o.no_delta;
  cfg.cachegen_per_channel = !o.pooled;
  cfg.cachegen_flush = vq::flush_mode_from_name(o.flush);
  cfg.validate();

  if (!o.recon_keys.empty() && !o.recon_values.empty())
    require_distinct_outputs(o.recon_keys, "--recon-keys", o.recon_values, "--recon-values");
  const vq::Tensor k = vq::read_npy(o.keys);
  const vq::Tensor v = vq::read_npy(o.values);
  vq::require(k.dim(0) == v.dim(0) && k.dim(1) == v.dim(1) && k.dim(2) == v.dim(2),
              "{} has shape {} but {} has shape {}: B, H and S must agree", o.keys, vq::shape_string(k.shape()),
                          o.values, vq::shape_string(v.shape()));
  vq::require(k.dtype() == v.dtype(), "{} is {} but {} is {}", o.keys, vq::dtype_name(k.dtype()), o.values,
                                                  vq::dtype_name(v.dtype()));

  vq::CacheGenKVCache cache(cfg);
  const std::int64_t S = k.dim(2);
  const std::int64_t chunk = o.chunk > 0 ? o.chunk : std::max<std::int64_t>(S, 1);
  std::pair<vq::Tensor, vq::Tensor> last;
  for (std::int64_t s = 0; s < S || (S == 0 && s == 0); s += chunk) {
    const std::int64_t e = std::min(S, s + chunk);
    last = cache.update_and_fetch(k.slice(2, s, e), v.slice(2, s, e));
    if (S == 0) break;
  }
  if (!o.recon_keys.empty()) vq::write_npy(o.recon_keys, last.first);
  if (!o.recon_values.empty()) vq::write_npy(o.recon_values, last.second);

  if (o.json) {
    nlohmann::json j;
    j["compressed_key_bytes"] = cache.compressed_key_bytes();
    j["compressed_value_bytes"] = cache.compressed_value_bytes();
    j["fixed_width_key_bytes"] = cache.fixed_width_key_bytes();
    j["fixed_width_value_bytes"] = cache.fixed_width_value_bytes();
    j["fp16_key_bytes"] = cache.fp16_key_bytes();
    j["fp16_value_bytes"] = cache.fp16_value_bytes();
    j["encoded_key_bytes"] = cache.encoded_key_bytes();
    j["encoded_value_bytes"] = cache.encoded_value_bytes();
    j["entropy_savings"] = cache.entropy_savings();
    j["assigned_avg_bits"] = cache.assigned_avg_bits();
    j["offset"] = cache.offset();
    fmt::print("{}\n", json_text(j, -1));
    return 0;
  }
  fmt::print("CacheGenKVCache  {}  K {}  V {}  {}\n", cfg.to_string(), vq::shape_string(k.shape()), vq::shape_string(v.shape()),
             vq::dtype_name(k.dtype()));
  fmt::print("tokens: {} ({})\n", cache.offset(), o.chunk > 0 ? fmt::format("{} per call", o.chunk) : std::string("all in one call"));
  fmt::print("{:<8} {:>16} {:>16} {:>16} {:>16} {:>10}\n", "", "compressed", "encoded", "fixed_width", "fp16", "bits/elem");
  auto row = [&](const char* name, std::uint64_t c, std::uint64_t e, std::uint64_t f, std::uint64_t h) {
    fmt::print("{:<8} {:>16} {:>16} {:>16} {:>16} {:>10.3f}\n", name, c, e, f, h,
               h ? 16.0 * static_cast<double>(c) / static_cast<double>(h) : 0.0);
  };
  row("keys", cache.compressed_key_bytes(), cache.encoded_key_bytes(), cache.fixed_width_key_bytes(), cache.fp16_key_bytes());
  row("values", cache.compressed_value_bytes(), cache.encoded_value_bytes(), cache.fixed_width_value_bytes(), cache.fp16_value_bytes());
  fmt::print("entropy_savings (keys): {:.4f}   assigned_avg_bits (keys): {:.4f}\n", cache.entropy_savings(), cache.assigned_avg_bits());
  fmt::print("(compressed: the reference's entropy estimate, scales and minima at fp16; encoded: measured rANS buffer with its\n"
             " tables, float32 scales and minima and header, plus the residual at fp16; bits/elem from compressed)\n");
  return 0;
}
}  // namespace

Runner add_account(CLI::App& app) {
  auto o = std::make_shared<AccountOptions>();
  app.add_option("--keys", o->keys, "keys .npy, float32 or float16 [B, H, S, D]")->required();
  app.add_option("--values", o->values, "values .npy, float32 or float16 [B, H, S, D]")->required();
  app.add_option("--bits", o->bits, "bits per code, 1..8")->capture_default_str()->transform(integer_in(1, 8));
  app.add_option("--group-size", o->group_size, "tokens per quantization group")->capture_default_str()->transform(integer_in(1, std::numeric_limits<int>::max()));
  app.add_flag("--no-delta", o->no_delta, "estimate entropy of raw codes instead of token deltas");
  app.add_flag("--pooled", o->pooled, "one entropy estimate over all channels instead of per channel");
  app.add_option("--flush", o->flush, "per_call (the reference) or group_aligned")->capture_default_str();
  app.add_option("--chunk", o->chunk, "tokens per update_and_fetch call (default: all at once)")->transform(integer_in(0, kMaxCount));
  app.add_option("--recon-keys", o->recon_keys, "write the keys the last update_and_fetch returned (.npy)");
  app.add_option("--recon-values", o->recon_values, "write the values the last update_and_fetch returned (.npy)");
  app.add_flag("--json", o->json, "print one JSON object");
  return [o] { return run_account(*o); };
}

}  // namespace vqcli
