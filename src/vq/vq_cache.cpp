#include "veloxquant/vq/vq_cache.hpp"

#include <algorithm>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include <fmt/format.h>

#include "../core/dtype_round.hpp"
#include "code_pack.hpp"
#include "reconstruct_kernels.hpp"
#include "seal_coder.hpp"
#include "veloxquant/vq/vq_reconstruct_at.hpp"
#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/core/kernel_clones.hpp"
#include "vq_attention_kernels.hpp"

namespace vq {

namespace {

std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

// Names for sealed tiles' contents, unique in the process (the readers' scratch is keyed by it).
std::uint64_t next_seal_gen() {
  static std::atomic<std::uint64_t> gen{0};
  return ++gen;
}

// The high-rate code rate of a uniformly quantized Gaussian is log2(sigma * sqrt(2 pi e) / step).
constexpr double kSqrt2PiE = 4.132731354122493;

#if defined(__x86_64__) && defined(__GNUC__)
// forward() for a transform that mixes every head, from F transposed (fwd_t): eight rows per zmm
// of doubles, up to 32 rows side by side; each row's terms are the scalar loop's (double(f) * x_j,
// a product and then an add, from 0 in j order), so the codes are the same bits.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's _mm512_cvtps_pd passes an undefined source for its unused mask
__attribute__((target("avx512f"))) void forward_t_avx512(const float* fwd_t, int n, const double* x, double* y) {
  for (int i0 = 0; i0 < n; i0 += 32) {
    const int blocks = std::min(32, n - i0) / 8;
    __m512d acc[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd()};
    for (int j = 0; j < n; ++j) {
      const __m512d xj = _mm512_set1_pd(x[j]);
      const float* col = fwd_t + sz(j) * sz(n) + sz(i0);
      for (int k = 0; k < blocks; ++k) acc[k] = _mm512_add_pd(acc[k], _mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(col + 8 * k)), xj));
    }
    for (int k = 0; k < blocks; ++k) _mm512_storeu_pd(y + i0 + 8 * k, acc[k]);
  }
}
#pragma GCC diagnostic pop
bool forward_avx512_ok() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}
#endif

// Undo RoPE on each (2i, 2i+1) pair of every head, angle = pos * freq_i, in double, with cos / sin
// from the position's VqRopeTable row (pairs {cos, sin}, the table's expressions).
void unrope_from(double* x, int heads, int d, const double* cs, std::size_t pairs) {
  for (std::size_t p = 0; p < pairs; ++p) {
    const double c = cs[2 * p], s = -cs[2 * p + 1];
    for (int h = 0; h < heads; ++h) {
      double* v = x + sz(h) * sz(d) + 2 * p;
      const double v0 = v[0], v1 = v[1];
      v[0] = v0 * c - v1 * s;
      v[1] = v0 * s + v1 * c;
    }
  }
}

// std::nearbyint in the default rounding mode (half to even), without the library call on CPUs
// without SSE4.1's round: adding and subtracting 1.5 * 2^52 rounds any |v| < 2^51 exactly so.
inline double round_even(double v) {
  constexpr double kMagic = 6755399441055744.0;  // 1.5 * 2^52
  return std::fabs(v) < 2251799813685248.0 ? (v + kMagic) - kMagic : std::nearbyint(v);
}

// y = F x (double); identity when F is empty.
void forward(const VqSideTransform& t, const double* x, double* y) {
  const int n = t.n;
  if (t.identity()) {
    std::copy_n(x, n, y);
    return;
  }
#if defined(__x86_64__) && defined(__GNUC__)
  if (t.fwd_t.size() == sz(n) * sz(n) && n % 8 == 0 && forward_avx512_ok()) return forward_t_avx512(t.fwd_t.data(), n, x, y);
#endif
  // With per-head blocks (col_span = d < n) row i's nonzero columns are its head's: the terms
  // skipped are exact zeros (acc never holds -0, so adding them changes no bit). Four rows at once
  // give four independent sums, each in the same order as one row alone.
  const int span = t.col_span > 0 && t.col_span < n && n % t.col_span == 0 ? t.col_span : n;
  int i = 0;
  if (span % 4 == 0)
    for (; i + 4 <= n; i += 4) {
      const int j0 = span == n ? 0 : i / span * span;
      const float* r0 = t.fwd.data() + sz(i) * sz(n);
      const float *r1 = r0 + n, *r2 = r1 + n, *r3 = r2 + n;
      double a0 = 0, a1 = 0, a2 = 0, a3 = 0;
      for (int j = j0; j < j0 + span; ++j) {
        const double xj = x[j];
        a0 += static_cast<double>(r0[j]) * xj;
        a1 += static_cast<double>(r1[j]) * xj;
        a2 += static_cast<double>(r2[j]) * xj;
        a3 += static_cast<double>(r3[j]) * xj;
      }
      y[i] = a0;
      y[i + 1] = a1;
      y[i + 2] = a2;
      y[i + 3] = a3;
    }
  for (; i < n; ++i) {
    const int j0 = span == n ? 0 : i / span * span;
    double acc = 0;
    const float* row = t.fwd.data() + sz(i) * sz(n);
    for (int j = j0; j < j0 + span; ++j) acc += static_cast<double>(row[j]) * x[j];
    y[i] = acc;
  }
}

// The decoder's rows of head h (d values) from a row's y_hat (n floats): x_hat = F^-1 y_hat in
// float, each output accumulated over j in order (j outer, so the d outputs advance together and
// vectorise without reordering any sum; F^-1 is the layer model's own row-major matrix, nothing
// copied per cache), then keys re-rotated in double. Shared by the cache's tiles, state() and
// vq_reconstruct so all produce the same bits.
// Keys re-rotated (freq), or copied, from x to out.
inline void rotate_out(const float* __restrict x, int d, const std::vector<double>* freq, std::int64_t pos, float* __restrict out) {
  if (freq && !freq->empty()) {
    for (std::size_t p = 0; p < freq->size(); ++p) {
      const double ang = static_cast<double>(pos) * (*freq)[p], c = std::cos(ang), s = std::sin(ang);
      const double v0 = x[2 * p], v1 = x[2 * p + 1];
      out[2 * p] = static_cast<float>(v0 * c - v1 * s);
      out[2 * p + 1] = static_cast<float>(v0 * s + v1 * c);
    }
  } else {
    for (int i = 0; i < d; ++i) out[i] = x[i];
  }
}

VQ_KERNEL
void reconstruct_head(const float* __restrict inv, int n, const float* __restrict yhat, int h, int d,
                      const std::vector<double>* freq, std::int64_t pos, float* __restrict acc, float* __restrict out) {
  const float* x = yhat + sz(h) * sz(d);
  if (inv) {
    for (int i = 0; i < d; ++i) acc[i] = 0.0f;
    const float* __restrict rows = inv + sz(h) * sz(d) * sz(n);
    for (int j = 0; j < n; ++j) {
      const float y = yhat[j];
      for (int i = 0; i < d; ++i) acc[i] += rows[sz(i) * sz(n) + sz(j)] * y;
    }
    x = acc;
  }
  rotate_out(x, d, freq, pos, out);
}

// The same rows from the transform's column blocks (VqSideTransform::inv_cols): `cols` is head h's
// block (span columns of d), `y` its span y_hat values. Every term reconstruct_head adds and this
// skips is an exact zero times a finite value, and the rest are added in the same order, so the
// result is the same bits; the columns are read contiguously (the d outputs vectorise).
VQ_KERNEL
void reconstruct_head_cols(const float* __restrict cols, int span, const float* __restrict y, int d,
                           const std::vector<double>* freq, std::int64_t pos, float* __restrict acc, float* __restrict out) {
  for (int i = 0; i < d; ++i) acc[i] = 0.0f;
  for (int j = 0; j < span; ++j) {
    const float yj = y[j];
    const float* __restrict col = cols + sz(j) * sz(d);
    for (int i = 0; i < d; ++i) acc[i] += col[i] * yj;
  }
  rotate_out(acc, d, freq, pos, out);
}

// Packed fields: width w at bit position `bit` of a buffer with 8 bytes of slack past its rows.
inline std::uint32_t get_field(const std::uint8_t* base, std::uint64_t bit, unsigned w) {
  std::uint64_t v;
  std::memcpy(&v, base + (bit >> 3), 8);
  return static_cast<std::uint32_t>((v >> (bit & 7)) & ((std::uint64_t{1} << w) - 1));
}
std::size_t packed_bytes(std::int64_t rows, std::uint32_t row_bits) { return (sz(rows) * row_bits + 7) / 8 + 8; }

// Grows a side's packed rows from q0 to q1 rows for a code-domain load. PackedRows grow in page
// mappings (mremap: no copy, no heap hole); a loader's expected prefix (expect_tokens) is reserved
// at the first rows, in huge pages.
template <class Rows>  // VqKVCache::PackedRows (private)
void grow_loaded_rows(Rows& buf, std::int64_t q0, std::int64_t q1, std::uint32_t row_bits, std::int64_t expected) {
  if (q0 == 0 && expected > q1) buf.reserve_huge(packed_bytes(expected, row_bits));
  buf.resize(packed_bytes(q1, row_bits));
}

using code_pack::pack_layout;  // a side's layout as code_pack takes it
// code_pack's escapes appended to the cache's list (the same three fields): an empty list gets
// exactly their number (nbytes bills capacity), a list that grows chunk by chunk grows as vectors do.
template <class EscapeT>
void append_escapes(std::vector<EscapeT>& dst, const std::vector<code_pack::Escape>& esc) {
  if (dst.empty()) dst.reserve(esc.size());
  for (const code_pack::Escape& e : esc) dst.push_back({e.t, e.c, e.q});
}

using code_pack::lay_out;  // the packed layout from preferred widths (code_pack.hpp)

// Bits an escape costs (its entry in the side list).
constexpr double kEscapeBits = 96.0;

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
  require(sinks >= 0, "vq: sinks={} must be >= 0", sinks);
  require(bits + k_offset > 0 && bits + v_offset > 0 && bits + k_offset <= 10 && bits + v_offset <= 10,
          "vq: bits {} with the layer's offsets K {:+} V {:+} leaves a side outside (0, 10]", bits, k_offset, v_offset);
}

VqKVCache::VqKVCache(VqConfig config, std::shared_ptr<const VqLayerModel> layer)
    : config_(config), layer_(std::move(layer)), identity_from_data_(!layer_), seal_gen_(next_seal_gen()) {
  config_.validate();
  if (layer_)
    require(layer_->kv_heads > 0 && layer_->k.n % layer_->kv_heads == 0 && layer_->v.n % layer_->kv_heads == 0,
            "vq: inconsistent layer model");
}

void VqKVCache::reset() {
  calibrated_ = false;
  quantized_ = 0;
  sealed_ = 0;
  seal_gen_ = next_seal_gen();
  kq_ = SideQuant();  // move-assigned: `kq_ = vq_ = SideQuant()` copied an empty vq_ into kq_, which kept kq_'s capacity (billed)
  vq_ = SideQuant();
  ks_ = SideStore();
  vs_ = SideStore();
  encoded_size_.reset();
}

