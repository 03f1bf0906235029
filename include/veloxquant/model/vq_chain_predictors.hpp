// The predictors of `vq:...,predict=on` (vq/vq_chain.hpp) for a model our engine runs: fitted on
// the K/V of text the model samples itself (kVqChainSamples sequences of up to kVqChainSampleTokens
// tokens from BOS, temperature 1, top-p 0.9, fixed seeds), so they are a function of the model
// alone: no text file, nothing per context, nothing stored with a cache.
#pragma once
#include <memory>
#include <vector>

#include "veloxquant/model/transformer.hpp"
#include "veloxquant/vq/vq_chain.hpp"

namespace vq {

inline constexpr int kVqChainSamples = 8;
inline constexpr int kVqChainSampleTokens = 256;

// One predictor per model layer, for the layer models model.vq_layer_model(l, basis). Fitted on first
// use and kept process-wide per (model fingerprint, basis); safe to call from several threads.
std::shared_ptr<const std::vector<VqChainPredictor>> vq_chain_predictors(const Transformer& model, const VqBasisOptions& basis);

}  // namespace vq
