// Fp16KVCache: the `fp16` method. K/V rounded to float16 (half to even) and back, stored as
// float32: exactly float16's precision, billed as 2 bytes per element.
#pragma once
#include <string>
#include <utility>

#include "veloxquant/cache/kv_cache.hpp"

namespace vq {

class Fp16KVCache : public KVCache {
 public:
  std::pair<Tensor, Tensor> update_and_fetch(const Tensor& keys, const Tensor& values) override;
  std::string kind() const override { return "Fp16KVCache"; }
  // Billed as the float16 it represents: 2 bytes per element.
  CacheBytes stored_bytes() const override;
};

}  // namespace vq
