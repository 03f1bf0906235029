// The transform stage of `vq` (src/vq/transform.hpp): the forward transform's fast path and its
// scalar reference give the same bits as a plain double loop, for per-head blocks and for one block
// mixing every head; reconstruction from F^-1's column blocks equals reconstruction from its rows
// bit for bit; RoPE undone and redone gives the rows back.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "../../src/vq/reconstruct_kernels.hpp"
#include "../../src/vq/transform.hpp"
#include "../support/vq_random_layer.hpp"

namespace {

using vq::vq_transform::reconstruct_head;
using vq::vq_transform::reconstruct_head_cols;

std::vector<double> random_row(int n, unsigned seed) {
  std::mt19937 g(seed);
  std::normal_distribution<double> nd;
  std::vector<double> x(static_cast<std::size_t>(n));
  for (auto& v : x) v = nd(g);
  return x;
}

// y_i = sum over j in order of double(F_ij) * x_j, from 0: what the transform promises.
std::vector<double> plain_product(const vq::VqSideTransform& t, const std::vector<double>& x) {
  std::vector<double> y(static_cast<std::size_t>(t.n));
  for (int i = 0; i < t.n; ++i) {
    double acc = 0;
    for (int j = 0; j < t.n; ++j) acc += static_cast<double>(t.fwd[static_cast<std::size_t>(i * t.n + j)]) * x[static_cast<std::size_t>(j)];
    y[static_cast<std::size_t>(i)] = acc;
  }
  return y;
}

void expect_same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(double)), 0);
}

TEST(VqTransform, ForwardIsThePlainProductOnEveryPath) {
  // A random layer's transforms (weights and hadamard bases).
  for (const auto basis : {vq::VqBasis::Weights, vq::VqBasis::Hadamard}) {
    vq::VqBasisOptions o;
    o.basis = basis;
    const vq::VqLayerModel layer = vqtest::random_weights_layer_model(4, 16, 48, 3, o);
    for (const auto* t : {&layer.k, &layer.v}) {
      ASSERT_FALSE(t->identity());
      const auto x = random_row(t->n, 7);
      std::vector<double> fast(static_cast<std::size_t>(t->n)), ref(static_cast<std::size_t>(t->n));
      vq::vq_transform::vq_forward(*t, x.data(), fast.data());
      vq::vq_transform::vq_forward_ref(*t, x.data(), ref.data());
      expect_same_bits(fast, ref);
      expect_same_bits(ref, plain_product(*t, x));
    }
  }
  // A dense random F (every head mixed): the encoder's transposed copy exists, and on a CPU with
  // AVX-512 vq_forward takes that path.
  vq::VqSideTransform dense;
  dense.n = 64;
  std::mt19937 g(5);
  std::normal_distribution<float> nd;
  dense.fwd.resize(64 * 64), dense.inv.resize(64 * 64);
  for (auto& v : dense.fwd) v = nd(g);
  for (auto& v : dense.inv) v = nd(g);
  vq::vq_index_inverse(dense, 4);
  ASSERT_EQ(dense.col_span, 64);
  ASSERT_EQ(dense.fwd_t.size(), dense.fwd.size());
  {
    const auto x = random_row(64, 8);
    std::vector<double> fast(64), ref(64);
    vq::vq_transform::vq_forward(dense, x.data(), fast.data());
    vq::vq_transform::vq_forward_ref(dense, x.data(), ref.data());
    expect_same_bits(fast, ref);
    expect_same_bits(ref, plain_product(dense, x));
  }
  // The identity copies.
  vq::VqSideTransform id;
  id.n = 5;
  const auto x = random_row(5, 9);
  std::vector<double> y(5);
  vq::vq_transform::vq_forward(id, x.data(), y.data());
  expect_same_bits(y, x);
}

TEST(VqTransform, ColumnBlocksReconstructTheSameBitsAsRows) {
  const vq::VqLayerModel layer = vqtest::random_weights_layer_model(4, 16, 48, 5);
  const auto& t = layer.k;
  ASSERT_GT(t.col_span, 0);
  const int d = layer.head_dim, n = t.n;
  std::mt19937 g(11);
  std::normal_distribution<float> nd;
  std::vector<float> yhat(static_cast<std::size_t>(n));
  for (auto& v : yhat) v = nd(g);
  std::vector<float> acc(static_cast<std::size_t>(d)), rows(static_cast<std::size_t>(d)), cols(static_cast<std::size_t>(d));
  for (int h = 0; h < layer.kv_heads; ++h)
    for (const std::int64_t pos : {std::int64_t{0}, std::int64_t{37}}) {
      reconstruct_head(t.inv.data(), n, yhat.data(), h, d, &layer.rope_freq, pos, acc.data(), rows.data());
      const int j0 = t.col_span == n ? 0 : h * t.col_span;
      reconstruct_head_cols(t.inv_cols.data() + static_cast<std::size_t>(h * t.col_span * d), t.col_span, yhat.data() + j0, d,
                            &layer.rope_freq, pos, acc.data(), cols.data());
      EXPECT_EQ(std::memcmp(rows.data(), cols.data(), rows.size() * sizeof(float)), 0) << "head " << h << " pos " << pos;
    }
}

TEST(VqTransform, RopeUndoneAndRedoneGivesTheRowsBack) {
  const int heads = 3, d = 8;
  const std::vector<double> freq = {1.0, 0.1, 0.01, 0.001};
  const auto table = vq::vq_rope_table(freq, 100);
  for (const std::int64_t pos : {std::int64_t{0}, std::int64_t{1}, std::int64_t{99}}) {
    const auto x = random_row(heads * d, static_cast<unsigned>(pos) + 1);
    auto un = x;
    vq::vq_transform::vq_unrope(un.data(), heads, d, table->at(pos), freq.size());
    if (pos > 0) EXPECT_GT(std::fabs(un[0] - x[0]) + std::fabs(un[1] - x[1]), 1e-3);  // it did rotate
    std::vector<float> yhat(un.begin(), un.end()), acc(d), out(d);
    for (int h = 0; h < heads; ++h) {
      reconstruct_head(nullptr, heads * d, yhat.data(), h, d, &freq, pos, acc.data(), out.data());
      for (int i = 0; i < d; ++i) EXPECT_NEAR(out[static_cast<std::size_t>(i)], x[static_cast<std::size_t>(h * d + i)], 1e-5);
    }
  }
}

TEST(VqTransform, RoundEvenIsNearbyint) {
  for (const double v : {0.5, 1.5, 2.5, -0.5, -1.5, 3.49999, 1e15 + 0.5, -7.5, 0.0, 4503599627370497.0, 1e300})
    EXPECT_EQ(vq::vq_transform::round_even(v), std::nearbyint(v)) << v;
}

}  // namespace
