// vq_decode (vq/codec.hpp) into a caller's VqLayerCodes, for callers that decode layer after layer
// (or chunk after chunk) of one shape: the decoder writes every code exactly once, so the caller's
// code buffers are reused as they are, with no allocation and no zero fill (at 8 Mi codes a layer,
// the zero fill alone was ~15 % of a decode: commit 706e11c).
#pragma once
#include <cstdint>
#include <span>

#include "veloxquant/vq/codec.hpp"

namespace vq {

// Decodes `bytes` as vq_decode does (same checks, same FormatError) into `out`: out.k.codes and
// out.v.codes keep their storage when it already has the decoded size (whatever they held is
// overwritten), else they are resized; every other field is replaced. On FormatError `out` is left
// valid but unspecified.
void vq_decode(std::span<const std::uint8_t> bytes, std::uint64_t max_codes, VqLayerCodes& out, RansKernel kernel = RansKernel::Auto);

}  // namespace vq
