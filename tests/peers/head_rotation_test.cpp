// HeadRotation: orthonormal, its own inverse's transpose, the documented signs and blocks.
#include "veloxquant/peers/head_rotation.hpp"

#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"

namespace {

TEST(HeadRotation, OrthonormalAndUndoneForEveryHeadDim) {
  std::mt19937 rng(1);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (std::int64_t D : {1, 2, 8, 13, 32, 48, 64, 96, 128, 256}) {
    const vq::HeadRotation r(D);
    std::vector<float> x(static_cast<std::size_t>(D)), y(static_cast<std::size_t>(D)), z;
    for (auto& v : x) v = n(rng);
    for (auto& v : y) v = n(rng);
    double dot = 0, norm = 0;
    for (std::int64_t i = 0; i < D; ++i) dot += double(x[i]) * y[i], norm += double(x[i]) * x[i];
    std::vector<float> rx = x, ry = y;
    r.rotate(rx.data());
    r.rotate(ry.data());
    double rdot = 0, rnorm = 0;
    for (std::int64_t i = 0; i < D; ++i) rdot += double(rx[i]) * ry[i], rnorm += double(rx[i]) * rx[i];
    EXPECT_NEAR(rdot, dot, 1e-4 * (1 + std::fabs(dot))) << D;  // dot products survive: attention can run rotated
    EXPECT_NEAR(rnorm, norm, 1e-4 * norm) << D;
    z = rx;
    r.unrotate(z.data());
    for (std::int64_t i = 0; i < D; ++i) EXPECT_NEAR(z[i], x[i], 1e-5) << D << " " << i;
  }
}

// A unit vector at channel j lands on +-1/sqrt(n) in every coefficient of its power-of-two block:
// D = 8 is one block of 8; D = 13 is 8 + 4 + 1 (the last channel only changes sign).
TEST(HeadRotation, BlocksAreThePowersOfTwoOfTheHeadDim) {
  const vq::HeadRotation r(13);
  for (int j : {0, 9, 12}) {
    std::vector<float> e(13, 0.0f);
    e[static_cast<std::size_t>(j)] = 1.0f;
    r.rotate(e.data());
    const int lo = j < 8 ? 0 : j < 12 ? 8 : 12, n = j < 8 ? 8 : j < 12 ? 4 : 1;
    for (int i = 0; i < 13; ++i) {
      if (i >= lo && i < lo + n)
        EXPECT_NEAR(std::fabs(e[static_cast<std::size_t>(i)]), 1.0 / std::sqrt(n), 1e-6) << j << " " << i;
      else
        EXPECT_EQ(e[static_cast<std::size_t>(i)], 0.0f) << j << " " << i;
    }
  }
  // The signs are fixed (splitmix64 from seed 0): a constant row does not collapse onto one coefficient.
  std::vector<float> ones(128, 1.0f);
  vq::HeadRotation(128).rotate(ones.data());
  int nonzero = 0;
  for (float v : ones) nonzero += std::fabs(v) > 1e-6f;
  EXPECT_GT(nonzero, 64);
  EXPECT_THROW(vq::HeadRotation(0), vq::InvalidArgument);
}

}  // namespace
