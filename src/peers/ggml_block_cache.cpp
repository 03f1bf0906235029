#include "veloxquant/peers/ggml_block_cache.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "peer_attention.hpp"
#include "peer_rows.hpp"
#include "veloxquant/core/error.hpp"

namespace vq {

namespace {

// Quantize every token row of `t` into blocks (token-major, written from `out` on), each head's
// D values rotated first when `rot` is set.
template <class Traits>
void quantize_rows(const Tensor& t, const std::optional<HeadRotation>& rot, typename Traits::block* out) {
  const std::int64_t B = t.dim(0), H = t.dim(1), S = t.dim(2), D = t.dim(3), row = H * D, nblk = row / ggml::QK;
  std::vector<float> x(static_cast<std::size_t>(row));
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t b = 0; b < B; ++b) {
      peers_detail::gather_token(t, b, s, x.data());
      if (rot)
        for (std::int64_t h = 0; h < H; ++h) rot->rotate(x.data() + h * D);
      for (std::int64_t j = 0; j < nblk; ++j) {
        typename Traits::block blk{};
        Traits::quantize(x.data() + j * ggml::QK, blk);
        *out++ = blk;
      }
    }
}

// The layout a resident cache keeps in keys_buf_ / values_buf_: shape and dtype, no storage.
Tensor layout_of(const Tensor& t) { return Tensor::wrap(nullptr, {t.dim(0), t.dim(1), 0, t.dim(3)}, t.dtype()); }

}  // namespace

template <class Traits>
std::string GgmlBlockCache<Traits>::kind() const {
  return fmt::format("GgmlBlockCache<{}{}>", Traits::name, rotate_ ? ":rotate=1" : "");
}

template <class Traits>
std::pair<Tensor, Tensor> GgmlBlockCache<Traits>::update_and_fetch(const Tensor& keys, const Tensor& values) {
  update(keys, values);
  const KVState s = state();
  return {s.keys, s.values};
}

template <class Traits>
void GgmlBlockCache<Traits>::update(const Tensor& keys, const Tensor& values) {
  check_chunk(keys, values);
  for (const Tensor* t : {&keys, &values}) {
    const std::int64_t row = t->dim(1) * t->dim(3);
    require(row % ggml::QK == 0, "{}: a token's row of H*D = {}*{} = {} values is not a multiple of the block size {}", Traits::name,
            t->dim(1), t->dim(3), row, ggml::QK);
    require(t->all_finite(), "{}: keys and values must be finite (no NaN or Inf)", Traits::name);
  }
  // Everything that can throw happens before the cache changes, so a throw leaves it as it was:
  // the rotations, then room for the chunk's blocks (a failed second append gives back the first).
  std::optional<HeadRotation> kr, vr;
  if (rotate_) kr.emplace(keys.dim(3)), vr.emplace(values.dim(3));
  if (offset_ == 0) {
    key_blocks_.clear();
    value_blocks_.clear();
  }
  const std::size_t k_old = key_blocks_.size();
  Block* kb = key_blocks_.append(static_cast<std::size_t>(keys.dim(0) * keys.dim(2) * keys.dim(1) * keys.dim(3) / ggml::QK));
  Block* vb = nullptr;
  try {
    vb = value_blocks_.append(static_cast<std::size_t>(values.dim(0) * values.dim(2) * values.dim(1) * values.dim(3) / ggml::QK));
  } catch (...) {
    key_blocks_.shrink(k_old);
    throw;
  }
  quantize_rows<Traits>(keys, kr, kb);
  quantize_rows<Traits>(values, vr, vb);
  if (offset_ == 0) {
    keys_buf_ = layout_of(keys);
    values_buf_ = layout_of(values);
    key_rotation_ = std::move(kr);
    value_rotation_ = std::move(vr);
  }
  offset_ += keys.dim(2);
}

