#include "veloxquant/peers/ggml_block_cache.hpp"

#include <fmt/format.h>

#include "peer_rows.hpp"
#include "veloxquant/core/error.hpp"

namespace vq {

namespace {

// Quantize every token row of `t` into blocks (token-major, appended to `blocks`) and write their
// dequantization to `recon` (same shape and dtype as t).
template <class Traits>
void quantize_rows(const Tensor& t, std::vector<typename Traits::block>& blocks, Tensor& recon) {
  const std::int64_t B = t.dim(0), S = t.dim(2), row = t.dim(1) * t.dim(3), nblk = row / ggml::QK;
  std::vector<float> x(static_cast<std::size_t>(row)), y(static_cast<std::size_t>(row));
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t b = 0; b < B; ++b) {
      peers_detail::gather_token(t, b, s, x.data());
      for (std::int64_t j = 0; j < nblk; ++j) {
        typename Traits::block blk{};
        Traits::quantize(x.data() + j * ggml::QK, blk);
        Traits::dequantize(blk, y.data() + j * ggml::QK);
        blocks.push_back(blk);
      }
      peers_detail::scatter_token(recon, b, s, y.data());
    }
}

}  // namespace

template <class Traits>
std::string GgmlBlockCache<Traits>::kind() const {
  return fmt::format("GgmlBlockCache<{}>", Traits::name);
}

template <class Traits>
std::pair<Tensor, Tensor> GgmlBlockCache<Traits>::update_and_fetch(const Tensor& keys, const Tensor& values) {
  check_chunk(keys, values);
  for (const Tensor* t : {&keys, &values}) {
    const std::int64_t row = t->dim(1) * t->dim(3);
    if (row % ggml::QK != 0)
      throw InvalidArgument(fmt::format("{}: a token's row of H*D = {}*{} = {} values is not a multiple of the block size {}",
                                        Traits::name, t->dim(1), t->dim(3), row, ggml::QK));
    if (!t->all_finite()) throw InvalidArgument(fmt::format("{}: keys and values must be finite (no NaN or Inf)", Traits::name));
  }
  // Everything is computed before the cache changes, so a throw leaves it as it was.
  std::vector<Block> kb, vb;
  kb.reserve(static_cast<std::size_t>(keys.dim(0) * keys.dim(2) * keys.dim(1) * keys.dim(3) / ggml::QK));
  vb.reserve(static_cast<std::size_t>(values.dim(0) * values.dim(2) * values.dim(1) * values.dim(3) / ggml::QK));
  Tensor rk = Tensor::uninitialized(keys.shape(), keys.dtype()), rv = Tensor::uninitialized(values.shape(), values.dtype());
  quantize_rows<Traits>(keys, kb, rk);
  quantize_rows<Traits>(values, vb, rv);
  if (offset_ == 0) {
    key_blocks_.clear();
    value_blocks_.clear();
  }
  key_blocks_.insert(key_blocks_.end(), kb.begin(), kb.end());
  value_blocks_.insert(value_blocks_.end(), vb.begin(), vb.end());
  append(rk, rv);
  return {keys_buf_.slice(2, 0, offset_), values_buf_.slice(2, 0, offset_)};
}

template <class Traits>
std::int64_t GgmlBlockCache<Traits>::trim(std::int64_t n) {
  const std::int64_t dropped = KVCache::trim(n);
  if (offset_ == 0) {
    key_blocks_.clear();
    value_blocks_.clear();
  } else {
    const auto per_token = [&](const Tensor& buf) { return buf.dim(0) * buf.dim(1) * buf.dim(3) / ggml::QK; };
    key_blocks_.resize(static_cast<std::size_t>(offset_ * per_token(keys_buf_)));
    value_blocks_.resize(static_cast<std::size_t>(offset_ * per_token(values_buf_)));
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
  return KVCache::nbytes() + (key_blocks_.capacity() + value_blocks_.capacity()) * sizeof(Block);
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
