// The tile kernels of attention (cache/attention_kernels.hpp): the AVX2 forms equal the scalar
// forms within the rounding of a reordered float32 sum, for every row type and awkward sizes
// (head dims 1..130 with 8- and 16-value tails; the AVX-512 forms at d = 32, 96, 128, tiles of 1..33 tokens, 1..9 query rows); the
// eight-lane exp is within 2.5 ulp of std::exp. Skipped where the CPU has no AVX2 + FMA + F16C.
#include "veloxquant/cache/attention_kernels.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "veloxquant/core/dtype.hpp"

namespace {

namespace attn = vq::attn;

// Runs f with the SIMD forms on, then off, restoring the setting.
template <class F>
void both(F&& f) {
  const bool was = attn::set_simd_enabled(true);
  f(true);
  attn::set_simd_enabled(false);
  f(false);
  attn::set_simd_enabled(was);
}

// Runs f with the AVX-512 forms on (where the CPU has them), then off (the AVX2 forms).
template <class F>
void each_width(F&& f) {
  for (bool wide : {true, false}) {
    const bool was = attn::set_avx512_enabled(wide);
    SCOPED_TRACE(wide ? "avx512" : "avx2");
    f();
    attn::set_avx512_enabled(was);
  }
}

bool have_simd() {
  const bool was = attn::set_simd_enabled(true);
  const bool on = attn::simd_enabled();
  attn::set_simd_enabled(was);
  return on;
}

// The error budget of a float32 sum of products taken in another order (with fused
// multiply-adds): each order is within d * eps of the exact sum of |terms| (Higham's bound for
// recursive or blocked summation), so two orders differ by at most twice that.
double reorder_budget(std::int64_t terms, double abs_sum) {
  return 2.0 * static_cast<double>(terms + 1) * std::numeric_limits<float>::epsilon() * abs_sum;
}

std::vector<float> uniform(std::size_t n, std::uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(g);
  return v;
}

struct Sizes {
  std::int64_t n, d, nq, stride;
};

std::vector<Sizes> sizes() {
  std::vector<Sizes> out;
  for (std::int64_t d : {1, 7, 8, 13, 16, 24, 31, 32, 96, 128, 130})
    for (std::int64_t n : {1, 7, 32, 33})
      for (std::int64_t nq : {1, 2, 3, 4, 5, 9}) out.push_back({n, d, nq, d + (d % 3)});  // rows not always adjacent
  return out;
}

TEST(AttentionKernels, ScoreSimdEqualsScalarForFloat32AndFloat16Rows) {
  if (!have_simd()) GTEST_SKIP() << "no AVX2 + FMA + F16C here";
  each_width([&] {
  for (const Sizes& z : sizes()) {
    SCOPED_TRACE(::testing::Message() << "n=" << z.n << " d=" << z.d << " nq=" << z.nq);
    const auto k = uniform(static_cast<std::size_t>(z.n * z.stride), 1), q = uniform(static_cast<std::size_t>(z.nq * z.d), 2);
    std::vector<std::uint16_t> kh(k.size());
    vq::from_f32(k.data(), kh.data(), vq::DType::F16, k.size());
    std::vector<float> kf(k.size());  // the float16 rows' values
    vq::to_f32(kh.data(), vq::DType::F16, kf.data(), k.size());
    for (int half = 0; half < 2; ++half) {
      std::vector<float> s[2];
      both([&](bool simd) {
        auto& out = s[simd ? 0 : 1];
        out.assign(static_cast<std::size_t>(z.nq * z.n), std::nanf(""));
        if (half) attn::score_f16(kh.data(), z.n, z.d, z.stride, q.data(), z.nq, out.data());
        else attn::score_f32(k.data(), z.n, z.d, z.stride, q.data(), z.nq, out.data());
      });
      const auto& rows = half ? kf : k;
      for (std::int64_t r = 0; r < z.nq; ++r)
        for (std::int64_t j = 0; j < z.n; ++j) {
          double exact = 0, abs_sum = 0;
          for (std::int64_t e = 0; e < z.d; ++e) {
            const double t = double(q[r * z.d + e]) * rows[j * z.stride + e];
            exact += t, abs_sum += std::fabs(t);
          }
          const auto i = static_cast<std::size_t>(r * z.n + j);
          EXPECT_LE(std::fabs(s[0][i] - s[1][i]), reorder_budget(z.d, abs_sum)) << "r=" << r << " j=" << j << " f16=" << half;
          EXPECT_LE(std::fabs(s[0][i] - exact), reorder_budget(z.d, abs_sum) / 2) << "r=" << r << " j=" << j << " f16=" << half;
        }
    }
  }
  });
}

TEST(AttentionKernels, AccumulateSimdEqualsScalarForFloat32AndFloat16Rows) {
  if (!have_simd()) GTEST_SKIP() << "no AVX2 + FMA + F16C here";
  each_width([&] {
  for (const Sizes& z : sizes()) {
    SCOPED_TRACE(::testing::Message() << "n=" << z.n << " d=" << z.d << " nq=" << z.nq);
    const auto v = uniform(static_cast<std::size_t>(z.n * z.stride), 3);
    auto w = uniform(static_cast<std::size_t>(z.nq * z.n), 4, 0.0f, 1.0f);
    w[0] = 0.0f;  // a masked token
    const auto acc0 = uniform(static_cast<std::size_t>(z.nq * z.d), 5);
    std::vector<std::uint16_t> vh(v.size());
    vq::from_f32(v.data(), vh.data(), vq::DType::F16, v.size());
    std::vector<float> vf(v.size());
    vq::to_f32(vh.data(), vq::DType::F16, vf.data(), v.size());
    for (int half = 0; half < 2; ++half) {
      std::vector<float> a[2];
      both([&](bool simd) {
        auto& out = a[simd ? 0 : 1];
        out = acc0;
        if (half) attn::accumulate_f16(vh.data(), z.n, z.d, z.stride, w.data(), z.nq, out.data());
        else attn::accumulate_f32(v.data(), z.n, z.d, z.stride, w.data(), z.nq, out.data());
      });
      const auto& rows = half ? vf : v;
      for (std::int64_t r = 0; r < z.nq; ++r)
        for (std::int64_t e = 0; e < z.d; ++e) {
          double abs_sum = std::fabs(acc0[r * z.d + e]);
          for (std::int64_t j = 0; j < z.n; ++j) abs_sum += std::fabs(double(w[r * z.n + j]) * rows[j * z.stride + e]);
          const auto i = static_cast<std::size_t>(r * z.d + e);
          EXPECT_LE(std::fabs(a[0][i] - a[1][i]), reorder_budget(z.n, abs_sum)) << "r=" << r << " e=" << e << " f16=" << half;
        }
    }
  }
  });
}

// A row's online softmax over several tiles, masked tails included: both forms keep the same
// running max, and sums, accumulators and weights within the exp's and sums' rounding.
TEST(AttentionKernels, SoftmaxStepSimdEqualsScalar) {
  if (!have_simd()) GTEST_SKIP() << "no AVX2 + FMA + F16C here";
  for (std::int64_t n : {1, 5, 8, 32, 37})
    for (std::int64_t dv : {1, 8, 13, 128}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " dv=" << dv);
      struct Run {
        float m = -std::numeric_limits<float>::infinity(), l = 0;
        std::vector<float> acc, w;
      } run[2];
      for (int tile = 0; tile < 4; ++tile) {
        // Growing scores so the max moves; the last tile masks all but its first token, the third all.
        const auto s0 = uniform(static_cast<std::size_t>(n), 10 + tile, -20.0f + 10 * tile, 5.0f + 10 * tile);
        const std::int64_t visible = tile == 3 ? 1 : tile == 2 ? 0 : n;
        both([&](bool simd) {
          Run& x = run[simd ? 0 : 1];
          if (x.acc.empty()) x.acc = uniform(static_cast<std::size_t>(dv), 9);
          x.w = s0;
          attn::softmax_step(x.w.data(), n, visible, 0.37f, x.m, x.l, x.acc.data(), dv);
        });
        EXPECT_EQ(run[0].m, run[1].m);
        EXPECT_NEAR(run[0].l, run[1].l, 4e-7 * run[1].l * double(n + 1));
        for (std::int64_t j = 0; j < n; ++j) {
          EXPECT_NEAR(run[0].w[j], run[1].w[j], 4e-7 * run[1].w[j]) << j;
          if (j >= visible) EXPECT_EQ(run[0].w[j], 0.0f) << j;
        }
        for (std::int64_t e = 0; e < dv; ++e) EXPECT_NEAR(run[0].acc[e], run[1].acc[e], 4e-7 * std::fabs(run[1].acc[e])) << e;
      }
    }
}

TEST(AttentionKernels, EightLaneExpIsWithinTwoAndAHalfUlpOfStdExp) {
  if (!have_simd()) GTEST_SKIP() << "no AVX2 + FMA + F16C here";
  std::vector<float> x;
  for (float v = -87.0f; v <= 88.0f; v += 0.0137f) x.push_back(v);
  for (float v : {0.0f, -0.0f, -1e-30f, 1e-30f, -87.3f, 88.3f}) x.push_back(v);
  std::vector<float> y(x.size());
  attn::exp_simd(x.data(), y.data(), static_cast<std::int64_t>(x.size()));
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double ref = std::exp(double(x[i]));
    EXPECT_LE(std::fabs(y[i] - ref), 2.5 * std::numeric_limits<float>::epsilon() * ref) << "x=" << x[i];
  }
}

}  // namespace
