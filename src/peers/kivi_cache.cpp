#include "veloxquant/peers/kivi_cache.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "../core/dtype_round.hpp"
#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/core/kernel_clones.hpp"

namespace vq {

namespace {

constexpr float kF16Max = 65504.0f;

// Asymmetric min/max quantization of n values (stride apart): codes q[i * qstride] and the float16
// scale and zero, such that x ~= q * scale16 + zero16.
void quantize_group(const float* x, std::int64_t n, std::int64_t stride, int bits, std::uint8_t* q, std::int64_t qstride,
                    std::uint16_t& scale16, std::uint16_t& zero16) {
  float mn = x[0], mx = x[0];
  for (std::int64_t i = 1; i < n; ++i) {
    mn = std::min(mn, x[i * stride]);
    mx = std::max(mx, x[i * stride]);
  }
  const float qmax = static_cast<float>((1 << bits) - 1);
  scale16 = f32_to_f16((mx - mn) / qmax);
  zero16 = f32_to_f16(mn);
  const float scale = f16_to_f32(scale16), zero = f16_to_f32(zero16);
  for (std::int64_t i = 0; i < n; ++i)
    q[i * qstride] = static_cast<std::uint8_t>(scale > 0.0f ? std::clamp(std::nearbyint((x[i * stride] - zero) / scale), 0.0f, qmax) : 0.0f);
}

// Scratch floats for per-tile parameters: on the stack up to 1024 of them.
struct Floats {
  explicit Floats(std::size_t n) : p(n <= 1024 ? stack : (heap.resize(n), heap.data())) {}
  float stack[1024];
  std::vector<float> heap;
  float* p;
};

// Values: n packed rows, one token each, whose groups of gv channels have the (already float32)
// scale and zero params[(r * ng + j) * 2 + {0, 1}]; q is scratch for dim codes.
VQ_KERNEL void dequant_value_rows(const std::uint8_t* rows, std::size_t row_bytes, std::int64_t n, int dim, int bits, int gv,
                                  const float* params, std::uint8_t* q, float* out) {
  const int ng = dim / gv;
  for (std::int64_t r = 0; r < n; ++r) {
    unpack_row(rows + static_cast<std::size_t>(r) * row_bytes, dim, bits, q);
    for (int j = 0; j < ng; ++j) {
      const float sc = params[(r * ng + j) * 2], zr = params[(r * ng + j) * 2 + 1];
      const std::uint8_t* __restrict qj = q + j * gv;
      float* __restrict o = out + r * dim + j * gv;
      for (int c = 0; c < gv; ++c) o[c] = static_cast<float>(qj[c]) * sc + zr;
    }
  }
}

bool within_f16(const Tensor& t) {
  const std::vector<float> v = t.to_f32_vector();
  return std::all_of(v.begin(), v.end(), [](float x) { return std::fabs(x) <= kF16Max; });  // false for NaN too
}

}  // namespace

void KiviConfig::validate() const {
  if (bits != 2 && bits != 4) throw InvalidArgument(fmt::format("kivi: bits={} is not valid; use bits=2 or bits=4", bits));
  if (group < 1) throw InvalidArgument(fmt::format("kivi: group={} must be >= 1", group));
  if (residual < group || residual % group != 0)
    throw InvalidArgument(fmt::format("kivi: residual={} must be a positive multiple of group={} (keys are flushed a whole "
                                      "residual block of whole groups at a time)",
                                      residual, group));
}

KiviKVCache::KiviKVCache(KiviConfig config) : config_(config) { config_.validate(); }

void KiviKVCache::update(const Tensor& keys, const Tensor& values) {
  check_chunk(keys, values);
  const std::int64_t dv = values.dim(3), gv = value_group(dv);
  if (dv % gv != 0)
    throw InvalidArgument(fmt::format("kivi: value head_dim {} is not a multiple of the value group {} (group={})", dv, gv, config_.group));
  if (!within_f16(keys) || !within_f16(values))
    throw InvalidArgument("kivi: keys and values must be finite and within float16 range (|x| <= 65504): scales and zeros are float16");
  if (keys.dim(2) == 0) return;
  if (offset_ == 0) {  // a fresh layout
    const std::int64_t B = keys.dim(0), H = keys.dim(1), slices = B * H, R = config_.residual;
    key_quantized_ = value_quantized_ = 0;
    keys_buf_ = Tensor::wrap(nullptr, {B, H, 0, keys.dim(3)}, keys.dtype());
    values_buf_ = Tensor::wrap(nullptr, {B, H, 0, dv}, values.dtype());
    key_codes_.assign(static_cast<std::size_t>(slices), PackedRows(static_cast<int>(keys.dim(3)), config_.bits));
    value_codes_.assign(static_cast<std::size_t>(slices), PackedRows(static_cast<int>(dv), config_.bits));
    for (auto* v : {&key_scales_, &key_zeros_, &value_scales_, &value_zeros_}) {
      v->clear();
      v->shrink_to_fit();
      v->resize(static_cast<std::size_t>(slices));
    }
    key_window_ = ExactRows(B, H, keys.dim(3), keys.dtype(), R);
    value_window_ = ExactRows(B, H, dv, values.dtype(), R);
  }
  const std::int64_t S = keys.dim(2), end = offset_ + S, R = config_.residual;
  const std::int64_t kq = end / R * R, vq = std::max<std::int64_t>(0, end - R);
  // Capacity for `end` tokens on both sides (geometric beyond it): sized by the tokens held, so the
  // value side (end - residual quantized tokens) does not settle just past a doubling.
  const auto room = [](auto& v, std::int64_t count) {
    const auto need = static_cast<std::size_t>(count);
    if (v.capacity() < need) v.reserve(std::max(need, 2 * v.capacity()));
  };
  for (std::size_t s = 0; s < key_codes_.size(); ++s) {
    key_codes_[s].reserve(end);
    value_codes_[s].reserve(end);
    room(key_scales_[s], kq / config_.group * keys.dim(3)), room(key_zeros_[s], kq / config_.group * keys.dim(3));  // D per group
    room(value_scales_[s], end * (dv / gv)), room(value_zeros_[s], end * (dv / gv));  // D / gv per token
  }
  // Keys: a whole residual block closes at a time, taking every row of the window with it.
  if (kq > key_quantized_) {
    quantize_keys(keys, key_quantized_, kq);
    key_window_.clear();
  }
  key_window_.push(keys, std::max(kq, offset_) - offset_, end - std::max(kq, offset_));
  // Values: the oldest tokens leave the window one at a time.
  if (vq > value_quantized_) {
    quantize_values(values, value_quantized_, vq);
    value_window_.pop_front(std::min(value_window_.size(), vq - value_quantized_));
  }
  value_window_.push(values, std::max(vq, offset_) - offset_, end - std::max(vq, offset_));
  key_quantized_ = std::max(key_quantized_, kq);
  value_quantized_ = std::max(value_quantized_, vq);
  offset_ = end;
}

void KiviKVCache::quantize_keys(const Tensor& input, std::int64_t from, std::int64_t to) {
  const std::int64_t H = keys_buf_.dim(1), D = keys_buf_.dim(3), G = config_.group;
  std::vector<float> x(static_cast<std::size_t>(G * D));
  std::vector<std::uint8_t> q(static_cast<std::size_t>(G * D));
  for (std::int64_t s = 0; s < static_cast<std::int64_t>(key_codes_.size()); ++s) {
    const std::int64_t b = s / H, h = s % H;
    auto& sc = key_scales_[static_cast<std::size_t>(s)];
    auto& zr = key_zeros_[static_cast<std::size_t>(s)];
    for (std::int64_t g = from; g < to; g += G) {
      for (std::int64_t i = 0; i < G; ++i) {
        const std::int64_t t = g + i;
        if (t < offset_)
          key_window_.read_f32(s, t - key_quantized_, 1, x.data() + i * D);
        else
          to_f32(input.row(b, h, t - offset_), input.dtype(), x.data() + i * D, static_cast<std::size_t>(D));
      }
      const std::size_t at = sc.size();
      sc.resize(at + static_cast<std::size_t>(D));
      zr.resize(at + static_cast<std::size_t>(D));
      for (std::int64_t c = 0; c < D; ++c)
        quantize_group(x.data() + c, G, D, config_.bits, q.data() + c, D, sc[at + static_cast<std::size_t>(c)], zr[at + static_cast<std::size_t>(c)]);
      key_codes_[static_cast<std::size_t>(s)].append(q.data(), G);
    }
  }
}

void KiviKVCache::quantize_values(const Tensor& input, std::int64_t from, std::int64_t to) {
  const std::int64_t H = values_buf_.dim(1), D = values_buf_.dim(3), gv = value_group(D), ng = D / gv;
  std::vector<float> x(static_cast<std::size_t>(D));
  std::vector<std::uint8_t> q(static_cast<std::size_t>(D));
  for (std::int64_t s = 0; s < static_cast<std::int64_t>(value_codes_.size()); ++s) {
    const std::int64_t b = s / H, h = s % H;
    auto& sc = value_scales_[static_cast<std::size_t>(s)];
    auto& zr = value_zeros_[static_cast<std::size_t>(s)];
    for (std::int64_t t = from; t < to; ++t) {
      if (t < offset_)
        value_window_.read_f32(s, t - value_quantized_, 1, x.data());
      else
        to_f32(input.row(b, h, t - offset_), input.dtype(), x.data(), static_cast<std::size_t>(D));
      const std::size_t at = sc.size();
      sc.resize(at + static_cast<std::size_t>(ng));
      zr.resize(at + static_cast<std::size_t>(ng));
      for (std::int64_t j = 0; j < ng; ++j)
        quantize_group(x.data() + j * gv, gv, 1, config_.bits, q.data() + j * gv, 1, sc[at + static_cast<std::size_t>(j)],
                       zr[at + static_cast<std::size_t>(j)]);
      value_codes_[static_cast<std::size_t>(s)].append(q.data(), 1);
    }
  }
}

std::pair<Tensor, Tensor> KiviKVCache::update_and_fetch(const Tensor& keys, const Tensor& values) {
  update(keys, values);
  KVState s = state();
  return {std::move(s.keys), std::move(s.values)};
}

const float* KiviKVCache::read_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* out) const {
  const std::int64_t s = b * keys_buf_.dim(1) + h, D = keys_buf_.dim(3), G = config_.group;
  const std::int64_t end = t0 + n, closed_end = std::min(end, key_quantized_);
  float* o = out;
  if (t0 < closed_end) {
    const PackedRows& codes = key_codes_[static_cast<std::size_t>(s)];
    const std::uint16_t* sc = key_scales_[static_cast<std::size_t>(s)].data();
    const std::uint16_t* zr = key_zeros_[static_cast<std::size_t>(s)].data();
    Floats params(static_cast<std::size_t>(2 * D));
    float* scale = params.p;
    float* zero = params.p + D;
    for (std::int64_t t = t0; t < closed_end;) {  // one group's rows at a time, its params converted once
      const std::int64_t g = t / G, m = std::min((g + 1) * G, closed_end) - t;
      to_f32(sc + g * D, DType::F16, scale, static_cast<std::size_t>(D));
      to_f32(zr + g * D, DType::F16, zero, static_cast<std::size_t>(D));
      dequant_packed_rows(codes.row(t), codes.row_bytes(), m, static_cast<int>(D), config_.bits, scale, zero, o);
      o += m * D;
      t += m;
    }
    round_through(out, static_cast<std::size_t>((closed_end - t0) * D), keys_buf_.dtype());
  }
  const std::int64_t w0 = std::max(t0, key_quantized_);
  if (w0 < end) key_window_.read_f32(s, w0 - key_quantized_, end - w0, o);
  return out;
}