namespace {

// The layout a resident cache keeps in keys_buf_ / values_buf_: shape and dtype, no storage.
Tensor layout_of(const Tensor& t) { return Tensor::wrap(nullptr, {t.dim(0), t.dim(1), 0, t.dim(3)}, t.dtype()); }

// Calibration of one side from its first rows y (transformed, [rows][n]): step by water-filling,
// grid offsets, code splits, packed widths.
void calibrate_side(const std::vector<double>& y, int n, double bits, float& step, std::vector<std::int32_t>& offset,
                    std::vector<float>& mean_f, std::vector<std::uint8_t>& shift, std::vector<std::uint8_t>& width) {
  const std::size_t rows = y.size() / sz(n);
  std::vector<double> sum(sz(n), 0.0), sum2(sz(n), 0.0), lo(sz(n), INFINITY), hi(sz(n), -INFINITY);
  for (std::size_t r = 0; r < rows; ++r)
    for (int c = 0; c < n; ++c) {
      const double v = y[r * sz(n) + sz(c)];
      sum[sz(c)] += v, sum2[sz(c)] += v * v;
      lo[sz(c)] = std::min(lo[sz(c)], v), hi[sz(c)] = std::max(hi[sz(c)], v);
    }
  const double cnt = static_cast<double>(rows);
  std::vector<double> sigma(sz(n)), mean(sz(n));
  for (int c = 0; c < n; ++c) {
    mean[sz(c)] = sum[sz(c)] / cnt;
    sigma[sz(c)] = std::sqrt(std::max(0.0, sum2[sz(c)] / cnt - mean[sz(c)] * mean[sz(c)]));
  }
  step = water_fill_step(sigma, bits);
  offset.resize(sz(n));
  mean_f.resize(sz(n));
  shift.assign(sz(n), 0);
  width.assign(sz(n), 1);
  std::vector<std::int64_t> beyond(17);
  for (int c = 0; c < n; ++c) {
    // Codes beyond +-255 are split (vq/codec.hpp). Reach 32 sigma or 4x the calibration's
    // extremes, so data that drifts after calibration rarely needs a wider split later (which
    // update() makes when it does); a generous split is nearly free.
    const double reach = std::max({32.0 * sigma[sz(c)], 4.0 * (hi[sz(c)] - mean[sz(c)]), 4.0 * (mean[sz(c)] - lo[sz(c)])}) / step;
    while (shift[sz(c)] < kVqMaxShift && reach > vq_max_code(shift[sz(c)])) ++shift[sz(c)];
    const double m = std::nearbyint(mean[sz(c)] / (0.25 * static_cast<double>(step)));
    offset[sz(c)] = static_cast<std::int32_t>(std::clamp(m, -static_cast<double>(kVqMaxOffset), static_cast<double>(kVqMaxOffset)));
    mean_f[sz(c)] = vq_offset(offset[sz(c)], step);
    // Width: the fewest bits + expected escape cost, the escape rate being the larger of the
    // calibration codes' own and a Gaussian tail of the calibration's spread.
    std::fill(beyond.begin(), beyond.end(), 0);
    for (std::size_t r = 0; r < rows; ++r) {
      const double q = std::fabs(round_even((y[r * sz(n) + sz(c)] - mean_f[sz(c)]) / static_cast<double>(step)));
      for (int w = 1; w <= 16; ++w)
        if (q > static_cast<double>((1 << (w - 1)) - 1)) ++beyond[sz(w)];
    }
    double best = INFINITY;
    for (int w = 1; w <= 16 && w < best; ++w) {  // a cost is at least w: no wider field can win (and no erfc is wasted)
      const double lim = static_cast<double>((1 << (w - 1)) - 1) + 0.5;
      const double gauss = sigma[sz(c)] > 0 ? std::erfc(lim * static_cast<double>(step) / (sigma[sz(c)] * std::sqrt(2.0))) : 0.0;
      const double cost = w + kEscapeBits * std::max(gauss, static_cast<double>(beyond[sz(w)]) / cnt);
      if (cost < best) best = cost, width[sz(c)] = static_cast<std::uint8_t>(w);
    }
  }
}

}  // namespace

template <class SideQuantT, class SideStoreT>
void widen(SideQuantT& sq, SideStoreT& st, int n, int heads, std::int64_t rows, std::int64_t base = 0);  // below

void VqKVCache::update(const Tensor& keys, const Tensor& values) {
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
  const std::int64_t B = keys.dim(0), S = keys.dim(2), T1 = offset_ + S;
  const std::int64_t due = std::max<std::int64_t>(0, T1 - config_.residual);  // tokens that have left the exact window
  const bool calibrate_now = !calibrated_ && due >= config_.calib;
  const std::int64_t q0 = quantized_, q1 = (calibrated_ || calibrate_now) ? std::max(due, quantized_) : quantized_;
  const std::size_t es = dtype_size(keys.dtype());

  // Everything below up to "commit" only computes: a refusal leaves the cache unchanged.
  struct Work {
    SideQuant q;                     // a new calibration (own), or a changed layout of the cache's (own)
    bool own = false;                // else the cache's own calibration is used as it is
    std::vector<std::uint8_t> shift;  // the coder's splits, widened as codes need (committed)
    PageVector<std::int32_t> codes;  // [b][t - q0][n]: a prefill's are MBs, mapped and unmapped at once (no heap hole)
  } work[2];
  for (int side = 0; side < 2; ++side) {
    const Tensor& in = side == 0 ? keys : values;
    const VqSideTransform& tr = side == 0 ? layer_->k : layer_->v;
    const SideStore& st = side == 0 ? ks_ : vs_;
    const int n = tr.n, d = static_cast<int>(in.dim(3));
    const std::vector<double>* freq = side == 0 && !layer_->rope_freq.empty() ? &layer_->rope_freq : nullptr;
    std::vector<double> x(sz(n));
    std::vector<float> row(sz(d));
    // Token t (tail or chunk) of batch b, transformed into y.
    // cos / sin of each position from the shared table (reconstruct_kernels.hpp: the expressions the
    // re-rotation uses, so the same bits as computing them here).
    const auto rope_tab = freq ? vq_rope_table(*freq, T1) : nullptr;
    auto transformed = [&](std::int64_t t, std::int64_t b, double* y) {
      for (std::int64_t h = 0; h < H; ++h) {
        const void* src = t < offset_ ? static_cast<const void*>(st.tail.data() + sz(((t - quantized_) * B + b) * H + h) * sz(d) * es)
                                      : static_cast<const void*>(in.row(b, h, t - offset_));
        to_f32(src, in.dtype(), row.data(), sz(d));
        std::copy(row.begin(), row.end(), x.begin() + h * d);
      }
      if (freq) unrope_from(x.data(), static_cast<int>(H), d, rope_tab->at(t), freq->size());
      forward(tr, x.data(), y);
    };
    Work& w = work[side];
    const SideQuant& current = side == 0 ? kq_ : vq_;
    if (calibrate_now) {
      std::vector<double> y(sz(B * config_.calib) * sz(n));
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t t = 0; t < config_.calib; ++t) transformed(t, b, y.data() + sz(b * config_.calib + t) * sz(n));
      calibrate_side(y, n, config_.bits + (side == 0 ? config_.k_offset : config_.v_offset), w.q.step, w.q.offset, w.q.mean, w.q.shift,
                     w.q.width);
      lay_out(w.q, n, static_cast<int>(H));
      w.own = true;
    } else if (calibrated_ && current.bit_at.empty() && q1 > q0) {  // dropped at rest (resident=coded): new rows are packed at 16 bits
      w.q = current;
      if (w.q.width.empty()) w.q.width.assign(sz(n), 16);
      lay_out(w.q, n, static_cast<int>(H));
      w.own = true;
    }
    // (A decode step quantizes one token: copying the whole calibration for it cost more than the token.)
    const SideQuant& wq = w.own ? w.q : current;
    w.shift = wq.shift;
    if (q1 == q0) continue;
    w.codes.append(sz(B * (q1 - q0)) * sz(n));
    std::vector<double> y(sz(n));
    const double inv_step = 1.0 / static_cast<double>(wq.step), lim = vq_max_code(kVqMaxShift);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = q0; t < q1; ++t) {
        transformed(t, b, y.data());
        std::int32_t* q = w.codes.data() + sz(b * (q1 - q0) + (t - q0)) * sz(n);
        for (int c = 0; c < n; ++c) {
          const double v = round_even((y[sz(c)] - wq.mean[sz(c)]) * inv_step);
          if (!(std::fabs(v) <= lim))
            throw InvalidArgument(fmt::format("vq: token {} {} coefficient {} lies {:.3g} steps from its calibrated mean, beyond the codes' "
                                              "reach of +-{} (bits={} is too fine for data this far from the first {} tokens); cache unchanged",
                                              t, side == 0 ? "K" : "V", c, v, vq_max_code(kVqMaxShift), config_.bits, config_.calib));
          q[c] = static_cast<std::int32_t>(v);
          auto& sh = w.shift[sz(c)];
          while (std::abs(q[c]) > vq_max_code(sh)) ++sh;  // the coder's split widens; the code is kept whole
        }
      }
  }

  // --- commit (nothing below throws but allocation) ---
  if (offset_ == 0) {
    keys_buf_ = layout_of(keys);
    values_buf_ = layout_of(values);
    ks_.packed.clear(), vs_.packed.clear();
    ks_.packed.resize(sz(B)), vs_.packed.resize(sz(B));
    ks_.escapes.assign(sz(B), {}), vs_.escapes.assign(sz(B), {});
  }
  for (int side = 0; side < 2; ++side) {
    const Tensor& in = side == 0 ? keys : values;
    SideStore& st = side == 0 ? ks_ : vs_;
    const std::size_t rowb = sz(in.dim(3)) * es, tokb = sz(B * H) * rowb;
    // Exact rows: the chunk joins the tail; the first `sinks` tokens are kept aside for good.
    const std::size_t old = st.tail.size();
    st.tail.resize(old + sz(S) * tokb);
    const std::int64_t sink_end = std::min<std::int64_t>(config_.sinks, T1);
    if (sink_end > offset_) st.sinks.resize(sz(sink_end) * tokb);
    for (std::int64_t s = 0; s < S; ++s)
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t h = 0; h < H; ++h) {
          const std::size_t at = sz(b * H + h) * rowb;  // within a token's [b][h] rows
          std::memcpy(st.tail.data() + old + sz(s) * tokb + at, in.row(b, h, s), rowb);
          if (offset_ + s < sink_end) std::memcpy(st.sinks.data() + sz(offset_ + s) * tokb + at, in.row(b, h, s), rowb);
        }
    SideQuant& sq = side == 0 ? kq_ : vq_;
    if (work[side].own) sq = std::move(work[side].q);
    sq.shift = std::move(work[side].shift);
    if (q1 == q0) continue;
    if (st.packed.size() != sz(B)) st.packed.resize(sz(B)), st.escapes.resize(sz(B));  // released between updates (resident=coded)
    const int n = side == 0 ? layer_->k.n : layer_->v.n;
    const std::uint32_t row_bits = sq.bit_at[sz(n)];
    // The new rows through code_pack's packer (fields kept in registers: packing field by field
    // into memory stalled on store forwarding); escapes appended in (token, coefficient) order.
    // (In blocks of 64 rows: the int16 copy stays small, whatever a prefill's size.)
    constexpr std::int64_t kBlock = 64;
    std::vector<std::int16_t> q16(sz(std::min(kBlock, q1 - q0)) * sz(n));
    std::vector<code_pack::Escape> esc;
    const code_pack::Layout lay = pack_layout(sq, n, static_cast<int>(H));
    for (std::int64_t b = 0; b < B; ++b) {
      auto& buf = st.packed[sz(b)];
      buf.resize(packed_bytes(q1 - sealed_, row_bits));
      for (std::int64_t t0 = q0; t0 < q1; t0 += kBlock) {
        const std::int64_t rows = std::min(kBlock, q1 - t0);
        const std::int32_t* q = work[side].codes.data() + sz(b * (q1 - q0) + (t0 - q0)) * sz(n);
        for (std::size_t i = 0; i < sz(rows) * sz(n); ++i) q16[i] = static_cast<std::int16_t>(q[i]);  // |q| <= vq_max_code(kVqMaxShift)
        esc.clear();
        code_pack::pack_rows(lay, q16.data(), rows, t0 - sealed_, buf.data(), esc);
        for (const code_pack::Escape& x : esc) st.escapes[sz(b)].push_back({x.t + static_cast<std::int32_t>(sealed_), x.c, x.q});
      }
    }
    widen(sq, st, n, static_cast<int>(H), q1 - sealed_, sealed_);
    st.tail.erase(st.tail.begin(), st.tail.begin() + static_cast<std::ptrdiff_t>(sz(q1 - q0) * tokb));
    // A prefill's rows released, and a decode step's spare too (nbytes bills capacity: a tail of a
    // few tokens grown by doubling held up to 2x its rows; the copy is of the tail only).
    if (st.tail.capacity() > st.tail.size() + st.tail.size() / 8 + 64) std::vector<std::uint8_t>(st.tail).swap(st.tail);
    if (st.sinks.capacity() > st.sinks.size()) st.sinks.shrink_to_fit();
  }
  calibrated_ = calibrated_ || calibrate_now;
  quantized_ = q1;
  offset_ = T1;
  encoded_size_.reset();
  seal_due();
}

