// Packing a vq layer's codes off the cache (vq/packed_codes.hpp), with the cache's packer and
// layout rule (code_pack.hpp).
#include "veloxquant/vq/packed_codes.hpp"

#include <cstdlib>

#include "code_pack.hpp"
#include "veloxquant/core/error.hpp"

namespace vq {

namespace {
std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

void check_side(const VqSideCodes& s, std::int64_t rows, const VqFieldLayout* lay) {
  require(lay != nullptr && lay->n == s.n && s.n >= 1, "vq_pack_codes: a layout of {} coefficients for codes of {}", lay ? lay->n : 0, s.n);
  require(s.offset.size() == sz(s.n) && s.codes.size() == sz(rows) * sz(s.n) && (s.shift.empty() || s.shift.size() == sz(s.n)),
          "vq_pack_codes: inconsistent code arrays");
  for (std::uint8_t sh : s.shift) require(sh <= kVqMaxShift, "vq_pack_codes: a code split {} above the coder's {}", sh, kVqMaxShift);
}

VqPackedSide pack_side(const VqSideCodes& s, std::int64_t rows, std::shared_ptr<const VqFieldLayout> lay, VqPackedSide&& reuse) {
  VqPackedSide out;
  out.rows = std::move(reuse.rows);
  out.escapes = std::move(reuse.escapes);
  out.escapes.clear();
  const code_pack::Layout view = code_pack::pack_layout(*lay, lay->n, lay->heads);
  out.rows.resize(sz(rows) * view.row_bytes() + 8);  // the packer writes every byte of every row; the slack is zeroed below
  std::vector<code_pack::Escape> esc;
  code_pack::pack_rows(view, s.codes.data(), rows, 0, out.rows.data(), esc);
  std::fill(out.rows.end() - 8, out.rows.end(), std::uint8_t{0});
  // The coder's reach: every code outside its field is an escape, so the escapes and the 16-bit
  // fields (which hold up to +-32767) are all that can lie beyond it.
  const int reach = vq_max_code(kVqMaxShift);
  for (const code_pack::Escape& e : esc) {
    require(std::abs(e.q) <= reach, "vq_pack_codes: a code ({}) lies beyond the codes' reach", e.q);
    out.escapes.push_back({e.t, e.c, e.q});
  }
  for (int c = 0; c < s.n; ++c)
    if (lay->width[sz(c)] > 8)
      for (std::int64_t r = 0; r < rows; ++r) {
        const int q = s.codes[sz(r) * sz(s.n) + sz(c)];
        require(std::abs(q) <= reach, "vq_pack_codes: a code ({}) lies beyond the codes' reach", q);
      }
  out.layout = std::move(lay);
  return out;
}
}  // namespace

VqFieldLayout VqFieldLayout::from_widths(std::vector<std::uint8_t> widths, int heads) {
  const auto n = static_cast<int>(widths.size());
  require(heads >= 1 && n >= 1 && n % heads == 0, "vq field layout: {} widths for {} heads", n, heads);
  for (std::uint8_t w : widths) require(w >= 1 && w <= 16, "vq field layout: a width of {} bits (1..16)", w);
  VqFieldLayout l;
  l.n = n;
  l.heads = heads;
  l.width = std::move(widths);
  code_pack::lay_out(l, n, heads);
  return l;
}

VqPackedCodes vq_pack_codes(const VqLayerCodes& codes, std::shared_ptr<const VqFieldLayout> k, std::shared_ptr<const VqFieldLayout> v,
                            VqPackedCodes&& reuse) {
  const std::int64_t rows = codes.rows();
  require(codes.batch >= 1 && codes.tokens >= 1, "vq_pack_codes: codes of batch {} and {} tokens", codes.batch, codes.tokens);
  check_side(codes.k, rows, k.get());
  check_side(codes.v, rows, v.get());
  VqPackedCodes p;
  p.meta.batch = codes.batch;
  p.meta.tokens = codes.tokens;
  for (int side = 0; side < 2; ++side) {
    const VqSideCodes& s = side == 0 ? codes.k : codes.v;
    VqSideCodes& m = side == 0 ? p.meta.k : p.meta.v;
    m = vq_side_params(s);
    if (m.shift.empty()) m.shift.assign(sz(s.n), 0);
  }
  p.k = pack_side(codes.k, rows, std::move(k), std::move(reuse.k));
  p.v = pack_side(codes.v, rows, std::move(v), std::move(reuse.v));
  return p;
}

VqLayerCodes vq_unpack_codes(const VqPackedCodes& p) {
  VqLayerCodes out = p.meta;
  const std::int64_t rows = p.meta.rows();
  for (int side = 0; side < 2; ++side) {
    const VqPackedSide& ps = side == 0 ? p.k : p.v;
    VqSideCodes& s = side == 0 ? out.k : out.v;
    const VqFieldLayout& lay = *ps.layout;
    s.codes.resize(sz(rows) * sz(s.n));
    code_pack::unpack_rows(code_pack::pack_layout(lay, lay.n, lay.heads), ps.rows.data(), rows, s.codes.data());
    for (const VqPackedEscape& e : ps.escapes) s.codes[sz(e.row) * sz(s.n) + sz(e.c)] = static_cast<std::int16_t>(e.q);
  }
  return out;
}

}  // namespace vq
