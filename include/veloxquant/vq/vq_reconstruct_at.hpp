// vq_reconstruct_at: vq_reconstruct (vq/vq_cache.hpp) for codes that do not start at position 0.
//
// A vq cache un-rotates each key at its position in the context before the transform, and
// vq_reconstruct re-rotates token t of the codes at position t. A live-coded store chunk
// (store/prefix_chunks.hpp) holds the codes of tokens [first_position, first_position + C) of its
// context: its rows are those of the live cache only when re-rotated at first_position + t. Same
// arithmetic otherwise (the tiled kernel's pos0), so the rows are the live cache's bit for bit.
#pragma once
#include <cstdint>

#include "veloxquant/vq/vq_cache.hpp"

namespace vq {

// Throws InvalidArgument on code arrays that do not fit the layer model or first_position < 0.
KVState vq_reconstruct_at(const VqLayerCodes& codes, const VqLayerModel& layer, DType dtype, std::int64_t first_position);

}  // namespace vq
