// Private to VqKVCache (vq_cache_attend.cpp): attention's two tile steps straight on a head's packed
// codes (vq/vq_cache.hpp, "Packed layout"), with no float32 tile in between.
//
// A head's fields come in groups of 8 of one width w (1..8 or 16), byte-aligned; a group is
// decoded 8 fields at a time: its bytes broadcast to eight lanes, each lane shifted right by its
// field's i*w and masked (w = 16: eight uint16 widened). An escape (a zero field, vq_cache.hpp)
// decodes as code 0 (the coefficient's mean, a value of the data's size: nothing to cancel) with
// no branch; the caller lists the tile's escapes for the head (FieldEscape) and the kernels add
// each one's difference from that afterwards.
// - float32 input: the value is mean_p + code * step (code = f - 2^(w-1)), so q . k = c + step *
//   (q . code) with c = sum_p q_p mean_p per query row, and sum_j w_j v_j = (sum_j w_j) mean + step
//   * sum_j w_j code_j: the SIMD loops only widen codes and multiply-add them (centred codes: no
//   cancellation against a large bias).
// - float16 input: each value is rebuilt as state() holds it (mean + code * step, a product then a
//   sum, rounded through float16) before it is used.
// Queries are in the head's field order (the caller permutes them); accumulate adds into acc in
// the head's own order through `order`. Scores and
// sums equal the float tile's up to the order and grouping of the sums (float32 rounding).
//
// AVX2 + FMA + F16C only, on src/cache/attention_simd.hpp's templates; callers use them only when
// available(), and otherwise take the KVCache defaults (the float tiles), which are what the
// tests hold these against.
#pragma once
#include <cstddef>
#include <cstdint>

namespace vq::vq_attention {

// An escaped field of the tile: token t0 + t, field position p, its code.
struct FieldEscape {
  std::int32_t t, p, code;
};

// Tokens t0 .. of one (batch, KV head) of one side.
struct HeadFields {
  const std::uint8_t* rows = nullptr;  // the batch's packed rows: token t's at rows + t * row_bytes
  std::size_t row_bytes = 0;
  std::int64_t t0 = 0;                 // the tile's first token
  std::int64_t d = 0;                  // the head's fields
  const std::uint32_t* group_byte = nullptr;  // the head's ceil(d / 8) groups: first byte in a row
  const std::uint8_t* group_width = nullptr;  // and field width
  const float* mean = nullptr;                // the head's d means in field order
  float step = 1.0f;
  bool round_f16 = false;  // values rounded through float16 (the cache's input dtype)
  const FieldEscape* escapes = nullptr;  // the escaped fields of the tile's tokens in this head
  std::size_t n_escapes = 0;
};

// How float32-input groups are decoded: by width (each run of equal-width groups in a loop
// specialised for its width, the default) or every group through the any-width decode (fields8).
// Both give the same results bit for bit (same codes, same order of sums); kGeneric is there for
// the tests. float16 input always takes the any-width decode.
// kByWidth takes AVX-512 (VBMI) for the values of widths <= 4 and for the scores of four query rows
// where the CPU has it and attn::avx512_enabled() (same bits);
// kByWidthAvx2 never does (for the tests, which hold all three against each other).
enum class Decode { kByWidth, kByWidthAvx2, kGeneric };

// Compiled (x86-64) and attn::simd_enabled().
bool available();

// s[r * n + j] = q_r . k_{t0+j} (q: nq rows of d floats in field order), unscaled.
void score(const HeadFields& f, std::int64_t n, const float* q, std::int64_t nq, float* s, Decode how = Decode::kByWidth);
// acc[r * d + order[p]] += sum_j w[r * n + j] * v_{t0+j}[p] (acc in the head's own order; order[p]
// = the head dim of field position p). The tile's sum is formed apart, then added.
void accumulate(const HeadFields& f, std::int64_t n, const float* w, std::int64_t nq, float* acc, const std::int32_t* order,
                Decode how = Decode::kByWidth);

}  // namespace vq::vq_attention
