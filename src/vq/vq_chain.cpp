// `vq:...,predict=on` (vq/vq_chain.hpp): the chained layer cache, its decoder and the predictors' fit.
// One set of functions (token_coefficients, predict_into, dequantize, side_rows) serves the fit, the
// cache and the decoder, so they make the same bits.
#include "veloxquant/vq/vq_chain.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>

#include <fmt/format.h>

#include "quantizer.hpp"
#include "reconstruct_kernels.hpp"
#include "transform.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/core/kernel_clones.hpp"

namespace vq {

namespace {

std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

// p = bias + sum_j in[j] * w[j], for all outs outputs at once: w is [ins + 1][outs] (row j the
// weights of input j, the bias row last). Float32, each output summed in input order: the compiled
// clones (AVX2, baseline) make the same bits, vectorised over the outputs.
VQ_KERNEL void predict_into(const float* __restrict w, int outs, int ins, const float* __restrict in, float* __restrict p) {
  const float* bias = w + sz(ins) * sz(outs);
  int c0 = 0;
  for (; c0 + 32 <= outs; c0 += 32) {  // 32 outputs held in registers across the inputs
    float a[32];
    for (int c = 0; c < 32; ++c) a[c] = bias[c0 + c];
    for (int j = 0; j < ins; ++j) {
      const float x = in[j];
      const float* __restrict wj = w + sz(j) * sz(outs) + sz(c0);
      for (int c = 0; c < 32; ++c) a[c] += wj[c] * x;
    }
    for (int c = 0; c < 32; ++c) p[c0 + c] = a[c];
  }
  for (int c = c0; c < outs; ++c) p[c] = bias[c];
  for (int j = 0; j < ins && c0 < outs; ++j) {
    const float x = in[j];
    const float* __restrict wj = w + sz(j) * sz(outs);
    for (int c = c0; c < outs; ++c) p[c] += wj[c] * x;
  }
}

// Token t's coefficients y (n doubles) of one side from its rows (row(h): head h's d floats), keys
// un-rotated at position t (rope: the keys' table, or null). x: heads x d doubles of scratch.
template <class Row>
void token_coefficients(const VqLayerModel& m, int side, const VqRopeTable* rope, std::int64_t t, Row row, double* x, double* y) {
  const int H = m.kv_heads, d = m.head_dim;
  for (int h = 0; h < H; ++h) std::copy_n(row(h), d, x + sz(h) * sz(d));
  if (side == 0 && rope) vq_transform::vq_unrope(x, H, d, rope->at(t), m.rope_freq.size());
  vq_transform::vq_forward(side == 0 ? m.k : m.v, x, y);
}

inline float dequantize(float p, std::int32_t q, float step, float mean) { return p + std::fma(static_cast<float>(q), step, mean); }

// One side's rows of tokens [t0, t0 + count) of one sequence from their yhat (y: the side's first
// coefficient of token t0's row, rows y_stride apart): out(h) receives head h's count rows of d
// (contiguous), keys re-rotated at their positions. The tiled kernel where the transform has its
// column blocks (reconstruct_kernels.hpp: the per-token path's bits), else token by token.
template <class Out>
void side_rows(const VqSideTransform& tr, const std::vector<double>* freq, int heads, int d, const float* y, std::size_t y_stride, std::int64_t t0,
               std::int64_t count, Out out) {
  if (count <= 0) return;
  const int span = tr.col_span, n = tr.n;
  if (span == n && tr.inv_t.size() == sz(n) * sz(n) && vq_all_head_rows_avx512()) {
    // A transform mixing every head: one [count x n] x [n x n] product for all heads on AVX-512
    // (inv_t is vq_whole_row_matrix's layout), the same bits as head by head.
    const auto rope = freq ? vq_rope_table(*freq, t0 + count) : nullptr;
    std::vector<float> yc(sz(count) * sz(n)), acc(sz(count) * sz(n)), rows(sz(count) * sz(n));
    for (std::int64_t t = 0; t < count; ++t) std::copy_n(y + sz(t) * y_stride, n, yc.begin() + t * n);
    vq_all_head_rows(tr.inv_t.data(), n, heads, yc.data(), count, rope.get(), t0, acc.data(), rows.data());
    for (int h = 0; h < heads; ++h) std::copy_n(rows.begin() + h * count * d, count * d, out(h));
    return;
  }
  if (!tr.identity() && !tr.inv_cols.empty() && sz(span) * sz(heads) * sz(d) == tr.inv_cols.size()) {
    const auto rope = freq ? vq_rope_table(*freq, t0 + count) : nullptr;
    for (int h = 0; h < heads; ++h)
      vq_head_rows(tr.inv_cols.data() + sz(h) * sz(span) * sz(d), span, d, y + (span == tr.n ? 0 : sz(h) * sz(d)), y_stride, count, rope.get(), t0,
                   out(h));
    return;
  }
  std::vector<float> acc(sz(d));
  for (std::int64_t t = 0; t < count; ++t)
    for (int h = 0; h < heads; ++h)
      vq_transform::reconstruct_head(tr.identity() ? nullptr : tr.inv.data(), tr.n, y + sz(t) * y_stride, h, d, freq, t0 + t, acc.data(),
                                     out(h) + sz(t) * sz(d));
}

// The inputs of V's prediction: own K yhat then the previous layer's row.
void v_inputs(const float* own_k, int n_k, const float* prev, int n_prev, float* in) {
  std::copy_n(own_k, n_k, in);
  if (n_prev > 0) std::copy_n(prev, n_prev, in + n_k);
}

// Solves (A + ridge I) x = b for each column of b (A symmetric positive definite, n x n; b n x m),
// by Cholesky in double. Returns x (n x m).
std::vector<double> ridge_solve(std::vector<double> a, int n, const std::vector<double>& b, int m, double ridge) {
  for (int i = 0; i < n; ++i) a[sz(i) * sz(n) + sz(i)] += ridge;
  for (int j = 0; j < n; ++j) {
    double s = a[sz(j) * sz(n) + sz(j)];
    for (int k = 0; k < j; ++k) s -= a[sz(j) * sz(n) + sz(k)] * a[sz(j) * sz(n) + sz(k)];
    const double ljj = std::sqrt(std::max(s, 1e-300));
    a[sz(j) * sz(n) + sz(j)] = ljj;
    for (int i = j + 1; i < n; ++i) {
      double t = a[sz(i) * sz(n) + sz(j)];
      for (int k = 0; k < j; ++k) t -= a[sz(i) * sz(n) + sz(k)] * a[sz(j) * sz(n) + sz(k)];
      a[sz(i) * sz(n) + sz(j)] = t / ljj;
    }
  }
  std::vector<double> x(b);
  for (int col = 0; col < m; ++col) {
    for (int i = 0; i < n; ++i) {  // L z = b
      double t = x[sz(i) * sz(m) + sz(col)];
      for (int k = 0; k < i; ++k) t -= a[sz(i) * sz(n) + sz(k)] * x[sz(k) * sz(m) + sz(col)];
      x[sz(i) * sz(m) + sz(col)] = t / a[sz(i) * sz(n) + sz(i)];
    }
    for (int i = n - 1; i >= 0; --i) {  // L^T x = z
      double t = x[sz(i) * sz(m) + sz(col)];
      for (int k = i + 1; k < n; ++k) t -= a[sz(k) * sz(n) + sz(i)] * x[sz(k) * sz(m) + sz(col)];
      x[sz(i) * sz(m) + sz(col)] = t / a[sz(i) * sz(n) + sz(i)];
    }
  }
  return x;
}

// The moments of a least-squares fit with a bias: sum of x x^T and x y^T over rows, x = [in, 1].
void moments(const std::vector<double>& in, int ins, const std::vector<double>& target, int outs, std::vector<double>& xx, std::vector<double>& xy) {
  const std::size_t rows = in.size() / sz(std::max(ins, 1));
  const int n = ins + 1;
  xx.assign(sz(n) * sz(n), 0.0), xy.assign(sz(n) * sz(outs), 0.0);
  std::vector<double> x(sz(n));
  for (std::size_t r = 0; r < rows; ++r) {
    for (int j = 0; j < ins; ++j) x[sz(j)] = in[r * sz(ins) + sz(j)];
    x[sz(ins)] = 1.0;
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j <= i; ++j) xx[sz(i) * sz(n) + sz(j)] += x[sz(i)] * x[sz(j)];
      for (int c = 0; c < outs; ++c) xy[sz(i) * sz(outs) + sz(c)] += x[sz(i)] * target[r * sz(outs) + sz(c)];
    }
  }
  for (int i = 0; i < n; ++i)
    for (int j = i + 1; j < n; ++j) xx[sz(i) * sz(n) + sz(j)] = xx[sz(j) * sz(n) + sz(i)];
}

