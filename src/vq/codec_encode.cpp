// vq/codec.hpp's encoder: a layer's codes into header, models and rANS stream (vq_encode).
#include "veloxquant/vq/codec.hpp"

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

void check_side(const VqSideCodes& s, std::int64_t rows, const char* name) {
  require(s.n >= 1 && s.n <= 65536 && s.offset.size() == sz(s.n) && s.codes.size() == sz(rows) * sz(s.n) &&
              (s.shift.empty() || s.shift.size() == sz(s.n)),
          "vq_encode: {} side has inconsistent sizes (n {}, {} offsets, {} shifts, {} codes for {} rows)", name, s.n,
                      s.offset.size(), s.shift.size(), s.codes.size(), rows);
  require(std::isfinite(s.step) && s.step > 0.0f, "vq_encode: {} step must be finite and > 0", name);
  for (const auto m : s.offset)
    require(m >= -kVqMaxOffset && m <= kVqMaxOffset, "vq_encode: {} offset {} is outside +-{}", name, m, kVqMaxOffset);
  for (int c = 0; c < static_cast<int>(s.shift.size()); ++c)
    require(s.shift[sz(c)] <= kVqMaxShift, "vq_encode: {} shift {} exceeds {}", name, s.shift[sz(c)], kVqMaxShift);
}

// A nibble per coefficient (the shifts; version 5's predictors, vq_pred_nibble), the cheaper of two
// layouts (most sides have none or a few that are not 0):
//   u8 0                       all 0
//   u8 1, varint k, k x (varint gap, u8 value)   sparse: the values that are not 0, gap = index - previous index - 1
//   u8 2, ceil(n / 2) bytes    dense nibbles, coefficient 2i in the low nibble of byte i
// v: n values (or empty: all 0).
void write_nibbles(std::vector<std::uint8_t>& out, const std::vector<std::uint8_t>& v, int n) {
  std::vector<std::uint8_t> sparse;
  std::size_t k = 0;
  int prev = -1;
  for (int c = 0; c < static_cast<int>(v.size()); ++c) {
    if (v[sz(c)] == 0) continue;
    put_varint(sparse, static_cast<std::uint64_t>(c - prev - 1));
    sparse.push_back(v[sz(c)]);
    prev = c;
    ++k;
  }
  if (k == 0) {
    out.push_back(0);
    return;
  }
  std::vector<std::uint8_t> head;
  put_varint(head, k);
  if (head.size() + sparse.size() <= sz(n + 1) / 2) {
    out.push_back(1);
    out.insert(out.end(), head.begin(), head.end());
    out.insert(out.end(), sparse.begin(), sparse.end());
    return;
  }
  out.push_back(2);
  for (int c = 0; c < n; c += 2) out.push_back(static_cast<std::uint8_t>(v[sz(c)] | (c + 1 < n ? v[sz(c + 1)] << 4 : 0)));
}

// Version 5's row copies of a side (codec_predict.hpp): u8 0 (none); or u8 1, varint k, k x (varint
// gap, varint d - 1): the copied rows in order (gap = row - previous copied row - 1), each the copy of
// row - d (d >= 1).
void write_copies(std::vector<std::uint8_t>& out, const std::vector<std::int32_t>& from) {
  std::size_t k = 0;
  for (const auto f : from) k += f >= 0;
  if (k == 0) {
    out.push_back(0);
    return;
  }
  out.push_back(1);
  put_varint(out, k);
  std::int64_t prev = -1;
  for (std::size_t r = 0; r < from.size(); ++r) {
    if (from[r] < 0) continue;
    put_varint(out, static_cast<std::uint64_t>(static_cast<std::int64_t>(r) - prev - 1));
    put_varint(out, r - static_cast<std::size_t>(from[r]) - 1);
    prev = static_cast<std::int64_t>(r);
  }
}

// The reference encoder step (rans.cpp's encode_scalar): x' = (x / f) * M + x % f + c.
inline void enc_put(std::uint32_t& x, std::uint32_t f, std::uint32_t c, int s, std::uint16_t*& ptr) {
  if (x >= (f << (31 - s))) {
    *--ptr = static_cast<std::uint16_t>(x);
    x >>= 16;
  }
  x = ((x / f) << s) + x % f + c;
}