template <class Traits>
const float* GgmlBlockCache<Traits>::read_tile(const PageVector<Block>& blocks, const Tensor& layout,
                                               const std::optional<HeadRotation>& rot, std::int64_t b, std::int64_t h, std::int64_t t0,
                                               std::int64_t n, float* out) const {
  // Tiles stay in the rotated space (map_query / unmap_output undo it once per query).
  constexpr std::int64_t QK = ggml::QK;
  const std::int64_t B = layout.dim(0), D = layout.dim(3), nblk = layout.dim(1) * D / QK, start = h * D;
  const bool aligned = start % QK == 0 && D % QK == 0;
  float tmp[QK];
  for (std::int64_t i = 0; i < n; ++i) {
    const Block* row = blocks.data() + ((t0 + i) * B + b) * nblk;
    float* o = out + i * D;
    if (aligned) {
      Traits::dequantize_row(row + start / QK, D / QK, o);
      continue;
    }
    for (std::int64_t pos = start; pos < start + D;) {  // a head that shares blocks with others
      const std::int64_t off = pos % QK, cnt = std::min(QK - off, start + D - pos);
      Traits::dequantize(row[pos / QK], tmp);
      std::copy(tmp + off, tmp + off + cnt, o + (pos - start));
      pos += cnt;
    }
  }
  if (layout.dtype() != DType::F32 && !rot) {
    // state() holds the input dtype: round through it so that attention reads exactly state()'s
    // values. (A rotated cache's tiles are rotated rows, which state() never holds: they stay
    // float32, within the input dtype's rounding of state().)
    std::uint16_t half[256];
    for (std::int64_t i = 0; i < n * D; i += 256) {
      const auto m = static_cast<std::size_t>(std::min<std::int64_t>(256, n * D - i));
      from_f32(out + i, half, layout.dtype(), m);
      to_f32(half, layout.dtype(), out + i, m);
    }
  }
  return out;
}

template <class Traits>
const float* GgmlBlockCache<Traits>::read_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const {
  return read_tile(key_blocks_, keys_buf_, key_rotation_, b, h, t0, n, scratch);
}

template <class Traits>
const float* GgmlBlockCache<Traits>::read_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const {
  return read_tile(value_blocks_, values_buf_, value_rotation_, b, h, t0, n, scratch);
}

namespace {
// Whether attention may run on a side's blocks directly: SIMD kernels on, whole blocks per head,
// and tiles that are the blocks' float32 values (read_tile rounds unrotated tiles through a
// float16 / bfloat16 input dtype; those take the tile path).
// The attention loop runs tiles outside heads: while head 0 works on a tile, fetch the next
// tile's token rows (every head's blocks of batch b) that exist.
template <class Block>
[[maybe_unused]] void prefetch_next_tile(const PageVector<Block>& blocks, std::int64_t B, std::int64_t nblk, std::int64_t b,
                                         std::int64_t t1, std::int64_t n) {
  const std::int64_t tokens = static_cast<std::int64_t>(blocks.size()) / (B * nblk), rows = std::min(n, tokens - t1);
  if (rows > 0)
    peer_attention::prefetch_rows(blocks.data() + (t1 * B + b) * nblk, rows, nblk * static_cast<std::int64_t>(sizeof(Block)),
                                  B * nblk * static_cast<std::int64_t>(sizeof(Block)));
}

[[maybe_unused]] bool blocks_direct(const Tensor& layout, bool rotated) {
  return attn::simd_enabled() && layout.dim(3) % ggml::QK == 0 && (layout.dtype() == DType::F32 || rotated);
}
}  // namespace

// Tiles of this many tokens where both sides run on the blocks with the AVX-512 kernels (the
// float-tile path keeps the default, sized for its scratch; so do the AVX2 kernels, which have no
// look-ahead prefetch: with 256-token tiles their q4_1 took 45-46 against 39-40 ms at 64k): a tile's per-head work outside the kernels (the hook calls,
// each query row's softmax step, the accumulators loaded and stored, the next-tile prefetch loop)
// is paid 8x less often than with the default's 32 tokens at D = 128, and the 4 x 256 scores stay
// in L1 (q4_0 at 64k, with the kernels' own prefetch: 32 -> 256 tokens 17.9 -> 15.6 ms in a first
// measurement; commit 0b6abd0). A power of two <= kAttentionSplitTokens, so the
// threaded loop's splits stay whole tiles (the same bits for any thread count).
constexpr std::int64_t kBlockTileTokens = 256;

template <class Traits>
std::int64_t GgmlBlockCache<Traits>::attention_tile_tokens() const {
  if (offset_ > 0 && attn::avx512_enabled() && blocks_direct(keys_buf_, key_rotation_.has_value()) &&
      blocks_direct(values_buf_, value_rotation_.has_value()))
    return kBlockTileTokens;
  return KVCache::attention_tile_tokens();
}

