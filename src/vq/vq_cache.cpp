#include "veloxquant/vq/vq_cache.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"

namespace vq {

namespace {

std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

// The high-rate code rate of a uniformly quantized Gaussian is log2(sigma * sqrt(2 pi e) / step).
constexpr double kSqrt2PiE = 4.132731354122493;

// Rotate each (2i, 2i+1) pair of every head by +angle (re-apply RoPE) or -angle (undo it),
// angle = pos * freq_i, in double.
void rope(double* x, int heads, int d, const std::vector<double>& freq, std::int64_t pos, bool undo) {
  for (std::size_t p = 0; p < freq.size(); ++p) {
    const double a = static_cast<double>(pos) * freq[p], c = std::cos(a), s = undo ? -std::sin(a) : std::sin(a);
    for (int h = 0; h < heads; ++h) {
      double* v = x + sz(h) * sz(d) + 2 * p;
      const double v0 = v[0], v1 = v[1];
      v[0] = v0 * c - v1 * s;
      v[1] = v0 * s + v1 * c;
    }
  }
}

// y = F x (double); identity when F is empty.
void forward(const VqSideTransform& t, const double* x, double* y) {
  const int n = t.n;
  if (t.identity()) {
    std::copy_n(x, n, y);
    return;
  }
  for (int i = 0; i < n; ++i) {
    double acc = 0;
    const float* row = t.fwd.data() + sz(i) * sz(n);
    for (int j = 0; j < n; ++j) acc += static_cast<double>(row[j]) * x[j];
    y[i] = acc;
  }
}

// The decoder's row: y_hat from codes, x_hat = F^-1 y_hat, keys re-rotated. Float arithmetic in
// a fixed order (the build has -ffp-contract=off), shared by the cache and vq_reconstruct so both
// produce the same bits.
void reconstruct_row(const VqSideTransform& t, const std::int16_t* q, const float* mean, float step, const std::vector<double>* freq,
                     int heads, std::int64_t pos, float* yhat, double* out) {
  const int n = t.n;
  for (int c = 0; c < n; ++c) yhat[c] = mean[c] + static_cast<float>(q[c]) * step;
  if (t.identity()) {
    for (int i = 0; i < n; ++i) out[i] = yhat[i];
  } else {
    for (int i = 0; i < n; ++i) {
      float acc = 0.0f;
      const float* row = t.inv.data() + sz(i) * sz(n);
      for (int j = 0; j < n; ++j) acc += row[j] * yhat[j];
      out[i] = acc;
    }
  }
  if (freq && !freq->empty()) rope(out, heads, n / heads, *freq, pos, /*undo=*/false);
}

// Step by reverse water-filling: the step at which the mean over coefficients of
// max(0, log2(4.13 sigma_c / step)) equals `bits` (bisection on log2 step).
float water_fill_step(const std::vector<double>& sigma, double bits) {
  double smax = 0;
  for (double s : sigma) smax = std::max(smax, s);
  if (!(smax > 0)) return 1.0f;  // constant data: any step; every code is 0
  auto rate = [&](double log_step) {
    double r = 0;
    for (double s : sigma)
      if (s > 0) r += std::max(0.0, std::log2(kSqrt2PiE * s) - log_step);
    return r / static_cast<double>(sigma.size());
  };
  double lo = std::log2(kSqrt2PiE * smax) - 64, hi = std::log2(kSqrt2PiE * smax);  // rate(hi) = 0 <= bits
  for (int i = 0; i < 100; ++i) {
    const double mid = 0.5 * (lo + hi);
    (rate(mid) > bits ? lo : hi) = mid;
  }
  return static_cast<float>(std::exp2(hi));
}

}  // namespace

void VqConfig::validate() const {
  // 10: above it the widest coefficients of stories260K would need more than the coder's +-32640
  // steps, and 10 bits already match float16's quality there.
  require(bits > 0 && bits <= 10, "vq: bits={} must be in (0, 10]", bits);
  require(calib >= 1, "vq: calib={} must be >= 1", calib);
  require(residual >= 0, "vq: residual={} must be >= 0", residual);
  require(bits + k_offset > 0 && bits + v_offset > 0 && bits + k_offset <= 10 && bits + v_offset <= 10,
          "vq: bits {} with the layer's offsets K {:+} V {:+} leaves a side outside (0, 10]", bits, k_offset, v_offset);
}

VqKVCache::VqKVCache(VqConfig config, std::shared_ptr<const VqLayerModel> layer)
    : config_(config), layer_(std::move(layer)), identity_from_data_(!layer_) {
  config_.validate();
  if (layer_)
    require(layer_->kv_heads > 0 && layer_->k.n % layer_->kv_heads == 0 && layer_->v.n % layer_->kv_heads == 0,
            "vq: inconsistent layer model");
}

void VqKVCache::reset() {
  calibrated_ = false;
  quantized_ = 0;
  k_codes_.clear();
  v_codes_.clear();
  kq_ = vq_ = SideQuant();
  encoded_size_.reset();
}

std::pair<Tensor, Tensor> VqKVCache::update_and_fetch(const Tensor& keys, const Tensor& values) {
  check_chunk(keys, values);
  require(keys.all_finite() && values.all_finite(), "vq: keys and values must be finite (NaN or Inf in the input)");
  const std::int64_t H = keys.dim(1);
  if (identity_from_data_ && offset_ == 0) layer_.reset();  // an empty cache takes the new chunk's shape
  if (layer_) {
    require(H == layer_->kv_heads && H * keys.dim(3) == layer_->k.n && H * values.dim(3) == layer_->v.n,
            "vq: the layer model expects {} heads of K dim {} and V dim {}, got {} heads of {} and {}", layer_->kv_heads,
                        layer_->k.n / layer_->kv_heads, layer_->v.n / layer_->kv_heads, H, keys.dim(3), values.dim(3));
    require(layer_->rope_freq.empty() || static_cast<std::int64_t>(layer_->rope_freq.size()) * 2 == keys.dim(3),
            "vq: the layer model's RoPE pairs do not match the key head dim");
  } else {
    auto m = std::make_shared<VqLayerModel>();
    m->kv_heads = static_cast<int>(H);
    m->head_dim = static_cast<int>(keys.dim(3));
    m->k.n = static_cast<int>(H * keys.dim(3));
    m->v.n = static_cast<int>(H * values.dim(3));
    layer_ = std::move(m);
  }
  if (offset_ == 0) reset();
  append(keys, values);
  encoded_size_.reset();
  const std::int64_t due = offset_ - config_.residual;  // tokens that have left the exact window
  if (!calibrated_ && due >= config_.calib) calibrate();
  if (calibrated_ && due > quantized_) quantize_tokens(quantized_, due);
  return {keys_buf_.slice(2, 0, offset_), values_buf_.slice(2, 0, offset_)};
}

void VqKVCache::calibrate() {
  const std::int64_t B = keys_buf_.dim(0), H = layer_->kv_heads, T = config_.calib;
  for (int side = 0; side < 2; ++side) {
    const VqSideTransform& tr = side == 0 ? layer_->k : layer_->v;
    const Tensor& buf = side == 0 ? keys_buf_ : values_buf_;
    const int n = tr.n, d = static_cast<int>(buf.dim(3));
    std::vector<double> sum(sz(n), 0.0), sum2(sz(n), 0.0), lo(sz(n), INFINITY), hi(sz(n), -INFINITY), x(sz(n)), y(sz(n));
    std::vector<float> row(sz(d));
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < T; ++t) {
        for (std::int64_t h = 0; h < H; ++h) {
          to_f32(buf.row(b, h, t), buf.dtype(), row.data(), sz(d));
          std::copy(row.begin(), row.end(), x.begin() + h * d);
        }
        if (side == 0 && !layer_->rope_freq.empty()) rope(x.data(), static_cast<int>(H), d, layer_->rope_freq, t, /*undo=*/true);
        forward(tr, x.data(), y.data());
        for (int c = 0; c < n; ++c) {
          sum[sz(c)] += y[sz(c)], sum2[sz(c)] += y[sz(c)] * y[sz(c)];
          lo[sz(c)] = std::min(lo[sz(c)], y[sz(c)]), hi[sz(c)] = std::max(hi[sz(c)], y[sz(c)]);
        }
      }
    SideQuant& s = side == 0 ? kq_ : vq_;
    std::vector<double> sigma(sz(n));
    const double cnt = static_cast<double>(B * T);
    std::vector<double> mean(sz(n));
    for (int c = 0; c < n; ++c) {
      mean[sz(c)] = sum[sz(c)] / cnt;
      sigma[sz(c)] = std::sqrt(std::max(0.0, sum2[sz(c)] / cnt - mean[sz(c)] * mean[sz(c)]));
    }
    s.step = water_fill_step(sigma, config_.bits + (side == 0 ? config_.k_offset : config_.v_offset));
    // The grid offset: the mean in quarter steps (a mean beyond the bound is absorbed by the codes).
    s.offset.resize(sz(n));
    s.mean.resize(sz(n));
    s.shift.assign(sz(n), 0);
    for (int c = 0; c < n; ++c) {
      // Codes beyond +-255 are split (vq/codec.hpp). Reach 32 sigma or 4x the calibration's
      // extremes before clamping, so data that drifts after calibration is not clipped; a generous
      // split is nearly free (its low bits are uniform while sigma spans >= 8 of its hi steps).
      const double reach = std::max({32.0 * sigma[sz(c)], 4.0 * (hi[sz(c)] - mean[sz(c)]), 4.0 * (mean[sz(c)] - lo[sz(c)])}) / s.step;
      while (s.shift[sz(c)] < kVqMaxShift && reach > vq_max_code(s.shift[sz(c)])) ++s.shift[sz(c)];
      const double m = std::nearbyint(mean[sz(c)] / (0.25 * static_cast<double>(s.step)));
      s.offset[sz(c)] = static_cast<std::int32_t>(std::clamp(m, -static_cast<double>(kVqMaxOffset), static_cast<double>(kVqMaxOffset)));
      s.mean[sz(c)] = vq_offset(s.offset[sz(c)], s.step);
    }
  }
  calibrated_ = true;
}