// Data that drifts from its calibration escapes more and more codes of a coefficient. Once its
// escapes cost more than one more bit in every row would, the coefficient's field widens to the
// width that minimises rows x width + escape bits over the codes held, and the side is re-packed
// (O(rows x n), rare: each widening at least doubles a field's range). Values never change.
// (A template over the cache's private side types: the header stays as it is.) `rows` packed rows,
// row r holding token base + r (base: the sealed tokens).
template <class SideQuantT, class SideStoreT>
void widen(SideQuantT& sq, SideStoreT& st, int n, int heads, std::int64_t rows, std::int64_t base) {
  using EscapeT = typename std::remove_reference_t<decltype(st.escapes[0])>::value_type;
  const std::int64_t B = static_cast<std::int64_t>(st.packed.size()), R = B * rows;
  std::vector<std::int64_t> count(sz(n), 0);
  for (const auto& e : st.escapes)
    for (const EscapeT& x : e) ++count[sz(x.c)];
  std::vector<std::uint8_t> width = sq.width;
  std::vector<char> over(sz(n), 0);
  bool any = false;
  for (int c = 0; c < n; ++c) {
    over[sz(c)] = static_cast<double>(count[sz(c)]) * kEscapeBits > static_cast<double>(R);
    any = any || over[sz(c)];
  }
  if (!any) return;
  std::vector<std::int64_t> beyond(sz(n) * 17, 0);  // [c][w]: escaped codes of c still escaped at width w
  for (const auto& e : st.escapes)
    for (const EscapeT& x : e)
      if (over[sz(x.c)])
        for (int w = sq.width[sz(x.c)]; w <= 16; ++w) beyond[sz(x.c) * 17 + sz(w)] += std::abs(x.q) >= (1 << (w - 1));
  any = false;
  for (int c = 0; c < n; ++c) {
    if (!over[sz(c)]) continue;
    double best = INFINITY;
    for (int w = sq.width[sz(c)]; w <= 16; ++w) {
      const double cost = static_cast<double>(w) * static_cast<double>(R) + kEscapeBits * static_cast<double>(beyond[sz(c) * 17 + sz(w)]);
      if (cost < best) best = cost, width[sz(c)] = static_cast<std::uint8_t>(w);
    }
    any = any || width[sz(c)] != sq.width[sz(c)];
  }
  if (!any) return;
  // Re-pack every row at the new widths (and the layout they give): unpack, the escapes in their
  // places, pack (code_pack.hpp), a block of rows at a time through one small buffer that stays in
  // cache (unpacking the whole side first wrote and read back a fresh mapping of rows x n codes:
  // perf of a code-domain load showed its page faults and misses above the packing itself).
  SideQuantT nq;
  nq.width = std::move(width);
  nq.mean = sq.mean;
  lay_out(nq, n, heads);
  const code_pack::Layout from = pack_layout(sq, n, heads), to = pack_layout(nq, n, heads);
  const std::int64_t block = std::max<std::int64_t>(8, 32768 / n);  // ~64 KiB of codes
  std::vector<std::int16_t> q(sz(std::min(block, rows)) * sz(n));
  std::int16_t* qd = q.data();
  std::vector<code_pack::Escape> esc;
  for (std::int64_t b = 0; b < B; ++b) {
    typename std::remove_reference_t<decltype(st.packed[0])> buf;
    buf.resize(packed_bytes(rows, to.bit_at[n]));
    esc.clear();
    const auto& old_esc = st.escapes[sz(b)];  // sorted by (t, c); t from base on
    std::size_t e = 0;
    for (std::int64_t t0 = 0; t0 < rows; t0 += block) {
      const std::int64_t count = std::min(block, rows - t0);
      code_pack::unpack_rows(from, st.packed[sz(b)].data() + sz(t0) * from.row_bytes(), count, qd);
      for (; e < old_esc.size() && old_esc[e].t - base < t0 + count; ++e)  // |q| <= vq_max_code(kVqMaxShift)
        qd[sz(old_esc[e].t - base - t0) * sz(n) + sz(old_esc[e].c)] = static_cast<std::int16_t>(old_esc[e].q);
      code_pack::pack_rows(to, qd, count, t0, buf.data(), esc);
    }
    for (code_pack::Escape& x : esc) x.t += static_cast<std::int32_t>(base);
    st.packed[sz(b)] = std::move(buf);
    std::vector<EscapeT> kept;  // a new list: the old one's memory released (clear() would keep its capacity)
    append_escapes(kept, esc);
    st.escapes[sz(b)] = std::move(kept);
  }
  sq.width = std::move(nq.width);
  sq.bit_at = std::move(nq.bit_at);
  sq.order = std::move(nq.order);
  sq.group_byte = std::move(nq.group_byte);
  sq.group_width = std::move(nq.group_width);
  sq.field_mean = std::move(nq.field_mean);
}

std::pair<Tensor, Tensor> VqKVCache::update_and_fetch(const Tensor& keys, const Tensor& values) {
  update(keys, values);
  return {materialise(0), materialise(1)};
}

KVState VqKVCache::state() const {
  if (offset_ == 0) return {};
  return {materialise(0), materialise(1)};
}

void VqKVCache::read_rows(int side, std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* out) const {
  const SideQuant& sq = side == 0 ? kq_ : vq_;
  const SideStore& st = side == 0 ? ks_ : vs_;
  const VqSideTransform& tr = side == 0 ? layer_->k : layer_->v;
  const DType dtype = keys_buf_.dtype();
  const std::int64_t B = keys_buf_.dim(0), H = keys_buf_.dim(1);
  const int d = static_cast<int>((side == 0 ? keys_buf_ : values_buf_).dim(3)), nc = tr.n;
  const std::size_t rowb = sz(d) * dtype_size(dtype);
  const std::int64_t sink_end = std::min<std::int64_t>(config_.sinks, offset_);
  // A transform that mixes every head (one column block of the whole row: the weight-derived
  // basis on stories260K): a tile's rows of all heads are built at once from whole y_hat rows and
  // kept per thread (and side) for the other heads' reads of the same tile; the attend loop reads
  // a tile's heads in turn. Exact tokens are copied; the quantized tokens' y_hat comes from their
  // codes (sealed tiles, or the packed rows through code_pack::unpack_rows; escapes patched from
  // the side list afterwards), then one product with every head's column block and the rotation
  // (vq_all_head_rows: the per-token path's bits). The kept tile is named by seal_gen_ (new at
  // construction, reset, trim and unseal: the changes that are not appends) and the token counts.
  if (!tr.identity() && tr.col_span == nc && H * d == nc && sz(H * d * nc) == tr.inv_cols.size()) {
    struct Tile {
      std::uint64_t gen = 0;
      std::int64_t b = -1, t0 = -1, n = -1, offset = -1, quantized = -1;
      std::vector<float> rows, y, acc, part;
    };
    thread_local Tile tiles[2];
    // The whole-row matrices of the layer models read lately (a decode step reads every layer in
    // turn), named by the model's control block: a weak_ptr keeps it from being reused by another
    // model while the entry lives.
    struct Matrix {
      std::weak_ptr<const VqLayerModel> model;
      std::vector<float> w;
    };
    thread_local std::vector<Matrix> matrices[2];
    thread_local std::size_t next_matrix = 0;
    Tile& s = tiles[side];
    if (!(s.gen == seal_gen_ && s.b == b && s.t0 == t0 && s.n == n && s.offset == offset_ && s.quantized == quantized_)) {
      s.gen = 0;  // invalid until filled
      s.rows.resize(sz(H) * sz(n) * sz(d));
      const std::int64_t qa = std::max(t0, sink_end), qb = std::max(qa, std::min(t0 + n, quantized_));
      for (std::int64_t t = t0; t < t0 + n; ++t) {  // exact tokens: the sinks and the tail
        if (t >= qa && t < qb) continue;
        const std::uint8_t* src = t < sink_end ? st.sinks.data() + sz(t * B + b) * sz(H) * rowb
                                               : st.tail.data() + sz((t - quantized_) * B + b) * sz(H) * rowb;
        for (std::int64_t hh = 0; hh < H; ++hh) to_f32(src + sz(hh) * rowb, dtype, s.rows.data() + (sz(hh) * sz(n) + sz(t - t0)) * sz(d), sz(d));
      }
      if (qa < qb) {
        const std::int64_t m = qb - qa;
        s.y.resize(sz(m) * sz(nc));
        const float step = sq.step;
        const std::int64_t pa = std::max(qa, std::min(qb, sealed_));  // [qa, pa) sealed, [pa, qb) packed
        // y_hat of a token from its n codes.
        const auto put_y = [&](std::int64_t t, const std::int16_t* q) {
          float* y = s.y.data() + sz(t - qa) * sz(nc);
          for (int c = 0; c < nc; ++c) y[c] = sq.mean[sz(c)] + static_cast<float>(q[c]) * step;
        };
        for (std::int64_t t = qa; t < pa; ++t) put_y(t, sealed_row(side, b, t));
        // The packed rows (and their arrays, which a coded cache drops between updates once every
        // token is sealed: seal_due) through code_pack's unpacker; an escape reads -2^(w-1) there
        // until the side list's code replaces it below.
        const bool packed = pa < qb;
        if (packed) {
          thread_local std::vector<std::int16_t> unpacked;
          unpacked.resize(sz(qb - pa) * sz(nc));
          const code_pack::Layout lay = pack_layout(sq, nc, static_cast<int>(H));
          code_pack::unpack_rows(lay, st.packed[sz(b)].data() + sz(pa - sealed_) * lay.row_bytes(), qb - pa, unpacked.data());
          for (std::int64_t t = pa; t < qb; ++t) put_y(t, unpacked.data() + sz(t - pa) * sz(nc));
        }
        // Field 0 is an escape: its code is in the side list (packed tokens only).
        static const std::vector<Escape> kNone;
        const auto& e = packed ? st.escapes[sz(b)] : kNone;
        for (auto it = std::lower_bound(e.begin(), e.end(), pa, [](const Escape& x, std::int64_t t) { return x.t < t; }); it != e.end() && it->t < qb; ++it)
          s.y[sz(it->t - qa) * sz(nc) + sz(it->c)] = sq.mean[sz(it->c)] + static_cast<float>(it->q) * step;
        std::vector<Matrix>& ms = matrices[side];
        auto same = [&](const Matrix& x) { return !x.model.owner_before(layer_) && !layer_.owner_before(x.model) && !x.model.expired(); };
        auto mit = std::find_if(ms.begin(), ms.end(), same);
        if (mit == ms.end()) {
          // Layers' matrices kept per side and thread: up to 64, and 1 MiB of them (n x n floats each).
          const std::size_t kKept = std::clamp<std::size_t>((std::size_t{1} << 18) / (sz(nc) * sz(nc)), 1, 64);
          if (ms.size() < kKept) mit = ms.insert(ms.end(), Matrix{});
          else mit = ms.begin() + static_cast<std::ptrdiff_t>(next_matrix++ % kKept);
          mit->model = layer_;
          mit->w.resize(sz(nc) * sz(nc));
          vq_whole_row_matrix(tr.inv_cols.data(), nc, static_cast<int>(H), mit->w.data());
        }
        const std::vector<float>& w = mit->w;
        const auto rope = side == 0 ? vq_rope_table(layer_->rope_freq, qb) : nullptr;
        s.acc.resize(sz(m) * sz(nc));
        float* dst = m == n ? s.rows.data() : (s.part.resize(sz(H) * sz(m) * sz(d)), s.part.data());
        vq_all_head_rows(w.data(), nc, static_cast<int>(H), s.y.data(), m, rope.get(), qa, s.acc.data(), dst);
        if (dtype != DType::F32) round_through(dst, sz(H) * sz(m) * sz(d), dtype);  // what a fetch in that dtype holds
        if (m != n)
          for (std::int64_t hh = 0; hh < H; ++hh)
            std::copy_n(dst + sz(hh) * sz(m) * sz(d), sz(m) * sz(d), s.rows.data() + (sz(hh) * sz(n) + sz(qa - t0)) * sz(d));
      }
      s.gen = seal_gen_, s.b = b, s.t0 = t0, s.n = n, s.offset = offset_, s.quantized = quantized_;
    }
    std::copy_n(s.rows.data() + sz(h) * sz(n) * sz(d), sz(n) * sz(d), out);
    return;
  }
  const std::vector<double>* freq = side == 0 && !layer_->rope_freq.empty() ? &layer_->rope_freq : nullptr;
  // The identity reads head h's coefficients only (y_hat holds them at 0 .. d); a transform that
  // mixes heads needs the whole row. Scratch per call (a tile), freed on return.
  const bool whole = !tr.identity();
  // With the column blocks, only the coefficients of head h's block are read (its own d when the
  // transform is per head).
  const bool cols = whole && !tr.inv_cols.empty() && tr.col_span * static_cast<std::int64_t>(H) * d == static_cast<std::int64_t>(tr.inv_cols.size());
  const int span = cols ? tr.col_span : 0;
  const int c0 = whole ? (cols && span != nc ? static_cast<int>(h) * d : 0) : static_cast<int>(h) * d;
  const int c1 = whole ? (cols ? c0 + span : nc) : c0 + d;
  std::vector<float> yhat(sz(c1 - c0)), acc(whole ? sz(d) : 0);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t t = t0 + i;
    float* o = out + i * d;
    if (t < sink_end) {
      to_f32(st.sinks.data() + sz((t * B + b) * H + h) * rowb, dtype, o, sz(d));
    } else if (t >= quantized_) {
      to_f32(st.tail.data() + sz(((t - quantized_) * B + b) * H + h) * rowb, dtype, o, sz(d));
    } else if (t < sealed_) {
      const std::int16_t* q = sealed_row(side, b, t);
      for (int c = c0; c < c1; ++c) yhat[sz(c - c0)] = sq.mean[sz(c)] + static_cast<float>(q[c]) * sq.step;
    } else {
      const std::uint8_t* buf = st.packed[sz(b)].data();
      const std::uint64_t base = static_cast<std::uint64_t>(t - sealed_) * sq.bit_at[sz(nc)];
      for (int c = c0; c < c1; ++c) {
        const unsigned w = sq.width[sz(c)];
        const std::uint32_t f = get_field(buf, base + sq.bit_at[sz(c)], w);
        std::int32_t q = static_cast<std::int32_t>(f) - (1 << (w - 1));
        if (f == 0) {  // an escape: its code from the side list
          const auto& e = st.escapes[sz(b)];
          const auto it = std::lower_bound(e.begin(), e.end(), std::pair<std::int64_t, int>{t, c},
                                           [](const Escape& x, const std::pair<std::int64_t, int>& k) { return x.t < k.first || (x.t == k.first && x.c < k.second); });
          q = it->q;
        }
        yhat[sz(c - c0)] = sq.mean[sz(c)] + static_cast<float>(q) * sq.step;
      }
    }
    if (t >= sink_end && t < quantized_) {
      if (cols)
        reconstruct_head_cols(tr.inv_cols.data() + sz(h) * sz(span) * sz(d), span, yhat.data(), d, freq, t, acc.data(), o);
      else
        reconstruct_head(whole ? tr.inv.data() : nullptr, nc, yhat.data(), whole ? static_cast<int>(h) : 0, d, freq, t, acc.data(), o);
      round_through(o, sz(d), dtype);  // what a fetch in that dtype holds
    }
  }
}

