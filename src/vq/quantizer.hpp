// The quantizer stage of our `vq` method: how coefficients become integer codes, and how wide a
// code's packed field is.
//
// What a reader must know first:
// - One uniform step per side (K or V) of a layer, chosen at calibration by reverse water-filling
//   over the calibration rows' per-coefficient spreads (water_fill_step): the step at which the mean
//   over coefficients of max(0, log2(4.13 sigma_c / step)) is the nominal bits.
// - Per coefficient c an offset m_c (its mean on a grid of step / 4), a code split (shift: codes past
//   +-255 are split, vq/codec.hpp) and a packed width; a code that does not fit its width escapes
//   into a side list at kEscapeBits each. calibrate_side chooses all four from the calibration rows;
//   widths_from_codes chooses widths from codes alone (restore's and a load's rule).
// - A code is round_even((y_c - mean_c) / step) (transform.hpp); nothing here is approximate.
// The design and its measurements: docs/methods.md, "vq".
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace vq::vq_quant {

// Bits an escape costs (its entry in the side list).
inline constexpr double kEscapeBits = 96.0;

// The step at which the mean over coefficients of max(0, log2(sqrt(2 pi e) sigma_c / step)) equals
// `bits` (bisection on log2 step); 1 when every sigma is 0.
float water_fill_step(const std::vector<double>& sigma, double bits);

// Calibration of one side from its first rows y (transformed, [rows][n]): step by water-filling,
// grid offsets, the means they stand for, code splits and packed widths.
void calibrate_side(const std::vector<double>& y, int n, double bits, float& step, std::vector<std::int32_t>& offset,
                    std::vector<float>& mean_f, std::vector<std::uint8_t>& shift, std::vector<std::uint8_t>& width);

// The smallest and largest code of codes[0 .. count) (0 and 0 when empty).
std::pair<int, int> code_range(const std::int16_t* codes, std::size_t count);
// Packed widths from codes alone: per coefficient the width that minimises rows x width + escape
// bits over `rows` rows of n codes.
void widths_from_codes(const std::int16_t* codes, std::int64_t rows, int n, std::vector<std::uint8_t>& width);

}  // namespace vq::vq_quant
