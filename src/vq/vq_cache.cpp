// VqKVCache, our `vq` method's layer cache: its life cycle (construct, update, trim, what it holds).
// The stages it composes have their own files: the transform (transform.hpp), the quantizer
// (quantizer.hpp), resident storage's sealed tiles (vq_cache_seal.cpp), attention over the codes
// (vq_cache_attend.cpp, kernels in vq_attention_kernels.hpp) and codes in and out: the codec,
// loads and restore (vq_cache_codes.cpp, vq/codec.hpp). The design: docs/methods.md, "vq".
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
#include "quantizer.hpp"
#include "transform.hpp"
#include "vq_attention_kernels.hpp"
#include "vq_cache_internal.hpp"

namespace vq {

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
    : config_(config), layer_(std::move(layer)), identity_from_data_(!layer_), seal_gen_(detail::next_seal_gen()) {
  config_.validate();
  if (layer_)
    require(layer_->kv_heads > 0 && layer_->k.n % layer_->kv_heads == 0 && layer_->v.n % layer_->kv_heads == 0,
            "vq: inconsistent layer model");
}

void VqKVCache::reset() {
  calibrated_ = false;
  quantized_ = 0;
  sealed_ = 0;
  seal_gen_ = detail::next_seal_gen();
  kq_ = SideQuant();  // move-assigned: `kq_ = vq_ = SideQuant()` copied an empty vq_ into kq_, which kept kq_'s capacity (billed)
  vq_ = SideQuant();
  ks_ = SideStore();
  vs_ = SideStore();
  encoded_size_.reset();
}

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
      if (freq) vq_transform::vq_unrope(x.data(), static_cast<int>(H), d, rope_tab->at(t), freq->size());
      vq_transform::vq_forward(tr, x.data(), y);
    };
    Work& w = work[side];
    const SideQuant& current = side == 0 ? kq_ : vq_;
    if (calibrate_now) {
      std::vector<double> y(sz(B * config_.calib) * sz(n));
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t t = 0; t < config_.calib; ++t) transformed(t, b, y.data() + sz(b * config_.calib + t) * sz(n));
      vq_quant::calibrate_side(y, n, config_.bits + (side == 0 ? config_.k_offset : config_.v_offset), w.q.step, w.q.offset, w.q.mean, w.q.shift,
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
          const double v = vq_transform::round_even((y[sz(c)] - wq.mean[sz(c)]) * inv_step);
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

std::pair<Tensor, Tensor> VqKVCache::update_and_fetch(const Tensor& keys, const Tensor& values) {
  update(keys, values);
  return {materialise(0), materialise(1)};
}

KVState VqKVCache::state() const {
  if (offset_ == 0) return {};
  return {materialise(0), materialise(1)};
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
  seal_gen_ = detail::next_seal_gen();  // a change (tokens past the new end may come back with other rows): read_rows' kept tiles go
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

namespace detail {
std::uint64_t next_seal_gen() {
  static std::atomic<std::uint64_t> gen{0};
  return ++gen;
}
}  // namespace detail

}  // namespace vq