void VqKVCache::quantize_tokens(std::int64_t t0, std::int64_t t1) {
  const std::int64_t B = keys_buf_.dim(0), H = layer_->kv_heads;
  if (k_codes_.size() != sz(B)) k_codes_.assign(sz(B), {}), v_codes_.assign(sz(B), {});
  for (int side = 0; side < 2; ++side) {
    const VqSideTransform& tr = side == 0 ? layer_->k : layer_->v;
    Tensor& buf = side == 0 ? keys_buf_ : values_buf_;
    const SideQuant& s = side == 0 ? kq_ : vq_;
    const std::vector<double>* freq = side == 0 ? &layer_->rope_freq : nullptr;
    const int n = tr.n, d = static_cast<int>(buf.dim(3));
    std::vector<double> x(sz(n)), y(sz(n)), out(sz(n));
    std::vector<float> row(sz(d)), yhat(sz(n));
    std::vector<std::int16_t> q(sz(n));
    const double inv_step = 1.0 / static_cast<double>(s.step);
    for (std::int64_t b = 0; b < B; ++b) {
      auto& codes = (side == 0 ? k_codes_ : v_codes_)[sz(b)];
      codes.resize(sz(t1) * sz(n));
      for (std::int64_t t = t0; t < t1; ++t) {
        for (std::int64_t h = 0; h < H; ++h) {
          to_f32(buf.row(b, h, t), buf.dtype(), row.data(), sz(d));
          std::copy(row.begin(), row.end(), x.begin() + h * d);
        }
        if (freq && !freq->empty()) rope(x.data(), static_cast<int>(H), d, *freq, t, /*undo=*/true);
        forward(tr, x.data(), y.data());
        for (int c = 0; c < n; ++c) {
          const double v = std::nearbyint((y[sz(c)] - s.mean[sz(c)]) * inv_step);
          const double lim = vq_max_code(s.shift[sz(c)]);
          q[sz(c)] = static_cast<std::int16_t>(std::clamp(v, -lim, lim));
        }
        std::copy(q.begin(), q.end(), codes.begin() + t * n);
        reconstruct_row(tr, q.data(), s.mean.data(), s.step, freq, static_cast<int>(H), t, yhat.data(), out.data());
        for (std::int64_t h = 0; h < H; ++h) {
          for (int i = 0; i < d; ++i) row[sz(i)] = static_cast<float>(out[sz(h * d + i)]);
          from_f32(row.data(), buf.row(b, h, t), buf.dtype(), sz(d));
        }
      }
    }
  }
  quantized_ = t1;
}

