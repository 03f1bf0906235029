// GgmlBlockCache<q8_0 | q4_0 | q4_1>: llama.cpp's quantized KV cache (`--cache-type-k/-v`) for one
// layer, as a vq::KVCache.
//
// Layout, as llama.cpp's: a token's keys for all KV heads form one row of H*D values (head-major,
// then head dim), and the row is cut into blocks of 32 consecutive values (ggml_blocks.hpp). With
// D a multiple of 32 every block lies inside one head; with a smaller D (stories260K: D = 8,
// H = 4) a block spans 32/D heads of the same token. H*D not a multiple of 32 is refused with
// InvalidArgument (no padding). Each token is quantized on arrival, independently of the others,
// so the cache does not depend on how the host chunks its calls.
//
// Storage: the packed blocks (what stored_bytes() bills: bytes/block * blocks, d and m included),
// plus a dense buffer in the input dtype that holds their dequantization for fetch (nbytes() counts
// both: a host with a block-aware attention kernel would drop the dense buffer).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/peers/ggml_blocks.hpp"

namespace vq {

template <class Traits>
class GgmlBlockCache : public KVCache {
 public:
  using Block = typename Traits::block;

  // As KVCache::update_and_fetch, returning the dequantized cache in the input dtype. Throws
  // InvalidArgument (cache unchanged) on a mismatch, NaN/Inf, or H*D not a multiple of 32.
  std::pair<Tensor, Tensor> update_and_fetch(const Tensor& keys, const Tensor& values) override;
  std::int64_t trim(std::int64_t n) override;
  // Quantizes `state` as one fresh chunk (dense tensors are all a state carries).
  void from_state(const KVState& state) override;
  std::size_t nbytes() const override;
  CacheBytes stored_bytes() const override;
  std::string kind() const override;

  // The packed blocks, token-major: [token][batch][block of the H*D row].
  const std::vector<Block>& key_blocks() const { return key_blocks_; }
  const std::vector<Block>& value_blocks() const { return value_blocks_; }

 private:
  std::vector<Block> key_blocks_, value_blocks_;
};

using Q8_0KVCache = GgmlBlockCache<ggml::Q8_0>;
using Q4_0KVCache = GgmlBlockCache<ggml::Q4_0>;
using Q4_1KVCache = GgmlBlockCache<ggml::Q4_1>;

extern template class GgmlBlockCache<ggml::Q8_0>;
extern template class GgmlBlockCache<ggml::Q4_0>;
extern template class GgmlBlockCache<ggml::Q4_1>;

}  // namespace vq
