// A llama2.c checkpoint of any shape with random weights (N(0, sigma) matrices and embedding, RMS
// gains 1), for benchmarks of speed and size at realistic shapes: never for quality.
#pragma once
#include <cstdint>

#include "veloxquant/model/checkpoint.hpp"

namespace vq {

// `config` with every tensor filled from std::mt19937(seed) in llama2.c's order (embedding, wq, wk,
// wv, wo, w1, w2, w3); shared classifier. Throws InvalidArgument on a non-positive size.
Checkpoint random_checkpoint(const ModelConfig& config, std::uint32_t seed, float sigma = 0.02f);

}  // namespace vq
