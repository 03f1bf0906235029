// The forward pass's matrix products (llama2.c's matmul), private to the model stage.
//
// What a reader must know first: out[t, o] = sum_i in[t, i] * wt[i, o] for t < n, o < out_dim, with
// wt the TRANSPOSED nn.Linear weight [in_dim, ws] (ws >= out_dim: a padded row stride, a multiple
// of 8 with zeros past out_dim for the vector paths); in rows are `is` floats apart, out rows `os`.
// Each output sums its products in order i = 0, 1, ..., starting from 0, a product then an add
// (never a fused multiply-add), exactly as run.c's matmul does: vectorising over outputs
// reassociates nothing, so every path (portable, AVX2, AVX-512) gives the same bits (tested:
// tests/model/matmul_test.cpp) and the model's logits are run.c's.
#pragma once
#include <cstddef>

namespace vq::detail {

enum class MatmulPath { Portable, Avx2, Avx512 };

// The fastest path this machine has.
void matmul_t(float* out, std::size_t os, const float* in, std::size_t is, const float* wt, std::size_t ws, int n, int in_dim, int out_dim);
// One path (for tests and benchmarks); false, nothing computed, where the machine lacks it or ws
// is not a multiple of 8 (the vector paths).
bool matmul_with(MatmulPath path, float* out, std::size_t os, const float* in, std::size_t is, const float* wt, std::size_t ws, int n,
                 int in_dim, int out_dim);

}  // namespace vq::detail
