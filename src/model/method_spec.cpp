// Method spec parser and the caches it builds.
#include "veloxquant/model/method_spec.hpp"

#include <charconv>

#include <fmt/core.h>

#include "veloxquant/cache/builder.hpp"
#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/peers/fp8_cache.hpp"
#include "veloxquant/peers/ggml_block_cache.hpp"
#include "veloxquant/peers/kivi_cache.hpp"

namespace vq {

namespace {

int parse_int(const std::string& key, const std::string& value, const std::string& spec) {
  int v = 0;
  const auto* end = value.data() + value.size();
  auto [p, ec] = std::from_chars(value.data(), end, v);
  if (ec != std::errc() || p != end || value.empty())
    throw InvalidArgument(fmt::format("method '{}': {}={} is not an integer", spec, key, value));
  return v;
}

bool parse_bool(const std::string& key, const std::string& value, const std::string& spec, const char* t, const char* f) {
  if (value == t) return true;
  if (value == f) return false;
  throw InvalidArgument(fmt::format("method '{}': {}={} is not valid; use {}={} or {}={}", spec, key, value, key, t, key, f));
}

}  // namespace

namespace {

// The key=value items of `args` (empty when the spec had no ':'), each passed to `set(key, value)`.
template <class Set>
void for_each_option(const std::string& spec, const std::string& args, bool has_colon, const char* keys, Set set) {
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

constexpr const char* kValidMethods =
    "fp32, fp16, cachegen[:bits=N,group=G,flush=per_call|group_aligned,delta=0|1,schedule=on|off], "
    "kivi[:bits=2|4,group=G,residual=R], q8_0, q4_0, q4_1, fp8";

}  // namespace

MethodSpec MethodSpec::parse(const std::string& spec) {
  const auto colon = spec.find(':');
  const bool has_colon = colon != std::string::npos;
  const std::string name = spec.substr(0, colon);
  const std::string args = has_colon ? spec.substr(colon + 1) : std::string();
  MethodSpec m;
  static const std::pair<const char*, Kind> kPlain[] = {{"fp32", Kind::Fp32}, {"fp16", Kind::Fp16}, {"q8_0", Kind::Q8_0},
                                                        {"q4_0", Kind::Q4_0}, {"q4_1", Kind::Q4_1}, {"fp8", Kind::Fp8}};
  for (const auto& [n, k] : kPlain) {
    if (name != n) continue;
    if (has_colon) throw InvalidArgument(fmt::format("method '{}': {} takes no options (remove ':{}')", spec, name, args));
    m.kind = k;
    return m;
  }
  if (name == "kivi") {
    m.kind = Kind::Kivi;
    constexpr const char* keys = "bits, group, residual";
    for_each_option(spec, args, has_colon, keys, [&](const std::string& key, const std::string& value) {
      if (key == "bits")
        m.kivi.bits = parse_int(key, value, spec);
      else if (key == "group")
        m.kivi.group = parse_int(key, value, spec);
      else if (key == "residual")
        m.kivi.residual = parse_int(key, value, spec);
      else
        throw InvalidArgument(fmt::format("method '{}': unknown key '{}' for kivi; valid keys are {}", spec, key, keys));
    });
    try {
      m.kivi.validate();
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("method '{}': {}", spec, e.what()));
    }
    return m;
  }
  if (name != "cachegen") throw InvalidArgument(fmt::format("unknown method '{}': valid methods are {}", name, kValidMethods));
  m.kind = Kind::CacheGen;
  for_each_option(spec, args, has_colon, "bits, group, flush, delta, schedule", [&](const std::string& key, const std::string& value) {
    if (key == "bits") {
      m.cachegen.cachegen_bits = parse_int(key, value, spec);
    } else if (key == "group") {
      m.cachegen.cachegen_group_size = parse_int(key, value, spec);
    } else if (key == "flush") {
      if (value != "per_call" && value != "group_aligned")
        throw InvalidArgument(fmt::format("method '{}': flush={} is not valid; use flush=per_call or flush=group_aligned", spec, value));
      m.cachegen.cachegen_flush = flush_mode_from_name(value);
    } else if (key == "delta") {
      m.cachegen.cachegen_use_delta = parse_bool(key, value, spec, "1", "0");
    } else if (key == "schedule") {
      m.schedule = parse_bool(key, value, spec, "on", "off");
    } else {
      throw InvalidArgument(
          fmt::format("method '{}': unknown key '{}' for cachegen; valid keys are bits, group, flush, delta, schedule", spec, key));
    }
  });
  try {
    m.cachegen.validate();
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("method '{}': {}", spec, e.what()));
  }
  return m;
}

