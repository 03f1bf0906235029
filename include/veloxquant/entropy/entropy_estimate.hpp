// The reference's entropy estimate and byte counts for one head slice.
//
// symbol_entropy_bits is the empirical Shannon entropy in bits per symbol (0 for an empty array).
// For a slice of N tokens and D channels whose symbols (token deltas, or plain codes) are a
// row-major [N, D] array:
//   per_channel: code_bits = sum_c min(H(symbols[:, c]), bits) * N
//   pooled:      code_bits = min(H(all symbols), bits) * N * D
//   entropy_coded_bytes = ceil(code_bits / 8) + n_groups * D * 4     (fp16 scale + fp16 min)
//   fixed_width_bytes   = ceil(N * D * bits / 8) + n_groups * D * 4
// Computed in double (the reference uses float32; results may differ by one byte after ceil).
// These are estimates of an ideal coder; they do not count the coder's probability tables.
#pragma once
#include <cstdint>
#include <span>

namespace vq {

// Bytes of metadata per group and channel: one fp16 scale and one fp16 minimum.
inline constexpr std::uint64_t kGroupMetaBytesPerChannel = 4;

double symbol_entropy_bits(std::span<const std::int16_t> symbols);

// Estimated code bits of a slice (the sum above, before ceil).
double estimated_code_bits(std::span<const std::int16_t> symbols, int n_tokens, int dim, int bits, bool per_channel);

std::uint64_t entropy_coded_bytes(std::span<const std::int16_t> symbols, int n_tokens, int dim, int bits, int n_groups,
                                  bool per_channel);

std::uint64_t fixed_width_bytes(std::int64_t n_tokens, int dim, int bits, std::int64_t n_groups);

// Bytes for a code-bit total: ceil(code_bits / 8), robust to tiny negative rounding noise.
std::uint64_t code_bits_to_bytes(double code_bits);

}  // namespace vq
