#include "veloxquant/core/tensor.hpp"

#include <cmath>
#include <limits>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"
#include "../support/test_util.hpp"

namespace {

TEST(Tensor, ZerosAndShape) {
  auto t = vq::Tensor::zeros({1, 2, 3, 4}, vq::DType::F16);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 48u);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.at(0, 1, 2, 3), 0.0f);
  EXPECT_THROW(vq::Tensor::zeros({1, -1, 3, 4}, vq::DType::F32), vq::InvalidArgument);
}

// A zero dimension beside huge ones once passed the element-count check (the product is 0) and
// then overflowed int64 computing strides and numel() (UBSan in tensor.cpp and tensor.hpp).
TEST(Tensor, HugeDimensionsBesideAZeroAreRefusedWithoutOverflow) {
  constexpr std::int64_t big = std::int64_t{1} << 40;
  EXPECT_THROW(vq::Tensor::zeros({1, big, big, 0}, vq::DType::F32), vq::InvalidArgument);
  EXPECT_THROW(vq::Tensor::zeros({0, std::int64_t{1} << 62, std::int64_t{1} << 62, 4}, vq::DType::F16), vq::InvalidArgument);
  EXPECT_THROW(vq::checked_numel({big, 2, 0, 1}), vq::InvalidArgument);
  std::int64_t x = 0;
  EXPECT_THROW(vq::Tensor::wrap(&x, {1, big, 0, big}, vq::DType::F32), vq::InvalidArgument);
  // Up to the limit, a zero dimension still makes an empty tensor.
  auto t = vq::Tensor::zeros({1, 1, 0, big}, vq::DType::F32);
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(t.nbytes(), 0u);
  EXPECT_EQ(vq::checked_numel({1, 4096, 0, 4096}), 0);
  EXPECT_EQ(vq::checked_numel({2, 3, 4, 5}), 120);
  EXPECT_EQ(vq::checked_numel({1, 1, 1, big}), big);
  EXPECT_THROW(vq::checked_numel({1, 1, 2, big}), vq::InvalidArgument);
}

TEST(Tensor, FromF32ChecksCount) {
  std::vector<float> v(5);
  EXPECT_THROW(vq::Tensor::from_f32({1, 1, 2, 3}, v), vq::InvalidArgument);
}

TEST(Tensor, SliceIsAViewWithoutCopy) {
  auto t = vqtest::random_uniform({2, 3, 10, 4}, 1);
  auto s = t.slice(2, 3, 7);
  EXPECT_TRUE(s.shares_storage_with(t));
  EXPECT_FALSE(s.is_contiguous());
  EXPECT_EQ(s.shape(), (vq::Shape4{2, 3, 4, 4}));
  EXPECT_EQ(s.at(1, 2, 0, 3), t.at(1, 2, 3, 3));
  s.set(0, 0, 0, 0, 42.0f);  // writes through
  EXPECT_EQ(t.at(0, 0, 3, 0), 42.0f);
  auto c = s.contiguous();
  EXPECT_FALSE(c.shares_storage_with(t));
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_TRUE(c.bit_equal(s));
  EXPECT_THROW(t.slice(2, 5, 11), vq::InvalidArgument);
  EXPECT_THROW(t.slice(4, 0, 1), vq::InvalidArgument);
  EXPECT_THROW(t.at(0, 0, 10, 0), vq::InvalidArgument);
}

TEST(Tensor, ConvertKeepsValuesRepresentable) {
  auto t = vqtest::random_uniform({1, 2, 5, 8}, 2, vq::DType::F16);
  auto f = t.to(vq::DType::F32);
  EXPECT_EQ(f.dtype(), vq::DType::F32);
  auto back = f.to(vq::DType::F16);
  EXPECT_TRUE(back.bit_equal(t));  // f16 -> f32 -> f16 is exact
  auto bf = t.to(vq::DType::BF16);
  EXPECT_EQ(bf.dtype(), vq::DType::BF16);
  EXPECT_NEAR(bf.at(0, 1, 4, 7), t.at(0, 1, 4, 7), 1e-2);
}

TEST(Tensor, AllFiniteInEveryDtype) {
  for (auto dt : {vq::DType::F32, vq::DType::F16, vq::DType::BF16}) {
    auto t = vqtest::random_uniform({1, 2, 3, 4}, 3, dt);
    EXPECT_TRUE(t.all_finite());
    t.set(0, 1, 2, 3, std::numeric_limits<float>::infinity());
    EXPECT_FALSE(t.all_finite());
    t.set(0, 1, 2, 3, std::nanf(""));
    EXPECT_FALSE(t.all_finite());
    EXPECT_TRUE(t.slice(2, 0, 2).all_finite());  // the bad element lies outside this view
  }
}

TEST(Tensor, WrapDoesNotCopy) {
  std::vector<float> v(8, 1.5f);
  auto t = vq::Tensor::wrap(v.data(), {1, 1, 2, 4}, vq::DType::F32);
  v[5] = 7.0f;
  EXPECT_EQ(t.at(0, 0, 1, 1), 7.0f);
}

}  // namespace
