#include "veloxquant/quant/fused_group_quant.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include <gtest/gtest.h>

#include "veloxquant/quant/group_quant.hpp"

namespace {

// The dispatched kernel (AVX2+F16C where available) must equal the portable path bit for bit.
TEST(FusedGroupQuant, FastPathEqualsPortableBitForBit) {
  std::mt19937 rng(21);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (auto dt : {vq::DType::F32, vq::DType::F16, vq::DType::BF16})
    for (int dim : {1, 7, 8, 13, 128})
      for (int rows : {1, 2, 31, 32})
        for (int bits : {1, 2, 4, 8}) {
          const std::size_t esz = vq::dtype_size(dt), n = static_cast<std::size_t>(rows * dim);
          std::vector<float> f(n);
          for (std::size_t i = 0; i < n; ++i) f[i] = (i % 11 == 0) ? 0.5f * static_cast<float>(i % 7) : nd(rng);  // some exact ties
          std::vector<std::byte> src(n * esz), out_a(n * esz, std::byte{0x5a}), out_b(n * esz, std::byte{0xa5});
          vq::from_f32(f.data(), src.data(), dt, n);
          std::vector<const std::byte*> in(static_cast<std::size_t>(rows));
          std::vector<std::byte*> oa(in.size()), ob(in.size());
          for (int r = 0; r < rows; ++r) {
            in[static_cast<std::size_t>(r)] = src.data() + static_cast<std::size_t>(r * dim) * esz;
            oa[static_cast<std::size_t>(r)] = out_a.data() + static_cast<std::size_t>(r * dim) * esz;
            ob[static_cast<std::size_t>(r)] = out_b.data() + static_cast<std::size_t>(r * dim) * esz;
          }
          std::vector<std::uint8_t> qa(n, 99), qb(n, 77);
          std::vector<float> sa(static_cast<std::size_t>(dim)), sb(sa.size()), ma(sa.size()), mb(sa.size());
          vq::FusedGroupScratch scratch;
          ASSERT_EQ(vq::quantize_group_rows(in.data(), oa.data(), rows, dim, bits, dt, qa.data(), sa.data(), ma.data(), scratch), vq::QuantStatus::Ok);
          ASSERT_EQ(vq::quantize_group_rows_portable(in.data(), ob.data(), rows, dim, bits, dt, qb.data(), sb.data(), mb.data(), scratch), vq::QuantStatus::Ok);
          ASSERT_EQ(qa, qb) << "dtype " << static_cast<int>(dt) << " dim " << dim << " rows " << rows << " bits " << bits;
          ASSERT_EQ(0, std::memcmp(sa.data(), sb.data(), sa.size() * 4));
          ASSERT_EQ(0, std::memcmp(ma.data(), mb.data(), ma.size() * 4));
          ASSERT_EQ(out_a, out_b);
        }
}

// Values whose quotient (x - min) / scale lies at or within a few ulps of a half-integer, where a
// kernel that rounded an approximate quotient would pick the other code: the fast path must still
// equal the portable path (the reference's division) bit for bit.
TEST(FusedGroupQuant, NearTiesEqualPortable) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> span(0.01f, 100.0f), base(-50.0f, 50.0f);
  std::uniform_int_distribution<int> ulps(-4, 4);
  for (int bits : {2, 4, 8})
    for (int trial = 0; trial < 200; ++trial) {
      const int rows = 32, dim = 32, levels = (1 << bits) - 1;
      std::vector<float> f(static_cast<std::size_t>(rows * dim));
      for (int c = 0; c < dim; ++c) {
        const float lo = base(rng), hi = lo + span(rng);
        f[static_cast<std::size_t>(c)] = lo;                 // row 0: the minimum
        f[static_cast<std::size_t>(dim + c)] = hi;           // row 1: the maximum
        const float s = (hi - lo) / static_cast<float>(levels);
        for (int r = 2; r < rows; ++r) {
          const int k = static_cast<int>(rng() % static_cast<unsigned>(levels));
          float x = lo + (static_cast<float>(k) + 0.5f) * s;  // near the tie between codes k and k + 1
          for (int u = ulps(rng); u != 0; u += u > 0 ? -1 : 1) x = std::nextafter(x, u > 0 ? 1e30f : -1e30f);
          f[static_cast<std::size_t>(r * dim + c)] = std::clamp(x, lo, hi);
        }
      }
      std::vector<const std::byte*> in(rows);
      std::vector<std::byte*> oa(rows), ob(rows);
      std::vector<float> out_a(f.size()), out_b(f.size());
      for (int r = 0; r < rows; ++r) {
        in[static_cast<std::size_t>(r)] = reinterpret_cast<const std::byte*>(f.data() + r * dim);
        oa[static_cast<std::size_t>(r)] = reinterpret_cast<std::byte*>(out_a.data() + r * dim);
        ob[static_cast<std::size_t>(r)] = reinterpret_cast<std::byte*>(out_b.data() + r * dim);
      }
      std::vector<std::uint8_t> qa(f.size()), qb(f.size());
      std::vector<float> sa(dim), sb(dim), ma(dim), mb(dim);
      vq::FusedGroupScratch scratch;
      ASSERT_EQ(vq::quantize_group_rows(in.data(), oa.data(), rows, dim, bits, vq::DType::F32, qa.data(), sa.data(), ma.data(), scratch),
                vq::QuantStatus::Ok);
      ASSERT_EQ(vq::quantize_group_rows_portable(in.data(), ob.data(), rows, dim, bits, vq::DType::F32, qb.data(), sb.data(), mb.data(), scratch),
                vq::QuantStatus::Ok);
      ASSERT_EQ(qa, qb) << "bits " << bits << " trial " << trial;
      ASSERT_EQ(0, std::memcmp(out_a.data(), out_b.data(), out_a.size() * 4));
    }
}

