#include "veloxquant/model/vq_layer_models.hpp"

#include <bit>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include <xxhash.h>

#include "veloxquant/core/error.hpp"

namespace vq::detail {

VqLayerModel vq_checkpoint_layer(const Checkpoint& ck, std::size_t l, const VqBasisOptions& basis, std::uint64_t fingerprint) {
  const ModelConfig& c = ck.config;
  // Query and output projections are q_dim x dim (q_dim = heads x head size: dim itself unless the
  // heads were widened, as a --pad-head GGUF's are).
  const std::size_t dim = static_cast<std::size_t>(c.dim), kv = static_cast<std::size_t>(c.kv_dim()), qd = static_cast<std::size_t>(c.q_dim());
  VqLayerWeights w;
  w.dim = c.dim;
  w.n_heads = c.n_heads;
  w.n_kv_heads = c.n_kv_heads;
  w.head_dim = c.head_size();
  w.wq = std::span<const float>(ck.wq).subspan(l * qd * dim, qd * dim);
  w.wk = std::span<const float>(ck.wk).subspan(l * kv * dim, kv * dim);
  w.wv = std::span<const float>(ck.wv).subspan(l * kv * dim, kv * dim);
  w.wo = std::span<const float>(ck.wo).subspan(l * dim * qd, dim * qd);
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