// Exact coefficients of every token of a state ([1, H, T, D]): [T][n] for K (un-rotated) or V.
std::vector<double> coefficients(const KVState& s, const VqLayerModel& m, int side) {
  const Tensor& in = side == 0 ? s.keys : s.values;
  const VqSideTransform& tr = side == 0 ? m.k : m.v;
  require(in.dtype() == DType::F32 && in.dim(0) == 1 && in.dim(1) == m.kv_heads && in.dim(3) == m.head_dim,
          "fit_vq_chain: a sample of shape {} does not fit the layer ({} KV heads of {})", shape_string(in.shape()), m.kv_heads, m.head_dim);
  const std::int64_t T = in.dim(2);
  const auto tab = side == 0 && !m.rope_freq.empty() ? vq_rope_table(m.rope_freq, T) : nullptr;
  std::vector<double> out(sz(T) * sz(tr.n)), x(sz(tr.n));
  for (std::int64_t t = 0; t < T; ++t)
    token_coefficients(m, side, tab.get(), t, [&](int h) { return reinterpret_cast<const float*>(in.row(0, h, t)); }, x.data(),
                       out.data() + sz(t) * sz(tr.n));
  return out;
}

}  // namespace

std::vector<VqChainPredictor> fit_vq_chain(const std::vector<std::vector<KVState>>& samples,
                                           const std::vector<std::shared_ptr<const VqLayerModel>>& layers) {
  require(!samples.empty(), "fit_vq_chain: no samples");
  const std::size_t L = layers.size();
  for (const auto& s : samples) require(s.size() == L, "fit_vq_chain: a sample of {} layers for {} layer models", s.size(), L);
  std::vector<VqChainPredictor> out(L);
  std::vector<double> prev_k, prev_v;  // the previous layer's coefficients, all samples' tokens
  int prev_nk = 0, prev_nv = 0;
  for (std::size_t l = 0; l < L; ++l) {
    require(layers[l] != nullptr, "fit_vq_chain: layer {} has no model", l);
    const VqLayerModel& m = *layers[l];
    std::vector<double> yk, yv;
    for (const auto& s : samples) {
      const auto k = coefficients(s[l], m, 0), v = coefficients(s[l], m, 1);
      yk.insert(yk.end(), k.begin(), k.end());
      yv.insert(yv.end(), v.begin(), v.end());
    }
    VqChainPredictor& p = out[l];
    p.n_k = m.k.n, p.n_v = m.v.n, p.n_prev = l == 0 ? 0 : prev_nk + prev_nv, p.n_prev_k = l == 0 ? 0 : prev_nk;
    p.memo = std::make_shared<VqChainWeightMemo>();
    const std::size_t rows = yk.size() / sz(p.n_k);
    std::vector<double> prev(rows * sz(p.n_prev));
    for (std::size_t r = 0; r < rows && p.n_prev > 0; ++r) {
      std::copy_n(prev_k.begin() + static_cast<std::ptrdiff_t>(r * sz(prev_nk)), prev_nk, prev.begin() + static_cast<std::ptrdiff_t>(r * sz(p.n_prev)));
      std::copy_n(prev_v.begin() + static_cast<std::ptrdiff_t>(r * sz(prev_nv)), prev_nv,
                  prev.begin() + static_cast<std::ptrdiff_t>(r * sz(p.n_prev) + sz(prev_nk)));
    }
    p.rows = static_cast<double>(rows);
    if (p.n_prev > 0) moments(prev, p.n_prev, yk, p.n_k, p.k_moments, p.k_cross);
    std::vector<double> vin(rows * sz(p.n_k + p.n_prev));
    for (std::size_t r = 0; r < rows; ++r) {
      std::copy_n(yk.begin() + static_cast<std::ptrdiff_t>(r * sz(p.n_k)), p.n_k, vin.begin() + static_cast<std::ptrdiff_t>(r * sz(p.n_k + p.n_prev)));
      if (p.n_prev > 0)
        std::copy_n(prev.begin() + static_cast<std::ptrdiff_t>(r * sz(p.n_prev)), p.n_prev,
                    vin.begin() + static_cast<std::ptrdiff_t>(r * sz(p.n_k + p.n_prev) + sz(p.n_k)));
    }
    moments(vin, p.n_k + p.n_prev, yv, p.n_v, p.v_moments, p.v_cross);
    prev_k = std::move(yk), prev_v = std::move(yv), prev_nk = p.n_k, prev_nv = p.n_v;
  }
  return out;
}

