#include "veloxquant/synth/synthetic_kv.hpp"

#include <cmath>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"

namespace vq {

SyntheticKV make_synthetic_kv(const SyntheticKVConfig& cfg) {
  require(cfg.batch >= 1 && cfg.heads >= 1 && cfg.tokens >= 0 && cfg.head_dim >= 2,
          "synthetic KV: bad shape [{}, {}, {}, {}]", cfg.batch, cfg.heads, cfg.tokens, cfg.head_dim);
  require(cfg.head_dim % 2 == 0, "synthetic KV: head_dim must be even for RoPE, got {}", cfg.head_dim);
  require(cfg.outlier_channels >= 0 && cfg.outlier_channels <= cfg.head_dim, "synthetic KV: bad outlier channel count");
  const std::int64_t B = cfg.batch, H = cfg.heads, S = cfg.tokens, D = cfg.head_dim;
  (void)checked_numel({B, H, S, D});  // before sizing the buffers by B * H * S * D
  std::vector<float> k(static_cast<std::size_t>(B * H * S * D)), v(k.size());
  std::mt19937_64 rng(cfg.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> mean(static_cast<std::size_t>(D)), scale(static_cast<std::size_t>(D)), ks(static_cast<std::size_t>(D)),
      vs(static_cast<std::size_t>(D));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t c = 0; c < D; ++c) {
        mean[c] = 0.5f * normal(rng);
        scale[c] = 1.0f;
        ks[c] = normal(rng);
        vs[c] = normal(rng);
      }
      for (int o = 0; o < cfg.outlier_channels; ++o) {
        const auto c = static_cast<std::size_t>(rng() % static_cast<std::uint64_t>(D));
        scale[c] = 10.0f;
        mean[c] *= 10.0f;
      }
      for (std::int64_t s = 0; s < S; ++s) {
        float* kr = k.data() + ((b * H + h) * S + s) * D;
        float* vr = v.data() + ((b * H + h) * S + s) * D;
        for (std::int64_t c = 0; c < D; ++c) {
          ks[c] = 0.9f * ks[c] + 0.45f * normal(rng);
          vs[c] = 0.97f * vs[c] + 0.25f * normal(rng);
          kr[c] = mean[c] + scale[c] * ks[c];
          vr[c] = vs[c];
        }
        for (std::int64_t i = 0; i < D / 2; ++i) {  // RoPE on interleaved pairs (2i, 2i+1)
          const double freq = std::pow(static_cast<double>(cfg.rope_theta), -2.0 * static_cast<double>(i) / static_cast<double>(D));
          const double ang = static_cast<double>(s) * freq;
          const float cs = static_cast<float>(std::cos(ang)), sn = static_cast<float>(std::sin(ang));
          const float x0 = kr[2 * i], x1 = kr[2 * i + 1];
          kr[2 * i] = x0 * cs - x1 * sn;
          kr[2 * i + 1] = x0 * sn + x1 * cs;
        }
      }
    }
  return {Tensor::from_f32({B, H, S, D}, k, cfg.dtype), Tensor::from_f32({B, H, S, D}, v, cfg.dtype)};
}

}  // namespace vq