const float* VqKVCache::read_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const {
  read_rows(0, b, h, t0, n, scratch);
  return scratch;
}

const float* VqKVCache::read_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, float* scratch) const {
  read_rows(1, b, h, t0, n, scratch);
  return scratch;
}

bool VqKVCache::codes_direct(int side) const {
  if (config_.coded || !calibrated_ || quantized_ == 0 || !vq_attention::available()) return false;
  const DType dt = keys_buf_.dtype();
  if (dt != DType::F32 && dt != DType::F16) return false;
  const VqSideTransform& tr = side == 0 ? layer_->k : layer_->v;
  return tr.identity() && (side == 1 || layer_->rope_freq.empty());
}

std::int64_t VqKVCache::attention_tile_tokens() const {
  if (config_.coded) return kSealTokens;  // a sealed tile is decoded once per side for all heads
  return codes_direct(0) && codes_direct(1) ? kCodeTileTokens : KVCache::attention_tile_tokens();
}

// The kernels' view of tokens [t0, t1) of (b, h), one side (all coded), with the escapes among
// them (field positions: the inverse of the head's order) in a per-thread list (`esc` is no
// longer used: kept so that the header does not change).
//
// The loop reads a tile's heads in turn (K and V of head 0, then head 1, ...), so the tile's
// escapes are split by head once, at the first head's call, into a per-thread entry per side
// (listing each head's from the whole tile, 8 passes over its escapes and a binary search over
// the side's list per head, was ~14 % of a 64k-token step). An entry is used only where it is
// what a fresh split would give: same cache, side, batch row, tokens and head dim, the escapes
// with tokens in [t0, t1) exactly its copy (bounded on both sides by the sorted list), and the
// head's order its copy; otherwise it is built again (so no entry outlives a change of the cache).
vq_attention::HeadFields VqKVCache::head_fields(int side, std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t t1,
                                                std::vector<vq_attention::FieldEscape>& esc) const {
  const SideQuant& sq = side == 0 ? kq_ : vq_;
  const SideStore& st = side == 0 ? ks_ : vs_;
  const std::int64_t d = (side == 0 ? keys_buf_ : values_buf_).dim(3), gph = (d + 7) / 8;
  vq_attention::HeadFields f;
  f.rows = st.packed[sz(b)].data();
  f.row_bytes = sq.bit_at.back() / 8;
  f.t0 = t0;
  f.d = d;
  f.group_byte = sq.group_byte.data() + h * gph;
  f.group_width = sq.group_width.data() + h * gph;
  f.mean = sq.field_mean.data() + h * d;
  f.step = sq.step;
  f.round_f16 = keys_buf_.dtype() == DType::F16;
  (void)esc;
  struct TileEscapes {
    const VqKVCache* owner = nullptr;
    std::int64_t b = -1, t0 = -1, t1 = -1, d = 0;
    std::size_t i0 = 0, i1 = 0;             // the range of the side's list it was built from
    std::vector<Escape> copy;               // that range's escapes
    std::vector<std::int32_t> order;        // the side's order then (every head's)
    std::vector<std::int32_t> pos;          // its inverse per head: field position of coefficient c
    std::vector<std::vector<vq_attention::FieldEscape>> heads;  // per head, field positions, t from t0
  };
  thread_local TileEscapes tiles[2];
  TileEscapes& te = tiles[side];
  const std::vector<Escape>& e = st.escapes[sz(b)];
  const std::size_t ne = e.size();
  const std::int32_t* order = sq.order.data();
  const std::size_t n_coef = sq.order.size();
  // The range [i0, i1) holds exactly the escapes of tokens [t0, t1) when its neighbours lie outside.
  auto bounds = [&](std::size_t i0, std::size_t i1) {
    return i0 <= i1 && i1 <= ne && (i0 == 0 || e[i0 - 1].t < t0) && (i0 == i1 || e[i0].t >= t0) && (i1 == ne || e[i1].t >= t1) &&
           (i0 == i1 || e[i1 - 1].t < t1);
  };
  const bool valid = te.owner == this && te.b == b && te.t0 == t0 && te.t1 == t1 && te.d == d && te.order.size() == n_coef &&
                     bounds(te.i0, te.i1) && te.copy.size() == te.i1 - te.i0 &&
                     (te.copy.empty() || std::memcmp(te.copy.data(), e.data() + te.i0, te.copy.size() * sizeof(Escape)) == 0) &&
                     std::memcmp(te.order.data() + h * d, order + h * d, sz(d) * sizeof(std::int32_t)) == 0;
  if (!valid) {
    // The first escape at or past t0: from where the previous tile's range ended, when that is it.
    std::size_t i0 = te.i1;
    if (!(te.owner == this && te.b == b && te.t1 == t0 && i0 <= ne && (i0 == 0 || e[i0 - 1].t < t0) && (i0 == ne || e[i0].t >= t0)))
      i0 = static_cast<std::size_t>(
          std::lower_bound(e.begin(), e.end(), t0, [](const Escape& x, std::int64_t t) { return x.t < t; }) - e.begin());
    std::size_t i1 = i0;
    while (i1 < ne && e[i1].t < t1) ++i1;
    te.owner = this, te.b = b, te.t0 = t0, te.t1 = t1, te.d = d, te.i0 = i0, te.i1 = i1;
    te.copy.assign(e.begin() + static_cast<std::ptrdiff_t>(i0), e.begin() + static_cast<std::ptrdiff_t>(i1));
    if (te.order.size() != n_coef || std::memcmp(te.order.data(), order, n_coef * sizeof(std::int32_t)) != 0) {
      te.order.assign(order, order + n_coef);
      te.pos.resize(n_coef);
      for (std::size_t c = 0; c < n_coef; ++c) te.pos[sz(order[c])] = static_cast<std::int32_t>(c % sz(d));
    }
    const std::size_t H = d > 0 ? n_coef / sz(d) : 0;
    te.heads.resize(H);
    for (auto& l : te.heads) l.clear();
    for (const Escape& x : te.copy)
      te.heads[sz(x.c / d)].push_back({static_cast<std::int32_t>(x.t - t0), te.pos[sz(x.c)], x.q});
  }
  const auto& l = te.heads[sz(h)];
  f.escapes = l.data();
  f.n_escapes = l.size();
  return f;
}

// The tile hooks on codes: tokens [t0, t0 + n) split into the coded run [qa, qb) (what the
// kernels read) and the exact tokens around it (the sinks before, the tail after: the float tiles
// of the defaults). Queries and accumulators are permuted into the head's field order and back.
void VqKVCache::score_key_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, const float* queries, std::int64_t nq,
                               float* scores, float* scratch) const {
  const std::int64_t qa = std::max(t0, std::min<std::int64_t>(config_.sinks, offset_)), qb = std::min(t0 + n, quantized_);
  if (!codes_direct(0) || qa >= qb) return KVCache::score_key_tile(b, h, t0, n, queries, nq, scores, scratch);
  const std::int64_t d = keys_buf_.dim(3);
  thread_local std::vector<float> part;
  thread_local std::vector<vq_attention::FieldEscape> esc;
  // The loop hands every tile of a (batch, head) the same query rows: each head's rows in field
  // order are kept from its last tile and permuted again only when the rows or the head's order
  // differ (compared by content, so no entry outlives a change of step, cache or calibration).
  struct Permuted {
    std::vector<float> raw, perm;
    std::vector<std::int32_t> order;
  };
  thread_local std::vector<Permuted> permuted;
  if (permuted.size() <= sz(h)) permuted.resize(sz(h) + 1);
  Permuted& pq = permuted[sz(h)];
  const std::int32_t* order = kq_.order.data() + h * d;
  const std::size_t m = sz(nq * d);
  if (!(pq.raw.size() == m && pq.order.size() == sz(d) && std::memcmp(pq.raw.data(), queries, m * sizeof(float)) == 0 &&
        std::memcmp(pq.order.data(), order, sz(d) * sizeof(std::int32_t)) == 0)) {
    pq.raw.assign(queries, queries + m);
    pq.order.assign(order, order + d);
    pq.perm.resize(m);
    for (std::int64_t r = 0; r < nq; ++r)
      for (std::int64_t p = 0; p < d; ++p) pq.perm[sz(r * d + p)] = queries[r * d + order[p] - h * d];
  }
  const std::vector<float>& qp = pq.perm;
  const vq_attention::HeadFields f = head_fields(0, b, h, qa, qb, esc);
  if (qa == t0 && qb == t0 + n) return vq_attention::score(f, n, qp.data(), nq, scores);
  // A tile with exact tokens: each run into `part`, then into its columns of `scores`.
  auto run = [&](std::int64_t a, std::int64_t e, bool coded) {
    const std::int64_t m = e - a;
    if (m <= 0) return;
    part.resize(sz(nq * m));
    if (coded)
      vq_attention::score(f, m, qp.data(), nq, part.data());
    else
      KVCache::score_key_tile(b, h, a, m, queries, nq, part.data(), scratch);
    for (std::int64_t r = 0; r < nq; ++r) std::copy_n(part.data() + r * m, m, scores + r * n + (a - t0));
  };
  run(t0, qa, false);
  run(qa, qb, true);
  run(qb, t0 + n, false);
}

void VqKVCache::accumulate_value_tile(std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t n, const float* weights,
                                      std::int64_t nq, float* acc, float* scratch) const {
  const std::int64_t qa = std::max(t0, std::min<std::int64_t>(config_.sinks, offset_)), qb = std::min(t0 + n, quantized_);
  if (!codes_direct(1) || qa >= qb) return KVCache::accumulate_value_tile(b, h, t0, n, weights, nq, acc, scratch);
  const std::int64_t d = values_buf_.dim(3);
  thread_local std::vector<float> part;
  thread_local std::vector<vq_attention::FieldEscape> esc;
  // Exact runs first, on acc as it is.
  auto weights_of = [&](std::int64_t a, std::int64_t m) {
    part.resize(sz(nq * m));
    for (std::int64_t r = 0; r < nq; ++r) std::copy_n(weights + r * n + (a - t0), m, part.data() + r * m);
    return part.data();
  };
  if (qa > t0) KVCache::accumulate_value_tile(b, h, t0, qa - t0, weights_of(t0, qa - t0), nq, acc, scratch);
  if (qb < t0 + n) KVCache::accumulate_value_tile(b, h, qb, t0 + n - qb, weights_of(qb, t0 + n - qb), nq, acc, scratch);
  thread_local std::vector<std::int32_t> rel;  // the head's order as head dims
  rel.resize(sz(d));
  for (std::int64_t p = 0; p < d; ++p) rel[sz(p)] = vq_.order[sz(h * d + p)] - static_cast<std::int32_t>(h * d);
  const vq_attention::HeadFields f = head_fields(1, b, h, qa, qb, esc);
  vq_attention::accumulate(f, qb - qa, qa == t0 && qb == t0 + n ? weights : weights_of(qa, qb - qa), nq, acc, rel.data());
}

