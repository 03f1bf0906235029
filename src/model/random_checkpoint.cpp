#include "veloxquant/model/random_checkpoint.hpp"

#include <random>

#include "veloxquant/core/error.hpp"

namespace vq {

Checkpoint random_checkpoint(const ModelConfig& config, std::uint32_t seed, float sigma) {
  const ModelConfig& c = config;
  require(c.dim > 0 && c.hidden_dim > 0 && c.n_layers > 0 && c.n_heads > 0 && c.n_kv_heads > 0 && c.vocab_size > 0 && c.seq_len > 0 &&
              c.n_heads % c.n_kv_heads == 0,
          "random_checkpoint: every size must be positive and the KV heads divide the heads");
  Checkpoint ck;
  ck.config = config;
  ck.config.shared_classifier = true;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, sigma);
  const auto fill = [&](std::vector<float>& v, std::size_t n) {
    v.resize(n);
    for (auto& x : v) x = nd(rng);
  };
  const auto L = static_cast<std::size_t>(c.n_layers), D = static_cast<std::size_t>(c.dim), Q = static_cast<std::size_t>(c.q_dim()),
             KV = static_cast<std::size_t>(c.n_kv_heads * c.head_size()), H = static_cast<std::size_t>(c.hidden_dim),
             V = static_cast<std::size_t>(c.vocab_size);
  fill(ck.token_embedding, V * D);
  ck.rms_att.assign(L * D, 1.0f);
  fill(ck.wq, L * Q * D);
  fill(ck.wk, L * KV * D);
  fill(ck.wv, L * KV * D);
  fill(ck.wo, L * D * Q);
  ck.rms_ffn.assign(L * D, 1.0f);
  fill(ck.w1, L * H * D);
  fill(ck.w2, L * D * H);
  fill(ck.w3, L * H * D);
  ck.rms_final.assign(D, 1.0f);
  return ck;
}

}  // namespace vq