std::vector<float> vq_chain_weights(const std::vector<double>& xx, const std::vector<double>& xy, int ins, int outs, double rows,
                                    const std::vector<float>& input_steps) {
  const int n = ins + 1;
  require(xx.size() == sz(n) * sz(n) && xy.size() == sz(n) * sz(outs) && input_steps.size() == sz(ins) && rows > 0,
          "vq_chain_weights: moments of {} inputs and {} outputs do not fit", ins, outs);
  std::vector<double> a(xx);
  double energy = 0;
  for (int j = 0; j < ins; ++j) {
    const double mean = xx[sz(j) * sz(n) + sz(ins)] / rows;
    const double var = std::max(0.0, xx[sz(j) * sz(n) + sz(j)] / rows - mean * mean);
    const double step = input_steps[sz(j)];
    a[sz(j) * sz(n) + sz(j)] += rows * std::min(step * step / 12.0, var);
    energy += xx[sz(j) * sz(n) + sz(j)];
  }
  // A ridge of 1e-9 of the inputs' mean energy keeps a constant input (a padded head's zero channels) solvable.
  const double ridge = 1e-9 * std::max(energy / std::max(1, ins), 1e-30);
  const std::vector<double> sol = ridge_solve(std::move(a), n, xy, outs, ridge);
  std::vector<float> w(sol.size());  // sol is [ins + 1][outs] already: the layout predict_into reads
  for (std::size_t i = 0; i < sol.size(); ++i) w[i] = static_cast<float>(sol[i]);
  return w;
}