std::int64_t VqKVCache::trim(std::int64_t n) {
  const std::int64_t dropped = KVCache::trim(n);
  if (offset_ == 0) {
    reset();
  } else if (quantized_ > offset_) {
    quantized_ = offset_;
    for (auto& c : k_codes_) c.resize(sz(offset_) * sz(layer_->k.n));
    for (auto& c : v_codes_) c.resize(sz(offset_) * sz(layer_->v.n));
  }
  if (dropped > 0) encoded_size_.reset();
  return dropped;
}

void VqKVCache::from_state(const KVState& state) {
  refeed_state(state, [this] { reset(); });
}

std::size_t VqKVCache::nbytes() const {
  std::size_t n = KVCache::nbytes();
  for (const auto* side : {&k_codes_, &v_codes_})
    for (const auto& c : *side) n += c.capacity() * sizeof(std::int16_t);
  return n;
}

VqLayerCodes VqKVCache::codes() const {
  VqLayerCodes lc;
  lc.batch = offset_ > 0 ? keys_buf_.dim(0) : 0;
  lc.tokens = quantized_;
  lc.k.n = layer_ ? layer_->k.n : 1;
  lc.v.n = layer_ ? layer_->v.n : 1;
  lc.k.step = kq_.step;
  lc.v.step = vq_.step;
  lc.k.shift = kq_.shift;
  lc.v.shift = vq_.shift;
  lc.k.offset = kq_.offset.empty() ? std::vector<std::int32_t>(sz(lc.k.n), 0) : kq_.offset;
  lc.v.offset = vq_.offset.empty() ? std::vector<std::int32_t>(sz(lc.v.n), 0) : vq_.offset;
  for (std::int64_t b = 0; b < lc.batch && quantized_ > 0; ++b) {
    lc.k.codes.insert(lc.k.codes.end(), k_codes_[sz(b)].begin(), k_codes_[sz(b)].begin() + quantized_ * lc.k.n);
    lc.v.codes.insert(lc.v.codes.end(), v_codes_[sz(b)].begin(), v_codes_[sz(b)].begin() + quantized_ * lc.v.n);
  }
  return lc;
}

