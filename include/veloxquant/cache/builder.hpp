// KVCacheBuilder: one cache per layer of a model, with CacheGen's layer-wise bit schedule.
#pragma once
#include <memory>
#include <optional>
#include <vector>

#include "veloxquant/cache/config.hpp"
#include "veloxquant/cache/kv_cache.hpp"

namespace vq {

// A model as the builder sees it: per layer, its attention head dim, or nullopt for a layer
// without attention (e.g. a state-space or MLP-only layer).
struct ModelDescription {
  std::vector<std::optional<int>> layer_head_dims;
  static ModelDescription uniform(int n_layers, int head_dim);
};

struct KVCacheBuilder {
  // One cache per layer: attention layer i (counting attention layers only) gets a CacheGenKVCache
  // with cachegen_resolved_bits = layer_group_bits(n_attention, cachegen_bits, cachegen_layer_groups)[i];
  // other layers get a plain KVCache. Throws InvalidArgument when `config` already sets
  // cachegen_resolved_bits (it would silently bypass the schedule) or is otherwise invalid.
  static std::vector<std::shared_ptr<KVCache>> for_model(const ModelDescription& model, const KVCacheConfig& config);
};

}  // namespace vq
