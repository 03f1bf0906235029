// A synthetic KV source with the structure real LLM caches show, for when no model is at hand:
//   - keys: a per-head mean plus an AR(1) process over tokens (adjacent tokens are similar), a few
//     outlier channels with ~10x the magnitude of the rest (as measured in KIVI / KVQuant), then
//     RoPE applied on interleaved pairs, so keys rotate with position as mlx_lm caches them;
//   - values: a slowly drifting AR(1) process, no outliers.
// Deterministic for a given seed. Labelled "synthetic" wherever the CLI reports on it.
#pragma once
#include <cstdint>

#include "veloxquant/core/tensor.hpp"

namespace vq {

struct SyntheticKVConfig {
  std::int64_t batch = 1;
  std::int64_t heads = 8;
  std::int64_t tokens = 1024;
  std::int64_t head_dim = 128;
  int outlier_channels = 4;     // per head
  float rope_theta = 10000.0f;
  std::uint64_t seed = 0;
  DType dtype = DType::F16;
};

struct SyntheticKV {
  Tensor keys;
  Tensor values;
};

// Throws InvalidArgument on a non-positive size or an odd head_dim (RoPE pairs channels).
SyntheticKV make_synthetic_kv(const SyntheticKVConfig& config);

}  // namespace vq
