// KiviKVCache: KIVI (Liu et al., ICML 2024, arXiv 2402.02750; repo jy-yuan/KIVI) for one layer.
//
// Keys are quantized per channel: a group runs along `group` tokens, one scale and zero per
// (batch, head, channel, group). Values are quantized per token: a group runs along `group`
// channels of one token (the whole head when head_dim < group; head_dim must then be a multiple
// of the group). Asymmetric min/max, `bits` per code: scale = (max - min) / (2^bits - 1) and the
// zero (= min) are stored as float16, q = clamp(round_half_even((x - min16) / scale16), 0,
// 2^bits - 1), x ~= q * scale16 + min16 (scale16 = 0: every code 0, x ~= min16).
//
// Full-precision window, KIVI's rules, which depend only on token counts (so the cache is the
// same whatever the host's chunking):
//   keys:   after n tokens, the first floor(n / residual) * residual are quantized; keys are
//           flushed a whole residual block at a time (residual % group == 0 is required, so
//           groups never straddle a block).
//   values: the first max(0, n - residual) are quantized; values are flushed one token at a time,
//           oldest first, once the full-precision window would exceed `residual`.
// Fetch returns the dense cache in the input dtype: reconstructions, then the exact residual.
//
// Stored and billed (stored_bytes): codes at `bits` per element, scale + zero at 2 + 2 bytes per
// group, the full-precision residual at 2 bytes per element (float16, as the CacheGen cache bills
// its residual, although this model runs float32). Memory (nbytes) is the dense buffer only: the
// codes are folded into their reconstruction at flush time and not kept.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>

#include "veloxquant/cache/kv_cache.hpp"

namespace vq {

struct KiviConfig {
  int bits = 2;        // 2 or 4
  int group = 32;      // tokens per key group; channels per value group
  int residual = 128;  // full-precision window; a multiple of group
  void validate() const;  // throws InvalidArgument
};

class KiviKVCache : public KVCache {
 public:
  explicit KiviKVCache(KiviConfig config = {});  // throws InvalidArgument on a bad config

  // Throws InvalidArgument (cache unchanged) on a mismatch, NaN/Inf, |x| > 65504 (scales and
  // zeros are float16), or a value head_dim that the value group does not divide.
  std::pair<Tensor, Tensor> update_and_fetch(const Tensor& keys, const Tensor& values) override;
  // Quantized tokens cannot be restored to full precision: not trimmable (trim(n > 0) throws).
  bool is_trimmable() const override { return false; }
  std::int64_t trim(std::int64_t n) override;
  void from_state(const KVState& state) override;  // feeds `state` as one chunk
  CacheBytes stored_bytes() const override;
  std::string kind() const override { return "KiviKVCache"; }

  const KiviConfig& config() const { return config_; }
  std::int64_t quantized_keys() const { return key_quantized_; }      // tokens [0, this) of K are quantized
  std::int64_t quantized_values() const { return value_quantized_; }  // tokens [0, this) of V are quantized
  // Channels per value group for a value head_dim d: min(group, d).
  int value_group(std::int64_t d) const { return static_cast<int>(std::min<std::int64_t>(config_.group, d)); }

 private:
  KiviConfig config_;
  std::int64_t key_quantized_ = 0, value_quantized_ = 0;
};

}  // namespace vq