TEST(FusedGroupQuant, InPlaceAndOverflow) {
  std::vector<float> x{1.0f, -3e38f, 2.0f, 3e38f};  // channel 1 overflows
  const std::byte* in[2] = {reinterpret_cast<const std::byte*>(x.data()), reinterpret_cast<const std::byte*>(x.data() + 2)};
  std::byte* out[2] = {reinterpret_cast<std::byte*>(x.data()), reinterpret_cast<std::byte*>(x.data() + 2)};
  std::uint8_t q[4];
  float s[2], m[2];
  vq::FusedGroupScratch scratch;
  EXPECT_EQ(vq::quantize_group_rows(in, out, 2, 2, 4, vq::DType::F32, q, s, m, scratch), vq::QuantStatus::RangeOverflow);
  std::vector<float> y(16);
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<float>(i);
  const std::byte* yi[2] = {reinterpret_cast<const std::byte*>(y.data()), reinterpret_cast<const std::byte*>(y.data() + 8)};
  std::byte* yo[2] = {reinterpret_cast<std::byte*>(y.data()), reinterpret_cast<std::byte*>(y.data() + 8)};
  std::uint8_t qy[16];
  float sy[8], my[8];
  ASSERT_EQ(vq::quantize_group_rows(yi, yo, 2, 8, 1, vq::DType::F32, qy, sy, my, scratch), vq::QuantStatus::Ok);
  for (std::size_t i = 0; i < 8; ++i) {  // 1 bit: min and max of each channel are exact
    EXPECT_EQ(y[i], static_cast<float>(i));
    EXPECT_EQ(y[i + 8], static_cast<float>(i + 8));
  }
}

TEST(FusedGroupQuant, NonFiniteIsReportedByBothPaths) {
  for (int dim : {8, 13}) {
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
      std::vector<float> x(static_cast<std::size_t>(3 * dim), 1.0f);
      x[static_cast<std::size_t>(2 * dim + dim - 1)] = bad;  // last channel of the last row (the tail for dim 13)
      std::vector<const std::byte*> in;
      std::vector<std::byte*> out;
      for (int r = 0; r < 3; ++r) {
        in.push_back(reinterpret_cast<const std::byte*>(x.data() + r * dim));
        out.push_back(reinterpret_cast<std::byte*>(x.data() + r * dim));
      }
      std::vector<std::uint8_t> q(x.size());
      std::vector<float> s(static_cast<std::size_t>(dim)), m(s.size());
      vq::FusedGroupScratch scratch;
      EXPECT_EQ(vq::quantize_group_rows(in.data(), out.data(), 3, dim, 4, vq::DType::F32, q.data(), s.data(), m.data(), scratch),
                vq::QuantStatus::NonFinite);
      EXPECT_EQ(vq::quantize_group_rows_portable(in.data(), out.data(), 3, dim, 4, vq::DType::F32, q.data(), s.data(), m.data(), scratch),
                vq::QuantStatus::NonFinite);
    }
  }
}