std::vector<std::uint8_t> VqKVCache::encode() const {
  std::vector<std::uint8_t> out = vq_encode(codes());
  encoded_size_ = out.size();
  return out;
}

CacheBytes VqKVCache::stored_bytes() const {
  if (offset_ == 0) return {};
  if (!encoded_size_) encoded_size_ = quantized_ > 0 ? encode().size() : 0;
  const double residual = static_cast<double>(offset_ - quantized_) * static_cast<double>(keys_buf_.dim(0) * keys_buf_.dim(1)) *
                          static_cast<double>(keys_buf_.dim(3) + values_buf_.dim(3)) * 2.0;
  const double bytes = static_cast<double>(*encoded_size_) + residual;
  return {bytes, bytes};
}

std::shared_ptr<VqKVCache> VqKVCache::restore(VqConfig config, std::shared_ptr<const VqLayerModel> layer, VqLayerCodes codes,
                                              const KVState& exact) {
  auto c = std::make_shared<VqKVCache>(config, layer);
  const Tensor& ek = exact.keys;
  const Tensor& ev = exact.values;
  require(ek.dim(0) == ev.dim(0) && ek.dim(1) == ev.dim(1) && ek.dim(2) == ev.dim(2) && ek.dtype() == ev.dtype() && ek.dim(0) > 0 &&
              ek.dim(1) > 0 && ek.dim(3) > 0 && ev.dim(3) > 0,
          "vq restore: exact keys {} and values {} disagree", shape_string(ek.shape()), shape_string(ev.shape()));
  const std::int64_t B = ek.dim(0), H = ek.dim(1), Q = codes.tokens, T = Q + ek.dim(2);
  if (!c->layer_) {  // the identity sized from the data, as update_and_fetch builds it
    auto m = std::make_shared<VqLayerModel>();
    m->kv_heads = static_cast<int>(H);
    m->head_dim = static_cast<int>(ek.dim(3));
    m->k.n = static_cast<int>(H * ek.dim(3));
    m->v.n = static_cast<int>(H * ev.dim(3));
    c->layer_ = std::move(m);
  }
  const VqLayerModel& lm = *c->layer_;
  require(H == lm.kv_heads && H * ek.dim(3) == lm.k.n && H * ev.dim(3) == lm.v.n &&
              (lm.rope_freq.empty() || static_cast<std::int64_t>(lm.rope_freq.size()) * 2 == ek.dim(3)),
          "vq restore: the layer model expects {} heads of K dim {} and V dim {}, the rows have {} heads of {} and {}", lm.kv_heads,
          lm.k.n / lm.kv_heads, lm.v.n / lm.kv_heads, H, ek.dim(3), ev.dim(3));
  require(Q >= 0 && (Q == 0 || (codes.batch == B && codes.k.n == lm.k.n && codes.v.n == lm.v.n)),
          "vq restore: codes of batch {} and widths {}/{} do not match rows of batch {} and the layer's {}/{}", codes.batch, codes.k.n,
          codes.v.n, B, lm.k.n, lm.v.n);
  // The states update_and_fetch leaves: calibrated (Q > 0) once calib tokens have left the exact
  // window, and then every token that has left it is quantized (trim may leave more).
  const std::int64_t due = T - config.residual;
  require(Q > 0 ? Q >= due : due < config.calib,
          "vq restore: {} quantized tokens of {} with residual={} and calib={} is not a state the cache can be in", Q, T, config.residual,
          config.calib);
  if (Q == 0) {
    if (T > 0) c->KVCache::from_state(exact);
    return c;
  }
  for (VqSideCodes* s : {&codes.k, &codes.v}) {
    require(s->offset.size() == static_cast<std::size_t>(s->n) && s->codes.size() == sz(B) * sz(Q) * sz(s->n) &&
                (s->shift.empty() || s->shift.size() == static_cast<std::size_t>(s->n)),
            "vq restore: inconsistent code arrays");
    if (s->shift.empty()) s->shift.assign(sz(s->n), 0);
  }
  KVState recon = vq_reconstruct(codes, lm, ek.dtype());
  c->KVCache::from_state(recon);
  if (T > Q) {
    c->check_chunk(ek, ev);
    c->append(ek, ev);
  }
  for (int side = 0; side < 2; ++side) {
    VqSideCodes& s = side == 0 ? codes.k : codes.v;
    SideQuant& q = side == 0 ? c->kq_ : c->vq_;
    q.step = s.step;
    q.offset = s.offset;
    q.shift = s.shift;
    q.mean.resize(sz(s.n));
    for (int i = 0; i < s.n; ++i) q.mean[sz(i)] = vq_offset(q.offset[sz(i)], q.step);
    auto& per_batch = side == 0 ? c->k_codes_ : c->v_codes_;
    per_batch.assign(sz(B), {});
    const std::size_t per = sz(Q) * sz(s.n);
    for (std::int64_t b = 0; b < B; ++b) per_batch[sz(b)].assign(s.codes.begin() + static_cast<std::ptrdiff_t>(sz(b) * per),
                                                                 s.codes.begin() + static_cast<std::ptrdiff_t>(sz(b + 1) * per));
  }
  c->calibrated_ = true;
  c->quantized_ = Q;
  return c;
}

