// Fp8KVCache: vLLM's `kv_cache_dtype=fp8_e4m3` for one layer, with a scale per head.
//
// E4M3 ("e4m3fn", OCP FP8): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities;
// 0x7F/0xFF are NaN; the largest finite value is 448; subnormals m * 2^-9. Encoding rounds to
// nearest, ties to even, and saturates: |x| >= 448 (and +-Inf) become +-448. Decoding is exact.
//
// Scale granularity (our choice; vLLM offers per-tensor and per-head scales): one float32 scale per
// (batch, KV head) per update_and_fetch call, s = amax / 448 over that call's tokens of that head
// (s = 1 for an all-zero head), so every call is saturation-free: x ~= e4m3(x / s) * s. A
// one-token decode step therefore pays a scale per head for that token. Results depend on how the
// host chunks its calls (unlike q8_0/q4_x and KIVI).
// Stored and billed: 1 byte per element + 4 bytes per scale (K and V each).
// Resident: the cache holds the codes, the scales and the calls' first tokens, nothing else
// (nbytes() = their vectors' capacity). attend decodes codes in registers (float32 input) or a tile
// of codes at a time;
// update_and_fetch and state() decode everything into fresh dense tensors in the input dtype on
// each call (O(offset) work, and a dense cache's bytes while the caller holds them).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "veloxquant/cache/kv_cache.hpp"

namespace vq {

namespace fp8 {
inline constexpr float kE4M3Max = 448.0f;
std::uint8_t e4m3_from_f32(float x);  // RNE, saturating; NaN -> 0x7F
float e4m3_to_f32(std::uint8_t code);  // exact; 0x7F / 0xFF -> NaN
}  // namespace fp8

class Fp8KVCache : public KVCache {
 public:
  std::pair<Tensor, Tensor> update_and_fetch(const Tensor& keys, const Tensor& values) override;
  // Appends the chunk's codes only (no dense tensors are made).
  void update(const Tensor& keys, const Tensor& values) override;
  KVState state() const override;  // decoded into fresh tensors in the input dtype
  std::int64_t trim(std::int64_t n) override;
  void from_state(const KVState& state) override;  // quantizes `state` as one chunk
  std::size_t nbytes() const override;
  CacheBytes stored_bytes() const override;
  std::string kind() const override { return "Fp8KVCache"; }
  const float* read_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const override;
  const float* read_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const override;
  // With float32 input and the SIMD kernels on: scores and weighted sums straight on the codes
  // (src/peers/peer_attention.hpp), each token's scale factored out; otherwise the KVCache
  // defaults over read_*_tile.
  void score_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, const float* queries, std::int64_t nq,
                      float* scores, float* scratch) const override;
  void accumulate_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, const float* weights, std::int64_t nq,
                             float* acc, float* scratch) const override;

  // Codes token-major [token][batch][head][d]; scales [call][batch][head]; call_starts[i] = the
  // first token of call i.
  const std::vector<std::uint8_t>& key_codes() const { return key_codes_; }
  const std::vector<std::uint8_t>& value_codes() const { return value_codes_; }
  const std::vector<float>& key_scales() const { return key_scales_; }
  const std::vector<float>& value_scales() const { return value_scales_; }
  const std::vector<std::int64_t>& call_starts() const { return call_starts_; }

 private:
  std::vector<std::uint8_t> key_codes_, value_codes_;
  std::vector<float> key_scales_, value_scales_;
  std::vector<std::int64_t> call_starts_;
};

}  // namespace vq
