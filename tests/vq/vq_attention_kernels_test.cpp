// VqKVCache's attention kernels on packed codes (src/vq/vq_attention_kernels.hpp), on hand-built
// heads: the width-specialised loops (Decode::kByWidth, with AVX-512 where the CPU has it, and
// kByWidthAvx2) against the any-width decode (Decode::kGeneric), bit for bit, for every field width (1..8, 16), runs of mixed widths, a partial
// last group, 1..5 query rows and tile lengths that are not multiples of the token blocks; and both
// against a scalar reference that reads every field by its bit position.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "../../src/vq/vq_attention_kernels.hpp"

namespace {

namespace va = vq::vq_attention;

// A head of d fields over n tokens with the given group widths (ceil(d / 8) of them), packed as
// vq_cache.hpp's "Packed layout" says (groups byte-aligned, back to back, fields at bits i*w), with
// random bytes: every field value occurs, the escape (0) included. Rows start `lead` bytes in
// (another head's segment) and the buffer keeps 8 bytes of slack past the last row.
struct Head {
  std::vector<std::uint8_t> rows;
  std::vector<std::uint32_t> group_byte;
  std::vector<std::uint8_t> group_width;
  std::vector<float> mean;
  std::size_t row_bytes = 0;
  std::int64_t d = 0, n = 0;

  Head(std::int64_t d_, std::int64_t n_, const std::vector<int>& widths, std::uint64_t seed) : d(d_), n(n_) {
    std::mt19937_64 rng(seed);
    const std::uint32_t lead = 3;
    std::uint32_t at = lead;
    for (std::size_t g = 0; g < widths.size(); ++g) {
      const std::int64_t m = std::min<std::int64_t>(8, d - 8 * static_cast<std::int64_t>(g));
      group_byte.push_back(at);
      group_width.push_back(static_cast<std::uint8_t>(widths[g]));
      at += static_cast<std::uint32_t>((m * widths[g] + 7) / 8);
    }
    row_bytes = at + 2;  // a following head's bytes
    rows.resize(row_bytes * static_cast<std::size_t>(n) + 8);
    for (auto& b : rows) b = static_cast<std::uint8_t>(rng());
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (std::int64_t p = 0; p < d; ++p) mean.push_back(nd(rng));
  }

  va::HeadFields fields(std::int64_t t0) const {
    va::HeadFields f;
    f.rows = rows.data();
    f.row_bytes = row_bytes;
    f.t0 = t0;
    f.d = d;
    f.group_byte = group_byte.data();
    f.group_width = group_width.data();
    f.mean = mean.data();
    f.step = 0.37f;
    return f;
  }

