// GgmlBlockCache<q8_0 | q4_0 | q4_1>: llama.cpp's quantized KV cache (`--cache-type-k/-v`) for one
// layer, as a vq::KVCache, resident-compressed: it holds the packed blocks and nothing else.
//
// Layout, as llama.cpp's: a token's keys for all KV heads form one row of H*D values (head-major,
// then head dim), and the row is cut into blocks of 32 consecutive values (ggml_blocks.hpp). With
// D a multiple of 32 every block lies inside one head; with a smaller D (stories260K: D = 8,
// H = 4) a block spans 32/D heads of the same token. H*D not a multiple of 32 is refused with
// InvalidArgument (no padding). Each token is quantized on arrival, independently of the others,
// so the cache does not depend on how the host chunks its calls.
//
// Rotation (`rotate = true`, spec `q4_0:rotate=1`): each head's K row and V row is multiplied by
// the fixed signed Hadamard rotation R of head_rotation.hpp before it is cut into blocks; the
// blocks hold R x. Dequantization undoes it (state(), update_and_fetch); attend runs in the
// rotated space (the query is rotated once per step, the output rotated back once).
//
// Memory (what nbytes() reports, exactly the allocations): the two arrays of blocks, each in a
// memory mapping of its own (core/page_vector.hpp: grown with mremap, so growing leaves no freed
// buffers behind in malloc's heap; the pages that back its blocks, i.e. its bytes rounded up to
// the page size), with rotate the two sign vectors (4 bytes per head dim each, on the heap), and
// nothing per token besides. No dense copy is kept.
// - attend() scores K and sums V straight on the blocks (src/peers/peer_attention.hpp: each block
//   decoded in registers, 16 values at a time), or dequantizes a tile of blocks at a time into the
//   loop's scratch where those kernels do not apply (cache/attention.hpp).
// - update_and_fetch() and state() materialise: they dequantize every block into fresh dense
//   tensors [B, H, offset, D] in the input dtype, owned by the caller (the cache keeps no reference;
//   they are freed when the caller drops them). Cost per call: O(offset * H * D) dequantization and
//   B*H*offset*(D_k + D_v)*sizeof(dtype) bytes allocated, i.e. what a dense cache holds, for as long
//   as the caller holds them. A host that attends through attend() never pays it.
// What stored_bytes() bills: bytes/block * blocks (d and m included), the same as nbytes() less the
// rounding of each array to whole pages and the signs.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/core/page_vector.hpp"
#include "veloxquant/peers/ggml_blocks.hpp"
#include "veloxquant/peers/head_rotation.hpp"

namespace vq {

template <class Traits>
class GgmlBlockCache : public KVCache {
 public:
  using Block = typename Traits::block;

  explicit GgmlBlockCache(bool rotate = false) : rotate_(rotate) {}

  // As KVCache::update_and_fetch, returning the dequantized cache in the input dtype (fresh
  // tensors: see Memory above). Throws InvalidArgument (cache unchanged) on a mismatch, NaN/Inf,
  // or H*D not a multiple of 32.
  std::pair<Tensor, Tensor> update_and_fetch(const Tensor& keys, const Tensor& values) override;
  // Appends the chunk's codes only (no dense tensors are made).
  void update(const Tensor& keys, const Tensor& values) override;
  // The dequantized cache (fresh tensors in the input dtype, as update_and_fetch returns).
  KVState state() const override;
  std::int64_t trim(std::int64_t n) override;
  // Quantizes `state` as one fresh chunk (dense tensors are all a state carries).
  void from_state(const KVState& state) override;
  std::size_t nbytes() const override;
  CacheBytes stored_bytes() const override;
  std::string kind() const override;

  // Attention reads blocks: a tile is dequantized straight from them (rotated rows when rotate).
  const float* read_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const override;
  const float* read_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const override;
  void map_query(float* q) const override;
  void unmap_output(float* out) const override;
  // Scores and weighted sums straight on the blocks (no float32 tile) where the SIMD kernels run
  // and every head owns whole blocks (D % 32 == 0) whose dequantized values are what attention
  // reads (float32 input, or rotated); otherwise the KVCache defaults over read_*_tile.
  void score_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, const float* queries, std::int64_t nq,
                      float* scores, float* scratch) const override;
  void accumulate_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, const float* weights, std::int64_t nq,
                             float* acc, float* scratch) const override;
  // Longer tiles (256 tokens) where both sides run on the blocks with the AVX-512 kernels;
  // otherwise the default.
  std::int64_t attention_tile_tokens() const override;

  bool rotate() const { return rotate_; }
  // The packed blocks, token-major: [token][batch][block of the H*D row].
  const PageVector<Block>& key_blocks() const { return key_blocks_; }
  const PageVector<Block>& value_blocks() const { return value_blocks_; }

 private:
  const float* read_tile(const PageVector<Block>& blocks, const Tensor& layout, const std::optional<HeadRotation>& rot, std::int64_t b,
                         std::int64_t h, std::int64_t t0, std::int64_t n, float* out) const;
  Tensor dequantize_all(const PageVector<Block>& blocks, const Tensor& layout, const std::optional<HeadRotation>& rot) const;

  bool rotate_;
  std::optional<HeadRotation> key_rotation_, value_rotation_;  // set with the layout when rotate_
  // keys_buf_ / values_buf_ hold only the layout: [B, H, 0, D] in the input dtype, no storage.
  PageVector<Block> key_blocks_, value_blocks_;
};

using Q8_0KVCache = GgmlBlockCache<ggml::Q8_0>;
using Q4_0KVCache = GgmlBlockCache<ggml::Q4_0>;
using Q4_1KVCache = GgmlBlockCache<ggml::Q4_1>;

extern template class GgmlBlockCache<ggml::Q8_0>;
extern template class GgmlBlockCache<ggml::Q4_0>;
extern template class GgmlBlockCache<ggml::Q4_1>;

}  // namespace vq
