#include "veloxquant/peers/fp8_cache.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "peer_attention.hpp"
#include "veloxquant/core/error.hpp"

namespace vq {

namespace fp8 {

std::uint8_t e4m3_from_f32(float x) {
  if (std::isnan(x)) return 0x7F;
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::fabs(x);
  if (a >= kE4M3Max) return sign | 0x7E;  // saturate (RNE would round (448, 464] to 448 anyway)
  if (a < 0x1p-6f) {
    // Subnormal range: steps of 2^-9; q = 8 is exactly the smallest normal, whose code is 0x08.
    return sign | static_cast<std::uint8_t>(std::nearbyint(a * 512.0f));
  }
  int e = 0;
  (void)std::frexp(a, &e);                        // a = f * 2^e, f in [0.5, 1): exponent E = e - 1
  const float m = std::ldexp(a, 1 - e);           // [1, 2), exact
  const int mm = static_cast<int>(std::nearbyint((m - 1.0f) * 8.0f));  // 0..8, ties to even; 8 carries
  const int code = ((e - 1 + 7) << 3) + mm;       // codes are monotonic in the value, so a carry is +1
  return sign | static_cast<std::uint8_t>(std::min(code, 0x7E));
}

float e4m3_to_f32(std::uint8_t code) {
  const int e = (code >> 3) & 0x0F, m = code & 0x07;
  if (e == 15 && m == 7) return std::numeric_limits<float>::quiet_NaN();
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(static_cast<float>(8 + m), e - 10);
  return (code & 0x80) ? -v : v;
}

}  // namespace fp8

namespace {

// Encode one call's tensor: per (b, h) scale over its tokens; codes appended token-major, scales
// appended [b][h].
void encode_chunk(const Tensor& t, std::vector<std::uint8_t>& codes, std::vector<float>& scales) {
  const std::int64_t B = t.dim(0), H = t.dim(1), S = t.dim(2), D = t.dim(3);
  std::vector<float> x(static_cast<std::size_t>(S * D));
  std::vector<float> sc(static_cast<std::size_t>(B * H));
  const std::size_t base = codes.size();
  codes.resize(base + static_cast<std::size_t>(B * H * S * D));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t s = 0; s < S; ++s) to_f32(t.row(b, h, s), t.dtype(), x.data() + s * D, static_cast<std::size_t>(D));
      float amax = 0.0f;
      for (float v : x) amax = std::max(amax, std::fabs(v));
      float scale = amax / fp8::kE4M3Max;
      if (!(scale > 0.0f)) scale = 1.0f;
      sc[static_cast<std::size_t>(b * H + h)] = scale;
      for (std::int64_t s = 0; s < S; ++s) {
        std::uint8_t* out = codes.data() + base + static_cast<std::size_t>(((s * B + b) * H + h) * D);
        for (std::int64_t d = 0; d < D; ++d) out[d] = fp8::e4m3_from_f32(x[static_cast<std::size_t>(s * D + d)] / scale);
      }
    }
  scales.insert(scales.end(), sc.begin(), sc.end());
}

// The layout a resident cache keeps in keys_buf_ / values_buf_: shape and dtype, no storage.
Tensor layout_of(const Tensor& t) { return Tensor::wrap(nullptr, {t.dim(0), t.dim(1), 0, t.dim(3)}, t.dtype()); }

// Tokens [t0, t0 + n) of (b, h) decoded to float32 (code * its call's scale), as the dense
// reconstruction held them before: rounded through the input dtype when that is not float32.
void decode_rows(const std::vector<std::uint8_t>& codes, const std::vector<float>& scales, const std::vector<std::int64_t>& call_starts,
                 const Tensor& layout, std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* out) {
  // e4m3_to_f32 of every code, once (attention's inner loop would otherwise call ldexp per element).
  static const std::array<float, 256> kDecode = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[static_cast<std::size_t>(c)] = fp8::e4m3_to_f32(static_cast<std::uint8_t>(c));
    return t;
  }();
  const std::int64_t B = layout.dim(0), H = layout.dim(1), D = layout.dim(3);
  auto call = std::upper_bound(call_starts.begin(), call_starts.end(), t0) - call_starts.begin() - 1;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t t = t0 + i;
    while (call + 1 < static_cast<std::ptrdiff_t>(call_starts.size()) && call_starts[static_cast<std::size_t>(call + 1)] <= t) ++call;
    const float scale = scales[static_cast<std::size_t>((call * B + b) * H + h)];
    const std::uint8_t* c = codes.data() + ((t * B + b) * H + h) * D;
    for (std::int64_t d = 0; d < D; ++d) out[i * D + d] = kDecode[c[d]] * scale;
  }
  if (layout.dtype() != DType::F32) {
    std::uint16_t half[256];
    for (std::int64_t i = 0; i < n * D; i += 256) {
      const auto m = static_cast<std::size_t>(std::min<std::int64_t>(256, n * D - i));
      from_f32(out + i, half, layout.dtype(), m);
      to_f32(half, layout.dtype(), out + i, m);
    }
  }
}