namespace {
// The input steps of K's prediction (the previous layer's K step for its K coefficients, then its V
// step) and of V's (the own K step, then the same).
std::vector<float> input_steps(int n_own_k, float own_k_step, int prev_k, float prev_k_step, int prev_v, float prev_v_step) {
  std::vector<float> s(sz(n_own_k), own_k_step);
  s.insert(s.end(), sz(prev_k), prev_k_step);
  s.insert(s.end(), sz(prev_v), prev_v_step);
  return s;
}
}  // namespace

struct VqChainWeightMemo {
  std::mutex mu;
  std::map<std::array<int, 4>, std::shared_ptr<const std::vector<float>>> weights;
};

namespace {
// A positive step's bin (an eighth of its octave's mantissa range) and the step at its middle.
int step_bin(float step) {
  int e = 0;
  const float m = std::frexp(step, &e);  // step = m 2^e, m in [0.5, 1)
  return e * 8 + std::clamp(static_cast<int>((m - 0.5f) * 16.0f), 0, 7);
}
float bin_step(int bin) {
  const int e = bin >= 0 ? bin / 8 : -((-bin + 7) / 8), k = bin - e * 8;
  return std::ldexp(0.5f + (static_cast<float>(k) + 0.5f) / 16.0f, e);
}
}  // namespace

std::shared_ptr<const std::vector<float>> VqChainPredictor::weights(int side, float own_k_step, float prev_k_step, float prev_v_step) const {
  require(memo != nullptr, "vq chained layer: a predictor without its memo (make it with fit_vq_chain)");
  const std::array<int, 4> key{side, side == 1 ? step_bin(own_k_step) : 0, n_prev > 0 ? step_bin(prev_k_step) : 0, n_prev > 0 ? step_bin(prev_v_step) : 0};
  std::lock_guard<std::mutex> lock(memo->mu);
  if (memo->weights.size() >= kVqChainMemo && !memo->weights.contains(key)) memo->weights.clear();  // holders keep theirs
  auto& slot = memo->weights[key];
  if (!slot) {
    const float ks = bin_step(key[1]), pks = bin_step(key[2]), pvs = bin_step(key[3]);
    slot = std::make_shared<const std::vector<float>>(
        side == 0 ? vq_chain_weights(k_moments, k_cross, n_prev, n_k, rows, input_steps(0, 0, n_prev_k, pks, n_prev - n_prev_k, pvs))
                  : vq_chain_weights(v_moments, v_cross, n_k + n_prev, n_v, rows, input_steps(n_k, ks, n_prev_k, pks, n_prev - n_prev_k, pvs)));
  }
  return slot;
}

VqChainKVCache::VqChainKVCache(VqConfig config, std::shared_ptr<const VqLayerModel> layer, std::shared_ptr<const VqChainPredictor> predictor,
                               std::shared_ptr<const VqChainKVCache> previous)
    : config_(config), layer_(std::move(layer)), pred_(std::move(predictor)), prev_(std::move(previous)) {
  config_.validate();
  require(config_.residual == 0 && config_.sinks == 0 && !config_.coded,
          "vq: predict=on is a storage setting: it takes no residual=, sinks= or resident=coded");
  require(layer_ != nullptr && pred_ != nullptr, "vq: predict=on needs the model's layer transforms and predictors");
  n_k_ = layer_->k.n, n_v_ = layer_->v.n;
  require(pred_->n_k == n_k_ && pred_->n_v == n_v_, "vq: predict=on: the predictor is of {} + {} coefficients, the layer of {} + {}", pred_->n_k,
          pred_->n_v, n_k_, n_v_);
  require(pred_->n_prev == (prev_ ? prev_->coefficients() : 0), "vq: predict=on: the predictor reads {} coefficients of the layer before, which has {}",
          pred_->n_prev, prev_ ? prev_->coefficients() : 0);
}