const float* KiviKVCache::read_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* out) const {
  const std::int64_t s = b * values_buf_.dim(1) + h, D = values_buf_.dim(3), gv = value_group(D), ng = D / gv;
  const std::int64_t end = t0 + n, closed_end = std::min(end, value_quantized_);
  float* o = out;
  if (t0 < closed_end) {
    const PackedRows& codes = value_codes_[static_cast<std::size_t>(s)];
    const std::uint16_t* sc = value_scales_[static_cast<std::size_t>(s)].data();
    const std::uint16_t* zr = value_zeros_[static_cast<std::size_t>(s)].data();
    constexpr std::int64_t kRows = 64;  // rows whose params are converted at a time
    Floats params(static_cast<std::size_t>(std::min(kRows, closed_end - t0) * ng * 2));
    std::uint8_t qstack[4096];
    std::vector<std::uint8_t> qheap(D > 4096 ? static_cast<std::size_t>(D) : 0);
    std::uint8_t* q = D > 4096 ? qheap.data() : qstack;
    for (std::int64_t t = t0; t < closed_end;) {
      const std::int64_t m = std::min(kRows, closed_end - t);
      for (std::int64_t i = 0; i < m * ng; ++i) {
        params.p[2 * i] = f16_to_f32(sc[t * ng + i]);
        params.p[2 * i + 1] = f16_to_f32(zr[t * ng + i]);
      }
      dequant_value_rows(codes.row(t), codes.row_bytes(), m, static_cast<int>(D), config_.bits, static_cast<int>(gv), params.p, q, o);
      o += m * D;
      t += m;
    }
    round_through(out, static_cast<std::size_t>((closed_end - t0) * D), values_buf_.dtype());
  }
  const std::int64_t w0 = std::max(t0, value_quantized_);
  if (w0 < end) value_window_.read_f32(s, w0 - value_quantized_, end - w0, o);
  return out;
}

