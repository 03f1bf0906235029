// Method spec parser and the caches it builds.
#include "veloxquant/model/method_spec.hpp"

#include <algorithm>
#include <charconv>

#include <fmt/core.h>

#include "veloxquant/cache/builder.hpp"
#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/model/cachegen_profile.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/peers/cachegen_paper_cache.hpp"
#include "veloxquant/peers/fp8_cache.hpp"
#include "veloxquant/peers/ggml_block_cache.hpp"
#include "veloxquant/peers/kivi_cache.hpp"
#include "veloxquant/peers/lmcache_cache.hpp"
#include "method_spec_vq.hpp"

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

double parse_double(const std::string& key, const std::string& value, const std::string& spec) {
  double v = 0;
  const auto* end = value.data() + value.size();
  auto [p, ec] = std::from_chars(value.data(), end, v);
  if (ec != std::errc() || p != end || value.empty())
    throw InvalidArgument(fmt::format("method '{}': {}={} is not a number", spec, key, value));
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

constexpr const char* kValidMethods =
    "fp32, fp16, cachegen[:bits=N,group=G,flush=per_call|group_aligned,delta=0|1,schedule=on|off], "
    "kivi[:bits=2|4,group=G,residual=R], q8_0[:rotate=0|1], q4_0[:rotate=0|1], q4_1[:rotate=0|1], fp8, lmcache[:chunk=N,schedule=scaled|native], "
    "cachegen_paper[:bin1=B,bin2=B,bin3=B,group=G,chunk=N,profile=PATH,profile_tokens=N], "
    "vq[:bits=B,calib=N,residual=N,alloc=flat|K0/V0/...,basis=weights|hadamard|identity,shape=on|off,rope=on|off]";

}  // namespace

