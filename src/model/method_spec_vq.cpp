#include "method_spec_vq.hpp"

#include "veloxquant/model/transformer.hpp"

#include <bit>
#include <charconv>
#include <memory>
#include <mutex>

#include <xxhash.h>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"

namespace vq::detail {

namespace {

constexpr const char* kKeys = "bits, calib, residual, sinks, resident, alloc, basis, shape, rope";

double parse_real(const std::string& spec, const std::string& key, const std::string& value) {
  double v = 0;
  const char* end = value.data() + value.size();
  auto [p, ec] = std::from_chars(value.data(), end, v);
  if (value.empty() || ec != std::errc() || p != end)
    throw InvalidArgument(fmt::format("method '{}': {}={} is not a number", spec, key, value));
  return v;
}

bool parse_on_off(const std::string& spec, const std::string& key, const std::string& value) {
  if (value == "on") return true;
  if (value == "off") return false;
  throw InvalidArgument(fmt::format("method '{}': {}={} is not valid; use {}=on or {}=off", spec, key, value, key, key));
}

// The numbers of an explicit alloc value (K0/V0/K1/V1/...); throws InvalidArgument.
std::vector<double> alloc_values(const std::string& spec, const std::string& alloc) {
  std::vector<double> v;
  std::size_t start = 0;
  while (start <= alloc.size()) {
    const auto slash = alloc.find('/', start);
    v.push_back(parse_real(spec, "alloc", alloc.substr(start, slash == std::string::npos ? std::string::npos : slash - start)));
    start = slash == std::string::npos ? alloc.size() + 1 : slash + 1;
  }
  if (v.size() % 2 != 0)
    throw InvalidArgument(fmt::format("method '{}': alloc lists {} offsets; it needs two per attention layer (K/V)", spec, v.size()));
  return v;
}

// The (K, V) offsets an alloc value gives `n` attention layers; throws InvalidArgument.
std::vector<std::pair<double, double>> allocation(const std::string& spec, const std::string& alloc, int n) {
  // flat is the default because it measured best: with the downstream shaping (vq/basis.hpp) no
  // K/V split or depth trend we tried lowered KL at equal bits (docs/methods.md, "vq").
  if (alloc == "flat") return std::vector<std::pair<double, double>>(static_cast<std::size_t>(n), {0.0, 0.0});
  const std::vector<double> v = alloc_values(spec, alloc);
  if (v.size() != 2 * static_cast<std::size_t>(n))
    throw InvalidArgument(fmt::format("method '{}': alloc lists {} offsets; the model has {} attention layers, so it needs {} (K/V per layer)",
                                      spec, v.size(), n, 2 * n));
  std::vector<std::pair<double, double>> out;
  for (std::size_t i = 0; i < v.size(); i += 2) out.emplace_back(v[i], v[i + 1]);
  return out;
}

}  // namespace

MethodSpec parse_vq_spec(const std::string& spec, const std::string& args, bool has_colon) {
  MethodSpec m;
  m.kind = MethodSpec::Kind::Vq;
  for_each_option(spec, args, has_colon, kKeys, [&](const std::string& key, const std::string& value) {
    if (key == "bits") {
      m.vq.bits = parse_real(spec, key, value);
    } else if (key == "calib" || key == "residual" || key == "sinks") {
      int v = 0;
      const char* end = value.data() + value.size();
      auto [p, ec] = std::from_chars(value.data(), end, v);
      if (value.empty() || ec != std::errc() || p != end)
        throw InvalidArgument(fmt::format("method '{}': {}={} is not an integer", spec, key, value));
      (key == "calib" ? m.vq.calib : key == "residual" ? m.vq.residual : m.vq.sinks) = v;
    } else if (key == "resident") {
      if (value != "packed" && value != "coded")
        throw InvalidArgument(fmt::format("method '{}': resident={} must be packed or coded", spec, value));
      m.vq.coded = value == "coded";
    } else if (key == "alloc") {
      if (value != "flat") (void)alloc_values(spec, value);
      m.vq_alloc = value;
    } else if (key == "basis") {
      naming_spec(spec, [&] { m.vq_basis.basis = vq_basis_from_name(value); });
    } else if (key == "shape") {
      m.vq_basis.shape = parse_on_off(spec, key, value);
    } else if (key == "rope") {
      m.vq_basis.rope = parse_on_off(spec, key, value);
    } else {
      throw InvalidArgument(fmt::format("method '{}': unknown key '{}' for vq; valid keys are {}", spec, key, kKeys));
    }
  });
  naming_spec(spec, [&] { m.vq.validate(); });
  return m;
}

std::string vq_spec_string(const MethodSpec& m) {
  // sinks and resident only when set, so the canonical text of every earlier spec is unchanged.
  return fmt::format("vq:bits={},calib={},residual={},{}{}alloc={},basis={},shape={},rope={}", m.vq.bits, m.vq.calib, m.vq.residual,
                     m.vq.sinks > 0 ? fmt::format("sinks={},", m.vq.sinks) : std::string(), m.vq.coded ? "resident=coded," : "", m.vq_alloc,
                     vq_basis_name(m.vq_basis.basis),
                     m.vq_basis.shape ? "on" : "off", m.vq_basis.rope ? "on" : "off");
}

VqLayerModel vq_checkpoint_layer(const Checkpoint& ck, std::size_t l, const VqBasisOptions& basis, std::uint64_t fingerprint) {
  const ModelConfig& c = ck.config;
  const std::size_t dim = static_cast<std::size_t>(c.dim), kv = static_cast<std::size_t>(c.kv_dim());
  VqLayerWeights w;
  w.dim = c.dim;
  w.n_heads = c.n_heads;
  w.n_kv_heads = c.n_kv_heads;
  w.head_dim = c.head_size();
  w.wq = std::span<const float>(ck.wq).subspan(l * dim * dim, dim * dim);
  w.wk = std::span<const float>(ck.wk).subspan(l * kv * dim, kv * dim);
  w.wv = std::span<const float>(ck.wv).subspan(l * kv * dim, kv * dim);
  w.wo = std::span<const float>(ck.wo).subspan(l * dim * dim, dim * dim);
  w.rms_att = std::span<const float>(ck.rms_att).subspan(l * dim, dim);
  VqLayerModel lm = make_vq_layer_model(w, basis);
  lm.source = VqModelSource{fingerprint, static_cast<int>(l), basis};
  return lm;
}

// The layer model of (fingerprint, layer, basis), shared process-wide while anyone holds it: a put
// that makes each level's caches, and a loader that rebuilds them from what the chunks name, then
// build each layer once (seconds per layer at head_dim 128: an eigen-decomposition per head), not
// once per level and per user. Same inputs, same model (the build is deterministic), so sharing
// changes no value. Held weakly: the cache keeps no model alive by itself.
std::shared_ptr<const VqLayerModel> shared_checkpoint_layer(const Checkpoint& ck, std::size_t l, const VqBasisOptions& basis,
                                                            std::uint64_t fingerprint) {
  static std::mutex mu;
  static std::vector<std::pair<VqModelSource, std::weak_ptr<const VqLayerModel>>> built;
  const VqModelSource key{fingerprint, static_cast<int>(l), basis};
  {
    std::lock_guard<std::mutex> lock(mu);
    std::erase_if(built, [](const auto& e) { return e.second.expired(); });
    for (const auto& [k, w] : built)
      if (k == key)
        if (auto m = w.lock()) return m;
  }
  auto m = std::make_shared<const VqLayerModel>(vq_checkpoint_layer(ck, l, basis, fingerprint));  // outside the lock
  std::lock_guard<std::mutex> lock(mu);
  built.emplace_back(key, m);
  return m;
}

std::vector<std::shared_ptr<KVCache>> make_vq_caches(const MethodSpec& m, const ModelDescription& model, const Transformer* weights) {
  int n_attention = 0;
  for (const auto& d : model.layer_head_dims) n_attention += d.has_value();
  const auto alloc = allocation(vq_spec_string(m), m.vq_alloc, n_attention);
  std::vector<std::shared_ptr<KVCache>> caches;
  int a = 0;
  for (std::size_t l = 0; l < model.layer_head_dims.size(); ++l) {
    if (!model.layer_head_dims[l]) {
      caches.push_back(std::make_shared<KVCache>());
      continue;
    }
    VqConfig cfg = m.vq;
    cfg.k_offset = alloc[static_cast<std::size_t>(a)].first;
    cfg.v_offset = alloc[static_cast<std::size_t>(a)].second;
    ++a;
    std::shared_ptr<const VqLayerModel> layer;
    if (weights) layer = weights->vq_layer_model(static_cast<int>(l), m.vq_basis);
    caches.push_back(std::make_shared<VqKVCache>(cfg, layer));
  }
  return caches;
}

}  // namespace vq::detail