Tensor VqKVCache::materialise(int side) const {
  const Tensor& layout = side == 0 ? keys_buf_ : values_buf_;
  const std::int64_t B = layout.dim(0), H = layout.dim(1), D = layout.dim(3);
  Tensor t = Tensor::uninitialized({B, H, offset_, D}, layout.dtype());
  std::vector<float> rows(sz(offset_ * D));
  // The quantized tokens past the sinks go through the tiled kernel (reconstruct_kernels.hpp), all
  // of a batch row's tokens per head, when the transform has its column blocks: the same bits as
  // read_rows' per-token path (and from_f32 of a row rounded through the dtype is from_f32 of the
  // row). Sinks, the exact tail and the other transforms: read_rows.
  const SideQuant& sq = side == 0 ? kq_ : vq_;
  const SideStore& st = side == 0 ? ks_ : vs_;
  const VqSideTransform& tr = side == 0 ? layer_->k : layer_->v;
  const int d = static_cast<int>(D), nc = tr.n;
  const std::int64_t q0 = std::min<std::int64_t>(config_.sinks, offset_), q1 = std::max(q0, quantized_);
  const bool tiled = !tr.identity() && !tr.inv_cols.empty() && tr.col_span * static_cast<std::int64_t>(H) * d ==
                                                                    static_cast<std::int64_t>(tr.inv_cols.size()) && q1 > q0;
  std::vector<float> yhat(tiled ? sz(q1 - q0) * sz(nc) : 0);
  const auto rope = tiled && side == 0 ? vq_rope_table(layer_->rope_freq, q1) : nullptr;
  for (std::int64_t b = 0; b < B; ++b) {
    if (tiled) {  // y_hat of every quantized token of batch row b
      // No packed rows, layout or escapes between updates with resident=coded (every token sealed).
      const std::uint8_t* buf = sz(b) < st.packed.size() ? st.packed[sz(b)].data() : nullptr;
      const std::uint32_t row_bits = sq.bit_at.empty() ? 0 : sq.bit_at[sz(nc)];
      for (std::int64_t tk = q0; tk < q1; ++tk) {
        float* y = yhat.data() + sz(tk - q0) * sz(nc);
        if (tk < sealed_) {
          const std::int16_t* q = sealed_row(side, b, tk);
          for (int c = 0; c < nc; ++c) y[c] = sq.mean[sz(c)] + static_cast<float>(q[c]) * sq.step;
          continue;
        }
        const std::uint64_t base = static_cast<std::uint64_t>(tk - sealed_) * row_bits;
        for (int c = 0; c < nc; ++c) {
          const unsigned w = sq.width[sz(c)];
          const std::int32_t q = static_cast<std::int32_t>(get_field(buf, base + sq.bit_at[sz(c)], w)) - (1 << (w - 1));
          y[c] = sq.mean[sz(c)] + static_cast<float>(q) * sq.step;
        }
      }
      if (sz(b) < st.escapes.size())
        for (const Escape& e : st.escapes[sz(b)])  // field 0: the code is in the side list
          if (e.t >= q0 && e.t < q1) yhat[sz(e.t - q0) * sz(nc) + sz(e.c)] = sq.mean[sz(e.c)] + static_cast<float>(e.q) * sq.step;
    }
    for (std::int64_t h = 0; h < H; ++h) {
      if (tiled) {
        if (q0 > 0) read_rows(side, b, h, 0, q0, rows.data());
        const int span = tr.col_span;
        vq_head_rows(tr.inv_cols.data() + sz(h) * sz(span) * sz(d), span, d, yhat.data() + (span == nc ? 0 : sz(h) * sz(d)), sz(nc),
                     q1 - q0, rope.get(), q0, rows.data() + sz(q0) * sz(d));
        if (offset_ > q1) read_rows(side, b, h, q1, offset_ - q1, rows.data() + sz(q1) * sz(d));
      } else {
        read_rows(side, b, h, 0, offset_, rows.data());
      }
      if (offset_ > 0) from_f32(rows.data(), t.row(b, h, 0), t.dtype(), sz(offset_ * D));
    }
  }
  return t;
}

std::int64_t VqKVCache::trim(std::int64_t n) {
  const std::int64_t old = offset_;
  const std::int64_t dropped = KVCache::trim(n);
  if (dropped == 0) return 0;
  encoded_size_.reset();
  seal_gen_ = next_seal_gen();  // a change (tokens past the new end may come back with other rows): read_rows' kept tiles go
  if (offset_ == 0) {
    reset();
    return dropped;
  }
  if (offset_ < sealed_) unseal();  // into a sealed tile: everything packed again, sealed again below
  const std::int64_t B = keys_buf_.dim(0), H = keys_buf_.dim(1);
  for (int side = 0; side < 2; ++side) {
    SideStore& st = side == 0 ? ks_ : vs_;
    const std::size_t tokb = sz(B * H * (side == 0 ? keys_buf_ : values_buf_).dim(3)) * dtype_size(keys_buf_.dtype());
    st.sinks.resize(std::min(st.sinks.size(), sz(offset_) * tokb));
    if (quantized_ <= offset_) {
      st.tail.resize(st.tail.size() - sz(old - offset_) * tokb);
      continue;
    }
    st.tail.clear();  // every exact tail token is gone; codes past offset_ go too
    const SideQuant& sq = side == 0 ? kq_ : vq_;
    const std::uint32_t row_bits = sq.bit_at.back();
    for (std::int64_t b = 0; b < B; ++b) {
      auto& buf = st.packed[sz(b)];
      const std::uint64_t end = static_cast<std::uint64_t>(offset_ - sealed_) * row_bits;
      buf.resize(packed_bytes(offset_ - sealed_, row_bits));
      // Zero every bit past the last row (later rows are OR-ed in).
      std::fill(buf.data() + (end + 7) / 8, buf.data() + buf.size(), std::uint8_t{0});
      if (end % 8) buf.data()[end / 8] &= static_cast<std::uint8_t>((1u << (end % 8)) - 1);
      auto& e = st.escapes[sz(b)];
      e.erase(std::lower_bound(e.begin(), e.end(), offset_, [](const Escape& x, std::int64_t t) { return x.t < t; }), e.end());
    }
  }
  quantized_ = std::min(quantized_, offset_);
  seal_due();
  return dropped;
}

void VqKVCache::from_state(const KVState& state) {
  refeed_state(state, [this] { reset(); });
}

std::size_t VqKVCache::nbytes() const {
  std::size_t n = 0;
  for (const SideQuant* q : {&kq_, &vq_})
    n += q->offset.capacity() * sizeof(std::int32_t) + q->mean.capacity() * sizeof(float) + q->shift.capacity() + q->width.capacity() +
         q->bit_at.capacity() * sizeof(std::uint32_t) + q->order.capacity() * sizeof(std::int32_t) +
         q->group_byte.capacity() * sizeof(std::uint32_t) + q->group_width.capacity() + q->field_mean.capacity() * sizeof(float);
  for (const SideStore* s : {&ks_, &vs_}) {
    n += s->tail.capacity() + s->sinks.capacity();
    n += s->packed.capacity() * sizeof(PackedRows) + s->escapes.capacity() * sizeof(std::vector<Escape>);
    for (const auto& p : s->packed) n += p.bytes().nbytes();
    for (const auto& e : s->escapes) n += e.capacity() * sizeof(Escape);
    n += s->sealed.capacity() * sizeof(PageVector<std::uint8_t>) + s->tile_at.capacity() * sizeof(std::vector<std::uint32_t>);
    for (const auto& p : s->sealed) n += p.nbytes();
    for (const auto& a : s->tile_at) n += a.capacity() * sizeof(std::uint32_t);
    n += s->open.capacity() * sizeof(std::vector<std::uint8_t>);
    for (const auto& o : s->open) n += o.capacity();
  }
  return n;
}

std::size_t VqKVCache::nbytes_mapped() const {
  std::size_t n = 0;
  for (const SideStore* s : {&ks_, &vs_}) {
    for (const auto& p : s->packed) n += p.bytes().mapped() ? p.bytes().nbytes() : 0;
    for (const auto& p : s->sealed) n += p.mapped() ? p.nbytes() : 0;
  }
  return n;
}

void VqKVCache::PackedRows::resize(std::size_t n) {
  const std::size_t have = bytes_.size();
  if (n > have)
    std::memset(bytes_.append(n - have), 0, n - have);
  else
    bytes_.shrink(n);
}

std::size_t VqKVCache::escapes() const {
  std::size_t n = 0;
  for (const SideStore* s : {&ks_, &vs_})
    for (const auto& e : s->escapes) n += e.size();
  return n;
}

namespace {
// Appends n bytes to a sealed buffer. On the heap it grows to exactly its new size (one copy per
// tile: PageVector's growth by an eighth would leave up to 1/8 of the sealed bytes as spare
// capacity, and nbytes bills it); in its mapping (past kPageVectorHeapBytes) only pages are billed.
std::uint8_t* append_exact(PageVector<std::uint8_t>& v, std::size_t n) {
  if (v.mapped() || v.size() == 0 || v.size() + n > kPageVectorHeapBytes) return v.append(n);
  PageVector<std::uint8_t> grown;
  std::uint8_t* p = grown.append(v.size() + n);  // a first append allocates exactly its size
  std::memcpy(p, v.data(), v.size());
  const std::size_t old = v.size();
  v = std::move(grown);
  return v.data() + old;
}

// The grid offset m_c that a mean holds (mean = vq_offset(m_c, step), float32).
inline std::int32_t offset_of_mean(float mean, float step) {
  return static_cast<std::int32_t>(std::nearbyint(static_cast<double>(mean) / (static_cast<double>(step) * 0.25)));
}

// resident=coded, between updates: the offsets go when the means give them back exactly (they
// always do but for offsets near kVqMaxOffset, where the float32 product may round), as codes() reads them.
template <class SideQuantT>
void drop_offsets(SideQuantT& sq) {
  if (sq.offset.empty() || sq.mean.size() != sq.offset.size()) return;
  for (std::size_t c = 0; c < sq.offset.size(); ++c)
    if (offset_of_mean(sq.mean[c], sq.step) != sq.offset[c] || vq_offset(sq.offset[c], sq.step) != sq.mean[c]) return;
  std::vector<std::int32_t>().swap(sq.offset);
}

// The packed layout (and the widths it came from: packed rows exist only inside an update, where
// 16-bit fields do) of a resident=coded cache between updates.
template <class SideQuantT>
void drop_layout(SideQuantT& sq) {
  std::vector<std::uint8_t>().swap(sq.width);
  std::vector<std::uint32_t>().swap(sq.bit_at);
  std::vector<std::int32_t>().swap(sq.order);
  std::vector<std::uint32_t>().swap(sq.group_byte);
  std::vector<std::uint8_t>().swap(sq.group_width);
  std::vector<float>().swap(sq.field_mean);
}
}  // namespace

void VqKVCache::ensure_layout() {
  if (!calibrated_ || !layer_) return;
  const int H = layer_->kv_heads;
  for (SideQuant* sq : {&kq_, &vq_}) {
    const int n = sq == &kq_ ? layer_->k.n : layer_->v.n;
    if (!sq->bit_at.empty()) continue;
    if (sq->width.empty()) sq->width.assign(sz(n), 16);  // 16 bits: every code fits (|q| <= 32640), nothing escapes
    lay_out(*sq, n, H);
  }
}