MethodSpec MethodSpec::parse(const std::string& spec) {
  const auto colon = spec.find(':');
  const bool has_colon = colon != std::string::npos;
  const std::string name = spec.substr(0, colon);
  const std::string args = has_colon ? spec.substr(colon + 1) : std::string();
  MethodSpec m;
  static const std::pair<const char*, Kind> kPlain[] = {{"fp32", Kind::Fp32}, {"fp16", Kind::Fp16}, {"fp8", Kind::Fp8}};
  for (const auto& [n, k] : kPlain) {
    if (name != n) continue;
    if (has_colon) throw InvalidArgument(fmt::format("method '{}': {} takes no options (remove ':{}')", spec, name, args));
    m.kind = k;
    return m;
  }
  static const std::pair<const char*, Kind> kBlocks[] = {{"q8_0", Kind::Q8_0}, {"q4_0", Kind::Q4_0}, {"q4_1", Kind::Q4_1}};
  for (const auto& [n, k] : kBlocks) {
    if (name != n) continue;
    m.kind = k;
    detail::for_each_option(spec, args, has_colon, "rotate", [&](const std::string& key, const std::string& value) {
      if (key != "rotate") throw InvalidArgument(fmt::format("method '{}': unknown key '{}' for {}; valid keys are rotate", spec, key, name));
      m.rotate = parse_bool(key, value, spec, "1", "0");
    });
    return m;
  }
  if (name == "kivi") {
    m.kind = Kind::Kivi;
    constexpr const char* keys = "bits, group, residual";
    detail::for_each_option(spec, args, has_colon, keys, [&](const std::string& key, const std::string& value) {
      if (key == "bits")
        m.kivi.bits = parse_int(key, value, spec);
      else if (key == "group")
        m.kivi.group = parse_int(key, value, spec);
      else if (key == "residual")
        m.kivi.residual = parse_int(key, value, spec);
      else
        throw InvalidArgument(fmt::format("method '{}': unknown key '{}' for kivi; valid keys are {}", spec, key, keys));
    });
    detail::naming_spec(spec, [&] { m.kivi.validate(); });
    return m;
  }
  if (name == "lmcache") {
    m.kind = Kind::Lmcache;
    constexpr const char* keys = "chunk, schedule";
    detail::for_each_option(spec, args, has_colon, keys, [&](const std::string& key, const std::string& value) {
      if (key == "chunk")
        m.lmcache.chunk = parse_int(key, value, spec);
      else if (key == "schedule")
        m.lmcache.scaled = parse_bool(key, value, spec, "scaled", "native");
      else
        throw InvalidArgument(fmt::format("method '{}': unknown key '{}' for lmcache; valid keys are {}", spec, key, keys));
    });
    detail::naming_spec(spec, [&] { m.lmcache.validate(); });
    return m;
  }
  if (name == "cachegen_paper") {
    m.kind = Kind::CachegenPaper;
    constexpr const char* keys = "bin1, bin2, bin3, group, chunk, profile, profile_tokens";
    detail::for_each_option(spec, args, has_colon, keys, [&](const std::string& key, const std::string& value) {
      auto& c = m.cachegen_paper;
      if (key == "bin1" || key == "bin2" || key == "bin3")
        c.bins[static_cast<std::size_t>(key[3] - '1')] = parse_double(key, value, spec);
      else if (key == "group")
        c.group = parse_int(key, value, spec);
      else if (key == "chunk")
        c.chunk = parse_int(key, value, spec);
      else if (key == "profile" && !value.empty())
        c.profile = value;
      else if (key == "profile_tokens")
        c.profile_tokens = parse_int(key, value, spec);
      else if (key == "profile")
        throw InvalidArgument(fmt::format("method '{}': profile= needs a path (a file written by `veloxquant profile`)", spec));
      else
        throw InvalidArgument(fmt::format("method '{}': unknown key '{}' for cachegen_paper; valid keys are {}", spec, key, keys));
    });
    detail::naming_spec(spec, [&] { m.cachegen_paper.validate(); });
    return m;
  }
  if (name == "vq") return detail::parse_vq_spec(spec, args, has_colon);
  if (name != "cachegen") throw InvalidArgument(fmt::format("unknown method '{}': valid methods are {}", name, kValidMethods));
  m.kind = Kind::CacheGen;
  detail::for_each_option(spec, args, has_colon, "bits, group, flush, delta, schedule", [&](const std::string& key, const std::string& value) {
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
  detail::naming_spec(spec, [&] { m.cachegen.validate(); });
  return m;
}

std::string MethodSpec::to_string() const {
  switch (kind) {
    case Kind::Fp32: return "fp32";
    case Kind::Fp16: return "fp16";
    case Kind::Q8_0: return rotate ? "q8_0:rotate=1" : "q8_0";
    case Kind::Q4_0: return rotate ? "q4_0:rotate=1" : "q4_0";
    case Kind::Q4_1: return rotate ? "q4_1:rotate=1" : "q4_1";
    case Kind::Fp8: return "fp8";
    case Kind::Kivi: return fmt::format("kivi:bits={},group={},residual={}", kivi.bits, kivi.group, kivi.residual);
    case Kind::Lmcache: return fmt::format("lmcache:chunk={},schedule={}", lmcache.chunk, lmcache.scaled ? "scaled" : "native");
    case Kind::CachegenPaper: {
      const auto& c = cachegen_paper;
      return fmt::format("cachegen_paper:bin1={},bin2={},bin3={},group={},chunk={},{}", c.bins[0], c.bins[1], c.bins[2], c.group, c.chunk,
                         c.profile.empty() ? fmt::format("profile_tokens={}", c.profile_tokens) : "profile=" + c.profile);
    }
    case Kind::Vq: return detail::vq_spec_string(*this);
    case Kind::CacheGen: break;
  }
  return fmt::format("cachegen:bits={},group={},flush={},delta={},schedule={}", cachegen.cachegen_bits, cachegen.cachegen_group_size,
                     flush_mode_name(cachegen.cachegen_flush), cachegen.cachegen_use_delta ? 1 : 0, schedule ? "on" : "off");
}

std::pair<Tensor, Tensor> Fp16KVCache::update_and_fetch(const Tensor& keys, const Tensor& values) {
  require(keys.dtype() == DType::F32 && values.dtype() == DType::F32,
          "Fp16KVCache takes float32 keys and values, got {} and {}", dtype_name(keys.dtype()), dtype_name(values.dtype()));
  // f32 -> f16 -> f32 rounds each element to float16 precision (half to even) exactly once.
  auto round_trip = [](const Tensor& t) { return t.to(DType::F16).to(DType::F32); };
  return KVCache::update_and_fetch(round_trip(keys), round_trip(values));
}

CacheBytes Fp16KVCache::stored_bytes() const {
  const KVState s = state();
  const double bytes = 2.0 * static_cast<double>(s.keys.numel() + s.values.numel());
  return {bytes, bytes};
}

namespace {

// `transformer` (may be null) lets a cachegen_paper spec without profile=PATH profile the model.
std::vector<std::shared_ptr<KVCache>> build_caches(const MethodSpec& spec, const ModelDescription& model, const Transformer* transformer) {
  if (spec.kind == MethodSpec::Kind::CacheGen && spec.schedule) return KVCacheBuilder::for_model(model, spec.cachegen);
  if (spec.kind == MethodSpec::Kind::Vq) return detail::make_vq_caches(spec, model, transformer);
  KVCacheConfig cfg = spec.cachegen;
  cfg.cachegen_resolved_bits = cfg.cachegen_bits;
  // The CacheGen-family peers need each attention layer's depth: count attention layers only.
  const int n_attention = static_cast<int>(std::count_if(model.layer_head_dims.begin(), model.layer_head_dims.end(),
                                                         [](const auto& d) { return d.has_value(); }));
  std::shared_ptr<const CachegenPaperProfile> profile;
  if (spec.kind == MethodSpec::Kind::CachegenPaper && n_attention > 0)
    profile = cachegen_paper_profile_for(spec.cachegen_paper, transformer, n_attention);
  int attention_layer = 0;
  std::vector<std::shared_ptr<KVCache>> caches;
  for (const auto& head_dim : model.layer_head_dims) {
    const int layer = head_dim ? attention_layer++ : -1;
    if (!head_dim || spec.kind == MethodSpec::Kind::Fp32)
      caches.push_back(std::make_shared<KVCache>());
    else if (spec.kind == MethodSpec::Kind::Fp16)
      caches.push_back(std::make_shared<Fp16KVCache>());
    else if (spec.kind == MethodSpec::Kind::Kivi)
      caches.push_back(std::make_shared<KiviKVCache>(spec.kivi));
    else if (spec.kind == MethodSpec::Kind::Q8_0)
      caches.push_back(std::make_shared<Q8_0KVCache>(spec.rotate));
    else if (spec.kind == MethodSpec::Kind::Q4_0)
      caches.push_back(std::make_shared<Q4_0KVCache>(spec.rotate));
    else if (spec.kind == MethodSpec::Kind::Q4_1)
      caches.push_back(std::make_shared<Q4_1KVCache>(spec.rotate));
    else if (spec.kind == MethodSpec::Kind::Fp8)
      caches.push_back(std::make_shared<Fp8KVCache>());
    else if (spec.kind == MethodSpec::Kind::Lmcache)
      caches.push_back(std::make_shared<LmcacheKVCache>(spec.lmcache, layer, n_attention));
    else if (spec.kind == MethodSpec::Kind::CachegenPaper)
      caches.push_back(std::make_shared<CachegenPaperKVCache>(spec.cachegen_paper, layer, n_attention, profile));
    else
      caches.push_back(std::make_shared<CacheGenKVCache>(cfg));
  }
  return caches;
}

}  // namespace

std::vector<std::shared_ptr<KVCache>> make_caches(const MethodSpec& spec, const ModelDescription& model) {
  return build_caches(spec, model, nullptr);
}

std::vector<std::shared_ptr<KVCache>> make_caches(const MethodSpec& spec, const Transformer& model) {
  return build_caches(spec, model.description(), &model);
}

std::vector<std::shared_ptr<KVCache>> make_caches(const std::string& spec, const Transformer& model) {
  return make_caches(MethodSpec::parse(spec), model);
}

}  // namespace vq
