// vq/codec.hpp's decoder: header, models and rANS stream back into a layer's codes (vq_decode,
// and vq_decode into caller arrays, codec_decode_into.hpp). Every byte is untrusted: bounded
// before it is read, checked before it is used.
#include "veloxquant/vq/codec.hpp"
#include "veloxquant/vq/codec_decode_into.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <unordered_map>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/entropy/rans.hpp"
#include "../entropy/byte_io.hpp"
#include "../entropy/rans_kernels.hpp"
#include "codec_kernels.hpp"
#include "codec_models.hpp"
#include "codec_predict.hpp"

namespace vq {

namespace {

using namespace vq_codec_detail;

// The n nibbles write_nibbles wrote, each <= max (what: the field, for messages).
std::vector<std::uint8_t> read_nibbles(ByteReader& r, int n, int max, const char* what) {
  std::vector<std::uint8_t> v(sz(n), 0);
  const std::uint8_t layout = r.u8();
  if (layout == 0) return v;
  if (layout == 1) {
    const std::uint64_t k = r.varint(static_cast<std::uint64_t>(n), what);
    std::uint64_t at = 0;
    for (std::uint64_t i = 0; i < k; ++i) {
      at += r.varint(static_cast<std::uint64_t>(n), what);
      if (at >= static_cast<std::uint64_t>(n)) r.fail(fmt::format("{} index past the last coefficient", what));
      const std::uint8_t x = r.u8();
      if (x == 0 || x > max) r.fail(fmt::format("sparse {} {} outside 1..{}", what, x, max));
      v[at++] = x;
    }
    return v;
  }
  if (layout != 2) r.fail(fmt::format("unknown {} layout", what));
  for (int c = 0; c < n; c += 2) {
    const std::uint8_t b = r.u8();
    if ((b & 0xf) > max || (b >> 4) > max || (c + 1 == n && (b >> 4) != 0)) r.fail(fmt::format("bad dense {}", what));
    v[sz(c)] = b & 0xf;
    if (c + 1 < n) v[sz(c + 1)] = static_cast<std::uint8_t>(b >> 4);
  }
  return v;
}

// Per row -1 or the row it copies; empty when none. Each copied row < rows, each source < its row.
std::vector<std::int32_t> read_copies(ByteReader& r, std::uint64_t rows) {
  const std::uint8_t layout = r.u8();
  if (layout == 0) return {};
  if (layout != 1) r.fail("unknown row copy layout");
  const std::uint64_t k = r.varint(rows, "row copy count");
  std::vector<std::int32_t> from(sz(static_cast<std::int64_t>(rows)), -1);
  std::uint64_t at = 0;
  for (std::uint64_t i = 0; i < k; ++i) {
    at += r.varint(rows, "row copy gap");
    if (at >= rows) r.fail("row copy past the last row");
    const std::uint64_t d = r.varint(rows, "row copy distance") + 1;
    if (d > at) r.fail("row copy before the first row");
    from[sz(static_cast<std::int64_t>(at))] = static_cast<std::int32_t>(at - d);
    ++at;
  }
  return from;
}

inline void refill(std::uint32_t& x, const std::uint8_t*& p, const std::uint8_t* end) {
  if (x < kL) {
    if (end - p < 2) rans_detail::throw_truncated();
    x = x << 16 | static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8;
    p += 2;
  }
}

// Decoder slot tables of a call: sym[table << 12 | slot] (scalar reference) or the packed entries
// of codec_kernels.hpp (fast kernel; tables with amax <= 127 only), 2^scale entries a table from
// packed_off[table] on. Up to 16 KiB a table, so only up to
// kMaxPoolTables distinct tables (a hostile header names up to 65,280): beyond, the reference
// finds each symbol by a binary search over the cumulative frequencies instead.
constexpr std::size_t kMaxPoolTables = 1024;
struct DecodePools {
  std::vector<std::uint16_t> sym;
  std::vector<std::uint32_t> packed;
  std::vector<std::int32_t> packed_off;
  const std::uint32_t* pool = nullptr;  // the fast kernel's entries (packed_off into it): the model arena, or `packed`
  void build(const CallTables& t, bool fast) {
    if (t.tables.size() > kMaxPoolTables) return;
    const std::size_t M = sz(1) << kVqScaleBits;
    if (fast) {  // a table with amax > 127 has no entries (its side decodes with the reference)
      bool in_arena = true;
      for (std::size_t k = 0; k < t.models.size(); ++k) in_arena = in_arena && (t.amax[k] > 127 || t.models[k]->arena_off >= 0);
      if (in_arena) {  // every model cached: decode from the arena
        for (std::size_t k = 0; k < t.models.size(); ++k) packed_off.push_back(t.amax[k] > 127 ? 0 : t.models[k]->arena_off);
        pool = model_arena();
        return;
      }
      // A model of the call's own: every model's entries one after the other.
      std::size_t total = 0;
      for (const FrequencyTable* tb : t.tables) {
        packed_off.push_back(static_cast<std::int32_t>(total));
        total += tb->total();
      }
      packed.resize(total);
      for (std::size_t k = 0; k < t.tables.size(); ++k)
        if (t.amax[k] <= 127) std::copy_n(t.models[k]->entries(), t.tables[k]->total(), packed.begin() + packed_off[k]);
      pool = packed.data();
      return;
    }
    sym.resize(t.tables.size() * M);
    for (std::size_t k = 0; k < t.tables.size(); ++k) {
      const FrequencyTable& tb = *t.tables[k];
      for (int s = 0; s < tb.alphabet_size(); ++s) std::fill_n(sym.data() + k * M + tb.cum(s), tb.freq(s), static_cast<std::uint16_t>(s));
    }
  }
};

// The symbol whose range holds slot: the last s with cum(s) <= slot.
int find_symbol(const FrequencyTable& t, std::uint32_t slot) {
  int lo = 0, hi = t.alphabet_size() - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.cum(mid) <= slot)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// The scalar reference over region symbols [i0, i1) into hi (codes); sym: DecodePools::sym, or
// null (search).
const std::uint8_t* decode_region_scalar(std::uint32_t* x, std::int16_t* hi, std::size_t i0, std::size_t i1, std::size_t base,
                                         std::size_t lanes, const SideModel& sm, const CallTables& t, const std::uint16_t* sym, const std::uint8_t* p,
                                         const std::uint8_t* end) {
  if (i1 <= i0) return p;
  const std::size_t m = sm.m();
  std::size_t j = i0 % m;
  for (std::size_t i = i0; i < i1; ++i) {
    const std::size_t k = sz(sm.table[j]);
    const FrequencyTable& tb = *t.tables[k];
    std::uint32_t& xi = x[(base + i) & (lanes - 1)];
    const std::uint32_t slot = xi & (tb.total() - 1);
    const int s = sym ? sym[(k << kVqScaleBits) + slot] : find_symbol(tb, slot);
    xi = tb.freq(s) * (xi >> tb.scale_bits()) + slot - tb.cum(s);
    refill(xi, p, end);
    hi[i] = static_cast<std::int16_t>(s - sm.col_amax[j]);
    if (++j == m) j = 0;
  }
  return p;
}

// The fast kernel's scalar steps (heads and tails of a region), from the packed entries.
const std::uint8_t* decode_region_packed(std::uint32_t* x, std::int16_t* hi, std::size_t i0, std::size_t i1, std::size_t base,
                                         const vq_codec_detail::RegionTables& rt, const std::uint8_t* p, const std::uint8_t* end) {
  if (i1 <= i0) return p;
  std::size_t j = i0 % rt.m;
  for (std::size_t i = i0; i < i1; ++i) {
    std::uint32_t& xi = x[(base + i) & (rt.lanes - 1)];
    const int scale = rt.col_scale[j];
    const std::uint32_t e = rt.dec_pool[sz(rt.dec_off[j]) + (xi & ((1u << scale) - 1))];
    xi = (e & kField) * (xi >> scale) + ((e >> 12) & kField);
    refill(xi, p, end);
    hi[i] = static_cast<std::int16_t>(static_cast<std::int32_t>(e) >> 24);
    if (++j == rt.m) j = 0;
  }
  return p;
}

// The parsed header of a layer (any version): shape, sides' quantizer and models.
struct ParsedHeader {
  VqLayerCodes lc;
  std::uint64_t rows = 0;
  SideModel k, v;
};

ParsedHeader parse_header(ByteReader& r, int version, std::uint64_t max_codes, CallTables& t) {
  ParsedHeader h;
  VqLayerCodes& lc = h.lc;
  lc.batch = static_cast<std::int64_t>(r.varint(1u << 20, "batch"));
  lc.tokens = static_cast<std::int64_t>(r.varint(1u << 30, "tokens"));
  lc.k.n = static_cast<int>(r.varint(65536, "n_k"));
  lc.v.n = static_cast<int>(r.varint(65536, "n_v"));
  if (lc.k.n == 0 || lc.v.n == 0) r.fail("a side has no coefficients");
  h.rows = static_cast<std::uint64_t>(lc.batch) * static_cast<std::uint64_t>(lc.tokens);
  if (h.rows > max_codes / static_cast<std::uint64_t>(lc.k.n + lc.v.n))
    r.fail(fmt::format("{} rows of {} coefficients exceed the expected {} codes", h.rows, lc.k.n + lc.v.n, max_codes));
  for (auto [s, sm] : {std::pair{&lc.k, &h.k}, std::pair{&lc.v, &h.v}}) {
    const std::uint32_t step_bits = r.u32le();
    std::memcpy(&s->step, &step_bits, 4);
    if (!std::isfinite(s->step) || s->step <= 0.0f) r.fail("step is not a finite positive float32");
    s->shift = read_nibbles(r, s->n, kVqMaxShift, "shift");
    if (version >= 5) {
      const auto nib = read_nibbles(r, s->n, 15, "predictor");
      if (std::any_of(nib.begin(), nib.end(), [](std::uint8_t v) { return v != 0; }))
        for (const std::uint8_t v : nib) sm->pred.push_back(static_cast<std::int8_t>(vq_codec_detail::vq_pred_from_nibble(v)));
      sm->copy_from = read_copies(r, h.rows);
    }
    sm->coded_rows = sz(static_cast<std::int64_t>(h.rows));
    for (const auto f : sm->copy_from) sm->coded_rows -= f >= 0;
    s->offset.resize(sz(s->n));
    sm->amax.assign(sz(s->n), 0);
    sm->param.assign(sz(s->n), 0);
    for (int c = 0; c < s->n; ++c) {
      const std::uint64_t z = r.varint(2 * static_cast<std::uint64_t>(kVqMaxOffset), "offset");
      s->offset[sz(c)] = (z & 1) ? -static_cast<std::int32_t>((z + 1) / 2) : static_cast<std::int32_t>(z / 2);
      sm->amax[sz(c)] = static_cast<int>(r.varint(kVqMaxCode, "amax"));
      if (sm->amax[sz(c)] > 0) sm->param[sz(c)] = r.u8();
    }
    const int side_scale = version == 3 ? vq_side_scale_bits(*std::max_element(sm->amax.begin(), sm->amax.end())) : kVqScaleBits;
    sm->scale.resize(sz(s->n));
    for (int c = 0; c < s->n; ++c) sm->scale[sz(c)] = version >= 4 ? vq_coef_scale_bits(sm->amax[sz(c)]) : side_scale;
    sm->derive(*s, t);
  }
  return h;
}

// Version 1: one rANS segment per coded column (hi parts), each followed by its low parts.
void decode_v1(ByteReader& r, ParsedHeader& h, const CallTables& t, RansKernel kernel) {
  const std::uint64_t rows = h.rows;
  std::vector<FrequencyTable> lows;
  lows.reserve(sz(h.lc.k.n + h.lc.v.n));
  struct Coded {
    VqSideCodes* side;
    int c, amax, shift;
    bool low;  // the segment of the low parts (else of the hi parts)
  };
  std::vector<Coded> coded;  // per segment
  std::vector<const FrequencyTable*> seg_table;
  for (auto [s, sm] : {std::pair{&h.lc.k, &h.k}, std::pair{&h.lc.v, &h.v}}) {
    for (int c = 0; c < s->n; ++c) {
      const int shift = s->shift[sz(c)], amax = sm->amax[sz(c)];
      if (amax > 0) {
        const auto j = static_cast<std::size_t>(std::lower_bound(sm->cols.begin(), sm->cols.end(), c) - sm->cols.begin());
        seg_table.push_back(t.tables[sz(sm->table[j])]);
        coded.push_back({s, c, amax, shift, false});
      }
      if (shift > 0) {
        lows.push_back(low_table(shift));
        seg_table.push_back(&lows.back());
        coded.push_back({s, c, amax, shift, true});
      }
    }
    s->codes.assign(sz(static_cast<std::int64_t>(rows)) * sz(s->n), 0);
  }
  std::vector<std::uint16_t> symbols(coded.size() * rows);
  std::vector<RansDecodeSegment> segments;
  for (std::size_t i = 0; i < coded.size(); ++i) segments.push_back({std::span<std::uint16_t>(symbols).subspan(i * rows, rows), seg_table[i]});
  rans_decode(r.rest(), segments, kernel);  // FormatError on a corrupt, short or long payload
  // q = hi * 2^shift + low; hi segments come before their low segments, so hi is placed first.
  for (std::size_t i = 0; i < coded.size(); ++i) {
    const Coded& k = coded[i];
    for (std::uint64_t row = 0; row < rows; ++row) {
      std::int16_t& q = k.side->codes[row * sz(k.side->n) + sz(k.c)];
      const int sym = symbols[i * rows + row];
      q = static_cast<std::int16_t>(k.low ? q + sym : (sym - k.amax) * (1 << k.shift));
    }
  }
}

// The decoder of one side's region (stream symbols base .. base + coded_rows * m): the lane states,
// the word pointer, and how symbols are decoded (the fast kernel and its packed tables, or the
// scalar reference with sym, DecodePools::sym or null).
struct SideDecoder {
  std::uint32_t* x;
  const SideModel& sm;
  const CallTables& t;
  const std::uint16_t* sym;
  decltype(&vq_codec_detail::decode_region_avx2) kernel;  // null: the scalar reference
  vq_codec_detail::RegionTables rt;
  std::size_t base;
  std::size_t lanes;  // the stream's lanes (32 or 64)
  const std::uint8_t* p;
  const std::uint8_t* end;
  // Region symbols [i0, i1) into out[i - sbase] (sbase % m == 0, so columns follow from out's index).
  void decode(std::int16_t* out, std::size_t i0, std::size_t i1, std::size_t sbase) {
    const std::size_t b = base + sbase;
    std::size_t i = i0 - sbase;
    const std::size_t n = i1 - sbase;
    if (!kernel) {
      p = decode_region_scalar(x, out, i, n, b, lanes, sm, t, sym, p, end);
      return;
    }
    // Whole groups (one symbol per lane) from a stream index divisible by the lanes; the head and
    // the rest one by one.
    const std::size_t head = std::min(n, i + (lanes - (b + i) % lanes) % lanes);
    p = decode_region_packed(x, out, i, head, b, rt, p, end);
    i = head;
    if (n > i) p = kernel(x, out, i, n, i % rt.m, rt, p, end);
    p = decode_region_packed(x, out, i, n, b, rt, p, end);
  }
};

// Region symbols a chunk decodes into the decoder's scratch: 16 KiB of codes (L1), then each row
// is finished into the side's codes.
constexpr std::size_t kDecodeChunk = 8192;

// Decodes a side's region and writes its hi parts into s.codes [rows, n] (every entry): the region's
// rows are decoded a chunk at a time into a small scratch buffer and each row finished from there
// (its coded columns placed, the uncoded ones 0; version 5's prediction undone from the finished
// previous token; copied rows copied), so the codes are written once and never zero-filled. A side
// coded as it is (every column, no prediction, no copies) is decoded straight into s.codes; a
// predicted one with every column coded and no copies, with the AVX-512 kernel, too (the kernel
// finishes each group as it stores it: codec_kernels.hpp's PredictRows).
// False when a rebuilt hi part leaves +-kVqMaxCode (a corrupt stream); FormatError from the rANS steps.
bool decode_side_hi(SideDecoder& d, VqSideCodes& s, std::size_t batch, std::size_t tokens, int simd) {
  const SideModel& sm = d.sm;
  const std::size_t m = sm.m(), n = sz(s.n), R = batch * tokens, N = sm.coded_rows * m;
  if (m == n && sm.pred.empty() && sm.copy_from.empty()) {
    if (N > 0) d.decode(s.codes.data(), 0, N, 0);
    return true;
  }
  std::vector<std::int16_t> k16(n, 0);
  for (std::size_t c = 0; c < sm.pred.size(); ++c) k16[c] = sm.pred[c];
  const bool predicted = !sm.pred.empty();
  // Predicted, every column coded, no copies, rows of whole groups: the AVX-512 kernel finishes each
  // group as it stores it (codec_kernels.hpp's PredictRows); what it leaves is decoded by the
  // reference steps into place and finished row by row.
  if (m == n && predicted && sm.copy_from.empty() && d.kernel == &vq_codec_detail::decode_region_avx512 && n % d.lanes == 0 &&
      d.base % d.lanes == 0 && N > 0) {
    const std::vector<std::int16_t> zero(n, 0);
    vq_codec_detail::PredictRows pr{k16.data(), zero.data(), n, tokens, false};
    std::int16_t* const codes = s.codes.data();
    std::size_t i = 0;
    d.p = vq_codec_detail::decode_region_pred_avx512(d.x, codes, i, N, d.rt, pr, d.p, d.end);
    if (pr.bad) return false;
    const std::size_t done = i;
    d.p = decode_region_packed(d.x, codes, i, N, d.base, d.rt, d.p, d.end);
    for (std::size_t row = done / n; row < R; ++row) {
      const std::size_t c0 = row == done / n ? done % n : 0;
      std::int16_t* out = codes + row * n;
      const std::int16_t* prev = row % tokens != 0 ? out - n + c0 : nullptr;
      if (!vq_codec_detail::vq_unpredict_row(out + c0, out + c0, prev, k16.data() + c0, n - c0, kVqMaxCode, simd)) return false;
    }
    return true;
  }
  std::vector<std::int16_t> wide(m == n ? 0 : n, 0);  // a coded row with its uncoded columns (0)
  std::int16_t* const codes = s.codes.data();
  std::size_t row = 0;  // the next row of the side to finish
  // Finishes rows up to and including the next coded one (res: its m region codes); copied rows
  // before it are copies of earlier finished rows.
  auto finish = [&](const std::int16_t* res) {
    for (; !sm.copy_from.empty() && sm.copy_from[row] >= 0; ++row)
      std::memcpy(codes + row * n, codes + sz(sm.copy_from[row]) * n, 2 * n);
    std::int16_t* out = codes + row * n;
    if (m != n) {
      for (std::size_t j = 0; j < m; ++j) wide[sz(sm.cols[j])] = res[j];
      res = wide.data();
    }
    const std::int16_t* prev = predicted && row % tokens != 0 ? out - n : nullptr;
    ++row;
    return vq_codec_detail::vq_unpredict_row(out, res, prev, k16.data(), n, kVqMaxCode, simd);
  };
  if (m == 0) {
    for (std::size_t k = 0; k < sm.coded_rows; ++k)
      if (!finish(wide.data())) return false;
  } else {
    // Chunks end at stream indices divisible by the lanes (whole groups for the kernel); the scratch
    // holds a partial row carried over plus one chunk.
    std::vector<std::int16_t> scratch(m + kDecodeChunk + 64);
    std::size_t i = 0, sbase = 0;  // next region symbol; region index of scratch[0] (a row start)
    while (i < N) {
      const std::size_t goal = (d.base + i + kDecodeChunk) / d.lanes * d.lanes - d.base;
      const std::size_t i1 = std::min(N, goal);
      d.decode(scratch.data(), i, i1, sbase);
      i = i1;
      const std::size_t full = i / m;  // coded rows complete
      for (std::size_t k = sbase / m; k < full; ++k)
        if (!finish(scratch.data() + (k * m - sbase))) return false;
      const std::size_t carry = i - full * m;
      if (carry) std::memmove(scratch.data(), scratch.data() + (full * m - sbase), 2 * carry);
      sbase = full * m;
    }
  }
  for (; row < R; ++row) std::memcpy(codes + row * n, codes + sz(sm.copy_from[row]) * n, 2 * n);  // trailing copies
  return true;
}

}  // namespace

using namespace vq_codec_detail;

VqLayerCodes vq_decode(std::span<const std::uint8_t> bytes, std::uint64_t max_codes, RansKernel kernel) {
  VqLayerCodes out;
  vq_decode(bytes, max_codes, out, kernel);
  return out;
}

void vq_decode(std::span<const std::uint8_t> bytes, std::uint64_t max_codes, VqLayerCodes& out, RansKernel kernel) {
  const RegionKernels kern = region_kernels(kernel);
  const bool fast = kern.fast();
  ByteReader r(bytes, "vq layer");
  const std::uint8_t version = r.u8();
  if (version < 1 || version > 7) r.fail(fmt::format("unknown version {} (expected 1 to 7)", version));
  CallTables tables;
  ParsedHeader h = parse_header(r, version, max_codes, tables);
  if (version == 1) {
    decode_v1(r, h, tables, kernel);
    out = std::move(h.lc);
    return;
  }
  // The caller's code buffers: every code is written below, so storage of the right size is
  // reused as it is (no zero fill).
  h.lc.k.codes.swap(out.k.codes);
  h.lc.v.codes.swap(out.v.codes);
  const std::size_t R = sz(static_cast<std::int64_t>(h.rows));
  std::size_t n_total = 0;
  for (const SideModel* sm : {&h.k, &h.v}) n_total += sm->coded_rows * sm->m() + R * sm->low_cols.size();
  // rans.hpp's stream header.
  const std::uint64_t n = r.varint(~0ull, "symbol count");
  if (n != n_total) r.fail(fmt::format("the rANS stream holds {} symbols, the header implies {}", n, n_total));
  const std::size_t lanes = vq_codec_detail::vq_stream_lanes(version, n_total);
  std::uint32_t x[vq_codec_detail::kVqLanes];
  for (auto& v : x) v = kL;
  for (std::size_t j = 0; j < std::min<std::size_t>(n_total, lanes); ++j) {
    x[j] = r.u32le();
    if (x[j] < kL || x[j] >= (kL << 16)) r.fail(fmt::format("state of lane {} = {} is outside [2^15, 2^31)", j, x[j]));
  }
  const auto words = r.rest();
  if (words.size() % 2) r.fail("the rANS payload has an odd number of bytes");
  const std::uint8_t* p = words.data();
  const std::uint8_t* const end = p + words.size();
  DecodePools pools;
  if (R > 0) pools.build(tables, fast);
  std::size_t base = 0;
  const int simd = kern.decode == &vq_codec_detail::decode_region_avx512 ? 2 : fast ? 1 : 0;
  for (auto [s, sm] : {std::pair{&h.lc.k, &h.k}, std::pair{&h.lc.v, &h.v}}) {
    const std::size_t m = sm->m(), n_side = sz(s->n), N = sm->coded_rows * m;
    s->codes.resize(R * n_side);  // every code is written below (no zero fill needed)
    const bool side_fast = fast && lanes >= 32 && pools.pool != nullptr && std::all_of(sm->col_amax.begin(), sm->col_amax.end(), [](int a) { return a <= 127; });
    if (!side_fast && N > 0 && pools.sym.empty()) pools.build(tables, false);  // a fast call's side with amax > 127
    SideDecoder d{x, *sm, tables, pools.sym.empty() ? nullptr : pools.sym.data(), side_fast ? kern.decode : nullptr, {}, base, lanes, p, end};
    std::vector<std::int32_t> per_col, dec_off, col_scale;
    if (side_fast && m > 0) {
      per_col.resize(m);
      for (std::size_t j = 0; j < m; ++j) per_col[j] = pools.packed_off[sz(sm->table[j])];
      dec_off = wrapped(per_col);
      col_scale = wrapped(std::vector<std::int32_t>(sm->col_scale.begin(), sm->col_scale.end()));
      d.rt.m = m;
      d.rt.lanes = lanes;
      d.rt.col_scale = col_scale.data();
      d.rt.uniform_scale = uniform_scale(sm->col_scale);
      d.rt.dec_off = dec_off.data();
      d.rt.dec_pool = pools.pool;
    }
    if (!decode_side_hi(d, *s, sz(h.lc.batch), sz(h.lc.tokens), simd)) r.fail("a predicted hi part leaves +-255 (corrupt stream)");
    p = d.p;
    base += N;
    // The low parts, column after column in the stream: decoded into lows[row][column], then
    // merged row by row (one pass over the codes instead of one strided pass per column).
    const std::size_t L = sm->low_cols.size();
    std::unique_ptr<std::uint16_t[]> lows(L ? new std::uint16_t[L * R] : nullptr);
    for (std::size_t l = 0; l < L; ++l) {
      const int shift = s->shift[sz(sm->low_cols[l])];
      const std::uint32_t lmask = (1u << shift) - 1;
      for (std::size_t row = 0; row < R; ++row, ++base) {
        std::uint32_t& xi = x[base & (lanes - 1)];
        lows[row * L + l] = static_cast<std::uint16_t>(xi & lmask);
        xi >>= shift;  // freq 1, cum = low: x = (x >> shift) + low - low
        refill(xi, p, end);
      }
    }
    // The rows were finished long before (the region comes first in the stream), so their lines
    // are fetched ahead: without, this loop waited on a miss per split column and row (~6 % of a
    // 7B-shaped layer's decode).
    constexpr std::size_t kAhead = 8;
    for (std::size_t row = 0; row < R && L; ++row)
      for (std::size_t l = 0; l < L; ++l) {
        const std::size_t c = sz(sm->low_cols[l]);
        if (row + kAhead < R) __builtin_prefetch(s->codes.data() + (row + kAhead) * n_side + c, 1);
        std::int16_t& q = s->codes[row * n_side + c];
        q = static_cast<std::int16_t>(q * (1 << s->shift[c]) + static_cast<int>(lows[row * L + l]));
      }
  }
  if (p != end) r.fail(fmt::format("{} rANS renormalisation words left over (corrupt)", (end - p) / 2));
  for (std::size_t j = 0; j < lanes; ++j)
    if (x[j] != kL) r.fail(fmt::format("rANS lane {} did not return to its initial state (corrupt stream)", j));
  out = std::move(h.lc);
}

}  // namespace vq
