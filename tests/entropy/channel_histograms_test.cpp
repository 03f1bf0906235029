#include "veloxquant/entropy/channel_histograms.hpp"

#include <random>

#include <gtest/gtest.h>

#include "veloxquant/entropy/entropy_estimate.hpp"

namespace {

TEST(ChannelHistograms, IncrementalEqualsFromScratch) {
  std::mt19937 rng(4);
  vq::ChannelHistograms h(3, -15, 31);
  std::vector<std::vector<std::int16_t>> live(3);
  for (int step = 0; step < 20000; ++step) {
    const auto k = static_cast<std::size_t>(rng() % 3);
    if (!live[k].empty() && rng() % 4 == 0) {
      h.remove(k, live[k].back());
      live[k].pop_back();
    } else {
      const auto s = static_cast<std::int16_t>(static_cast<int>(rng() % 7) - 3 + (k == 2 ? 10 : 0));
      h.add(k, s);
      live[k].push_back(s);
    }
    if (step % 997 == 0)
      for (std::size_t j = 0; j < 3; ++j) {
        const double want = vq::symbol_entropy_bits(live[j]) * static_cast<double>(live[j].size());
        ASSERT_NEAR(h.total_bits(j), want, 1e-7 * (1.0 + want));
        ASSERT_EQ(h.total(j), live[j].size());
      }
  }
}

TEST(ChannelHistograms, AddManyTakesBothPathsAndAgrees) {
  std::mt19937 rng(5);
  std::vector<std::int16_t> sym(4000);
  for (auto& s : sym) s = static_cast<std::int16_t>(static_cast<int>(rng() % 9) - 4);
  vq::ChannelHistograms a(1, -15, 31), b(1, -15, 31);
  a.add_many(0, sym.data(), sym.size(), 1);               // recount path (n > alphabet)
  for (std::size_t i = 0; i < sym.size(); i += 20) b.add_many(0, sym.data() + i, 20, 1);  // incremental path
  const double want = vq::symbol_entropy_bits(sym) * static_cast<double>(sym.size());
  EXPECT_NEAR(a.total_bits(0), want, 1e-7 * want);
  EXPECT_NEAR(b.total_bits(0), want, 1e-7 * want);
  EXPECT_EQ(a.symbol_count(0, -4), b.symbol_count(0, -4));
}

TEST(ChannelHistograms, SingleSymbolIsExactlyZeroAndCapWorks) {
  vq::ChannelHistograms h(1, 0, 16);
  for (int i = 0; i < 100000; ++i) h.add(0, 3);
  EXPECT_EQ(h.total_bits(0), 0.0);
  h.add(0, 4);
  EXPECT_GT(h.total_bits(0), 1.0);
  vq::ChannelHistograms u(1, 0, 16);
  for (int i = 0; i < 1600; ++i) u.add(0, i % 16);  // 4 bits per symbol
  EXPECT_NEAR(u.total_bits(0), 6400.0, 1e-6);
  EXPECT_NEAR(u.capped_bits(0, 2.0), 3200.0, 1e-9);
  for (int i = 0; i < 100; ++i) u.remove(0, 3);
  EXPECT_EQ(u.symbol_count(0, 3), 0u);
  EXPECT_THROW(u.remove(0, 3), std::logic_error);
}

}  // namespace
