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

}  // namespace
