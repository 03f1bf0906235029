#include "veloxquant/cache/builder.hpp"

#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/quant/layer_schedule.hpp"

namespace vq {

ModelDescription ModelDescription::uniform(int n_layers, int head_dim) {
  ModelDescription m;
  m.layer_head_dims.assign(static_cast<std::size_t>(std::max(0, n_layers)), head_dim);
  return m;
}

std::vector<std::shared_ptr<KVCache>> KVCacheBuilder::for_model(const ModelDescription& model, const KVCacheConfig& config) {
  require(!config.cachegen_resolved_bits.has_value(),
          "KVCacheBuilder::for_model: config already sets cachegen_resolved_bits, which would bypass the layer schedule; "
          "leave it unset (set cachegen_bits instead)");
  config.validate();
  int n_attention = 0;
  for (const auto& d : model.layer_head_dims) {
    if (d) require(*d >= 1, "KVCacheBuilder::for_model: a head dim must be >= 1");
    n_attention += d.has_value();
  }
  const auto bits = layer_group_bits(n_attention, config.cachegen_bits, config.cachegen_layer_groups);
  std::vector<std::shared_ptr<KVCache>> caches;
  std::size_t i = 0;
  for (const auto& d : model.layer_head_dims) {
    if (!d) {
      caches.push_back(std::make_shared<KVCache>());
      continue;
    }
    KVCacheConfig c = config;
    c.cachegen_resolved_bits = bits[i++];
    caches.push_back(std::make_shared<CacheGenKVCache>(c));
  }
  return caches;
}

}  // namespace vq
