// Our method's row: `vq`, the transform codec (vq/vq_cache.hpp; its story in docs/methods.md, "vq").
#include "method_rows.hpp"

#include <memory>

#include "veloxquant/core/error.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/model/vq_chain_predictors.hpp"
#include "veloxquant/vq/profile.hpp"

namespace vq::detail {

namespace {

// The numbers of an explicit alloc value (K0/V0/K1/V1/...); throws InvalidArgument.
std::vector<double> alloc_values(const std::string& spec, const std::string& alloc) {
  std::vector<double> v;
  std::size_t start = 0;
  while (start <= alloc.size()) {
    const auto slash = alloc.find('/', start);
    v.push_back(parse_double("alloc", alloc.substr(start, slash == std::string::npos ? std::string::npos : slash - start), spec));
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

void set_vq(MethodSpec& m, const std::string& key, const std::string& value, const std::string& spec) {
  if (key == "bits") {
    m.vq.bits = parse_double(key, value, spec);
  } else if (key == "calib" || key == "residual" || key == "sinks") {
    (key == "calib" ? m.vq.calib : key == "residual" ? m.vq.residual : m.vq.sinks) = parse_int(key, value, spec);
  } else if (key == "resident") {
    if (value != "packed" && value != "coded")
      throw InvalidArgument(fmt::format("method '{}': resident={} must be packed or coded", spec, value));
    m.vq.coded = value == "coded";
  } else if (key == "alloc") {
    if (value != "flat") (void)alloc_values(spec, value);
    m.vq_alloc = value;
  } else if (key == "basis") {
    naming_spec(spec, [&] { m.vq_basis.basis = vq_basis_from_name(value); });
  } else if (key == "profile") {
    if (value.empty()) throw InvalidArgument(fmt::format("method '{}': profile= needs a path (a file written by `veloxquant calibrate`)", spec));
    m.vq_profile = value;
    m.vq_basis.basis = VqBasis::Profile;
  } else if (key == "predict") {
    m.vq_predict = parse_bool(key, value, spec, "on", "off");
  } else if (key == "block") {
    if (value != "row" && value != "head") throw InvalidArgument(fmt::format("method '{}': block={} must be row or head", spec, value));
    m.vq_basis.per_head = value == "head";
  } else if (key == "shape") {
    m.vq_basis.shape = parse_bool(key, value, spec, "on", "off");
  } else {
    m.vq_basis.rope = parse_bool(key, value, spec, "on", "off");
  }
}

std::string vq_spec_string(const MethodSpec& m) {
  // sinks, resident, block, profile and predict only when set, so the canonical text of every earlier spec is unchanged.
  return fmt::format("vq:bits={},calib={},residual={},{}{}alloc={},basis={},shape={},rope={}{}{}{}", m.vq.bits, m.vq.calib, m.vq.residual,
                     m.vq.sinks > 0 ? fmt::format("sinks={},", m.vq.sinks) : std::string(), m.vq.coded ? "resident=coded," : "", m.vq_alloc,
                     vq_basis_name(m.vq_basis.basis), m.vq_basis.shape ? "on" : "off", m.vq_basis.rope ? "on" : "off",
                     m.vq_basis.per_head ? ",block=head" : "", m.vq_profile.empty() ? std::string() : ",profile=" + m.vq_profile,
                     m.vq_predict ? ",predict=on" : "");
}

LayerCaches make_vq_caches(const MethodSpec& m, const ModelDescription& model, const Transformer* weights) {
  int n_attention = 0;
  for (const auto& d : model.layer_head_dims) n_attention += d.has_value();
  const auto alloc = allocation(vq_spec_string(m), m.vq_alloc, n_attention);
  std::vector<std::shared_ptr<KVCache>> caches;
  // A profile's axes replace the basis (with or without a model): its shape must be the model's.
  std::shared_ptr<const VqProfile> profile;
  if (!m.vq_profile.empty()) {
    profile = load_vq_profile(m.vq_profile);
    if (weights && weights->checkpoint().file_fingerprint != 0)
      check_vq_profile_model(*profile, m.vq_profile, weights->checkpoint().file_fingerprint, "this model");
    require(profile->layers == static_cast<int>(model.layer_head_dims.size()), "{} is a profile of {} layers; this model has {}", m.vq_profile,
            profile->layers, model.layer_head_dims.size());
    for (std::size_t l = 0; l < model.layer_head_dims.size(); ++l)
      require(!model.layer_head_dims[l] || *model.layer_head_dims[l] == profile->head_dim, "{} is a profile of heads of {}; layer {} has {}",
              m.vq_profile, profile->head_dim, l, model.layer_head_dims[l].value_or(0));
  }
  // predict=on: the chained caches (vq/vq_chain.hpp), each reading the one before, with predictors
  // fitted on the model's own K/V.
  std::shared_ptr<const std::vector<VqChainPredictor>> predictors;
  std::shared_ptr<const VqChainKVCache> previous;
  if (m.vq_predict) {
    require(weights != nullptr, "vq: predict=on fits its predictors on the model's own K/V: it needs a model our engine runs (eval, rd, generate)");
    require(!profile, "vq: predict=on takes the basis from the weights; profile= does not carry predictors");
    predictors = vq_chain_predictors(*weights, m.vq_basis);
  }
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
    if (profile) layer = vq_profile_layer(*profile, static_cast<int>(l));
    else if (weights) layer = weights->vq_layer_model(static_cast<int>(l), m.vq_basis);
    if (predictors) {
      auto chained = std::make_shared<VqChainKVCache>(
          cfg, layer, std::shared_ptr<const VqChainPredictor>(predictors, &(*predictors)[l]), previous);
      previous = chained;
      caches.push_back(std::move(chained));
      continue;
    }
    caches.push_back(std::make_shared<VqKVCache>(cfg, layer));
  }
  return caches;
}

}  // namespace

MethodRow vq_row() {
  return {.kind = MethodSpec::Kind::Vq,
          .name = "vq",
          .family = MethodFamily::Ours,
          .summary = "our transform codec: weight-derived per-head transforms, water-filled uniform codes, rANS; attention reads the codes",
          .cache = "VqKVCache (vq/vq_cache.hpp)",
          .keys = {{"bits", "2", "B", "nominal code bits per element, a real number in (0, 10] (the actual size is measured)"},
                   {"calib", "64", "N", "tokens that calibrate the quantizer (kept exact until then), >= 1"},
                   {"residual", "0", "N", "most recent tokens kept exact (for hosts decoding against the cache)"},
                   {"sinks", "0", "N", "first tokens also kept exact"},
                   {"resident", "packed", "packed|coded", "coded: full 64-token tiles held Rice-coded (about half the memory, slower attention)"},
                   {"alloc", "flat", "flat|K0/V0/K1/V1/...", "bits added per attention layer to K and V (flat = all 0, the measured best)"},
                   {"basis", "weights", "weights|hadamard|identity", "the transform (vq/basis.hpp); without a model, identity; profile= sets it to profile"},
                   {"shape", "on", "on|off", "shape the transform by the layer's downstream weights"},
                   {"rope", "on", "on|off", "undo RoPE before the transform, redo it after"},
                   {"block", "row", "row|head",
                    "row: one transform over all KV heads' row when it is at most 256 wide (else per head); head: one per head (decodes KV-heads times faster)"},
                   {"profile", "", "PATH", "axes fitted on the model's own K/V (`veloxquant calibrate -o PATH`): a basis without weights"},
                   {"predict", "off", "on|off",
                    "on: each layer's K predicted from the layer before, V from K and the layer before, the residuals coded (a storage setting; needs a model our engine runs)"}},
          .set = set_vq,
          .validate =
              [](const MethodSpec& m) {
                m.vq.validate();
                require(!m.vq_predict || (m.vq.residual == 0 && m.vq.sinks == 0 && !m.vq.coded),
                        "vq: predict=on is a storage setting: it takes no residual=, sinks= or resident=coded");
                require(!m.vq_basis.per_head || m.vq_profile.empty(), "vq: block=head does not apply to profile=PATH (a profile has its own blocks)");
                require((m.vq_basis.basis == VqBasis::Profile) == !m.vq_profile.empty(),
                        m.vq_profile.empty() ? "vq: basis=profile needs profile=PATH (a file written by `veloxquant calibrate`)"
                                             : "vq: profile=PATH replaces the basis: leave basis= out (or write basis=profile)");
              },
          .canonical = vq_spec_string,
          .make = make_vq_caches,
          .saves_vqkv = true,
          .rd = {"vq:bits=0.5", "vq:bits=0.75", "vq:bits=1", "vq:bits=1.5", "vq:bits=2", "vq:bits=3", "vq:bits=4", "vq:bits=6", "vq:bits=8",
                 "vq:bits=10"},
          .demo = {{"vq:bits=1", "ours"}, {"vq:bits=2", "ours"}, {"vq:bits=4", "ours"}},
          .bench_attention = {"vq:bits=2"},
          .store = {"vq:bits=1", "vq:bits=2", "vq:bits=4"}};
}

}  // namespace vq::detail