void VqKVCache::seal_due() {
  if (!config_.coded) return;
  if (quantized_ > sealed_) {
    const std::int64_t first = sealed_ / kSealTokens * kSealTokens;  // the open tile's first token (or sealed_)
    const std::int64_t rows = quantized_ - first, tiles = rows / kSealTokens, rest = rows % kSealTokens;
    // The open tile's codes (decoded) and the packed rows', after the full tile before them (rows copy from it).
    const std::int64_t from = first >= kSealTokens ? first - kSealTokens : first, all = quantized_ - from;
    const VqLayerCodes lc = codes(from, quantized_);
    const std::int64_t B = lc.batch;
    std::vector<std::uint8_t> bytes;
    for (int side = 0; side < 2; ++side) {
      const VqSideCodes& sc = side == 0 ? lc.k : lc.v;
      SideStore& st = side == 0 ? ks_ : vs_;
      const int n = sc.n;
      if (st.sealed.size() != sz(B)) st.sealed.resize(sz(B)), st.tile_at.resize(sz(B)), st.open.resize(sz(B));
      for (std::int64_t b = 0; b < B; ++b) {
        const std::int16_t* q = sc.codes.data() + sz(b * all + (first - from)) * sz(n);
        // The tile before each new one and its rows that copy from the tile before it.
        const std::int16_t* prev = from < first ? q - sz(kSealTokens) * sz(n) : nullptr;
        std::uint64_t prev_back = prev ? seal::copies_back(st.sealed[sz(b)].data() + st.tile_at[sz(b)].back(), kSealTokens) : 0;
        if (tiles > 0) {
          bytes.clear();
          auto& at = st.tile_at[sz(b)];
          auto& sealed = st.sealed[sz(b)];
          const std::size_t end = sealed.size() >= 8 ? sealed.size() - 8 : 0;  // past the last tile: the 8 zero bytes
          for (std::int64_t i = 0; i < tiles; ++i) {
            at.push_back(static_cast<std::uint32_t>(end + bytes.size()));
            const std::int16_t* tile = q + sz(i * kSealTokens) * sz(n);
            prev_back = seal::encode_tile(tile, kSealTokens, n, bytes, prev, prev_back);
            prev = tile;
          }
          if (sealed.size() >= 8) sealed.shrink(sealed.size() - 8);
          std::uint8_t* dst = append_exact(sealed, bytes.size() + 8);
          std::memcpy(dst, bytes.data(), bytes.size());
          std::memset(dst + bytes.size(), 0, 8);
          if (at.capacity() > at.size()) at.shrink_to_fit();
        }
        // The open tile, coded whole again into a buffer of its size (+ 8 zero bytes), or released.
        bytes.clear();
        if (rest > 0) {
          seal::encode_tile(q + sz(tiles * kSealTokens) * sz(n), rest, n, bytes, prev, prev_back);
          bytes.resize(bytes.size() + 8, 0);
        }
        std::vector<std::uint8_t>(bytes).swap(st.open[sz(b)]);
      }
      // Every packed row and its escapes leave, their per-batch lists too (update makes them again).
      std::vector<PackedRows>().swap(st.packed);
      std::vector<std::vector<Escape>>().swap(st.escapes);
    }
    sealed_ = quantized_;
  }
  drop_layout(kq_);
  drop_layout(vq_);
  drop_offsets(kq_);
  drop_offsets(vq_);
}

void VqKVCache::unseal() {
  if (sealed_ == 0) return;
  ensure_layout();
  const VqLayerCodes lc = codes(0, quantized_);
  const std::int64_t B = lc.batch, Q = quantized_;
  const int H = static_cast<int>(keys_buf_.dim(1));
  std::vector<code_pack::Escape> esc;
  for (int side = 0; side < 2; ++side) {
    const VqSideCodes& sc = side == 0 ? lc.k : lc.v;
    const SideQuant& sq = side == 0 ? kq_ : vq_;
    SideStore& st = side == 0 ? ks_ : vs_;
    st.packed.resize(sz(B)), st.escapes.resize(sz(B));
    for (std::int64_t b = 0; b < B; ++b) {
      PackedRows buf;
      buf.resize(packed_bytes(Q, sq.bit_at[sz(sc.n)]));
      esc.clear();
      code_pack::pack_rows(pack_layout(sq, sc.n, H), sc.codes.data() + sz(b * Q) * sz(sc.n), Q, 0, buf.data(), esc);
      st.packed[sz(b)] = std::move(buf);
      std::vector<Escape> kept;
      append_escapes(kept, esc);
      st.escapes[sz(b)] = std::move(kept);
    }
    st.sealed.clear();
    st.tile_at.clear();
    st.open.clear();
  }
  sealed_ = 0;
  seal_gen_ = next_seal_gen();
}

const std::int16_t* VqKVCache::sealed_row(int side, std::int64_t b, std::int64_t t) const {
  // Two decoded tiles per side per thread, each named by (contents, batch row, tile, its tokens: the
  // open tile grows, and its first tokens' codes stay what they were) and whether it is whole (a
  // tile decoded only as the one before another has its own copies from the tile before it unset).
  // Tiles read in order find the tile before in the other slot.
  struct Slot {
    std::uint64_t gen = 0;
    std::int64_t b = -1, tile = -1, rows = 0;
    bool whole = false;
    std::vector<std::int16_t> codes;
  };
  thread_local Slot slots[2][2];
  Slot* s = slots[side];
  const std::int64_t tile = t / kSealTokens, rows = std::min(kSealTokens, sealed_ - tile * kSealTokens);
  const int n = side == 0 ? layer_->k.n : layer_->v.n;
  const SideStore& st = side == 0 ? ks_ : vs_;
  auto holds = [&](const Slot& x, std::int64_t i, std::int64_t r) { return x.gen == seal_gen_ && x.b == b && x.tile == i && x.rows == r; };
  auto bytes_of = [&](std::int64_t i) {
    const auto& at = st.tile_at[sz(b)];
    return sz(i) < at.size() ? st.sealed[sz(b)].data() + at[sz(i)] : st.open[sz(b)].data();
  };
  auto decode = [&](Slot& x, std::int64_t i, std::int64_t r, const std::int16_t* prev, bool whole) {
    x.codes.resize(sz(kSealTokens) * sz(n));
    seal::decode_tile(bytes_of(i), r, n, x.codes.data(), prev);
    x.gen = seal_gen_, x.b = b, x.tile = i, x.rows = r, x.whole = whole;
  };
  const std::int64_t at_row = t - tile * kSealTokens;
  for (int i = 0; i < 2; ++i)
    if (holds(s[i], tile, rows) && s[i].whole) return s[i].codes.data() + sz(at_row) * sz(n);
  // s[1] becomes the tile before (when this one copies from it), s[0] this tile.
  const std::uint8_t* src = bytes_of(tile);
  const std::int16_t* prev = nullptr;
  if (tile > 0 && seal::copies_back(src, rows) != 0) {
    if (holds(s[0], tile - 1, kSealTokens)) std::swap(s[0], s[1]);
    if (!holds(s[1], tile - 1, kSealTokens)) {
      const std::uint8_t* before = bytes_of(tile - 1);
      decode(s[1], tile - 1, kSealTokens, nullptr, tile - 1 == 0 || seal::copies_back(before, kSealTokens) == 0);
    }
    prev = s[1].codes.data();
  } else if (holds(s[0], tile - 1, kSealTokens)) {
    std::swap(s[0], s[1]);  // keep the tile before for the reader's next tile
  }
  decode(s[0], tile, rows, prev, true);
  return s[0].codes.data() + sz(at_row) * sz(n);
}

VqLayerCodes VqKVCache::codes() const { return codes(0, quantized_); }

VqLayerCodes VqKVCache::codes(std::int64_t t0, std::int64_t t1) const {
  require(0 <= t0 && t0 <= t1 && t1 <= quantized_, "vq codes: tokens [{}, {}) outside the {} quantized", t0, t1, quantized_);
  VqLayerCodes lc;
  lc.batch = offset_ > 0 ? keys_buf_.dim(0) : 0;
  lc.tokens = t1 - t0;
  lc.k.n = layer_ ? layer_->k.n : 1;
  lc.v.n = layer_ ? layer_->v.n : 1;
  lc.k.step = kq_.step;
  lc.v.step = vq_.step;
  lc.k.shift = kq_.shift;
  lc.v.shift = vq_.shift;
  // Offsets: held, or (resident=coded) given back by the means, or 0 before calibration.
  for (int side = 0; side < 2; ++side) {
    const SideQuant& sq = side == 0 ? kq_ : vq_;
    std::vector<std::int32_t>& o = side == 0 ? lc.k.offset : lc.v.offset;
    const int n = side == 0 ? lc.k.n : lc.v.n;
    if (!sq.offset.empty()) {
      o = sq.offset;
    } else {
      o.assign(sz(n), 0);
      if (sq.mean.size() == sz(n))
        for (int c = 0; c < n; ++c) o[sz(c)] = offset_of_mean(sq.mean[sz(c)], sq.step);
    }
  }
  const std::int64_t S = t1 - t0;
  for (int side = 0; side < 2 && S > 0; ++side) {
    const SideQuant& sq = side == 0 ? kq_ : vq_;
    const SideStore& st = side == 0 ? ks_ : vs_;
    VqSideCodes& out = side == 0 ? lc.k : lc.v;
    const int n = out.n;
    out.codes.resize(sz(lc.batch * S) * sz(n));
    for (std::int64_t b = 0; b < lc.batch; ++b) {
      std::int16_t* o = out.codes.data() + sz(b * S) * sz(n);
      for (std::int64_t t = t0; t < t1; ++t) {
        if (t < sealed_) {
          std::copy_n(sealed_row(side, b, t), n, o + (t - t0) * n);
          continue;
        }
        for (int c = 0; c < n; ++c) {
          const unsigned w = sq.width[sz(c)];
          const std::uint32_t f =
              get_field(st.packed[sz(b)].data(), static_cast<std::uint64_t>(t - sealed_) * sq.bit_at[sz(n)] + sq.bit_at[sz(c)], w);
          o[(t - t0) * n + c] = static_cast<std::int16_t>(static_cast<std::int32_t>(f) - (1 << (w - 1)));
        }
      }
      if (sz(b) >= st.escapes.size()) continue;  // none held (resident=coded between updates)
      const auto& esc = st.escapes[sz(b)];  // sorted by (t, c)
      auto it = std::lower_bound(esc.begin(), esc.end(), t0, [](const Escape& e, std::int64_t t) { return e.t < t; });
      for (; it != esc.end() && it->t < t1; ++it) o[sz(it->t - t0) * sz(n) + sz(it->c)] = static_cast<std::int16_t>(it->q);
    }
  }
  return lc;
}

namespace {
// Packed widths from codes alone (restore's rule): per coefficient the width that minimises
// rows x width + escape bits over `rows` rows of n codes. A code needs width w when its bit length
// (of |code|) is < w, so one histogram of bit lengths per coefficient gives every width's escapes.
// The smallest and largest code of codes[0 .. count): int16 lanes throughout (pminsw / pmaxsw; an
// int accumulator made the compiler widen every code to 32 bits).
std::pair<int, int> code_range(const std::int16_t* codes, std::size_t count) {
  std::int16_t lo = 0, hi = 0;
  for (std::size_t i = 0; i < count; ++i) lo = std::min(lo, codes[i]), hi = std::max(hi, codes[i]);
  return {lo, hi};
}

void widths_from_codes(const std::int16_t* codes, std::int64_t rows, int n, std::vector<std::uint8_t>& width) {
  // esc[c][w] = codes of c with bit length >= w, i.e. |code| >= 2^(w-1), for w = 1 .. the longest
  // bit length present (none longer): per row one pass over the coefficients per w, counted in
  // 16-bit lanes (flushed every 65535 rows), which the compiler vectorises (a histogram of bit
  // lengths per code did not).
  const auto [lo, hi] = code_range(codes, sz(rows) * sz(n));
  const int longest = std::bit_width(static_cast<unsigned>(std::max(-lo, hi)));
  std::vector<std::int64_t> esc(sz(n) * 17, 0);  // [c][w]
  std::vector<std::uint16_t> cnt(sz(n) * sz(longest + 1), 0);  // [w][c], w = 1 .. longest
  std::vector<std::uint16_t> mag(sz(n));
  for (std::int64_t r0 = 0; r0 < rows; r0 += 65535) {
    const std::int64_t r1 = std::min<std::int64_t>(rows, r0 + 65535);
    for (std::int64_t r = r0; r < r1; ++r) {
      const std::int16_t* q = codes + sz(r) * sz(n);
      for (int c = 0; c < n; ++c) mag[sz(c)] = static_cast<std::uint16_t>(q[c] < 0 ? -q[c] : q[c]);  // -32768 -> 32768
      for (int w = 1; w <= longest; ++w) {
        std::uint16_t* k = cnt.data() + sz(w) * sz(n);
        const unsigned s = static_cast<unsigned>(w - 1);
        for (int c = 0; c < n; ++c) k[c] = static_cast<std::uint16_t>(k[c] + ((mag[sz(c)] >> s) != 0));
      }
    }
    for (int w = 1; w <= longest; ++w)
      for (int c = 0; c < n; ++c) esc[sz(c) * 17 + sz(w)] += cnt[sz(w) * sz(n) + sz(c)], cnt[sz(w) * sz(n) + sz(c)] = 0;
  }
  width.assign(sz(n), 1);
  for (int c = 0; c < n; ++c) {
    double best = INFINITY;
    for (int w = 1; w <= 16; ++w) {
      const double cost = static_cast<double>(w) * static_cast<double>(rows) + kEscapeBits * static_cast<double>(esc[sz(c) * 17 + sz(w)]);
      if (cost < best) best = cost, width[sz(c)] = static_cast<std::uint8_t>(w);
    }
  }
}

}  // namespace