void VqChainKVCache::forget() {
  calibrated_ = false;
  quantized_ = 0;
  kq_ = {}, vq_ = {};
  k_weights_.reset(), v_weights_.reset();
  codes_k_.clear(), codes_v_.clear(), yhat_.clear();
  encoded_at_ = -1;
}

const float* VqChainKVCache::yhat_row(std::int64_t b, std::int64_t t) const {
  return yhat_.at(sz(b)).data() + sz(t) * sz(n_k_ + n_v_);
}

std::pair<Tensor, Tensor> VqChainKVCache::update_and_fetch(const Tensor& keys, const Tensor& values) {
  check_chunk(keys, values);
  require(keys.dtype() == DType::F32, "vq: predict=on takes float32 K/V, not {}", dtype_name(keys.dtype()));
  const int H = layer_->kv_heads, d = layer_->head_dim;
  require(keys.dim(1) == H && keys.dim(3) == d && values.dim(3) == d, "vq: keys {} do not fit the layer model ({} KV heads of {})",
          shape_string(keys.shape()), H, d);
  require(keys.all_finite() && values.all_finite(), "vq: K/V hold NaN or Inf; cache unchanged");
  if (offset_ == 0) forget();
  const std::int64_t B = keys.dim(0), S = keys.dim(2), T1 = offset_ + S;
  const bool calibrate_now = !calibrated_ && T1 >= config_.calib;
  const std::int64_t q0 = quantized_, q1 = calibrated_ || calibrate_now ? T1 : quantized_;
  if (q1 > q0 && prev_)
    require(prev_->quantized_tokens() >= q1 && prev_->offset() >= q1 && prev_->batch() == B,
            "vq: predict=on: this layer quantizes tokens up to {} of {} sequences, but the layer before has quantized {} of {} (feed the "
            "layers in order); cache unchanged",
            q1, B, prev_->quantized_tokens(), prev_->batch());

  // Token t (held or in the chunk) of batch b, side s: its exact rows, keys un-rotated, transformed into y.
  const std::vector<double>* freq = layer_->rope_freq.empty() ? nullptr : &layer_->rope_freq;
  const auto tab = freq ? vq_rope_table(*freq, T1) : nullptr;
  std::vector<double> xbuf(sz(H) * sz(d));
  const auto transformed = [&](int s, std::int64_t b, std::int64_t t, double* y) {
    const Tensor& in = s == 0 ? keys : values;
    const Tensor& held = s == 0 ? keys_buf_ : values_buf_;
    token_coefficients(*layer_, s, tab.get(), t,
                       [&](int h) { return reinterpret_cast<const float*>(t < offset_ ? held.row(b, h, t) : in.row(b, h, t - offset_)); },
                       xbuf.data(), y);
  };

  // --- compute (a refusal leaves the cache unchanged) ---
  Side nk = kq_, nv = vq_;
  std::shared_ptr<const std::vector<float>> kwp = k_weights_, vwp = v_weights_;  // the weights for this cache's steps (set at calibration)
  const std::int64_t count = q1 - q0;
  const int n = n_k_ + n_v_, np = pred_->n_prev;
  std::vector<std::vector<std::int16_t>> ck(sz(B)), cv(sz(B));
  std::vector<std::vector<float>> yh(sz(B));
  if (count > 0) {
    std::vector<float> pk(sz(n_k_)), pv(sz(n_v_)), vin(sz(n_k_ + np));
    std::vector<double> yk(sz(n_k_)), yv(sz(n_v_));
    const double lim = vq_max_code(kVqMaxShift);
    const auto code = [&](double e, float mean, float step, int s, std::int64_t t, int c) {
      const double v = vq_transform::round_even((e - static_cast<double>(mean)) / static_cast<double>(step));
      if (!(std::fabs(v) <= lim))
        throw InvalidArgument(fmt::format("vq: token {} {} coefficient {} lies {:.3g} steps from its prediction, beyond the codes' reach of +-{} "
                                          "(bits={} is too fine for this data); cache unchanged",
                                          t, s == 0 ? "K" : "V", c, v, vq_max_code(kVqMaxShift), config_.bits));
      return static_cast<std::int32_t>(v);
    };
    const auto k_pred = [&](std::int64_t b, std::int64_t t, float* p) {
      if (np == 0) {
        std::fill_n(p, n_k_, 0.0f);
        return;
      }
      predict_into(kwp->data(), n_k_, np, prev_->yhat_row(b, t), p);
    };
    const auto v_pred = [&](std::int64_t b, std::int64_t t, const float* own_k, float* p) {
      v_inputs(own_k, n_k_, np > 0 ? prev_->yhat_row(b, t) : nullptr, np, vin.data());
      predict_into(vwp->data(), n_v_, n_k_ + np, vin.data(), p);
    };
    if (calibrate_now) {
      // Closed loop over the calibration tokens: K's residuals, K calibrated and quantized, then
      // V's residuals from those reconstructions.
      const std::int64_t C = config_.calib;
      const float pks = prev_ ? prev_->key_step() : 1.0f, pvs = prev_ ? prev_->value_step() : 1.0f;
      if (np > 0) kwp = pred_->weights(0, 0, pks, pvs);
      std::vector<double> ek(sz(B * C) * sz(n_k_)), ev(sz(B * C) * sz(n_v_));
      std::vector<float> khat(sz(B * C) * sz(n_k_));
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t t = 0; t < C; ++t) {
          transformed(0, b, t, yk.data());
          k_pred(b, t, pk.data());
          for (int c = 0; c < n_k_; ++c) ek[sz(b * C + t) * sz(n_k_) + sz(c)] = yk[sz(c)] - static_cast<double>(pk[sz(c)]);
        }
      std::vector<std::uint8_t> shift, width;
      vq_quant::calibrate_side(ek, n_k_, config_.bits + config_.k_offset, nk.step, nk.offset, nk.mean, shift, width);
      vwp = pred_->weights(1, nk.step, pks, pvs);
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t t = 0; t < C; ++t) {
          k_pred(b, t, pk.data());
          float* kh = khat.data() + sz(b * C + t) * sz(n_k_);
          for (int c = 0; c < n_k_; ++c)
            kh[c] = dequantize(pk[sz(c)], code(ek[sz(b * C + t) * sz(n_k_) + sz(c)], nk.mean[sz(c)], nk.step, 0, t, c), nk.step, nk.mean[sz(c)]);
          transformed(1, b, t, yv.data());
          v_pred(b, t, kh, pv.data());
          for (int c = 0; c < n_v_; ++c) ev[sz(b * C + t) * sz(n_v_) + sz(c)] = yv[sz(c)] - static_cast<double>(pv[sz(c)]);
        }
      vq_quant::calibrate_side(ev, n_v_, config_.bits + config_.v_offset, nv.step, nv.offset, nv.mean, shift, width);
    }
    for (std::int64_t b = 0; b < B; ++b) {
      ck[sz(b)].resize(sz(count) * sz(n_k_));
      cv[sz(b)].resize(sz(count) * sz(n_v_));
      yh[sz(b)].resize(sz(count) * sz(n));
      for (std::int64_t t = q0; t < q1; ++t) {
        float* row = yh[sz(b)].data() + sz(t - q0) * sz(n);
        transformed(0, b, t, yk.data());
        k_pred(b, t, pk.data());
        for (int c = 0; c < n_k_; ++c) {
          const std::int32_t q = code(yk[sz(c)] - static_cast<double>(pk[sz(c)]), nk.mean[sz(c)], nk.step, 0, t, c);
          ck[sz(b)][sz(t - q0) * sz(n_k_) + sz(c)] = static_cast<std::int16_t>(q);
          row[c] = dequantize(pk[sz(c)], q, nk.step, nk.mean[sz(c)]);
        }
        transformed(1, b, t, yv.data());
        v_pred(b, t, row, pv.data());
        for (int c = 0; c < n_v_; ++c) {
          const std::int32_t q = code(yv[sz(c)] - static_cast<double>(pv[sz(c)]), nv.mean[sz(c)], nv.step, 1, t, c);
          cv[sz(b)][sz(t - q0) * sz(n_v_) + sz(c)] = static_cast<std::int16_t>(q);
          row[n_k_ + c] = dequantize(pv[sz(c)], q, nv.step, nv.mean[sz(c)]);
        }
      }
    }
  }

  // --- commit ---
  append(keys, values);
  if (calibrate_now) kq_ = std::move(nk), vq_ = std::move(nv), k_weights_ = std::move(kwp), v_weights_ = std::move(vwp), calibrated_ = true;
  if (count > 0) {
    codes_k_.resize(sz(B)), codes_v_.resize(sz(B)), yhat_.resize(sz(B));
    for (std::int64_t b = 0; b < B; ++b) {
      codes_k_[sz(b)].insert(codes_k_[sz(b)].end(), ck[sz(b)].begin(), ck[sz(b)].end());
      codes_v_[sz(b)].insert(codes_v_[sz(b)].end(), cv[sz(b)].begin(), cv[sz(b)].end());
      yhat_[sz(b)].insert(yhat_[sz(b)].end(), yh[sz(b)].begin(), yh[sz(b)].end());
      const float* y = yhat_row(b, q0);
      side_rows(layer_->k, freq, H, d, y, sz(n), q0, count, [&](int h) { return reinterpret_cast<float*>(keys_buf_.row(b, h, q0)); });
      side_rows(layer_->v, nullptr, H, d, y + n_k_, sz(n), q0, count, [&](int h) { return reinterpret_cast<float*>(values_buf_.row(b, h, q0)); });
    }
    quantized_ = q1;
  }
  return {keys_buf_.slice(2, 0, offset_), values_buf_.slice(2, 0, offset_)};
}