  // The code of field p of token t, read bit by bit: f - 2^(w-1), 0 for an escape (f = 0).
  int code(std::int64_t t, std::int64_t p) const {
    const std::size_t g = static_cast<std::size_t>(p / 8);
    const int w = group_width[g];
    const std::size_t bit0 = (static_cast<std::size_t>(t) * row_bytes + group_byte[g]) * 8 + static_cast<std::size_t>(p % 8) * static_cast<std::size_t>(w);
    int f = 0;
    for (int i = 0; i < w; ++i) f |= ((rows[(bit0 + static_cast<std::size_t>(i)) / 8] >> ((bit0 + static_cast<std::size_t>(i)) % 8)) & 1) << i;
    return f == 0 ? 0 : f - (1 << (w - 1));
  }
};

std::vector<float> random_floats(std::size_t count, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(count);
  for (auto& x : v) x = u(rng);
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// Scores and value sums of tokens [t0, t0 + n) both ways and by the scalar reference.
void expect_kernels_agree(const Head& head, std::int64_t t0, std::int64_t n, std::int64_t nq) {
  SCOPED_TRACE(::testing::Message() << "d=" << head.d << " t0=" << t0 << " n=" << n << " nq=" << nq << " width[0]=" << int(head.group_width[0]));
  const std::int64_t d = head.d;
  const va::HeadFields f = head.fields(t0);
  const std::vector<float> q = random_floats(static_cast<std::size_t>(nq * d), 5), w = random_floats(static_cast<std::size_t>(nq * n), 6);

  std::vector<float> s_width(static_cast<std::size_t>(nq * n)), s_generic(s_width.size());
  va::score(f, n, q.data(), nq, s_width.data(), va::Decode::kByWidth);
  va::score(f, n, q.data(), nq, s_generic.data(), va::Decode::kGeneric);
  EXPECT_TRUE(same_bits(s_width, s_generic));

  std::vector<std::int32_t> order(static_cast<std::size_t>(d));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(8));  // any permutation
  std::vector<float> a_width = random_floats(static_cast<std::size_t>(nq * d), 7), a_generic = a_width, a_start = a_width;
  va::accumulate(f, n, w.data(), nq, a_width.data(), order.data(), va::Decode::kByWidth);
  va::accumulate(f, n, w.data(), nq, a_generic.data(), order.data(), va::Decode::kGeneric);
  EXPECT_TRUE(same_bits(a_width, a_generic));
  // kByWidth takes AVX-512 for widths <= 4 where the CPU has it; kByWidthAvx2 never does.
  std::vector<float> a_avx2 = a_start, s_avx2(s_width.size());
  va::accumulate(f, n, w.data(), nq, a_avx2.data(), order.data(), va::Decode::kByWidthAvx2);
  EXPECT_TRUE(same_bits(a_avx2, a_generic));
  va::score(f, n, q.data(), nq, s_avx2.data(), va::Decode::kByWidthAvx2);
  EXPECT_TRUE(same_bits(s_avx2, s_generic));

  // The scalar reference (double): value = mean_p + step * code.
  for (std::int64_t r = 0; r < nq; ++r) {
    for (std::int64_t j = 0; j < n; ++j) {
      double ref = 0, mag = 0;
      for (std::int64_t p = 0; p < d; ++p) {
        const double v = head.mean[static_cast<std::size_t>(p)] + double(f.step) * head.code(t0 + j, p);
        ref += double(q[static_cast<std::size_t>(r * d + p)]) * v;
        mag += std::fabs(double(q[static_cast<std::size_t>(r * d + p)]) * v);
      }
      ASSERT_NEAR(s_width[static_cast<std::size_t>(r * n + j)], ref, 1e-5 * (1 + mag)) << "score r=" << r << " j=" << j;
    }
    for (std::int64_t p = 0; p < d; ++p) {
      double ref = a_start[static_cast<std::size_t>(r * d + order[static_cast<std::size_t>(p)])], mag = std::fabs(ref);
      for (std::int64_t j = 0; j < n; ++j) {
        const double v = head.mean[static_cast<std::size_t>(p)] + double(f.step) * head.code(t0 + j, p);
        ref += double(w[static_cast<std::size_t>(r * n + j)]) * v;
        mag += std::fabs(double(w[static_cast<std::size_t>(r * n + j)]) * v);
      }
      ASSERT_NEAR(a_width[static_cast<std::size_t>(r * d + order[static_cast<std::size_t>(p)])], ref, 1e-5 * (1 + mag)) << "acc r=" << r << " p=" << p;
    }
  }
}

TEST(VqAttentionKernels, EachWidthEqualsTheGenericDecode) {
  if (!va::available()) GTEST_SKIP() << "no AVX2: the kernels are not used";
  for (const int w : {1, 2, 3, 4, 5, 6, 7, 8, 16}) {
    const Head head(128, 50, std::vector<int>(16, w), 100 + static_cast<std::uint64_t>(w));
    for (const std::int64_t nq : {1, 2, 3, 4, 5}) expect_kernels_agree(head, 7, 37, nq);
  }
}

TEST(VqAttentionKernels, MixedRunsAndPartialGroups) {
  if (!va::available()) GTEST_SKIP() << "no AVX2: the kernels are not used";
  // Runs as calibration sorts them (narrowest first), a lone group between runs, and a head whose
  // d is not a multiple of 8 (its partial last group read field by field).
  const Head sorted(128, 300, {3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 4, 4, 6, 6}, 1);
  for (const std::int64_t nq : {1, 4, 8}) expect_kernels_agree(sorted, 0, 256, nq);
  expect_kernels_agree(sorted, 255, 45, 4);
  const Head mixed(40, 40, {2, 4, 16, 1, 7}, 2);
  expect_kernels_agree(mixed, 1, 33, 3);
  const Head partial(13, 40, {5, 3}, 3);
  expect_kernels_agree(partial, 0, 40, 4);
  const Head tiny(5, 20, {4}, 4);  // no full group at all
  expect_kernels_agree(tiny, 2, 17, 2);
  // Runs of 7, 3 and 5 groups of widths <= 4: AVX-512's passes of four groups, a pair and a lone group.
  const Head odd(128, 60, {1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 4, 4, 4, 4, 4, 8}, 5);
  for (const std::int64_t nq : {1, 3, 4, 5}) expect_kernels_agree(odd, 3, 50, nq);
}

}  // namespace
