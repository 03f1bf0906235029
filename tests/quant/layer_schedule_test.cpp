#include "veloxquant/quant/layer_schedule.hpp"

#include <algorithm>
#include <map>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"

namespace {

std::map<int, int> histogram(const std::vector<int>& bits) {
  std::map<int, int> h;
  for (int b : bits) ++h[b];
  return h;
}

TEST(LayerSchedule, ReferenceExamples) {
  EXPECT_EQ(histogram(vq::layer_group_bits(28, 4)), (std::map<int, int>{{4, 9}, {3, 10}, {2, 9}}));
  EXPECT_EQ(histogram(vq::layer_group_bits(24, 4)), (std::map<int, int>{{4, 8}, {3, 8}, {2, 8}}));
  EXPECT_TRUE(vq::layer_group_bits(0, 4).empty());
  EXPECT_TRUE(vq::layer_group_bits(-3, 4).empty());
}

TEST(LayerSchedule, HandComputedBounds) {
  // 8 layers: bounds round(8/3)=3, round(16/3)=5 -> 3 of 4, 2 of 3, 3 of 2.
  EXPECT_EQ(vq::layer_group_bits(8, 4), (std::vector<int>{4, 4, 4, 3, 3, 2, 2, 2}));
  // 9 layers: bounds 3, 6.
  EXPECT_EQ(vq::layer_group_bits(9, 4), (std::vector<int>{4, 4, 4, 3, 3, 3, 2, 2, 2}));
  // 12 layers: 4/4/4.
  EXPECT_EQ(histogram(vq::layer_group_bits(12, 4)), (std::map<int, int>{{4, 4}, {3, 4}, {2, 4}}));
  // 32 layers: bounds round(10.67)=11, round(21.33)=21 -> 11, 10, 11.
  EXPECT_EQ(histogram(vq::layer_group_bits(32, 4)), (std::map<int, int>{{4, 11}, {3, 10}, {2, 11}}));
}

TEST(LayerSchedule, HalfBoundsRoundToEven) {
  // 5 layers, 2 groups: bound 2.5 -> 2 (half to even), not 3.
  EXPECT_EQ(vq::layer_group_bits(5, 4, 2), (std::vector<int>{4, 4, 3, 3, 3}));
  // 7 layers, 2 groups: 3.5 -> 4.
  EXPECT_EQ(vq::layer_group_bits(7, 4, 2), (std::vector<int>{4, 4, 4, 4, 3, 3, 3}));
  // 6 layers, 4 groups: bounds 1.5->2, 3, 4.5->4 -> sizes 2, 1, 1, 2; bits max(2, 4-g).
  EXPECT_EQ(vq::layer_group_bits(6, 4, 4), (std::vector<int>{4, 4, 3, 2, 2, 2}));
  // 10 layers, 4 groups: bounds 2.5->2, 5, 7.5->8 -> sizes 2, 3, 3, 2.
  EXPECT_EQ(vq::layer_group_bits(10, 6, 4), (std::vector<int>{6, 6, 5, 5, 5, 4, 4, 4, 3, 3}));
}

TEST(LayerSchedule, NonIncreasingFromBaseDownAndFloorOfTwo) {
  for (int n : {1, 2, 3, 8, 9, 12, 24, 28, 32, 80})
    for (int base : {2, 3, 4, 8})
      for (int groups : {1, 2, 3, 4, 7}) {
        auto bits = vq::layer_group_bits(n, base, groups);
        ASSERT_EQ(static_cast<int>(bits.size()), n);
        ASSERT_EQ(bits.front(), base);
        ASSERT_TRUE(std::is_sorted(bits.rbegin(), bits.rend()));
        ASSERT_GE(*std::min_element(bits.begin(), bits.end()), std::min(2, base));
        if (groups > 1 && n >= 3 && base > 2) {
          ASSERT_LT(bits.back(), base);
        }
      }
  EXPECT_EQ(vq::layer_group_bits(2, 4, 3), (std::vector<int>{4, 3}));  // groups clamp to layers
}

TEST(LayerSchedule, RejectsBadArguments) {
  EXPECT_THROW(vq::layer_group_bits(8, 4, 0), vq::InvalidArgument);
  EXPECT_THROW(vq::layer_group_bits(8, 9, 3), vq::InvalidArgument);
}

}  // namespace
