// `vq:...,predict=on`: our method with each layer's coefficients predicted before they are
// quantized, from what the decoder already has (issue 31): the cache of one layer, its predictors
// and its coded form.
//
// What a reader must know first:
// - Coefficients are vq's: y = F x per token and side (vq/basis.hpp's transform of the layer, keys
//   un-rotated), so a token's coefficients do not depend on its position.
// - Per token, in this order, with yhat the decoder's reconstructions (closed loop):
//     K_l:  p_k = P_k [yhat_k(l-1), yhat_v(l-1), 1]               (the first layer: p_k = 0)
//     V_l:  p_v = P_v [yhat_k(l), yhat_k(l-1), yhat_v(l-1), 1]    (the first layer: [yhat_k(l), 1])
//   and the residual e = y - p is what is quantized, with one step per side and a per-coefficient
//   offset, exactly as vq quantizes y (water-filling over the residuals' spreads at calibration):
//     q = round_even((e - mean_c) / step),  yhat = p + fma(q, step, mean_c),  x_hat = F^-1 yhat.
//   K and V of a layer are as closely tied to the layer before as to each other: both are linear
//   maps of a residual stream that each layer only adds to.
// - The predictors P come from the model alone (the moments of a fit on text it samples itself:
//   model/vq_chain_predictors.hpp): nothing per context, no stored tables; each cache solves its
//   weights for its inputs' steps at calibration (VqChainPredictor::weights). The coded form is
//   vq's layer codec (vq/codec.hpp) as version 7 (8 rANS lanes) over the residual codes, after a
//   1-byte record tag: the billed size.
// - The cache of layer l reads the reconstructions of layer l-1's cache (held per token) for the
//   tokens it quantizes, so layers must be fed in order (the forward pass does); a layer fed tokens
//   its previous layer has not quantized is refused (InvalidArgument, cache unchanged).
// - Held: the reconstructed rows (dense, float32: fetch and attention read them as an exact cache's),
//   the codes and yhat per token. This is a storage setting (the reuse protocol, a stored prefix),
//   not a resident one: it holds float32 rows like `fp16` holds its rounded ones.
// - The decoder (vq_chain_decode) rebuilds yhat and the rows with the same functions in the same
//   order, so a decoded layer is bit for bit the cache that was coded (tested).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/vq/basis.hpp"
#include "veloxquant/vq/codec.hpp"
#include "veloxquant/vq/vq_cache.hpp"

namespace vq {

// One layer's predictors (see above), as the moments of a least-squares fit: the weights depend
// on how noisy the inputs will be (the reconstructions of a coarse step are far from the exact
// coefficients, and weights fitted on exact inputs amplified that noise past the residual they
// removed), so each cache solves for its own at calibration, when its inputs' steps are known
// (vq_chain_weights), and the decoder solves the same system from the same steps. Inputs in order
// [own K yhat (V only)], [previous layer's K yhat, V yhat], then 1 (the bias).
struct VqChainWeightMemo;
inline constexpr std::size_t kVqChainMemo = 1024;
struct VqChainPredictor {
  int n_k = 0, n_v = 0;
  int n_prev = 0;    // n_k + n_v of the previous attention layer; 0 for the first
  int n_prev_k = 0;  // its n_k
  double rows = 0;   // samples the moments sum over
  // Sum of x x^T ([ins + 1]^2) and of x y^T ([ins + 1][outs]) over the samples, x = [inputs, 1]:
  // K's (empty when n_prev == 0: no K prediction) and V's.
  std::vector<double> k_moments, k_cross, v_moments, v_cross;
  int k_inputs() const { return n_prev; }
  int v_inputs() const { return n_k + n_prev; }
  // The weights of K's (side 0) or V's (side 1) prediction for these steps (own_k_step: V only;
  // the previous layer's: unused by the first layer), from vq_chain_weights with each step taken
  // at the middle of its bin (an eighth of its binary octave's range, from its exponent and
  // mantissa: no libm), and kept per bin: a cache calibrating and a decoder solve each system once
  // per process (at most kVqChainMemo systems are kept: hostile streams cannot grow it without
  // bound). Thread-safe.
  std::shared_ptr<const std::vector<float>> weights(int side, float own_k_step, float prev_k_step, float prev_v_step) const;
  std::shared_ptr<VqChainWeightMemo> memo;  // made by fit_vq_chain; copies share it
};

// Weights [ins + 1][outs] (row j the weights of input j, the bias row last) of the least-squares fit from the moments, each input j
// taken with an added noise of variance min(step_j^2 / 12, its own variance): step_j the step of
// the side it comes from (a uniform quantizer's error; a step past the input's spread leaves
// about the input itself). Deterministic: the encoder and the decoder get the same floats.
std::vector<float> vq_chain_weights(const std::vector<double>& moments, const std::vector<double>& cross, int ins, int outs, double rows,
                                    const std::vector<float>& input_steps);

// Sums every attention layer's moments on exact K/V: samples[s][l] is layer
// l's state of sample sequence s ([1, H, T, D] float32, keys with RoPE as the model caches them),
// layers[l] the layer's vq model (its transforms and RoPE frequencies). Throws InvalidArgument on
// mismatched shapes.
std::vector<VqChainPredictor> fit_vq_chain(const std::vector<std::vector<KVState>>& samples,
                                           const std::vector<std::shared_ptr<const VqLayerModel>>& layers);

class VqChainKVCache : public KVCache {
 public:
  // previous: layer l-1's cache (null for the first attention layer); predictor.n_prev must be its
  // n_k + n_v. config: bits, calib, k_offset / v_offset (residual, sinks and resident=coded are
  // refused: InvalidArgument).
  VqChainKVCache(VqConfig config, std::shared_ptr<const VqLayerModel> layer, std::shared_ptr<const VqChainPredictor> predictor,
                 std::shared_ptr<const VqChainKVCache> previous);

