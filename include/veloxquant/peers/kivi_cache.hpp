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
// its residual, although this model runs float32).
//
// Resident (what nbytes() reports, exactly the allocations): per (batch, head) slice the key and
// value codes packed at `bits` (transform/packed_rows.hpp: 2-bit codes four per byte), the float16
// scale and zero of every group, and the two full-precision windows in the input dtype
// (cache/exact_rows.hpp: keys < residual tokens, values <= residual tokens, a ring that slides
// without copying). No dense copy of quantized tokens is kept; keys_buf_ / values_buf_ hold only
// the layout [B, H, 0, D].
// - attend() dequantizes a tile at a time straight from the codes (read_key_tile / read_value_tile).
// - update() appends without materialising anything.
// - update_and_fetch() and state() materialise: fresh dense tensors [B, H, offset, D] in the input
//   dtype, owned by the caller. Cost per call: O(offset * H * D) dequantization and
//   B*H*offset*(D_k + D_v)*sizeof(dtype) bytes allocated, what a dense cache holds, for as long as
//   the caller holds them. Values are bit-identical to those of the former dense implementation
//   (q * scale16 + zero16 in float32, rounded to the input dtype).
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>

#include <vector>

#include "veloxquant/cache/exact_rows.hpp"
#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/core/uninit_vector.hpp"
#include "veloxquant/transform/packed_rows.hpp"

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
  // As update_and_fetch without materialising anything.
  void update(const Tensor& keys, const Tensor& values) override;
  // The reconstruction, fresh tensors in the input dtype (see Resident above).
  KVState state() const override;
  std::size_t nbytes() const override;
  const float* read_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const override;
  const float* read_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const override;
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
  // Quantize tokens [from, to) of one side: token t is read from the window when t < offset_ (the
  // tokens held before this update), else from input row t - offset_.
  void quantize_keys(const Tensor& input, std::int64_t from, std::int64_t to);
  void quantize_values(const Tensor& input, std::int64_t from, std::int64_t to);
  Tensor materialise(bool values) const;

  KiviConfig config_;
  std::int64_t key_quantized_ = 0, value_quantized_ = 0;
  // Per slice (b * H + h): packed codes, float16 scale and zero bits. Keys: [group][D] per slice;
  // values: [token][D / value_group] per slice.
  std::vector<PackedRows> key_codes_, value_codes_;
  std::vector<UninitVector<std::uint16_t>> key_scales_, key_zeros_, value_scales_, value_zeros_;
  ExactRows key_window_, value_window_;  // tokens [key_quantized_, offset), [value_quantized_, offset)
};

}  // namespace vq
