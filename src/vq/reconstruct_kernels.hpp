// The vq decoder's last step for many tokens at once: x_hat = F^-1 y_hat per head, keys re-rotated.
//
// What a reader must know first:
// - The per-token path (transform.hpp's reconstruct_head_cols, used by the cache's attention tiles)
//   computes, for one token and head h, acc_i = sum over j = 0 .. span-1, in that order, of
//   cols[j * d + i] * y_j in float32 (a product, then an add: the project builds with
//   -ffp-contract=off, so never a fused multiply-add), acc starting at 0; then, for keys, each pair
//   (2p, 2p+1) is rotated by angle pos * freq_p in double (cos and sin of that angle) and rounded to
//   float. The kernels here compute exactly those operations in exactly that order, so their output
//   is bit for bit the per-token path's (tested: tests/vq/reconstruct_kernels_test.cpp); they only
//   do it for a tile of tokens at a time (a blocked GEMM: each column of F^-1 is loaded once per
//   tile, not once per token, and 6 tokens x 16 outputs stay in AVX2 registers), and take cos / sin
//   from a table built once per frequency list instead of calling them per pair per token.
// - AVX2 is chosen at run time (__builtin_cpu_supports); the scalar path is the same arithmetic.
// - Who uses them: vq_reconstruct (the .vqkv / store decoder) and VqKVCache::state(), so a loaded
//   chunk and a live cache's state() keep giving the same bits.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace vq {

// cos / sin of pos * freq[p] for positions [0, positions), [pos][p][2] = {cos, sin}, in double, with
// the same expressions as the per-token path. Process-wide and shared (built once per frequency list
// and grown as longer positions are asked for; thread-safe). Null for an empty freq.
struct VqRopeTable {
  std::vector<double> freq;
  std::int64_t positions = 0;
  std::vector<double> cs;
  const double* at(std::int64_t pos) const { return cs.data() + static_cast<std::size_t>(pos) * freq.size() * 2; }
};
std::shared_ptr<const VqRopeTable> vq_rope_table(const std::vector<double>& freq, std::int64_t positions);

// Rows of one head for `tokens` tokens: out[t * d + i] (t < tokens, i < d) from y[t * y_stride + j]
// (j < span; the head's block of y_hat) and cols ([span][d], the head's column block of F^-1,
// VqSideTransform::inv_cols). rope: null, or a table covering positions pos0 .. pos0 + tokens - 1
// (keys are re-rotated at position pos0 + t).
void vq_head_rows(const float* cols, int span, int d, const float* y, std::size_t y_stride, std::int64_t tokens,
                  const VqRopeTable* rope, std::int64_t pos0, float* out);
// The same, one token at a time with no tiling and no SIMD: the reference the tests compare with.
void vq_head_rows_scalar(const float* cols, int span, int d, const float* y, std::size_t y_stride, std::int64_t tokens,
                         const VqRopeTable* rope, std::int64_t pos0, float* out);
// Whether vq_head_rows takes a SIMD path on this machine (AVX2, or AVX-512 where the machine has it;
// benchmarks and tests report it).
bool vq_head_rows_avx2();

// A transform that mixes every head (VqSideTransform::col_span == n, n = heads * d): every head's
// column block side by side, w[j * n + h * d + i] = inv_cols[(h * n + j) * d + i], so that one pass
// over a token's whole y_hat row makes the rows of all heads at once (an [tokens x n] x [n x n]
// product instead of `heads` passes of [tokens x n] x [n x d], each reading the row again).
void vq_whole_row_matrix(const float* inv_cols, int n, int heads, float* w);
// The rows of every head for `tokens` tokens from whole y_hat rows y[t * n + j] (j < n) and w
// (vq_whole_row_matrix): out[(h * tokens + t) * d + i], head-major, bit for bit what vq_head_rows
// makes for each head (same products, same sums in the same order, same rotation); keys re-rotated
// at position pos0 + t (rope: null or a table covering those positions). `acc`: tokens * n floats of
// scratch. AVX-512 (16 outputs per register, 12 tokens per pass) where the machine has it.
void vq_all_head_rows(const float* w, int n, int heads, const float* y, std::int64_t tokens, const VqRopeTable* rope,
                      std::int64_t pos0, float* acc, float* out);
// The same with the scalar arithmetic only: the reference the tests compare with.
void vq_all_head_rows_scalar(const float* w, int n, int heads, const float* y, std::int64_t tokens, const VqRopeTable* rope,
                             std::int64_t pos0, float* acc, float* out);
bool vq_all_head_rows_avx512();

}  // namespace vq
