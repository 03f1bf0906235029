// The caches' fused quantizer: one group read straight from rows stored as f32 or f16, writing
// codes, scales, minima and the reconstruction (in the rows' dtype) in one pass over L1-resident
// data. Same numbers as quantize_group + dequant_group (tested bit for bit); an AVX2+F16C kernel
// is chosen at run time where the CPU has it, with the portable path as its reference.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "veloxquant/core/dtype.hpp"

namespace vq {

struct FusedGroupScratch {
  std::vector<float> in, out, inv;
};

enum class QuantStatus { Ok = 0, NonFinite, RangeOverflow };

// rows[r] / out_rows[r] point at `dim` elements of `dtype` (r < n_rows); out_rows may equal rows.
// Returns NonFinite when a value is NaN or Inf and RangeOverflow when some channel's max - min
// overflows float32; outputs are then unspecified (possibly partly written). Never throws.
QuantStatus quantize_group_rows(const std::byte* const* rows, std::byte* const* out_rows, int n_rows, int dim, int bits, DType dtype,
                         std::uint8_t* codes, float* scale, float* minv, FusedGroupScratch& scratch);

// n_groups consecutive groups of group_rows rows each (rows, out_rows: n_groups * group_rows
// pointers; codes: that many rows of dim; scale, minv: n_groups * dim), with the same results and
// the same first failing status as one quantize_group_rows call per group in order. The fast
// kernel overlaps one group's reads with the previous group's writes.
QuantStatus quantize_groups(const std::byte* const* rows, std::byte* const* out_rows, int n_groups, int group_rows, int dim, int bits,
                            DType dtype, std::uint8_t* codes, float* scale, float* minv, FusedGroupScratch& scratch);

// The portable implementation (exposed for the equality test).
QuantStatus quantize_group_rows_portable(const std::byte* const* rows, std::byte* const* out_rows, int n_rows, int dim, int bits,
                                  DType dtype, std::uint8_t* codes, float* scale, float* minv, FusedGroupScratch& scratch);
// Whether quantize_group_rows uses the AVX2+F16C kernel for `dtype` on this CPU.
bool fused_quant_has_fast_path(DType dtype);

}  // namespace vq
