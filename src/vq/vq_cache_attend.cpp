// VqKVCache's attention over its codes: the rows a tile reads (packed, sealed or exact), the
// kernels' view of a head's fields and escapes, and the score / accumulate hooks the attention loop
// calls (cache/attention.hpp). The kernels themselves: vq_attention_kernels.hpp.
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
        vq_transform::reconstruct_head_cols(tr.inv_cols.data() + sz(h) * sz(span) * sz(d), span, yhat.data(), d, freq, t, acc.data(), o);
      else
        vq_transform::reconstruct_head(whole ? tr.inv.data() : nullptr, nc, yhat.data(), whole ? static_cast<int>(h) : 0, d, freq, t, acc.data(), o);
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


}  // namespace vq