namespace vq {

std::uint64_t vq_model_fingerprint(const Checkpoint& ck) {
  XXH64_state_t* st = XXH64_createState();
  require(st != nullptr, "vq_model_fingerprint: out of memory");
  XXH64_reset(st, 0);
  const ModelConfig& c = ck.config;
  for (const std::int32_t v : {c.dim, c.n_layers, c.n_heads, c.n_kv_heads}) {
    const std::uint8_t le[4] = {static_cast<std::uint8_t>(v), static_cast<std::uint8_t>(v >> 8), static_cast<std::uint8_t>(v >> 16),
                                static_cast<std::uint8_t>(v >> 24)};
    XXH64_update(st, le, 4);
  }
  static_assert(std::endian::native == std::endian::little, "the fingerprint hashes float32 weights as little-endian bytes");
  for (const auto* w : {&ck.rms_att, &ck.wq, &ck.wk, &ck.wv, &ck.wo}) XXH64_update(st, w->data(), w->size() * sizeof(float));
  const std::uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  return h;
}

VqLayerModelSource vq_layer_models(std::shared_ptr<const Checkpoint> ck) {
  require(ck != nullptr, "vq_layer_models: no checkpoint");
  const std::uint64_t fingerprint = vq_model_fingerprint(*ck);
  return [ck, fingerprint](const VqModelSource& want) {
    require(want.fingerprint == fingerprint,
            "a vq layer was saved from the model with fingerprint {:016x}; the model given has fingerprint {:016x} (load it with the "
            "model it was compressed with)", want.fingerprint, fingerprint);
    require(want.layer >= 0 && want.layer < ck->config.n_layers, "a vq layer names model layer {}; the model has {}", want.layer,
            ck->config.n_layers);
    return detail::shared_checkpoint_layer(*ck, static_cast<std::size_t>(want.layer), want.basis, fingerprint);
  };
}

}  // namespace vq