std::int64_t VqChainKVCache::trim(std::int64_t n) {
  const std::int64_t dropped = KVCache::trim(n);
  if (dropped == 0) return 0;
  if (offset_ < config_.calib) {
    // The calibration's tokens are gone: what is left is held as exact rows (the reconstructions
    // they are), and the next tokens to reach `calib` calibrate again.
    forget();
    return dropped;
  }
  quantized_ = std::min(quantized_, offset_);
  for (auto& c : codes_k_) c.resize(sz(quantized_) * sz(n_k_));
  for (auto& c : codes_v_) c.resize(sz(quantized_) * sz(n_v_));
  for (auto& y : yhat_) y.resize(sz(quantized_) * sz(n_k_ + n_v_));
  encoded_at_ = -1;
  return dropped;
}

void VqChainKVCache::from_state(const KVState& state) {
  refeed_state(state, [this] { forget(); });
}

std::size_t VqChainKVCache::nbytes() const {
  std::size_t n = KVCache::nbytes();
  for (const auto& c : codes_k_) n += c.capacity() * sizeof(std::int16_t);
  for (const auto& c : codes_v_) n += c.capacity() * sizeof(std::int16_t);
  for (const auto& y : yhat_) n += y.capacity() * sizeof(float);
  n += (kq_.offset.capacity() + vq_.offset.capacity()) * sizeof(std::int32_t) + (kq_.mean.capacity() + vq_.mean.capacity()) * sizeof(float);
  return n;
}

