// Asymmetric min/max group quantization along the token axis (the reference's numerics).
//
// One head's slice is a row-major [N, D] matrix (N tokens, D channels). Groups run along tokens:
// `group_size` consecutive tokens of one channel share a scale and a minimum. For each group g and
// channel c, over the group's real rows (the reference pads a short last group by repeating its
// last row, which leaves min and max unchanged, so no padding is materialised):
//   levels = 2^bits - 1
//   scale  = max((max - min) / levels, 1e-8)                       (float32)
//   code   = clip(rint((x - min) / scale), 0, levels)              (rint: half to even)
//   x_hat  = code * scale + min                                    (float32, no fused multiply-add)
// This is the only lossy step in veloxquant.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace vq {

// The smallest scale the reference allows (guards constant groups).
inline constexpr float kMinScale = 1e-8f;

struct GroupQuantized {
  int n_tokens = 0;
  int dim = 0;
  int bits = 0;
  int group_size = 0;
  std::vector<std::uint8_t> codes;  // [n_tokens, dim]
  std::vector<float> scale;         // [n_groups, dim]
  std::vector<float> minv;          // [n_groups, dim]
  int n_groups() const { return group_size > 0 ? (n_tokens + group_size - 1) / group_size : 0; }
};

// Validate quantizer parameters; throws InvalidArgument (bits in 1..8, group_size >= 1).
void check_quant_params(int bits, int group_size);

// Quantize a row-major [n_tokens, dim] slice. Throws InvalidArgument on a size mismatch, bad
// parameters, or a non-finite value (NaN and Inf cannot be quantized).
GroupQuantized quantize_to_codes(std::span<const float> x, int n_tokens, int dim, int bits, int group_size);

// Reconstruct [n_tokens, dim] from codes, scales and minima. `out` must hold n_tokens * dim.
void dequant_codes(const GroupQuantized& q, std::span<float> out);

// ---- kernels on one group (used by the caches, tested through the functions above) ----

// Quantize `n_rows` (1..255) rows of `dim` channels that form one group. Writes n_rows * dim codes,
// and dim scales and minima. Input must be finite (see all_finite). Returns false (codes
// unspecified) when some channel's max - min overflows float32; never throws.
bool quantize_group(const float* rows, int n_rows, int dim, int bits, std::uint8_t* codes, float* scale, float* minv);
// x_hat for n_rows rows of one group.
void dequant_group(const std::uint8_t* codes, int n_rows, int dim, const float* scale, const float* minv, float* out);
// True when no element is NaN or +-Inf.
bool all_finite(const float* x, std::size_t n);

}  // namespace vq