bool VqKVCache::takes_codes(const VqLayerCodes& in, DType dtype) const {
  if (config_.residual != 0 || config_.sinks != 0 || config_.coded || !layer_ || identity_from_data_) return false;
  const std::int64_t B = in.batch, S = in.tokens;
  require(B >= 1 && S >= 1 && in.k.n == layer_->k.n && in.v.n == layer_->v.n,
          "vq append_codes: codes of batch {}, {} tokens and widths {}/{} do not fit the layer's {}/{}", B, S, in.k.n, in.v.n, layer_->k.n,
          layer_->v.n);
  for (const VqSideCodes* s : {&in.k, &in.v}) {
    require(s->offset.size() == sz(s->n) && (s->shift.empty() || s->shift.size() == sz(s->n)), "vq append_codes: inconsistent code arrays");
    for (std::uint8_t sh : s->shift) require(sh <= kVqMaxShift, "vq append_codes: a code split {} above the coder's {}", sh, kVqMaxShift);
  }
  if (offset_ == 0) return S >= config_.calib;  // else update() would still hold them exact, waiting to calibrate
  if (!calibrated_ || quantized_ != offset_ || B != keys_buf_.dim(0) || dtype != keys_buf_.dtype()) return false;
  return in.k.step == kq_.step && in.v.step == vq_.step && in.k.offset == kq_.offset && in.v.offset == vq_.offset;
}

void VqKVCache::start_from_codes(const VqLayerCodes& in, DType dtype) {
  reset();
  const int H = layer_->kv_heads;
  const std::int64_t B = in.batch;
  keys_buf_ = Tensor::wrap(nullptr, {B, H, 0, layer_->k.n / H}, dtype);
  values_buf_ = Tensor::wrap(nullptr, {B, H, 0, layer_->v.n / H}, dtype);
  for (int side = 0; side < 2; ++side) {
    const VqSideCodes& s = side == 0 ? in.k : in.v;
    SideQuant& q = side == 0 ? kq_ : vq_;
    SideStore& st = side == 0 ? ks_ : vs_;
    q.step = s.step;
    q.offset = s.offset;
    q.shift = s.shift.empty() ? std::vector<std::uint8_t>(sz(s.n), 0) : s.shift;
    q.mean.resize(sz(s.n));
    for (int i = 0; i < s.n; ++i) q.mean[sz(i)] = vq_offset(q.offset[sz(i)], q.step);
    st.packed.clear();
    st.packed.resize(sz(B));
    st.escapes.assign(sz(B), {});
  }
  calibrated_ = true;
}

namespace {
// Widen (a re-pack of every row when escapes cost too much) only when the rows held pass a power
// of 4: a load appends many chunks, and widening after each re-packed the whole cache again and
// again (perf: widen above the packing itself). Widths change memory, never values; the next
// update() widens as it always does.
template <class SideQuantT, class SideStoreT>
void widen_after_append(SideQuantT& sq, SideStoreT& st, int n, int heads, std::int64_t q0, std::int64_t q1) {
  const auto quarter_log = [](std::int64_t r) { return std::bit_width(static_cast<std::uint64_t>(r)) / 2; };
  if (q0 > 0 && quarter_log(q1) > quarter_log(q0)) widen(sq, st, n, heads, q1, 0);
}
}  // namespace

bool VqKVCache::append_codes(const VqLayerCodes& in, DType dtype) {
  if (!takes_codes(in, dtype)) return false;
  const int H = layer_->kv_heads;
  const std::int64_t B = in.batch, S = in.tokens;
  for (const VqSideCodes* s : {&in.k, &in.v}) {
    require(s->codes.size() == sz(B) * sz(S) * sz(s->n), "vq append_codes: inconsistent code arrays");
    const auto [lo, hi] = code_range(s->codes.data(), s->codes.size());  // one pass in int16 lanes, then one check
    require(-lo <= vq_max_code(kVqMaxShift) && hi <= vq_max_code(kVqMaxShift), "vq append_codes: a code ({} or {}) lies beyond the codes' reach",
            lo, hi);
  }
  // --- commit (nothing below throws but allocation) ---
  if (offset_ == 0) {
    start_from_codes(in, dtype);
    for (int side = 0; side < 2; ++side) {  // widths chosen from these codes, as restore() chooses them
      const VqSideCodes& s = side == 0 ? in.k : in.v;
      SideQuant& q = side == 0 ? kq_ : vq_;
      widths_from_codes(s.codes.data(), B * S, s.n, q.width);
      lay_out(q, s.n, H);
    }
  }
  const std::int64_t q0 = quantized_, q1 = quantized_ + S;
  std::vector<code_pack::Escape> esc;
  for (int side = 0; side < 2; ++side) {
    const VqSideCodes& s = side == 0 ? in.k : in.v;
    SideQuant& sq = side == 0 ? kq_ : vq_;
    SideStore& st = side == 0 ? ks_ : vs_;
    const int n = s.n;
    for (std::size_t i = 0; i < s.shift.size(); ++i) sq.shift[i] = std::max(sq.shift[i], s.shift[i]);
    for (std::int64_t b = 0; b < B; ++b) {
      auto& buf = st.packed[sz(b)];
      grow_loaded_rows(buf, q0, q1, sq.bit_at[sz(n)], expected_tokens_);
      esc.clear();
      code_pack::pack_rows(pack_layout(sq, n, H), s.codes.data() + sz(b * S) * sz(n), S, q0, buf.data(), esc);
      append_escapes(st.escapes[sz(b)], esc);
    }
    widen_after_append(sq, st, n, H, q0, q1);
  }
  quantized_ = q1;
  offset_ = q1;
  encoded_size_.reset();
  return true;
}

bool VqKVCache::append_packed(const VqPackedCodes& in, DType dtype) {
  if (!takes_codes(in.meta, dtype)) return false;
  const int H = layer_->kv_heads;
  const std::int64_t B = in.meta.batch, S = in.meta.tokens;
  const int reach = vq_max_code(kVqMaxShift);
  for (const VqPackedSide* p : {&in.k, &in.v}) {
    const int n = p == &in.k ? in.meta.k.n : in.meta.v.n;
    const VqFieldLayout* lay = p->layout.get();
    require(lay && lay->n == n && lay->heads == H && lay->width.size() == sz(n) && lay->order.size() == sz(n) && lay->bit_at.size() == sz(n) + 1 &&
                p->rows.size() == sz(B * S) * lay->row_bytes() + 8,
            "vq append_packed: inconsistent packed arrays");
    for (std::size_t e = 0; e < p->escapes.size(); ++e) {
      const VqPackedEscape& x = p->escapes[e];
      require(x.row >= 0 && x.row < B * S && x.c >= 0 && x.c < n && std::abs(x.q) <= reach &&
                  (e == 0 || x.row > p->escapes[e - 1].row || (x.row == p->escapes[e - 1].row && x.c > p->escapes[e - 1].c)),
              "vq append_packed: an escape out of place or beyond the codes' reach");
    }
  }
  const auto same = [](const SideQuant& q, const VqFieldLayout& l) { return q.width == l.width && q.order == l.order; };
  if (offset_ != 0 && (!same(kq_, *in.k.layout) || !same(vq_, *in.v.layout)))
    return append_codes(vq_unpack_codes(in), dtype);  // packed at another layout (e.g. before a widening): as codes
  // --- commit (nothing below throws but allocation) ---
  if (offset_ == 0) {
    start_from_codes(in.meta, dtype);
    for (int side = 0; side < 2; ++side) {  // the chunk's layout, as it is
      const VqFieldLayout& l = *(side == 0 ? in.k.layout : in.v.layout);
      SideQuant& q = side == 0 ? kq_ : vq_;
      q.width = l.width;
      q.order = l.order;
      q.bit_at = l.bit_at;
      q.group_byte = l.group_byte;
      q.group_width = l.group_width;
      q.field_mean.resize(sz(l.n));
      for (int i = 0; i < l.n; ++i) q.field_mean[sz(i)] = q.mean[sz(q.order[sz(i)])];
    }
  }
  const std::int64_t q0 = quantized_, q1 = quantized_ + S;
  for (int side = 0; side < 2; ++side) {
    const VqPackedSide& p = side == 0 ? in.k : in.v;
    const VqSideCodes& m = side == 0 ? in.meta.k : in.meta.v;
    SideQuant& sq = side == 0 ? kq_ : vq_;
    SideStore& st = side == 0 ? ks_ : vs_;
    const int n = m.n;
    const std::size_t row_bytes = sq.bit_at[sz(n)] / 8;
    for (std::size_t i = 0; i < m.shift.size(); ++i) sq.shift[i] = std::max(sq.shift[i], m.shift[i]);
    std::size_t e = 0;
    for (std::int64_t b = 0; b < B; ++b) {
      auto& buf = st.packed[sz(b)];
      grow_loaded_rows(buf, q0, q1, sq.bit_at[sz(n)], expected_tokens_);
      std::memcpy(buf.data() + sz(q0) * row_bytes, p.rows.data() + sz(b * S) * row_bytes, sz(S) * row_bytes);
      auto& dst = st.escapes[sz(b)];
      std::size_t end = e;
      while (end < p.escapes.size() && p.escapes[end].row < (b + 1) * S) ++end;
      if (dst.empty()) dst.reserve(end - e);
      for (; e < end; ++e) dst.push_back({static_cast<std::int32_t>(p.escapes[e].row - b * S + q0), p.escapes[e].c, p.escapes[e].q});
    }
    widen_after_append(sq, st, n, H, q0, q1);
  }
  quantized_ = q1;
  offset_ = q1;
  encoded_size_.reset();
  return true;
}

VqFieldLayout VqKVCache::field_layout(int side) const {
  const SideQuant& q = side == 0 ? kq_ : vq_;
  VqFieldLayout l;
  if (!calibrated_ || q.width.empty()) return l;
  l.n = static_cast<int>(q.width.size());
  l.heads = layer_ ? layer_->kv_heads : static_cast<int>(keys_buf_.dim(1));
  l.width = q.width;
  l.order = q.order;
  l.bit_at = q.bit_at;
  l.group_byte = q.group_byte;
  l.group_width = q.group_width;
  return l;
}

std::vector<std::uint8_t> VqKVCache::encode() const {
  std::vector<std::uint8_t> out = vq_encode(codes());
  encoded_size_ = out.size();
  return out;
}

CacheBytes VqKVCache::stored_bytes() const {
  if (offset_ == 0) return {};
  if (!encoded_size_) encoded_size_ = quantized_ > 0 ? encode().size() : 0;
  // Exact tokens at what they hold: the tail, and the sinks that also have codes.
  const double exact_tokens = static_cast<double>(offset_ - quantized_ + std::min<std::int64_t>(config_.sinks, quantized_));
  const double exact = exact_tokens * static_cast<double>(keys_buf_.dim(0) * keys_buf_.dim(1)) *
                       static_cast<double>(keys_buf_.dim(3) + values_buf_.dim(3)) * static_cast<double>(dtype_size(keys_buf_.dtype()));
  const double bytes = static_cast<double>(*encoded_size_) + exact;
  return {bytes, bytes};
}

