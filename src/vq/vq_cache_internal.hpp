// Private to the vq cache's own files (vq_cache*.cpp): the helpers its stages share. Packed rows'
// fields, the layout of a resident cache's dense buffers, and the widening of packed fields
// (quantizer.hpp chooses widths; this re-packs a side when they change).
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "code_pack.hpp"
#include "quantizer.hpp"
#include "veloxquant/vq/vq_cache.hpp"

namespace vq {

namespace detail {
// Names for sealed tiles' contents, unique in the process (the readers' scratch is keyed by it).
std::uint64_t next_seal_gen();
}  // namespace detail

namespace {

inline std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

// Packed fields: width w at bit position `bit` of a buffer with 8 bytes of slack past its rows.
inline std::uint32_t get_field(const std::uint8_t* base, std::uint64_t bit, unsigned w) {
  std::uint64_t v;
  std::memcpy(&v, base + (bit >> 3), 8);
  return static_cast<std::uint32_t>((v >> (bit & 7)) & ((std::uint64_t{1} << w) - 1));
}
inline std::size_t packed_bytes(std::int64_t rows, std::uint32_t row_bits) { return (sz(rows) * row_bits + 7) / 8 + 8; }

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

// The layout a resident cache keeps in keys_buf_ / values_buf_: shape and dtype, no storage.
inline Tensor layout_of(const Tensor& t) { return Tensor::wrap(nullptr, {t.dim(0), t.dim(1), 0, t.dim(3)}, t.dtype()); }

// The grid offset m_c that a mean holds (mean = vq_offset(m_c, step), float32).
inline std::int32_t offset_of_mean(float mean, float step) {
  return static_cast<std::int32_t>(std::nearbyint(static_cast<double>(mean) / (static_cast<double>(step) * 0.25)));
}

// Data that drifts from its calibration escapes more and more codes of a coefficient. Once its
// escapes cost more than one more bit in every row would, the coefficient's field widens to the
// width that minimises rows x width + escape bits over the codes held, and the side is re-packed
// (O(rows x n), rare: each widening at least doubles a field's range). Values never change.
// (A template over the cache's private side types: the header stays as it is.) `rows` packed rows,
// row r holding token base + r (base: the sealed tokens).
template <class SideQuantT, class SideStoreT>
void widen(SideQuantT& sq, SideStoreT& st, int n, int heads, std::int64_t rows, std::int64_t base = 0) {
  using EscapeT = typename std::remove_reference_t<decltype(st.escapes[0])>::value_type;
  const std::int64_t B = static_cast<std::int64_t>(st.packed.size()), R = B * rows;
  std::vector<std::int64_t> count(sz(n), 0);
  for (const auto& e : st.escapes)
    for (const EscapeT& x : e) ++count[sz(x.c)];
  std::vector<std::uint8_t> width = sq.width;
  std::vector<char> over(sz(n), 0);
  bool any = false;
  for (int c = 0; c < n; ++c) {
    over[sz(c)] = static_cast<double>(count[sz(c)]) * vq_quant::kEscapeBits > static_cast<double>(R);
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
      const double cost = static_cast<double>(w) * static_cast<double>(R) + vq_quant::kEscapeBits * static_cast<double>(beyond[sz(c) * 17 + sz(w)]);
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

}  // namespace

}  // namespace vq
