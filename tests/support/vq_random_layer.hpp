// A vq layer model built from random weights (N(0, 0.3), RMS gains 1 + |N|) of a small layer:
// `kv_heads` KV heads of `head_dim`, two query heads per KV head, model dim `dim`. The same seed
// gives the same model. For tests of the transforms and of what is rebuilt through them.
#pragma once
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "veloxquant/vq/basis.hpp"

namespace vqtest {

inline vq::VqLayerModel random_weights_layer_model(int kv_heads, int head_dim, int dim, std::uint64_t seed,
                                               const vq::VqBasisOptions& basis = {}) {
  const int n = kv_heads * head_dim, nq = 2 * kv_heads;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  std::vector<float> wq(static_cast<std::size_t>(nq * head_dim * dim)), wk(static_cast<std::size_t>(n * dim)),
      wv(static_cast<std::size_t>(n * dim)), wo(static_cast<std::size_t>(dim * nq * head_dim)), g(static_cast<std::size_t>(dim));
  for (auto* v : {&wq, &wk, &wv, &wo, &g})
    for (auto& x : *v) x = nd(rng);
  for (auto& x : g) x = 1.0f + std::fabs(x);
  vq::VqLayerWeights w;
  w.dim = dim, w.n_heads = nq, w.n_kv_heads = kv_heads, w.head_dim = head_dim;
  w.wq = wq, w.wk = wk, w.wv = wv, w.wo = wo, w.rms_att = g;
  return vq::make_vq_layer_model(w, basis);
}

}  // namespace vqtest