// The scalar reference over region symbols [i0, i1), backwards.
std::uint16_t* encode_region_scalar(std::uint32_t* x, const std::int16_t* hi, std::size_t i0, std::size_t i1, std::size_t base,
                                    std::size_t lanes, const SideModel& sm, const CallTables& t, std::uint16_t* ptr) {
  if (i1 <= i0) return ptr;
  const std::size_t m = sm.m();
  std::size_t j = (i1 - 1) % m;
  for (std::size_t i = i1; i-- > i0;) {
    const FrequencyTable& tb = *t.tables[sz(sm.table[j])];
    const int sym = hi[i] + sm.col_amax[j];
    enc_put(x[(base + i) & (lanes - 1)], tb.freq(sym), tb.cum(sym), sm.col_scale[j], ptr);
    j = j == 0 ? m - 1 : j - 1;
  }
  return ptr;
}

// A buffer of `count` codes: `keep` (a thread's, grown as needed and kept for the next call up to
// 4 Mi codes, 8 MiB: a 7B-shaped side of 4096 tokens) or, beyond, a fresh one owned by temp. The
// encoder's big buffers were allocated and page-faulted afresh in every call (~10 % of an encode).
struct KeptCodes {
  std::unique_ptr<std::int16_t[]> buf;
  std::size_t size = 0;
};
std::int16_t* scratch_codes(KeptCodes& keep, std::size_t count, std::unique_ptr<std::int16_t[]>& temp) {
  if (count <= keep.size) return keep.buf.get();
  if (count <= (sz(1) << 22)) {
    keep.buf.reset(new std::int16_t[count]);
    keep.size = count;
    return keep.buf.get();
  }
  temp.reset(new std::int16_t[count]);
  return temp.get();
}

// Scratch for the encoder's words, kept per thread up to 16 MiB (as rans.cpp's).
std::uint16_t* encode_scratch(std::size_t need, std::unique_ptr<std::uint16_t[]>& temp) {
  thread_local std::unique_ptr<std::uint16_t[]> keep;
  thread_local std::size_t kept = 0;
  if (need <= kept) return keep.get();
  if (need <= (sz(1) << 23)) {
    keep.reset(new std::uint16_t[need]);
    kept = need;
    return keep.get();
  }
  temp.reset(new std::uint16_t[need]);
  return temp.get();
}

}  // namespace

using namespace vq_codec_detail;

