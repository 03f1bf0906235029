#include "veloxquant/model/vq_chain_predictors.hpp"

#include <map>
#include <mutex>
#include <tuple>

#include "veloxquant/model/generate.hpp"

namespace vq {

std::shared_ptr<const std::vector<VqChainPredictor>> vq_chain_predictors(const Transformer& model, const VqBasisOptions& basis) {
  using Key = std::tuple<std::uint64_t, int, bool, bool, double, bool>;
  static std::mutex mu;
  static std::map<Key, std::shared_ptr<const std::vector<VqChainPredictor>>> memo;
  // The layer models name the model by the fingerprint the Transformer hashed once (every
  // make_caches of an evaluation comes here: no hashing of the weights per call).
  const ModelConfig& c = model.config();
  std::vector<std::shared_ptr<const VqLayerModel>> layer_models;
  for (int l = 0; l < c.n_layers; ++l) layer_models.push_back(model.vq_layer_model(l, basis));
  const Key key{layer_models.at(0)->source.value().fingerprint, static_cast<int>(basis.basis), basis.shape, basis.rope, basis.rope_theta, basis.per_head};
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = memo.find(key); it != memo.end()) return it->second;
  Transformer m = model;  // forward() uses the object's scratch: a copy of our own
  const int len = std::min(kVqChainSampleTokens, c.seq_len);
  std::vector<std::vector<KVState>> samples;
  for (int s = 0; s < kVqChainSamples; ++s) {
    auto caches = make_fp32_caches(m);
    Sampler sampler(c.vocab_size, {.temperature = 1.0f, .topp = 0.9f, .seed = static_cast<std::uint64_t>(1000 + s)});
    int token = 1;  // BOS
    for (int pos = 0; pos < len; ++pos) {
      const int in[1] = {token};
      std::vector<float> logits = m.forward(in, caches);
      token = sampler.sample(logits);
    }
    std::vector<KVState> layers;
    for (const auto& cache : caches) {
      const KVState st = cache->state();
      layers.push_back({st.keys.contiguous(true), st.values.contiguous(true)});
    }
    samples.push_back(std::move(layers));
  }
  auto fitted = std::make_shared<const std::vector<VqChainPredictor>>(fit_vq_chain(samples, layer_models));
  memo.emplace(key, fitted);
  return fitted;
}

}  // namespace vq
