// The layer models of our `vq` method that a llama2.c checkpoint gives: the transforms
// vq/basis.hpp derives from a layer's weights, and the fingerprint that names the model in saved
// `vq` caches and in a store's index (docs/format.md).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/vq/basis.hpp"

namespace vq {

// The fingerprint a saved `vq` cache names its model by (docs/format.md): xxHash64 (seed 0) of
// the little-endian int32 shape (dim, n_layers, n_heads, n_kv_heads), then the float32 bytes of
// every layer's rms_att, wq, wk, wv and wo, in that order: the weights vq/basis.hpp derives the
// transforms from, so two checkpoints with the same fingerprint rebuild the same layer models.
std::uint64_t vq_model_fingerprint(const Checkpoint& ck);
// The layer models of `ck` for a .vqkv loader (VqkvLoadOptions::vq_models): refuses a fingerprint
// other than ck's with an InvalidArgument that names both, and a layer index outside the model.
VqLayerModelSource vq_layer_models(std::shared_ptr<const Checkpoint> ck);

namespace detail {
// Layer `l`'s model from a checkpoint's weights, with its source (fingerprint, l, basis) set.
VqLayerModel vq_checkpoint_layer(const Checkpoint& ck, std::size_t l, const VqBasisOptions& basis, std::uint64_t fingerprint);
// The same, shared process-wide while anyone holds it (built once per (fingerprint, l, basis)).
std::shared_ptr<const VqLayerModel> shared_checkpoint_layer(const Checkpoint& ck, std::size_t l, const VqBasisOptions& basis,
                                                            std::uint64_t fingerprint);
}  // namespace detail

}  // namespace vq