std::string MethodSpec::to_string() const {
  switch (kind) {
    case Kind::Fp32: return "fp32";
    case Kind::Fp16: return "fp16";
    case Kind::Q8_0: return "q8_0";
    case Kind::Q4_0: return "q4_0";
    case Kind::Q4_1: return "q4_1";
    case Kind::Fp8: return "fp8";
    case Kind::Kivi: return fmt::format("kivi:bits={},group={},residual={}", kivi.bits, kivi.group, kivi.residual);
    case Kind::CacheGen: break;
  }
  return fmt::format("cachegen:bits={},group={},flush={},delta={},schedule={}", cachegen.cachegen_bits, cachegen.cachegen_group_size,
                     flush_mode_name(cachegen.cachegen_flush), cachegen.cachegen_use_delta ? 1 : 0, schedule ? "on" : "off");
}

std::pair<Tensor, Tensor> Fp16KVCache::update_and_fetch(const Tensor& keys, const Tensor& values) {
  require(keys.dtype() == DType::F32 && values.dtype() == DType::F32,
          fmt::format("Fp16KVCache takes float32 keys and values, got {} and {}", dtype_name(keys.dtype()), dtype_name(values.dtype())));
  // f32 -> f16 -> f32 rounds each element to float16 precision (half to even) exactly once.
  auto round_trip = [](const Tensor& t) { return t.to(DType::F16).to(DType::F32); };
  return KVCache::update_and_fetch(round_trip(keys), round_trip(values));
}

CacheBytes Fp16KVCache::stored_bytes() const {
  const KVState s = state();
  const double bytes = 2.0 * static_cast<double>(s.keys.numel() + s.values.numel());
  return {bytes, bytes};
}

std::vector<std::shared_ptr<KVCache>> make_caches(const MethodSpec& spec, const ModelDescription& model) {
  if (spec.kind == MethodSpec::Kind::CacheGen && spec.schedule) return KVCacheBuilder::for_model(model, spec.cachegen);
  KVCacheConfig cfg = spec.cachegen;
  cfg.cachegen_resolved_bits = cfg.cachegen_bits;
  std::vector<std::shared_ptr<KVCache>> caches;
  for (const auto& head_dim : model.layer_head_dims) {
    if (!head_dim || spec.kind == MethodSpec::Kind::Fp32)
      caches.push_back(std::make_shared<KVCache>());
    else if (spec.kind == MethodSpec::Kind::Fp16)
      caches.push_back(std::make_shared<Fp16KVCache>());
    else if (spec.kind == MethodSpec::Kind::Kivi)
      caches.push_back(std::make_shared<KiviKVCache>(spec.kivi));
    else if (spec.kind == MethodSpec::Kind::Q8_0)
      caches.push_back(std::make_shared<Q8_0KVCache>());
    else if (spec.kind == MethodSpec::Kind::Q4_0)
      caches.push_back(std::make_shared<Q4_0KVCache>());
    else if (spec.kind == MethodSpec::Kind::Q4_1)
      caches.push_back(std::make_shared<Q4_1KVCache>());
    else if (spec.kind == MethodSpec::Kind::Fp8)
      caches.push_back(std::make_shared<Fp8KVCache>());
    else
      caches.push_back(std::make_shared<CacheGenKVCache>(cfg));
  }
  return caches;
}

std::vector<std::shared_ptr<KVCache>> make_caches(const MethodSpec& spec, const Transformer& model) {
  return make_caches(spec, model.description());
}

std::vector<std::shared_ptr<KVCache>> make_caches(const std::string& spec, const Transformer& model) {
  return make_caches(MethodSpec::parse(spec), model);
}

}  // namespace vq