Tensor decode_all(const std::vector<std::uint8_t>& codes, const std::vector<float>& scales, const std::vector<std::int64_t>& call_starts,
                  const Tensor& layout, std::int64_t offset) {
  const std::int64_t B = layout.dim(0), H = layout.dim(1), D = layout.dim(3);
  Tensor t = Tensor::uninitialized({B, H, offset, D}, layout.dtype());
  std::vector<float> y(static_cast<std::size_t>(offset * D));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      decode_rows(codes, scales, call_starts, layout, b, h, 0, offset, y.data());
      for (std::int64_t s = 0; s < offset; ++s) from_f32(y.data() + s * D, t.row(b, h, s), t.dtype(), static_cast<std::size_t>(D));
    }
  return t;
}

}  // namespace

std::pair<Tensor, Tensor> Fp8KVCache::update_and_fetch(const Tensor& keys, const Tensor& values) {
  update(keys, values);
  const KVState s = state();
  return {s.keys, s.values};
}

void Fp8KVCache::update(const Tensor& keys, const Tensor& values) {
  check_chunk(keys, values);
  require(keys.all_finite() && values.all_finite(), "fp8: keys and values must be finite (no NaN or Inf)");
  if (offset_ == 0) {
    key_codes_.clear(), value_codes_.clear(), key_scales_.clear(), value_scales_.clear(), call_starts_.clear();
    keys_buf_ = layout_of(keys);
    values_buf_ = layout_of(values);
  }
  encode_chunk(keys, key_codes_, key_scales_);  // checks are done: nothing below throws
  encode_chunk(values, value_codes_, value_scales_);
  call_starts_.push_back(offset_);
  offset_ += keys.dim(2);
}

KVState Fp8KVCache::state() const {
  if (offset_ == 0) return {};
  return {decode_all(key_codes_, key_scales_, call_starts_, keys_buf_, offset_),
          decode_all(value_codes_, value_scales_, call_starts_, values_buf_, offset_)};
}

const float* Fp8KVCache::read_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const {
  decode_rows(key_codes_, key_scales_, call_starts_, keys_buf_, b, h, t0, n, scratch);
  return scratch;
}

const float* Fp8KVCache::read_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const {
  decode_rows(value_codes_, value_scales_, call_starts_, values_buf_, b, h, t0, n, scratch);
  return scratch;
}

namespace {
// Each token's scale in [t0, t0 + n) of (b, h), times 256 (peer_attention.hpp's decode reads a
// code's value times 2^-8).
void token_scales(const std::vector<float>& scales, const std::vector<std::int64_t>& call_starts, const Tensor& layout, std::int64_t b,
                  std::int64_t h, std::int64_t t0, std::int64_t n, float* out) {
  const std::int64_t B = layout.dim(0), H = layout.dim(1);
  auto call = std::upper_bound(call_starts.begin(), call_starts.end(), t0) - call_starts.begin() - 1;
  for (std::int64_t i = 0; i < n; ++i) {
    while (call + 1 < static_cast<std::ptrdiff_t>(call_starts.size()) && call_starts[static_cast<std::size_t>(call + 1)] <= t0 + i) ++call;
    out[i] = scales[static_cast<std::size_t>((call * B + b) * H + h)] * 256.0f;
  }
}

// While head 0 works on a tile, fetch the next tile's token rows (batch b's codes of every head)
// that exist: the attention loop runs tiles outside heads.
[[maybe_unused]] void prefetch_next_tile(const std::vector<std::uint8_t>& codes, std::int64_t token_bytes, std::int64_t b_offset,
                                         std::int64_t t1, std::int64_t n, std::int64_t row_bytes) {
  const std::int64_t rows = std::min(n, static_cast<std::int64_t>(codes.size()) / token_bytes - t1);
  if (rows > 0) peer_attention::prefetch_rows(codes.data() + t1 * token_bytes + b_offset, rows, row_bytes, token_bytes);
}

// Codes are read directly when the SIMD kernels run and the tiles would be their float32 values.
[[maybe_unused]] bool codes_direct(const Tensor& layout) { return attn::simd_enabled() && layout.dtype() == DType::F32; }
}  // namespace