Tensor KiviKVCache::materialise(bool values) const {
  const Tensor& layout = values ? values_buf_ : keys_buf_;
  const std::int64_t H = layout.dim(1), D = layout.dim(3);
  Tensor out = Tensor::uninitialized({layout.dim(0), H, offset_, D}, layout.dtype());
  constexpr std::int64_t kTile = 256;
  std::vector<float> f(static_cast<std::size_t>(std::min(kTile, offset_) * D));
  for (std::int64_t s = 0; s < layout.dim(0) * H; ++s)
    for (std::int64_t t0 = 0; t0 < offset_; t0 += kTile) {
      const std::int64_t n = std::min(kTile, offset_ - t0);
      if (values)
        read_value_tile(s / H, s % H, t0, n, f.data());
      else
        read_key_tile(s / H, s % H, t0, n, f.data());
      from_f32(f.data(), out.row(s / H, s % H, t0), layout.dtype(), static_cast<std::size_t>(n * D));  // rows adjacent
    }
  return out;
}

KVState KiviKVCache::state() const {
  if (offset_ == 0) return {};
  return {materialise(false), materialise(true)};
}

std::size_t KiviKVCache::nbytes() const {
  std::size_t total = (key_codes_.capacity() + value_codes_.capacity()) * sizeof(PackedRows) + key_window_.memory_bytes() +
                      value_window_.memory_bytes();
  for (const auto& c : key_codes_) total += c.memory_bytes();
  for (const auto& c : value_codes_) total += c.memory_bytes();
  for (const auto* v : {&key_scales_, &key_zeros_, &value_scales_, &value_zeros_}) {
    total += v->capacity() * sizeof((*v)[0]);
    for (const auto& x : *v) total += x.capacity() * sizeof(std::uint16_t);
  }
  return total;
}

