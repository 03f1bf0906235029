// The forward pass's SwiGLU activation (llama2.c's silu times w3 x), private to the model stage.
//
// What a reader must know first: h1[j] = (h1[j] * (1 / (1 + expf(-h1[j])))) * h3[j], run.c's
// operations per element with the C library's expf. The portable path calls std::exp per element.
// The AVX-512 path computes glibc's expf (sysdeps/ieee754/flt-32/e_expf.c as glibc builds it for
// CPUs with FMA, the variant its ifunc picks wherever AVX-512 runs) on eight doubles per vector:
// the same table, constants, fused multiply-adds and roundings, so the same floats. It runs only
// where a probe at first use finds it equal to this process's std::exp on a few thousand
// arguments (another C library, or glibc's non-FMA variant, keeps the portable path); arguments
// of magnitude 80 and above (over- and underflow, NaN) go to std::exp. Tested against std::exp:
// tests/model/swiglu_test.cpp.
#pragma once
#include <cstddef>

namespace vq::detail {

enum class SwigluPath { Portable, Avx512 };

// h1[j] = silu(h1[j]) * h3[j] for j < n on the fastest path that gives std::exp's bits.
void swiglu(float* h1, const float* h3, std::size_t n);
// One path; false, nothing computed, where it does not run here (see above).
bool swiglu_with(SwigluPath path, float* h1, const float* h3, std::size_t n);

}  // namespace vq::detail