// restore's checks, shared with vq_restored_state (which must refuse exactly what restore refuses).
// Fills an empty shift list with zeros. Returns the layer model restore's cache gets: `layer`, or the
// identity sized from the rows when it is null.
static std::shared_ptr<const VqLayerModel> check_restore(const VqConfig& config, std::shared_ptr<const VqLayerModel> layer,
                                                         VqLayerCodes& codes, const KVState& exact) {
  require(config.sinks == 0, "vq restore: sinks={} keeps exact rows of its first tokens that a .vqkv file does not hold", config.sinks);
  const VqKVCache probe(config, layer);  // the constructor's checks of the config and the layer model
  const Tensor& ek = exact.keys;
  const Tensor& ev = exact.values;
  require(ek.dim(0) == ev.dim(0) && ek.dim(1) == ev.dim(1) && ek.dim(2) == ev.dim(2) && ek.dtype() == ev.dtype() && ek.dim(0) > 0 &&
              ek.dim(1) > 0 && ek.dim(3) > 0 && ev.dim(3) > 0,
          "vq restore: exact keys {} and values {} disagree", shape_string(ek.shape()), shape_string(ev.shape()));
  const std::int64_t B = ek.dim(0), H = ek.dim(1), Q = codes.tokens, T = Q + ek.dim(2);
  if (!layer) {  // the identity sized from the data, as update builds it
    auto m = std::make_shared<VqLayerModel>();
    m->kv_heads = static_cast<int>(H);
    m->head_dim = static_cast<int>(ek.dim(3));
    m->k.n = static_cast<int>(H * ek.dim(3));
    m->v.n = static_cast<int>(H * ev.dim(3));
    layer = std::move(m);
  }
  const VqLayerModel& lm = *layer;
  require(H == lm.kv_heads && H * ek.dim(3) == lm.k.n && H * ev.dim(3) == lm.v.n &&
              (lm.rope_freq.empty() || static_cast<std::int64_t>(lm.rope_freq.size()) * 2 == ek.dim(3)),
          "vq restore: the layer model expects {} heads of K dim {} and V dim {}, the rows have {} heads of {} and {}", lm.kv_heads,
          lm.k.n / lm.kv_heads, lm.v.n / lm.kv_heads, H, ek.dim(3), ev.dim(3));
  require(Q >= 0 && (Q == 0 || (codes.batch == B && codes.k.n == lm.k.n && codes.v.n == lm.v.n)),
          "vq restore: codes of batch {} and widths {}/{} do not match rows of batch {} and the layer's {}/{}", codes.batch, codes.k.n,
          codes.v.n, B, lm.k.n, lm.v.n);
  // The states update leaves: calibrated (Q > 0) once calib tokens have left the exact window, and
  // then every token that has left it is quantized (trim may leave more).
  const std::int64_t due = T - config.residual;
  require(Q > 0 ? Q >= due : due < config.calib,
          "vq restore: {} quantized tokens of {} with residual={} and calib={} is not a state the cache can be in", Q, T, config.residual,
          config.calib);
  if (Q == 0) return layer;
  for (VqSideCodes* s : {&codes.k, &codes.v}) {
    require(s->offset.size() == static_cast<std::size_t>(s->n) && s->codes.size() == sz(B) * sz(Q) * sz(s->n) &&
                (s->shift.empty() || s->shift.size() == static_cast<std::size_t>(s->n)),
            "vq restore: inconsistent code arrays");
    if (s->shift.empty()) s->shift.assign(sz(s->n), 0);
    for (int i = 0; i < s->n; ++i)
      require(s->shift[sz(i)] <= kVqMaxShift, "vq restore: coefficient {} has code split {} above the coder's {}", i, s->shift[sz(i)],
              kVqMaxShift);
    for (std::int16_t q : s->codes)
      require(std::abs(static_cast<int>(q)) <= vq_max_code(kVqMaxShift), "vq restore: a code {} lies beyond the codes' reach", q);
  }
  return layer;
}

std::shared_ptr<VqKVCache> VqKVCache::restore(VqConfig config, std::shared_ptr<const VqLayerModel> layer, VqLayerCodes codes,
                                              const KVState& exact) {
  std::shared_ptr<const VqLayerModel> lm = check_restore(config, layer, codes, exact);
  auto c = std::make_shared<VqKVCache>(config, layer);
  c->layer_ = std::move(lm);
  const Tensor& ek = exact.keys;
  const Tensor& ev = exact.values;
  const std::int64_t B = ek.dim(0), H = ek.dim(1), Q = codes.tokens, T = Q + ek.dim(2);
  if (Q == 0) {  // uncalibrated: every token is exact, and update keeps them so
    if (T > 0) c->update(ek, ev);
    return c;
  }
  c->keys_buf_ = layout_of(ek);
  c->values_buf_ = layout_of(ev);
  for (int side = 0; side < 2; ++side) {
    VqSideCodes& s = side == 0 ? codes.k : codes.v;
    SideQuant& q = side == 0 ? c->kq_ : c->vq_;
    SideStore& st = side == 0 ? c->ks_ : c->vs_;
    const int n = s.n;
    q.step = s.step;
    q.offset = s.offset;
    q.shift = s.shift;
    q.mean.resize(sz(n));
    for (int i = 0; i < n; ++i) q.mean[sz(i)] = vq_offset(q.offset[sz(i)], q.step);
    // Widths from the codes held (per coefficient the width that minimises rows x width + escape
    // bits), then the rows packed at the layout they give.
    widths_from_codes(s.codes.data(), B * Q, n, q.width);
    lay_out(q, n, static_cast<int>(H));
    st.packed.clear();
    st.packed.resize(sz(B));
    st.escapes.assign(sz(B), {});
    std::vector<code_pack::Escape> esc;
    for (std::int64_t b = 0; b < B; ++b) {
      auto& buf = st.packed[sz(b)];
      buf.resize(packed_bytes(Q, q.bit_at[sz(n)]));
      esc.clear();
      code_pack::pack_rows(pack_layout(q, n, static_cast<int>(H)), s.codes.data() + sz(b * Q) * sz(n), Q, 0, buf.data(), esc);
      append_escapes(st.escapes[sz(b)], esc);
    }
    // The exact tail, token-major [t][b][h][d] in the input dtype.
    const Tensor& in = side == 0 ? ek : ev;
    const std::size_t rowb = sz(in.dim(3)) * dtype_size(in.dtype()), tokb = sz(B * H) * rowb;
    st.tail.resize(sz(T - Q) * tokb);
    for (std::int64_t t = 0; t < T - Q; ++t)
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t h = 0; h < H; ++h) std::memcpy(st.tail.data() + sz(t) * tokb + sz(b * H + h) * rowb, in.row(b, h, t), rowb);
  }
  c->calibrated_ = true;
  c->quantized_ = Q;
  c->offset_ = T;
  c->encoded_size_.reset();
  c->seal_due();
  return c;
}

// Tokens [0, lc.tokens) of out.keys / out.values ([batch, H, >= tokens, d], contiguous, any dtype);
// token t's keys re-rotated at position pos0 + t.
static void reconstruct_into(const VqLayerCodes& lc, const VqLayerModel& layer, KVState& out, std::int64_t pos0 = 0) {
  const int H = layer.kv_heads;
  for (int side = 0; side < 2; ++side) {
    Tensor& t = side == 0 ? out.keys : out.values;
    const DType dtype = t.dtype();
    const VqSideCodes& c = side == 0 ? lc.k : lc.v;
    const VqSideTransform& tr = side == 0 ? layer.k : layer.v;
    const int n = c.n, d = n / H;
    std::vector<float> mean(sz(n));
    for (int i = 0; i < n; ++i) mean[sz(i)] = vq_offset(c.offset[sz(i)], c.step);
    const int span = tr.col_span;
    if (!tr.identity() && !tr.inv_cols.empty() && sz(span) * sz(H) * sz(d) == tr.inv_cols.size()) {
      // All tokens of a batch row at once, head by head, through the tiled kernel
      // (reconstruct_kernels.hpp: the per-token path's bits).
      const std::vector<double>& freq = layer.rope_freq;
      const auto rope = side == 0 ? vq_rope_table(freq, pos0 + lc.tokens) : nullptr;
      std::vector<float> yhat(sz(lc.tokens) * sz(n)), rows(dtype == DType::F32 ? 0 : sz(lc.tokens) * sz(d));
      for (std::int64_t b = 0; b < lc.batch; ++b) {
        const std::int16_t* q = c.codes.data() + sz(b * lc.tokens) * sz(n);
        for (std::int64_t tok = 0; tok < lc.tokens; ++tok)
          for (int i = 0; i < n; ++i) yhat[sz(tok) * sz(n) + sz(i)] = mean[sz(i)] + static_cast<float>(q[sz(tok) * sz(n) + sz(i)]) * c.step;
        for (int h = 0; h < H; ++h) {
          float* out = dtype == DType::F32 ? reinterpret_cast<float*>(t.row(b, h, 0)) : rows.data();
          if (lc.tokens > 0)
            vq_head_rows(tr.inv_cols.data() + sz(h) * sz(span) * sz(d), span, d, yhat.data() + (span == n ? 0 : sz(h) * sz(d)), sz(n),
                         lc.tokens, rope.get(), pos0, out);
          if (dtype != DType::F32 && lc.tokens > 0) from_f32(rows.data(), t.row(b, h, 0), dtype, sz(lc.tokens) * sz(d));
        }
      }
      continue;
    }
    std::vector<float> yhat(sz(n)), acc(sz(d)), row(sz(d));
    for (std::int64_t b = 0; b < lc.batch; ++b)
      for (std::int64_t tok = 0; tok < lc.tokens; ++tok) {
        const std::int16_t* q = c.codes.data() + sz(b * lc.tokens + tok) * sz(n);
        for (int i = 0; i < n; ++i) yhat[sz(i)] = mean[sz(i)] + static_cast<float>(q[i]) * c.step;
        for (int h = 0; h < H; ++h) {
          reconstruct_head(tr.identity() ? nullptr : tr.inv.data(), n, yhat.data(), h, d, side == 0 ? &layer.rope_freq : nullptr,
                           pos0 + tok, acc.data(), row.data());
          from_f32(row.data(), t.row(b, h, tok), dtype, sz(d));
        }
      }
  }
}

KVState vq_reconstruct(const VqLayerCodes& lc, const VqLayerModel& layer, DType dtype) { return vq_reconstruct_at(lc, layer, dtype, 0); }

KVState vq_reconstruct_at(const VqLayerCodes& lc, const VqLayerModel& layer, DType dtype, std::int64_t first_position) {
  const int H = layer.kv_heads;
  require(H > 0 && lc.k.n == layer.k.n && lc.v.n == layer.v.n, "vq_reconstruct: the codes do not match the layer model");
  require(first_position >= 0, "vq_reconstruct: first position {} < 0", first_position);
  const std::size_t n = sz(lc.batch) * sz(lc.tokens);
  require(lc.batch >= 0 && lc.tokens >= 0 && lc.k.codes.size() == n * sz(lc.k.n) && lc.v.codes.size() == n * sz(lc.v.n) &&
              lc.k.offset.size() == sz(lc.k.n) && lc.v.offset.size() == sz(lc.v.n),
          "vq_reconstruct: inconsistent code arrays");
  KVState s{Tensor::uninitialized({lc.batch, H, lc.tokens, lc.k.n / H}, dtype), Tensor::uninitialized({lc.batch, H, lc.tokens, lc.v.n / H}, dtype)};
  reconstruct_into(lc, layer, s, first_position);
  return s;
}


KVState vq_restored_state(VqConfig config, std::shared_ptr<const VqLayerModel> layer, VqLayerCodes codes, const KVState& exact) {
  const std::shared_ptr<const VqLayerModel> lm = check_restore(config, std::move(layer), codes, exact);
  const Tensor& ek = exact.keys;
  const Tensor& ev = exact.values;
  const std::int64_t B = ek.dim(0), H = ek.dim(1), Q = codes.tokens, E = ek.dim(2), T = Q + E;
  // restore keeps an uncalibrated cache's rows through update, which refuses NaN / Inf: so here.
  require(Q > 0 || (ek.all_finite() && ev.all_finite()), "vq: keys and values must be finite (NaN or Inf in the input)");
  KVState s{Tensor::uninitialized({B, H, T, ek.dim(3)}, ek.dtype()), Tensor::uninitialized({B, H, T, ev.dim(3)}, ev.dtype())};
  if (Q > 0) reconstruct_into(codes, *lm, s);
  for (int side = 0; side < 2 && E > 0; ++side) {  // the exact rows after the codes, as the cache's tail holds them
    const Tensor& in = side == 0 ? ek : ev;
    Tensor& out = side == 0 ? s.keys : s.values;
    const std::size_t rowb = sz(in.dim(3)) * dtype_size(in.dtype());
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t t = 0; t < E; ++t) std::memcpy(out.row(b, h, Q + t), in.row(b, h, t), rowb);
  }
  return s;
}

}  // namespace vq