// quantize_groups (the fast kernel pipelines group g + 1's min/max pass into group g's quantizing
// pass) must equal one portable call per group, in place or not, and report the status of the
// first failing group when several groups fail in different ways.
TEST(FusedGroupQuant, GroupsInOneCallEqualOneCallPerGroup) {
  std::mt19937 rng(8);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (auto dt : {vq::DType::F32, vq::DType::F16})
    for (int dim : {8, 13, 40, 128})
      for (int n_groups : {1, 2, 5})
        for (bool in_place : {false, true}) {
          const int group_rows = 32, rows = group_rows * n_groups;
          const std::size_t esz = vq::dtype_size(dt), n = static_cast<std::size_t>(rows * dim);
          std::vector<float> f(n);
          for (auto& v : f) v = nd(rng);
          std::vector<std::byte> src(n * esz), out_a(n * esz), out_b(n * esz);
          vq::from_f32(f.data(), src.data(), dt, n);
          if (in_place) out_a = src;
          std::vector<const std::byte*> in(static_cast<std::size_t>(rows)), in_b(in.size());
          std::vector<std::byte*> oa(in.size()), ob(in.size());
          for (int r = 0; r < rows; ++r) {
            const std::size_t at = static_cast<std::size_t>(r * dim) * esz;
            in[static_cast<std::size_t>(r)] = in_place ? out_a.data() + at : src.data() + at;
            in_b[static_cast<std::size_t>(r)] = src.data() + at;
            oa[static_cast<std::size_t>(r)] = out_a.data() + at;
            ob[static_cast<std::size_t>(r)] = out_b.data() + at;
          }
          std::vector<std::uint8_t> qa(n, 1), qb(n, 2);
          const std::size_t ns = static_cast<std::size_t>(n_groups * dim);
          std::vector<float> sa(ns), sb(ns), ma(ns), mb(ns);
          vq::FusedGroupScratch scratch;
          ASSERT_EQ(vq::quantize_groups(in.data(), oa.data(), n_groups, group_rows, dim, 4, dt, qa.data(), sa.data(), ma.data(), scratch),
                    vq::QuantStatus::Ok);
          for (int g = 0; g < n_groups; ++g) {
            const std::size_t r0 = static_cast<std::size_t>(g * group_rows), c0 = static_cast<std::size_t>(g * dim);
            ASSERT_EQ(vq::quantize_group_rows_portable(in_b.data() + r0, ob.data() + r0, group_rows, dim, 4, dt, qb.data() + r0 * dim,
                                                       sb.data() + c0, mb.data() + c0, scratch),
                      vq::QuantStatus::Ok);
          }
          ASSERT_EQ(qa, qb) << "dim " << dim << " groups " << n_groups << " in place " << in_place;
          ASSERT_EQ(0, std::memcmp(sa.data(), sb.data(), ns * 4));
          ASSERT_EQ(0, std::memcmp(ma.data(), mb.data(), ns * 4));
          ASSERT_EQ(out_a, out_b);
        }
  // Failures: a NaN, an overflowing range, or both in different groups (in the main channels or in
  // the tail channels of dim 13); the first failing group decides.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Bad { int group; int channel; bool overflow; };
  const std::vector<std::vector<Bad>> cases{{{1, 0, false}}, {{2, 3, true}}, {{1, 12, false}, {0, 12, true}}, {{0, 2, false}, {1, 2, true}},
                                            {{2, 1, false}, {1, 5, true}}, {{1, 12, true}, {1, 0, false}}, {{0, 3, true}, {1, 0, false}}};
  for (const auto& bads : cases) {
    const int dim = 13, group_rows = 4, n_groups = 3, rows = group_rows * n_groups;
    std::vector<float> f(static_cast<std::size_t>(rows * dim), 1.0f);
    for (const Bad& b : bads) {
      const std::size_t at = static_cast<std::size_t>((b.group * group_rows + 1) * dim + b.channel);
      if (b.overflow) {
        f[at] = 3e38f;
        f[at + static_cast<std::size_t>(dim)] = -3e38f;
      } else {
        f[at] = nan;
      }
    }
    std::vector<const std::byte*> in(static_cast<std::size_t>(rows));
    std::vector<std::byte*> out(in.size());
    std::vector<float> o(f.size());
    for (int r = 0; r < rows; ++r) {
      in[static_cast<std::size_t>(r)] = reinterpret_cast<const std::byte*>(f.data() + r * dim);
      out[static_cast<std::size_t>(r)] = reinterpret_cast<std::byte*>(o.data() + r * dim);
    }
    std::vector<std::uint8_t> q(f.size());
    std::vector<float> s(static_cast<std::size_t>(n_groups * dim)), m(s.size());
    vq::FusedGroupScratch scratch;
    vq::QuantStatus expected = vq::QuantStatus::Ok;
    for (int g = 0; g < n_groups && expected == vq::QuantStatus::Ok; ++g)
      expected = vq::quantize_group_rows_portable(in.data() + g * group_rows, out.data() + g * group_rows, group_rows, dim, 4, vq::DType::F32,
                                                  q.data() + g * group_rows * dim, s.data() + g * dim, m.data() + g * dim, scratch);
    ASSERT_NE(expected, vq::QuantStatus::Ok);
    EXPECT_EQ(vq::quantize_groups(in.data(), out.data(), n_groups, group_rows, dim, 4, vq::DType::F32, q.data(), s.data(), m.data(), scratch),
              expected);
  }
}

}  // namespace
