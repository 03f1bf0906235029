// VqKVCache's codes in and out: the codes it holds (codes()), loads in the code domain
// (append_codes, append_packed: a store's chunks), its coded form (encode, vq/codec.hpp), restore
// from codes, and vq_reconstruct / vq_reconstruct_at (the decoder a .vqkv or store load runs).
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
    const auto [lo, hi] = vq_quant::code_range(s->codes.data(), s->codes.size());  // one pass in int16 lanes, then one check
    require(-lo <= vq_max_code(kVqMaxShift) && hi <= vq_max_code(kVqMaxShift), "vq append_codes: a code ({} or {}) lies beyond the codes' reach",
            lo, hi);
  }
  // --- commit (nothing below throws but allocation) ---
  if (offset_ == 0) {
    start_from_codes(in, dtype);
    for (int side = 0; side < 2; ++side) {  // widths chosen from these codes, as restore() chooses them
      const VqSideCodes& s = side == 0 ? in.k : in.v;
      SideQuant& q = side == 0 ? kq_ : vq_;
      vq_quant::widths_from_codes(s.codes.data(), B * S, s.n, q.width);
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
    vq_quant::widths_from_codes(s.codes.data(), B * Q, n, q.width);
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
      // Scratch kept per thread: a loader decodes chunk after chunk on the same threads, and fresh
      // buffers (zeroed, and above malloc's mmap threshold) cost each chunk their page faults.
      thread_local std::vector<float> yhat, rows;
      if (yhat.size() < sz(lc.tokens) * sz(n)) yhat.resize(sz(lc.tokens) * sz(n));
      if (dtype != DType::F32 && rows.size() < sz(lc.tokens) * sz(d)) rows.resize(sz(lc.tokens) * sz(d));
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
          vq_transform::reconstruct_head(tr.identity() ? nullptr : tr.inv.data(), n, yhat.data(), h, d, side == 0 ? &layer.rope_freq : nullptr,
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
