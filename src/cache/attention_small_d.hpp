// The online-softmax step of attend_tiled for small head dims (D_k = D_v = 8 or 16; stories260K
// has D = 8), private to the cache stage.
//
// Why a separate kernel: at D = 8 the generic per-row step (one 8-term dot product with its
// horizontal sum, one scalar std::exp and one 8-wide update per token) costs several times what
// the transformer's own attention did before it called attend(). Here one tile's keys are
// transposed once per KV head (KT[d][j]), so each row's scores vectorise across tokens, the
// exponentials run through the vectorisable exp_nonpositive (within 2 ulp of expf), and the value
// update is one D-wide vector per token. Same online softmax, same causal rule, float32
// throughout: results agree with the generic step within float32 rounding, not bit for bit.
#pragma once
#include <cstdint>

namespace vq::detail {

// One tile of one KV head for all `rows` query rows of that head (row r = g * Sq + i is query
// token i of the head's g-th query head; it sees tile tokens j with t0 + j <= T - Sq + i).
struct SmallDTile {
  const float* q;    // [rows, D] mapped queries
  const float* K;    // [n, D] the tile's key rows
  const float* V;    // [n, D] the tile's value rows
  std::int64_t rows, Sq, T, t0, n;
  float scale;
  float* m;          // [rows] running max
  float* l;          // [rows] running sum
  float* acc;        // [rows, D] running accumulators
  float* scratch;    // small_d_scratch_floats(n) floats
};

using SmallDKernel = void (*)(const SmallDTile&);

// The kernel for this head layout, or null where the generic step must run: the AVX-512 one
// where the machine has it, else the AVX2 one, else the portable one. The AVX2 and AVX-512
// kernels give the same bits (tests/cache/attention_small_d_test.cpp); the portable one agrees
// within float32 rounding.
SmallDKernel pick_small_d_kernel(std::int64_t Dk, std::int64_t Dv);

// One path's kernel (for tests and benchmarks); null where this machine or build lacks it or the
// path has none for this head layout (the vector paths: D = 8 only).
enum class SmallDPath { Portable, Avx2, Avx512 };
SmallDKernel small_d_kernel(SmallDPath path, std::int64_t Dk, std::int64_t Dv);

// Floats of scratch a tile of up to `tile` tokens needs.
std::int64_t small_d_scratch_floats(std::int64_t tile);

}  // namespace vq::detail