VqLayerCodes VqChainKVCache::codes() const {
  VqLayerCodes c;
  c.batch = quantized_ > 0 ? batch() : 0;
  c.tokens = quantized_;
  c.k.n = n_k_, c.v.n = n_v_;
  if (quantized_ == 0) {  // nothing quantized yet: no rows, a neutral calibration
    c.k.offset.assign(sz(n_k_), 0), c.v.offset.assign(sz(n_v_), 0);
    return c;
  }
  for (int s = 0; s < 2; ++s) {
    VqSideCodes& side = s == 0 ? c.k : c.v;
    const Side& q = s == 0 ? kq_ : vq_;
    side.step = q.step;
    side.offset = q.offset;
    for (const auto& rows : s == 0 ? codes_k_ : codes_v_) side.codes.insert(side.codes.end(), rows.begin(), rows.end());
    // The coder's splits from the codes themselves (a later token may have needed a wider one than calibration's).
    std::vector<int> amax(sz(side.n), 0);
    for (std::size_t r = 0; r < side.codes.size(); r += sz(side.n))
      for (int i = 0; i < side.n; ++i) amax[sz(i)] = std::max(amax[sz(i)], std::abs(static_cast<int>(side.codes[r + sz(i)])));
    side.shift.assign(sz(side.n), 0);
    for (int i = 0; i < side.n; ++i)
      while (amax[sz(i)] > vq_max_code(side.shift[sz(i)])) ++side.shift[sz(i)];
  }
  return c;
}

std::vector<std::uint8_t> VqChainKVCache::encode() const {
  std::vector<std::uint8_t> out{kVqChainTag};
  const auto body = vq_encode(codes(), RansKernel::Auto, 7);
  out.insert(out.end(), body.begin(), body.end());
  encoded_at_ = quantized_, encoded_size_ = out.size();
  return out;
}

CacheBytes VqChainKVCache::stored_bytes() const {
  if (encoded_at_ != quantized_) (void)encode();
  const double exact = static_cast<double>((offset_ - quantized_) * (offset_ > 0 ? batch() * kv_heads() * (key_dim() + value_dim()) : 0)) * 4.0;
  const double b = static_cast<double>(encoded_size_) + exact;
  return {b, b};
}

