// Token delta: the lossless transform CacheGen applies to codes before entropy coding.
//
// On a row-major [N, D] code matrix, row 0 is kept and row i becomes code[i] - code[i-1] (signed,
// per channel). Deltas cross group boundaries. With b-bit codes the symbols lie in
// [-(2^b - 1), 2^b - 1]. A per-channel prefix sum (token_undelta) inverts it exactly.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace vq {

std::vector<std::int16_t> token_delta(std::span<const std::uint8_t> codes, int n_tokens, int dim);

// Inverse of token_delta. Throws FormatError if a running sum leaves 0..255 (corrupt input).
std::vector<std::uint8_t> token_undelta(std::span<const std::int16_t> deltas, int n_tokens, int dim);

}  // namespace vq