std::vector<std::uint8_t> vq_encode(const VqLayerCodes& lc, RansKernel kernel, int version) {
  require(version == 6 || version == 7, "vq_encode: version {} (it writes 6, or 7 for narrow streams)", version);
  const RegionKernels kern = region_kernels(kernel);
  const bool fast = kern.fast();
  const bool simd_prep = kern.encode == &vq_codec_detail::encode_region_avx512;  // the AVX-512 side pass
  require(lc.batch >= 0 && lc.tokens >= 0, "vq_encode: negative batch or token count");
  const std::int64_t rows = lc.rows();
  check_side(lc.k, rows, "K");
  check_side(lc.v, rows, "V");
  const std::size_t R = sz(rows);
  std::vector<std::uint8_t> out;
  out.push_back(static_cast<std::uint8_t>(version));
  put_varint(out, static_cast<std::uint64_t>(lc.batch));
  put_varint(out, static_cast<std::uint64_t>(lc.tokens));
  put_varint(out, static_cast<std::uint64_t>(lc.k.n));
  put_varint(out, static_cast<std::uint64_t>(lc.v.n));
  CallTables tables;
  struct Side {
    const VqSideCodes* s;
    SideModel sm;
    std::unique_ptr<std::int16_t[]> hi_buf;  // the region's codes when not in a kept buffer (scratch_codes)
    const std::int16_t* hi = nullptr;
    std::vector<std::uint16_t> lows;  // [row][low column]
    std::size_t base = 0;             // stream index of the region's first symbol
  };
  Side sides[2] = {{&lc.k, {}, {}, nullptr, {}, 0}, {&lc.v, {}, {}, nullptr, {}, 0}};
  // Per thread: each side's region (residuals) and the hi parts of a split side.
  thread_local KeptCodes kept_codes[3];
  std::size_t n_total = 0;
  for (Side& sd : sides) {
    const VqSideCodes& s = *sd.s;
    const std::size_t n = sz(s.n);
    const bool shifted = has_shifts(s);
    // The hi parts: the codes themselves, or floor(q / 2^shift) column by column, with the range
    // check in the same pass (every entry written: no zero fill).
    std::unique_ptr<std::int16_t[]> his_temp;
    std::int16_t* const his_buf = shifted ? scratch_codes(kept_codes[2], R * n, his_temp) : nullptr;
    const std::int16_t* his = shifted ? his_buf : s.codes.data();
    std::vector<int> hi_amax;
    side_hi(s, R, simd_prep, his_buf, hi_amax, sd.s == &lc.k ? "K" : "V");
    // Version 5: the region codes each hi part's residual from the previous token's, and not at all
    // the rows that repeat an earlier one (codec_predict.hpp).
    std::int16_t* const res = scratch_codes(kept_codes[&sd - sides], R * n, sd.hi_buf);
    std::vector<int> res_amax;
    const auto pred = vq_codec_detail::vq_predict(his, res, n, sz(lc.batch), sz(lc.tokens), kVqMaxCode, &res_amax);
    std::vector<std::uint8_t> pred_nibbles(n);
    bool predicted = false;
    for (std::size_t c = 0; c < n; ++c) {
      pred_nibbles[c] = vq_codec_detail::vq_pred_nibble(pred[c]);
      predicted |= pred[c] != 0;
    }
    const auto copy_from = vq_codec_detail::vq_find_copies(his, n, R);
    std::size_t rc = 0;  // coded rows, compacted in place
    for (std::size_t r = 0; r < R; ++r)
      if (copy_from[r] < 0) {
        if (rc != r) std::copy_n(res + r * n, n, res + rc * n);
        ++rc;
      }
    sd.sm.coded_rows = rc;
    his = res;
    std::uint32_t step_bits;
    std::memcpy(&step_bits, &s.step, 4);
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::uint8_t>(step_bits >> (8 * i)));
    write_nibbles(out, s.shift, s.n);
    write_nibbles(out, pred_nibbles, s.n);
    write_copies(out, copy_from);
    // amax of what the region codes: the hi parts' when they are coded as they are, else the residuals'.
    // (vq_predict's residual amax covers every row: right when no row is left out.)
    if (!predicted && rc == R)
      sd.sm.amax = std::move(hi_amax);
    else if (rc == R)
      sd.sm.amax = std::move(res_amax);
    else
      column_amax(his, n, rc, sd.sm.amax);
    side_models(his, n, rc, simd_prep, sd.sm.amax, sd.sm.param, sd.sm.scale);
    for (int c = 0; c < s.n; ++c) {
      const std::int64_t off = s.offset[sz(c)];
      put_varint(out, off < 0 ? static_cast<std::uint64_t>(-2 * off - 1) : static_cast<std::uint64_t>(2 * off));  // zigzag
      put_varint(out, static_cast<std::uint64_t>(sd.sm.amax[sz(c)]));
      if (sd.sm.amax[sz(c)] > 0) out.push_back(sd.sm.param[sz(c)]);
    }
    sd.sm.derive(s, tables);
    const std::size_t m = sd.sm.m();
    // The region: the coded columns of the coded rows, compacted in place (entry r m + j comes from
    // r n + cols[j] >= it).
    if (m != n)
      for (std::size_t r = 0; r < rc; ++r)
        for (std::size_t j = 0; j < m; ++j) res[r * m + j] = res[r * n + sz(sd.sm.cols[j])];
    sd.hi = res;
    // The low parts [row][low column], row by row (one pass over the codes).
    const std::size_t L = sd.sm.low_cols.size();
    sd.lows.resize(L * R);
    for (std::size_t r = 0; r < R && L; ++r)
      for (std::size_t k = 0; k < L; ++k) {
        const std::size_t c = sz(sd.sm.low_cols[k]);
        sd.lows[r * L + k] = static_cast<std::uint16_t>(s.codes[r * n + c] & ((1 << s.shift[c]) - 1));
      }
    sd.base = n_total;
    n_total += rc * m + sd.lows.size();
  }
  // The fast kernel's encoder constants: every table's symbols in one pool.
  std::vector<std::uint64_t> enc_pool;
  std::vector<std::int32_t> tbase;
  if (fast) {
    for (const FrequencyTable* tb : tables.tables) {
      tbase.push_back(static_cast<std::int32_t>(enc_pool.size()));
      for (int s = 0; s < tb->alphabet_size(); ++s)
        enc_pool.push_back(rans_detail::pack_enc(rans_detail::make_enc_sym(tb->freq(s), tb->cum(s), tb->scale_bits())));
    }
  }
  std::unique_ptr<std::uint16_t[]> temp;
  const std::size_t need = n_total + rans_detail::kEncodeSlackWords;
  std::uint16_t* const buf = encode_scratch(need, temp);
  std::uint16_t* const end = buf + need;
  std::uint16_t* ptr = end;
  const std::size_t lanes = vq_codec_detail::vq_stream_lanes(version, n_total);
  std::uint32_t x[vq_codec_detail::kVqLanes];
  for (auto& v : x) v = kL;
  for (int k = 1; k >= 0; --k) {  // backwards: V, then K; within a side the low parts, then the region
    const Side& sd = sides[k];
    const std::size_t m = sd.sm.m(), N = sd.sm.coded_rows * m, lbase = sd.base + N, L = sd.sm.low_cols.size();
    for (std::size_t l = L; l-- > 0;) {
      const int shift = sd.s->shift[sz(sd.sm.low_cols[l])];
      for (std::size_t r = R; r-- > 0;) enc_put(x[(lbase + l * R + r) & (lanes - 1)], 1, sd.lows[r * L + l], shift, ptr);
    }
    if (N == 0) continue;
    if (!fast || lanes < 32) {
      ptr = encode_region_scalar(x, sd.hi, 0, N, sd.base, lanes, sd.sm, tables, ptr);
      continue;
    }
    std::vector<std::int32_t> per_col(m);
    for (std::size_t j = 0; j < m; ++j) per_col[j] = tbase[sz(sd.sm.table[j])] + sd.sm.col_amax[j];
    const auto enc_off = wrapped(per_col), col_scale = wrapped(std::vector<std::int32_t>(sd.sm.col_scale.begin(), sd.sm.col_scale.end()));
    vq_codec_detail::RegionTables rt;
    rt.m = m;
    rt.lanes = lanes;
    rt.col_scale = col_scale.data();
    rt.uniform_scale = uniform_scale(sd.sm.col_scale);
    rt.enc_off = enc_off.data();
    rt.enc_pool = enc_pool.data();
    // Whole groups (a symbol per lane) start at stream indices divisible by the lanes; the rest goes
    // through the reference.
    const std::size_t g0 = std::min(N, (lanes - sd.base % lanes) % lanes);
    const std::size_t aligned_end = (sd.base + N) / lanes * lanes;
    const std::size_t g1 = aligned_end > sd.base + g0 ? aligned_end - sd.base : g0;
    ptr = encode_region_scalar(x, sd.hi, g1, N, sd.base, lanes, sd.sm, tables, ptr);
    if (g1 > g0) ptr = kern.encode(x, sd.hi, g0, g1, g1 % m, rt, ptr);
    ptr = encode_region_scalar(x, sd.hi, 0, g0, sd.base, lanes, sd.sm, tables, ptr);
  }
  // rans.hpp's stream framing with `lanes` lanes: varint n, min(n, lanes) final states, the words in decoder order.
  const std::size_t words = static_cast<std::size_t>(end - ptr);
  const std::size_t k = std::min<std::size_t>(n_total, lanes);
  put_varint(out, n_total);
  out.resize(out.size() + 4 * k + 2 * words);
  std::uint8_t* o = out.data() + out.size() - 4 * k - 2 * words;
  for (std::size_t j = 0; j < k; ++j, o += 4)
    for (int b = 0; b < 4; ++b) o[b] = static_cast<std::uint8_t>(x[j] >> (8 * b));
  if (words) std::memcpy(o, ptr, 2 * words);
  return out;
}

}  // namespace vq
