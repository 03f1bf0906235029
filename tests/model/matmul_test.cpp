// The forward pass's matrix products (src/model/matmul.hpp): every vector path gives the portable
// path's bits (the same products and sums in the same order), for row counts around the 4-row
// blocks (and the 1-3 rows left after them), widths around the 8-, 16-, 32-, 64- and 128-output
// blocks (masked tails), padded strides,
// and the model's own shapes; and each path writes nothing past out_dim.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "../../src/model/matmul.hpp"

namespace {

using vq::detail::MatmulPath;

TEST(Matmul, VectorPathsGiveThePortableBits) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  int compared = 0;
  for (const int n : {1, 2, 3, 4, 5, 6, 7, 8, 9, 11})
    for (const int in_dim : {1, 7, 64, 172})
      for (const int out_dim : {1, 7, 8, 15, 16, 17, 31, 33, 64, 100, 113, 127, 128, 130, 176, 352, 512})
        for (const int pad : {0, 8}) {
          const std::size_t ws = static_cast<std::size_t>((out_dim + 7) / 8 * 8 + pad), os = static_cast<std::size_t>(out_dim) + 3,
                            is = static_cast<std::size_t>(in_dim) + 1;
          std::vector<float> w(static_cast<std::size_t>(in_dim) * ws, 0.0f), x(static_cast<std::size_t>(n) * is);
          for (int i = 0; i < in_dim; ++i)
            for (int o = 0; o < out_dim; ++o) w[static_cast<std::size_t>(i) * ws + static_cast<std::size_t>(o)] = nd(rng);
          for (auto& v : x) v = nd(rng);
          std::vector<float> want(static_cast<std::size_t>(n) * os, -1.0f);
          ASSERT_TRUE(vq::detail::matmul_with(MatmulPath::Portable, want.data(), os, x.data(), is, w.data(), ws, n, in_dim, out_dim));
          for (const MatmulPath path : {MatmulPath::Avx2, MatmulPath::Avx512}) {
            std::vector<float> got(want.size(), -1.0f);  // the gaps past out_dim must stay -1
            if (!vq::detail::matmul_with(path, got.data(), os, x.data(), is, w.data(), ws, n, in_dim, out_dim)) continue;
            ++compared;
            ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0)
                << "path " << static_cast<int>(path) << " n " << n << " in " << in_dim << " out " << out_dim << " pad " << pad;
          }
        }
  if (compared == 0) GTEST_SKIP() << "no vector path on this machine";
}

}  // namespace