VqChainDecoded vq_chain_decode(std::span<const std::uint8_t> bytes, const VqLayerModel& layer, const VqChainPredictor& pred,
                               const VqChainDecoded* previous, std::uint64_t max_codes) {
  if (bytes.empty() || bytes[0] != kVqChainTag) throw FormatError("vq chained layer: the record does not start with its tag");
  const VqLayerCodes c = vq_decode(bytes.subspan(1), max_codes);
  const int n_k = layer.k.n, n_v = layer.v.n, n = n_k + n_v, np = pred.n_prev, H = layer.kv_heads, d = layer.head_dim;
  require(pred.n_k == n_k && pred.n_v == n_v, "vq chained layer: the predictor does not fit the layer");
  if (c.tokens > 0 && (c.k.n != n_k || c.v.n != n_v))
    throw FormatError(fmt::format("vq chained layer: {} + {} coefficients per row where the layer has {} + {}", c.k.n, c.v.n, n_k, n_v));
  require((np > 0) == (previous != nullptr), "vq chained layer: the previous layer's reconstructions are {}",
          np > 0 ? "missing" : "given to the first layer");
  if (np > 0 && c.tokens > 0) {
    require(previous->n_k + previous->n_v == np, "vq chained layer: the layer before has {} coefficients, the predictor reads {}",
            previous->n_k + previous->n_v, np);
    // What the bytes claim against the layer before: a record that does not fit it is malformed.
    if (previous->yhat.size() != sz(c.batch))
      throw FormatError(fmt::format("vq chained layer: {} sequences where the layer before has {}", c.batch, previous->yhat.size()));
    for (const auto& rows : previous->yhat)
      if (rows.size() < sz(c.tokens) * sz(np))
        throw FormatError(fmt::format("vq chained layer: {} tokens where the layer before holds {}", c.tokens, rows.size() / sz(np)));
  }
  VqChainDecoded out;
  out.n_k = n_k, out.n_v = n_v;
  out.yhat.assign(sz(c.batch), {});
  const Shape4 shape{c.batch, H, c.tokens, d};
  out.state = {Tensor::zeros(shape, DType::F32), Tensor::zeros(shape, DType::F32)};
  if (c.tokens == 0) return out;
  out.key_step = c.k.step, out.value_step = c.v.step;
  const float pks = np > 0 ? previous->key_step : 1.0f, pvs = np > 0 ? previous->value_step : 1.0f;
  const auto kw = np > 0 ? pred.weights(0, 0, pks, pvs) : nullptr;
  const auto vw = pred.weights(1, c.k.step, pks, pvs);
  std::vector<float> mean_k(sz(n_k)), mean_v(sz(n_v)), pk(sz(n_k)), pv(sz(n_v)), vin(sz(n_k + np));
  for (int i = 0; i < n_k; ++i) mean_k[sz(i)] = vq_offset(c.k.offset[sz(i)], c.k.step);
  for (int i = 0; i < n_v; ++i) mean_v[sz(i)] = vq_offset(c.v.offset[sz(i)], c.v.step);
  const std::vector<double>* freq = layer.rope_freq.empty() ? nullptr : &layer.rope_freq;
  for (std::int64_t b = 0; b < c.batch; ++b) {
    auto& yh = out.yhat[sz(b)];
    yh.resize(sz(c.tokens) * sz(n));
    for (std::int64_t t = 0; t < c.tokens; ++t) {
      float* row = yh.data() + sz(t) * sz(n);
      const float* prev = np > 0 ? previous->yhat[sz(b)].data() + sz(t) * sz(np) : nullptr;
      if (np > 0) predict_into(kw->data(), n_k, np, prev, pk.data());
      const std::int16_t* qk = c.k.codes.data() + sz(b * c.tokens + t) * sz(n_k);
      for (int i = 0; i < n_k; ++i) row[i] = dequantize(pk[sz(i)], qk[i], c.k.step, mean_k[sz(i)]);
      v_inputs(row, n_k, prev, np, vin.data());
      predict_into(vw->data(), n_v, n_k + np, vin.data(), pv.data());
      const std::int16_t* qv = c.v.codes.data() + sz(b * c.tokens + t) * sz(n_v);
      for (int i = 0; i < n_v; ++i) row[n_k + i] = dequantize(pv[sz(i)], qv[i], c.v.step, mean_v[sz(i)]);
    }
    side_rows(layer.k, freq, H, d, yh.data(), sz(n), 0, c.tokens, [&](int h) { return reinterpret_cast<float*>(out.state.keys.row(b, h, 0)); });
    side_rows(layer.v, nullptr, H, d, yh.data() + n_k, sz(n), 0, c.tokens,
              [&](int h) { return reinterpret_cast<float*>(out.state.values.row(b, h, 0)); });
  }
  return out;
}

}  // namespace vq