template <class Traits>
void GgmlBlockCache<Traits>::score_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, const float* queries,
                                            std::int64_t nq, float* scores, float* scratch) const {
#ifdef VQ_ATTN_HAVE_AVX2
  if (blocks_direct(keys_buf_, key_rotation_.has_value())) {
    const std::int64_t B = keys_buf_.dim(0), D = keys_buf_.dim(3), nblk = keys_buf_.dim(1) * D / ggml::QK;
    const Block* first = key_blocks_.data() + (t0 * B + b) * nblk + h * D / ggml::QK;
    if (h == 0) prefetch_next_tile(key_blocks_, B, nblk, b, t0 + n, n);
    return peer_attention::score_blocks(first, B * nblk, n, D, queries, nq, scores);
  }
#endif
  KVCache::score_key_tile(b, h, t0, n, queries, nq, scores, scratch);
}

template <class Traits>
void GgmlBlockCache<Traits>::accumulate_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, const float* weights,
                                                   std::int64_t nq, float* acc, float* scratch) const {
#ifdef VQ_ATTN_HAVE_AVX2
  if (blocks_direct(values_buf_, value_rotation_.has_value())) {
    const std::int64_t B = values_buf_.dim(0), D = values_buf_.dim(3), nblk = values_buf_.dim(1) * D / ggml::QK;
    const Block* first = value_blocks_.data() + (t0 * B + b) * nblk + h * D / ggml::QK;
    if (h == 0) prefetch_next_tile(value_blocks_, B, nblk, b, t0 + n, n);
    return peer_attention::accumulate_blocks(first, B * nblk, n, D, weights, nq, acc);
  }
#endif
  KVCache::accumulate_value_tile(b, h, t0, n, weights, nq, acc, scratch);
}

template <class Traits>
void GgmlBlockCache<Traits>::map_query(float* q) const {
  if (key_rotation_) key_rotation_->rotate(q);
}

template <class Traits>
void GgmlBlockCache<Traits>::unmap_output(float* out) const {
  if (value_rotation_) value_rotation_->unrotate(out);
}

template <class Traits>
Tensor GgmlBlockCache<Traits>::dequantize_all(const PageVector<Block>& blocks, const Tensor& layout,
                                              const std::optional<HeadRotation>& rot) const {
  const std::int64_t B = layout.dim(0), H = layout.dim(1), D = layout.dim(3), row = H * D, nblk = row / ggml::QK;
  Tensor t = Tensor::uninitialized({B, H, offset_, D}, layout.dtype());
  std::vector<float> y(static_cast<std::size_t>(row));
  for (std::int64_t s = 0; s < offset_; ++s)
    for (std::int64_t b = 0; b < B; ++b) {
      const Block* blk = blocks.data() + (s * B + b) * nblk;
      for (std::int64_t j = 0; j < nblk; ++j) Traits::dequantize(blk[j], y.data() + j * ggml::QK);
      if (rot)
        for (std::int64_t h = 0; h < H; ++h) rot->unrotate(y.data() + h * D);
      peers_detail::scatter_token(t, b, s, y.data());
    }
  return t;
}

template <class Traits>
KVState GgmlBlockCache<Traits>::state() const {
  if (offset_ == 0) return {};
  return {dequantize_all(key_blocks_, keys_buf_, key_rotation_), dequantize_all(value_blocks_, values_buf_, value_rotation_)};
}

template <class Traits>
std::int64_t GgmlBlockCache<Traits>::trim(std::int64_t n) {
  const std::int64_t dropped = KVCache::trim(n);
  if (offset_ == 0) {
    key_blocks_.clear();
    value_blocks_.clear();
  } else {
    const auto per_token = [&](const Tensor& layout) { return layout.dim(0) * layout.dim(1) * layout.dim(3) / ggml::QK; };
    key_blocks_.shrink(static_cast<std::size_t>(offset_ * per_token(keys_buf_)));
    value_blocks_.shrink(static_cast<std::size_t>(offset_ * per_token(values_buf_)));
  }
  return dropped;
}

template <class Traits>
void GgmlBlockCache<Traits>::from_state(const KVState& state) {
  this->refeed_state(state, [this] {
    key_blocks_.clear();
    value_blocks_.clear();
  });
}

template <class Traits>
std::size_t GgmlBlockCache<Traits>::nbytes() const {
  return key_blocks_.nbytes() + value_blocks_.nbytes() + (key_rotation_ ? key_rotation_->nbytes() : 0) +
         (value_rotation_ ? value_rotation_->nbytes() : 0);
}

template <class Traits>
CacheBytes GgmlBlockCache<Traits>::stored_bytes() const {
  const double bytes = static_cast<double>((key_blocks_.size() + value_blocks_.size()) * sizeof(Block));
  return {bytes, bytes};
}

template class GgmlBlockCache<ggml::Q8_0>;
template class GgmlBlockCache<ggml::Q4_0>;
template class GgmlBlockCache<ggml::Q4_1>;

}  // namespace vq
