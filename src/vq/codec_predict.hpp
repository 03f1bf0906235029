// Private: version 5 of the vq codec (vq/codec.hpp) predicts each coefficient's hi part from the
// same coefficient's hi part one token earlier, and codes the residual instead.
//
// What a reader must know first:
// - The side's hi parts are [rows, n] row-major, row b * tokens + t (vq/codec.hpp). Per coefficient
//   c a predictor k_c in kVqPredMin..kVqPredMax (eighths: k = 8 repeats the previous token):
//     pred(t)     = t == 0 ? 0 : (k_c * hi[t - 1] + 4) >> 3     (arithmetic shift: floor, ties up)
//     residual(t) = hi[t] - pred(t)
//   within each batch (token 0 of every batch is predicted as 0, so batches stay independent).
//   k_c = 0 codes the hi parts as they are (version 4's symbols).
// - The residuals are what the rANS region codes (same lanes, same models: the encoder fits amax_c
//   and param_c to them), so the lane kernels never see a prediction: the decoder decodes the
//   residuals exactly as before and undoes the prediction afterwards, token by token, all
//   coefficients of a token at once (each coefficient is an independent lane; t is sequential).
// - Row copies: a row whose hi parts equal an earlier row's (any batch) is not coded at all; the
//   header names it and the distance back to the last row equal to it. Real caches repeat rows
//   wherever a token repeats and the layer sees only the token (stories260K's layer 0: 74 % of its
//   rows). A copied row is still the previous token of the next row's prediction.
// - Every residual must fit the model's alphabet (|residual| <= kVqMaxCode): a coefficient whose
//   residuals would not gets k_c = 0. The decoder checks every rebuilt hi part against +-kVqMaxCode
//   (a hostile stream could otherwise grow them without bound), so its arithmetic fits int16.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace vq::vq_codec_detail {

inline constexpr int kVqPredMin = -7, kVqPredMax = 8;
// A predictor is stored as a nibble, k & 15 (so k = 0, the common case, is nibble 0).
inline constexpr std::uint8_t vq_pred_nibble(int k) { return static_cast<std::uint8_t>(k & 15); }
inline constexpr int vq_pred_from_nibble(std::uint8_t v) { return v <= kVqPredMax ? v : v - 16; }
// Used only when it lowers the residual energy (sum of squares, per coefficient over all tokens)
// by at least 10 %: a smaller gain is within what the coarser fit of a wider residual alphabet
// and the header's nibble can cost.
inline constexpr double kVqPredMinGain = 0.10;

// Chooses k_c for each coefficient of hi [batch * tokens, n] (least squares on the previous token,
// rounded to eighths, kept when kVqPredMinGain is met and every residual fits +-max_residual) and
// writes the residuals to res [batch * tokens, n]. Returns the n predictors; res_amax (when not
// null) receives each coefficient's largest |residual| over all rows.
std::vector<std::int8_t> vq_predict(const std::int16_t* hi, std::int16_t* res, std::size_t n, std::size_t batch, std::size_t tokens,
                                    int max_residual, std::vector<int>* res_amax = nullptr);

// A side is searched for row copies only when a row is at least this wide: a copy costs the header
// ~2-3 bytes, which a coded row of fewer coefficients may not exceed.
inline constexpr std::size_t kVqMinCopyWidth = 16;

// Per row of hi [rows, n]: the earlier row it repeats (the last one equal to it), or -1. All -1
// when n < kVqMinCopyWidth.
std::vector<std::int32_t> vq_find_copies(const std::int16_t* hi, std::size_t n, std::size_t rows);

// One row of the decoder: out[c] = res[c] + ((k[c] * prev[c] + 4) >> 3) for c < n, or out = res when
// prev is null (token 0 of a batch, or no predictor); false when one leaves +-max_hi (max_hi <= 255,
// so the 16-bit arithmetic is exact). out may equal res; prev is an earlier, finished row. simd: 0
// plain C++, 1 AVX2, 2 AVX-512 BW (only where the CPU has it; same results).
bool vq_unpredict_row(std::int16_t* out, const std::int16_t* res, const std::int16_t* prev, const std::int16_t* k, std::size_t n, int max_hi,
                      int simd);

// Undoes vq_predict in place (codes: the residuals in, the hi parts out). Returns false, with codes
// partly rebuilt, when a rebuilt hi part leaves +-max_hi (a corrupt stream). copy_from: null, or per
// row -1 or the earlier row (< row) it repeats (copied, not predicted). avx2: vectorise the token
// loop with AVX2 (same results).
bool vq_unpredict(std::int16_t* codes, std::size_t n, std::size_t batch, std::size_t tokens, const std::int8_t* k, const std::int32_t* copy_from,
                  int max_hi, bool avx2);

}  // namespace vq::vq_codec_detail
