// The forward pass's SwiGLU activation (src/model/swiglu.hpp): the AVX-512 path, glibc's expf
// computed eight doubles at a time, gives the portable path's bits (std::exp per element) over
// the whole fast range, its edges, the arguments it hands to std::exp (|x| >= 80, Inf, NaN) and
// masked tails; and writes nothing past n.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "../../src/model/swiglu.hpp"

namespace {

using vq::detail::SwigluPath;

// Both paths on h1 (h3 as given); the AVX-512 one must write the portable one's bits and leave
// the sentinel past n alone.
void expect_same_bits(const std::vector<float>& h1, const std::vector<float>& h3) {
  std::vector<float> want = h1, got = h1;
  want.push_back(-7.0f);
  got.push_back(-7.0f);
  ASSERT_TRUE(vq::detail::swiglu_with(SwigluPath::Portable, want.data(), h3.data(), h1.size()));
  ASSERT_TRUE(vq::detail::swiglu_with(SwigluPath::Avx512, got.data(), h3.data(), h1.size()));
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(want[i])) {  // a NaN's payload and sign follow operand order, not the formula
      ASSERT_TRUE(std::isnan(got[i])) << "element " << i;
      continue;
    }
    ASSERT_EQ(std::bit_cast<std::uint32_t>(got[i]), std::bit_cast<std::uint32_t>(want[i]))
        << "element " << i << " of " << h1.size() << ": h1 " << h1[i < h1.size() ? i : 0] << " got " << got[i] << " want " << want[i];
  }
}

bool avx512_runs() {
  float h = 1.0f;
  const float one = 1.0f;
  return vq::detail::swiglu_with(SwigluPath::Avx512, &h, &one, 1);
}

TEST(Swiglu, PortablePathIsRunCsFormula) {
  std::vector<float> h1{-3.5f, -0.25f, 0.0f, 0.5f, 2.0f, 100.0f}, h3{2.0f, -1.0f, 3.0f, 0.5f, 1.5f, 1.0f};
  std::vector<float> want = h1;
  for (std::size_t j = 0; j < h1.size(); ++j) {
    float val = h1[j];
    val *= 1.0f / (1.0f + std::exp(-h1[j]));
    want[j] = val * h3[j];
  }
  ASSERT_TRUE(vq::detail::swiglu_with(SwigluPath::Portable, h1.data(), h3.data(), h1.size()));
  EXPECT_EQ(std::memcmp(h1.data(), want.data(), h1.size() * sizeof(float)), 0);
  EXPECT_FLOAT_EQ(h1[5], 100.0f);  // silu(x) -> x for large x
  EXPECT_EQ(h1[2], 0.0f);
}

TEST(Swiglu, Avx512PathGivesStdExpBits) {
  if (!avx512_runs()) GTEST_SKIP() << "the AVX-512 path does not run here (no AVX-512, or this C library's expf is not glibc's FMA one)";
  std::mt19937 rng(11);
  // A dense sweep of the floats in [-100, 100] (one in 1021 of the bit patterns) with random h3,
  // then random ones.
  std::vector<float> h1;
  for (std::uint32_t b = 0; b < 0x42C80000u; b += 1021) {  // |x| < 100
    h1.push_back(std::bit_cast<float>(b));
    h1.push_back(-std::bit_cast<float>(b));
  }
  std::vector<float> h3(h1.size());
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (float& v : h3) v = nd(rng);
  expect_same_bits(h1, h3);
  // Edges: the fast path's limit (|x| = 80), overflow and underflow, Inf, NaN, zeros, subnormals;
  // and every length up to 40 (the masked tail).
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> edges{80.0f, -80.0f, std::nextafter(80.0f, 0.0f), -std::nextafter(80.0f, 0.0f), 88.7f, -88.7f, 89.0f, -89.0f,
                           103.9f, -103.9f, 104.0f, -104.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(), 0.0f, -0.0f,
                           std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min(),
                           std::numeric_limits<float>::min(), 1e-30f, -1e-30f};
  expect_same_bits(edges, std::vector<float>(edges.size(), 1.5f));
  for (std::size_t n = 0; n <= 40; ++n) {
    std::vector<float> a(n), c(n);
    for (std::size_t i = 0; i < n; ++i) a[i] = nd(rng), c[i] = nd(rng);
    expect_same_bits(a, c);
  }
}

}  // namespace
