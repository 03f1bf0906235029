// VqKVCache: our own method (spec `vq`, docs/methods.md), for one layer.
//
// Per token, for K and for V: the row of all KV heads (n = H * D values; keys first un-rotated
// to undo RoPE) goes through the layer's fixed transform y = F x (vq/basis.hpp: derived from the
// model's weights, no bytes stored), then each coefficient is quantized uniformly with one step per
// side: q_c = clamp(round_half_even((y_c - o_c) / step), +-M_c), y_hat_c = o_c + q_c * step,
// x_hat = F^-1 y_hat (keys re-rotated). Codes are rANS-coded with per-coefficient parametric
// models (vq/codec.hpp): no group scales or zeros, so metadata is a few bytes per coefficient per
// cache, not a bit per element.
//
// (o_c: the coefficient's calibration mean rounded to a quarter step; M_c = 255, or 255 * 2^s when
// calibration says the codes need more, split in the coder; see vq/codec.hpp).
// Exact window: the most recent `residual` tokens (default 0) stay exact and are quantized when
// they leave it (KIVI's rule for values): in the reuse protocol a context is best stored whole,
// but a host that decodes against its own cache (eval --protocol stream) gains from it.
// Calibration: the first `calib` tokens wait in an exact residual; when that many have arrived,
// the step (float32) and the per-coefficient offsets are computed from them and frozen,
// those tokens are quantized, and every later token is quantized on arrival. The step is set by
// reverse water-filling on the calibration variances: the high-rate Gaussian estimate of the code
// rate, mean over coefficients of max(0, log2(4.13 sigma_c / step)), equals `bits` + the side's
// offset. Everything depends only on token counts, so the cache is the same whatever the host's
// chunking (tested).
//
// Stored and billed (stored_bytes): the size of encode() (header, steps, means, model parameters,
// the rANS stream with its lane states), measured by running the coder, plus the exact residual
// at 2 bytes per element (float16, as the other caches bill theirs). fixed == estimated.
// Fetch returns the dense reconstruction in the input dtype.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/vq/basis.hpp"
#include "veloxquant/vq/codec.hpp"

namespace vq {

struct VqConfig {
  double bits = 2.0;               // nominal code rate per element (see above), 0 < bits <= 10
  int calib = 64;                  // calibration tokens, >= 1
  int residual = 0;                // most recent tokens kept exact (billed float16), >= 0
  double k_offset = 0, v_offset = 0;  // bits added to this layer's K / V (the layer allocation)
  void validate() const;              // throws InvalidArgument
};

class VqKVCache : public KVCache {
 public:
  // `layer` null: identity transforms and no RoPE handling, sized from the first chunk. Otherwise
  // chunks must have layer->kv_heads heads of layer->head_dim. Throws InvalidArgument on a bad config.
  explicit VqKVCache(VqConfig config = {}, std::shared_ptr<const VqLayerModel> layer = nullptr);

  // Throws InvalidArgument (cache unchanged) on a mismatch or NaN/Inf input.
  std::pair<Tensor, Tensor> update_and_fetch(const Tensor& keys, const Tensor& values) override;
  // Drops the last tokens' codes and rows (each token's codes are independent). Trimming to 0
  // forgets the calibration.
  std::int64_t trim(std::int64_t n) override;
  void from_state(const KVState& state) override;  // feeds `state` as one chunk
  std::size_t nbytes() const override;
  CacheBytes stored_bytes() const override;
  std::string kind() const override { return "VqKVCache"; }

  const VqConfig& config() const { return config_; }
  std::int64_t quantized_tokens() const { return quantized_; }
  // The quantized part (tokens [0, quantized_tokens())) as the codec sees it.
  VqLayerCodes codes() const;
  // vq_encode(codes()); its size is memoised for stored_bytes until the next change.
  std::vector<std::uint8_t> encode() const;
  const VqLayerModel* layer_model() const { return layer_.get(); }
  // Whether the layer model is the identity sized from the data (the cache was built without one).
  bool model_from_data() const { return identity_from_data_; }

  // Rebuild a cache from what a saved one holds (the .vqkv reader, format/vqkv.hpp): its config,
  // its layer model (null: the identity sized from the data, as the constructor takes it), the
  // codes of its quantized tokens [0, Q) with their frozen calibration (step, offsets, shifts;
  // Q = codes.tokens, 0 when the cache had not calibrated yet) and the exact rows of the tokens
  // after them, `exact` [B, H, offset - Q, D] (any token count, 0 included; it gives the dtype and
  // shape). The result fetches bit for bit what the saved cache fetched (the quantized tokens are
  // reconstructed with vq_reconstruct, the cache's own arithmetic) and continues identically.
  // Throws InvalidArgument when the parts disagree with each other or with a cache that
  // update_and_fetch could have built (e.g. Q > 0 but fewer than offset - residual tokens).
  // Self-contained on purpose: it touches only the members listed here, so a storage rewrite
  // ports it by swapping the dense buffers for its own.
  static std::shared_ptr<VqKVCache> restore(VqConfig config, std::shared_ptr<const VqLayerModel> layer, VqLayerCodes codes,
                                            const KVState& exact);

 private:
  struct SideQuant {
    float step = 1.0f;
    std::vector<std::int32_t> offset;  // grid offsets, quarter steps
    std::vector<float> mean;           // their values
    std::vector<std::uint8_t> shift;   // code splits (vq/codec.hpp)
  };
  void calibrate();
  void quantize_tokens(std::int64_t t0, std::int64_t t1);
  void reset();

  VqConfig config_;
  std::shared_ptr<const VqLayerModel> layer_;
  bool identity_from_data_ = false;  // layer_ is the identity sized from the data (no model given)
  bool calibrated_ = false;
  SideQuant kq_, vq_;
  std::int64_t quantized_ = 0;
  std::vector<std::vector<std::int16_t>> k_codes_, v_codes_;  // per batch: [token, n]
  mutable std::optional<std::size_t> encoded_size_;
};

// The decoder's last step: dense K and V [batch, H, tokens, D] in `dtype` from decoded codes and
// the layer's transforms; bit-identical to what the cache returned for those tokens.
KVState vq_reconstruct(const VqLayerCodes& codes, const VqLayerModel& layer, DType dtype);

}  // namespace vq
