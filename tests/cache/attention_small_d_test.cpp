// The small-head-dim attention kernel at D = 8 (src/cache/attention_small_d.cpp) computes, row by
// row, one fixed sequence of float operations; the transformer's logits (tests/llama: llama.cpp
// within 6e-7) and every table scored through it depend on that sequence, so a faster kernel must
// keep it. This test writes the sequence out in scalar code and checks the kernel's running max,
// sum and accumulators bit for bit, over tiles, causal masks, tails and rows that see nothing.
#include "../../src/cache/attention_small_d.hpp"
#include "../../src/cache/exp_nonpositive.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace {

constexpr int D = 8;

struct State {
  std::vector<float> m, l, acc;
};

// One tile, as the AVX2 kernel does it: scores s_j = scale * (q0 k0 + q1 k1 + ... + q7 k7) summed
// in d order; the max; the old state rescaled by std::exp(m - max) when the max grew; weights
// exp_nonpositive(s_j - max); their sum over whole groups of 8 in eight lanes, the lanes folded as
// ((0+4) + (2+6)) + ((1+5) + (3+7)), then the rest in order; values summed with even tokens into
// one accumulator (starting from the old one) and odd tokens into another (from 0), added last.
void reference_tile(const vq::detail::SmallDTile& a, State& st) {
  for (std::int64_t row = 0; row < a.rows; ++row) {
    const std::int64_t i = row % a.Sq, last = a.T - a.Sq + i;
    const std::int64_t visible = std::min(a.n, last - a.t0 + 1);
    if (visible <= 0) continue;
    const float* q = a.q + row * D;
    std::vector<float> s(static_cast<std::size_t>(visible));
    float mx = st.m[static_cast<std::size_t>(row)];
    for (std::int64_t j = 0; j < visible; ++j) {
      float t = q[0] * a.K[j * D];
      for (int d = 1; d < D; ++d) t = t + q[d] * a.K[j * D + d];
      s[static_cast<std::size_t>(j)] = a.scale * t;
      mx = std::max(mx, s[static_cast<std::size_t>(j)]);
    }
    float* acc = st.acc.data() + row * D;
    float& m = st.m[static_cast<std::size_t>(row)];
    float& l = st.l[static_cast<std::size_t>(row)];
    if (mx > m) {
      const float c = std::exp(m - mx);
      l *= c;
      for (int d = 0; d < D; ++d) acc[d] *= c;
      m = mx;
    }
    for (float& x : s) x = vq::detail::exp_nonpositive(x - mx);
    const std::int64_t full = visible / 8 * 8;
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (std::int64_t j = 0; j < full; ++j) lane[j % 8] += s[static_cast<std::size_t>(j)];
    float sum = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
    for (std::int64_t j = full; j < visible; ++j) sum += s[static_cast<std::size_t>(j)];
    l += sum;
    float o0[D], o1[D];
    for (int d = 0; d < D; ++d) o0[d] = acc[d], o1[d] = 0.0f;
    std::int64_t j = 0;
    for (; j + 2 <= visible; j += 2)
      for (int d = 0; d < D; ++d) {
        o0[d] = o0[d] + s[static_cast<std::size_t>(j)] * a.V[j * D + d];
        o1[d] = o1[d] + s[static_cast<std::size_t>(j + 1)] * a.V[(j + 1) * D + d];
      }
    if (j < visible)
      for (int d = 0; d < D; ++d) o0[d] = o0[d] + s[static_cast<std::size_t>(j)] * a.V[j * D + d];
    for (int d = 0; d < D; ++d) acc[d] = o0[d] + o1[d];
  }
}

bool avx2_kernel_runs() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

// G query heads x Sq queries over T cached tokens in tiles of `tile`, both ways; bitwise equal.
void expect_same_bits(vq::detail::SmallDKernel kernel, std::int64_t G, std::int64_t Sq, std::int64_t T, std::int64_t tile,
                      std::uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "G=" << G << " Sq=" << Sq << " T=" << T << " tile=" << tile);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.5f);
  const std::int64_t rows = G * Sq;
  std::vector<float> q(static_cast<std::size_t>(rows * D)), K(static_cast<std::size_t>(T * D)), V(K.size());
  for (auto* v : {&q, &K, &V})
    for (float& x : *v) x = nd(rng);
  State got{std::vector<float>(static_cast<std::size_t>(rows), -std::numeric_limits<float>::infinity()),
            std::vector<float>(static_cast<std::size_t>(rows), 0.0f), std::vector<float>(static_cast<std::size_t>(rows * D), 0.0f)};
  State want = got;
  std::vector<float> scratch(static_cast<std::size_t>(vq::detail::small_d_scratch_floats(tile)));
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (std::int64_t t0 = 0; t0 < T; t0 += tile) {
    const std::int64_t n = std::min(tile, T - t0);
    const float* k = K.data() + t0 * D;
    const float* v = V.data() + t0 * D;
    kernel({q.data(), k, v, rows, Sq, T, t0, n, scale, got.m.data(), got.l.data(), got.acc.data(), scratch.data()});
    reference_tile({q.data(), k, v, rows, Sq, T, t0, n, scale, nullptr, nullptr, nullptr, nullptr}, want);
  }
  EXPECT_EQ(std::memcmp(got.m.data(), want.m.data(), got.m.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(got.l.data(), want.l.data(), got.l.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(got.acc.data(), want.acc.data(), got.acc.size() * sizeof(float)), 0);
  // A real result: every row saw at least its own token.
  for (float l : got.l) EXPECT_GE(l, 1.0f);
}

// Prefill chunks and whole-window scoring (stories260K: 2 query heads per KV head, tiles of 256),
// a decode step, odd lengths that leave tails in the groups of 8 and 16 tokens and of 4 and 8
// rows, and tiles where many rows see nothing.
void expect_same_bits_everywhere(vq::detail::SmallDKernel kernel) {
  expect_same_bits(kernel, 2, 64, 256, 256, 1);
  expect_same_bits(kernel, 2, 255, 511, 256, 2);
  expect_same_bits(kernel, 2, 1, 300, 256, 3);
  expect_same_bits(kernel, 1, 7, 37, 16, 4);
  expect_same_bits(kernel, 3, 13, 13, 256, 5);
  expect_same_bits(kernel, 4, 5, 263, 40, 6);
  expect_same_bits(kernel, 1, 1, 1, 256, 7);
  expect_same_bits(kernel, 2, 17, 100, 33, 8);
  expect_same_bits(kernel, 5, 9, 250, 7, 9);
}

TEST(SmallDAttention, AvxKernelKeepsItsOperationOrderBitForBit) {
  if (!avx2_kernel_runs()) GTEST_SKIP() << "the AVX2 kernel does not run here (no AVX2, or an ASan build)";
  const auto kernel = vq::detail::small_d_kernel(vq::detail::SmallDPath::Avx2, D, D);
  ASSERT_NE(kernel, nullptr);
  expect_same_bits_everywhere(kernel);
}

// The AVX-512 kernel (16 tokens per vector, values on token pairs) keeps the AVX2 kernel's
// sequence, and it is the one the attention loop picks where it runs.
TEST(SmallDAttention, Avx512KernelKeepsTheSameOperationOrderBitForBit) {
  const auto kernel = vq::detail::small_d_kernel(vq::detail::SmallDPath::Avx512, D, D);
  if (kernel == nullptr) GTEST_SKIP() << "the AVX-512 kernel does not run here (no AVX-512, or an ASan build)";
  EXPECT_EQ(vq::detail::pick_small_d_kernel(D, D), kernel);
  expect_same_bits_everywhere(kernel);
}

}  // namespace
