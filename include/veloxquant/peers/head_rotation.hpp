// HeadRotation: the fixed signed Hadamard rotation that `q8_0:rotate=1` / `q4_0:rotate=1` /
// `q4_1:rotate=1` apply to each head's K and V row before block quantization (as llama.cpp's
// rotated KV cache, PR #21038, and QuaRot-style quantizers do: a rotation spreads an outlier
// channel over the whole row, so one block scale no longer has to cover it).
//
//   R x = blockdiag(H_n1, H_n2, ...) (s * x)        R^T y = s * blockdiag(H_n1, H_n2, ...) y
//
// - H_n is the n x n Sylvester Hadamard matrix scaled by 1/sqrt(n) (orthonormal and symmetric),
//   applied by the fast Walsh-Hadamard transform in O(n log n).
// - The blocks are the powers of two of D's binary expansion, largest first: D = 128 is one block;
//   D = 96 is 64 + 32; D = 13 is 8 + 4 + 1 (a block of 1 is the sign alone). So every head dim is
//   rotated, and a power of two (every common head dim) gets a single full-width Hadamard.
// - s is a fixed sign vector: s_i = -1 when the top bit of splitmix64's (i+1)-th output from seed 0
//   is set, else +1 (i = 0 .. D-1, the index within the head). It breaks the Hadamard matrix's
//   alignment with structured rows (a constant row would otherwise land in one coefficient).
// - R is orthogonal: q . k = (R q) . (R k), and sum_t p_t v_t = R^T sum_t p_t (R v_t), so
//   attention runs in the rotated space (rotate q once, un-rotate the output once).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace vq {

class HeadRotation {
 public:
  // Throws InvalidArgument when dim < 1.
  explicit HeadRotation(std::int64_t dim);
  std::int64_t dim() const { return dim_; }
  void rotate(float* x) const;    // x <- R x, dim() values in place
  void unrotate(float* x) const;  // x <- R^T x
  std::size_t nbytes() const { return signs_.capacity() * sizeof(float); }  // memory held (the signs)

 private:
  void hadamard_blocks(float* x) const;
  std::int64_t dim_;
  std::vector<float> signs_;
};

}  // namespace vq