void Fp8KVCache::score_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, const float* queries, std::int64_t nq,
                                float* scores, float* scratch) const {
#ifdef VQ_ATTN_HAVE_AVX2
  if (codes_direct(keys_buf_)) {
    const std::int64_t B = keys_buf_.dim(0), H = keys_buf_.dim(1), D = keys_buf_.dim(3);
    float sc[256];  // the loop's tiles hold at most 256 tokens; longer ones go in pieces
    if (n > 256) {
      for (std::int64_t j = 0; j < n; j += 256) {
        const std::int64_t m = std::min<std::int64_t>(256, n - j);
        std::vector<float> part(static_cast<std::size_t>(nq * m));
        score_key_tile(b, h, t0 + j, m, queries, nq, part.data(), scratch);
        for (std::int64_t r = 0; r < nq; ++r) std::copy(part.begin() + r * m, part.begin() + (r + 1) * m, scores + r * n + j);
      }
      return;
    }
    token_scales(key_scales_, call_starts_, keys_buf_, b, h, t0, n, sc);
    if (h == 0) prefetch_next_tile(key_codes_, B * H * D, b * H * D, t0 + n, n, H * D);
    peer_attention::score_fp8(key_codes_.data() + ((t0 * B + b) * H + h) * D, B * H * D, n, D, queries, nq, scores);
    for (std::int64_t r = 0; r < nq; ++r)
      for (std::int64_t j = 0; j < n; ++j) scores[r * n + j] *= sc[j];
    return;
  }
#endif
  KVCache::score_key_tile(b, h, t0, n, queries, nq, scores, scratch);
}

void Fp8KVCache::accumulate_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, const float* weights,
                                       std::int64_t nq, float* acc, float* scratch) const {
#ifdef VQ_ATTN_HAVE_AVX2
  if (codes_direct(values_buf_)) {
    const std::int64_t B = values_buf_.dim(0), H = values_buf_.dim(1), D = values_buf_.dim(3);
    // n scales, then the weights times them: on the stack when small (no allocation per tile, and
    // nothing held between calls that nbytes() would not count).
    float small[2048];
    std::vector<float> large;
    float* w = small;
    if ((nq + 1) * n > 2048) large.resize(static_cast<std::size_t>((nq + 1) * n)), w = large.data();
    token_scales(value_scales_, call_starts_, values_buf_, b, h, t0, n, w);
    float* ws = w + n;
    for (std::int64_t r = 0; r < nq; ++r)
      for (std::int64_t j = 0; j < n; ++j) ws[r * n + j] = weights[r * n + j] * w[j];
    if (h == 0) prefetch_next_tile(value_codes_, B * H * D, b * H * D, t0 + n, n, H * D);
    peer_attention::accumulate_fp8(value_codes_.data() + ((t0 * B + b) * H + h) * D, B * H * D, n, D, ws, nq, acc);
    return;
  }
#endif
  KVCache::accumulate_value_tile(b, h, t0, n, weights, nq, acc, scratch);
}

std::int64_t Fp8KVCache::trim(std::int64_t n) {
  const std::int64_t dropped = KVCache::trim(n);
  if (offset_ == 0) {
    key_codes_.clear(), value_codes_.clear(), key_scales_.clear(), value_scales_.clear(), call_starts_.clear();
    return dropped;
  }
  const std::int64_t BH = keys_buf_.dim(0) * keys_buf_.dim(1);
  while (!call_starts_.empty() && call_starts_.back() >= offset_) call_starts_.pop_back();  // a call cut in two keeps its scale
  key_scales_.resize(call_starts_.size() * static_cast<std::size_t>(BH));
  value_scales_.resize(call_starts_.size() * static_cast<std::size_t>(BH));
  key_codes_.resize(static_cast<std::size_t>(offset_ * BH * keys_buf_.dim(3)));
  value_codes_.resize(static_cast<std::size_t>(offset_ * BH * values_buf_.dim(3)));
  return dropped;
}

void Fp8KVCache::from_state(const KVState& state) {
  refeed_state(state, [this] { key_codes_.clear(), value_codes_.clear(), key_scales_.clear(), value_scales_.clear(), call_starts_.clear(); });
}

std::size_t Fp8KVCache::nbytes() const {
  return key_codes_.capacity() + value_codes_.capacity() +
         (key_scales_.capacity() + value_scales_.capacity()) * sizeof(float) + call_starts_.capacity() * sizeof(std::int64_t);
}

CacheBytes Fp8KVCache::stored_bytes() const {
  const double bytes = static_cast<double>(key_codes_.size() + value_codes_.size()) +
                       4.0 * static_cast<double>(key_scales_.size() + value_scales_.size());
  return {bytes, bytes};
}

}  // namespace vq