std::int64_t KiviKVCache::trim(std::int64_t n) {
  require(n >= 0, "trim: n must be >= 0, got {}", n);
  if (n == 0 || offset_ == 0) return 0;
  throw InvalidArgument("kivi: the cache is not trimmable (its quantized tokens cannot be restored to full precision)");
}

void KiviKVCache::from_state(const KVState& state) {
  const KVState copy{state.keys.contiguous(true), state.values.contiguous(true)};  // it may be our own
  offset_ = 0;
  keys_buf_ = Tensor();
  values_buf_ = Tensor();
  key_quantized_ = value_quantized_ = 0;
  key_codes_.clear(), value_codes_.clear();
  key_window_ = ExactRows(), value_window_ = ExactRows();
  if (copy.keys.empty() && copy.values.empty()) return;
  update(copy.keys, copy.values);
}

CacheBytes KiviKVCache::stored_bytes() const {
  if (offset_ == 0) return {};
  const double bh = static_cast<double>(keys_buf_.dim(0) * keys_buf_.dim(1));
  const double dk = static_cast<double>(keys_buf_.dim(3)), dv = static_cast<double>(values_buf_.dim(3));
  const double bits = config_.bits, kq = static_cast<double>(key_quantized_), vq = static_cast<double>(value_quantized_);
  const double n = static_cast<double>(offset_);
  const double key_bytes = kq * dk * bits / 8.0 + (kq / config_.group) * dk * 4.0 + (n - kq) * dk * 2.0;
  const double value_bytes = vq * dv * bits / 8.0 + vq * (dv / value_group(values_buf_.dim(3))) * 4.0 + (n - vq) * dv * 2.0;
  const double bytes = bh * (key_bytes + value_bytes);
  return {bytes, bytes};
}

}  // namespace vq