  // float32 K/V only. Throws InvalidArgument (cache unchanged) on a mismatch, non-finite input, a
  // previous layer that has not quantized these tokens, or a code beyond the coder's reach.
  std::pair<Tensor, Tensor> update_and_fetch(const Tensor& keys, const Tensor& values) override;
  std::int64_t trim(std::int64_t n) override;      // trimming into the calibration tokens forgets it
  void from_state(const KVState& state) override;  // feeds `state` as one chunk
  std::size_t nbytes() const override;
  CacheBytes stored_bytes() const override;  // encode()'s size plus the exact tokens at 4 bytes
  std::string kind() const override { return "VqChainKVCache"; }

  std::int64_t quantized_tokens() const { return quantized_; }
  // The steps of K and V (1 before calibration): what the next layer's weights take as its inputs' noise.
  float key_step() const { return kq_.step; }
  float value_step() const { return vq_.step; }
  // Token t (< quantized_tokens()) of batch b: yhat_k (n_k floats) then yhat_v (n_v floats).
  const float* yhat_row(std::int64_t b, std::int64_t t) const;
  int coefficients() const { return n_k_ + n_v_; }
  int key_coefficients() const { return n_k_; }
  const VqLayerModel& layer_model() const { return *layer_; }
  const VqChainPredictor& predictor() const { return *pred_; }
  // The quantized tokens' residual codes with the calibration (vq/codec.hpp's layout).
  VqLayerCodes codes() const;
  // The coded form: kVqChainTag, then vq_encode(codes()).
  std::vector<std::uint8_t> encode() const;

 private:
  void forget();
  VqConfig config_;
  std::shared_ptr<const VqLayerModel> layer_;
  std::shared_ptr<const VqChainPredictor> pred_;
  std::shared_ptr<const VqChainKVCache> prev_;
  int n_k_ = 0, n_v_ = 0;
  bool calibrated_ = false;
  struct Side {
    float step = 1.0f;
    std::vector<std::int32_t> offset;
    std::vector<float> mean;
  } kq_, vq_;
  std::shared_ptr<const std::vector<float>> k_weights_, v_weights_;  // the predictor's weights for the calibration's steps
  std::int64_t quantized_ = 0;
  std::vector<std::vector<std::int16_t>> codes_k_, codes_v_;  // per batch: [t][n]
  std::vector<std::vector<float>> yhat_;                      // per batch: [t][n_k + n_v]
  mutable std::int64_t encoded_at_ = -1;                      // tokens when encoded_size_ was measured
  mutable std::size_t encoded_size_ = 0;
};

// The record tag before a chained layer's codes (a layer-format version of its own: vq/codec.hpp's
// versions 1-6 start with their version byte 1..6).
inline constexpr std::uint8_t kVqChainTag = 0x71;

// A chained layer decoded: yhat per batch ([t][n_k + n_v]), the rows [B, H, T, D] float32 and the
// steps (the next layer's decoder takes them).
struct VqChainDecoded {
  std::vector<std::vector<float>> yhat;
  KVState state;
  float key_step = 1.0f, value_step = 1.0f;
  int n_k = 0, n_v = 0;
};
// Decodes encode()'s bytes with the layer's model and predictor and the previous layer's decoded
// yhat and steps (null for the first layer; it must hold at least as many tokens per batch). Bit for bit the
// cache that was coded (its quantized tokens). Throws FormatError on malformed input (max_codes
// bounds the codes, as vq_decode), a record of other sequences or more tokens than the layer
// before holds included; InvalidArgument when the caller's parts (layer, predictor, previous) do
// not fit each other.
VqChainDecoded vq_chain_decode(std::span<const std::uint8_t> bytes, const VqLayerModel& layer, const VqChainPredictor& predictor,
                               const VqChainDecoded* previous, std::uint64_t max_codes);

}  // namespace vq