KVState vq_reconstruct(const VqLayerCodes& lc, const VqLayerModel& layer, DType dtype) {
  const int H = layer.kv_heads;
  require(H > 0 && lc.k.n == layer.k.n && lc.v.n == layer.v.n, "vq_reconstruct: the codes do not match the layer model");
  KVState s;
  for (int side = 0; side < 2; ++side) {
    const VqSideCodes& c = side == 0 ? lc.k : lc.v;
    const VqSideTransform& tr = side == 0 ? layer.k : layer.v;
    const int n = c.n, d = n / H;
    Tensor t = Tensor::zeros({lc.batch, H, lc.tokens, d}, dtype);
    std::vector<float> mean(sz(n)), yhat(sz(n)), row(sz(d));
    for (int i = 0; i < n; ++i) mean[sz(i)] = vq_offset(c.offset[sz(i)], c.step);
    std::vector<double> out(sz(n));
    for (std::int64_t b = 0; b < lc.batch; ++b)
      for (std::int64_t tok = 0; tok < lc.tokens; ++tok) {
        reconstruct_row(tr, c.codes.data() + sz(b * lc.tokens + tok) * sz(n), mean.data(), c.step, side == 0 ? &layer.rope_freq : nullptr,
                        H, tok, yhat.data(), out.data());
        for (int h = 0; h < H; ++h) {
          for (int i = 0; i < d; ++i) row[sz(i)] = static_cast<float>(out[sz(h * d + i)]);
          from_f32(row.data(), t.row(b, h, tok), dtype, sz(d));
        }
      }
    (side == 0 ? s.keys : s.values) = t;
  }
  return s;
}

}  // namespace vq
