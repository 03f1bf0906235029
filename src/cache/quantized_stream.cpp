#include "veloxquant/cache/quantized_stream.hpp"

#include <algorithm>
#include <cstring>

#include "../core/dtype_round.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/entropy/entropy_estimate.hpp"
#include "veloxquant/quant/fused_group_quant.hpp"
#include "veloxquant/quant/group_quant.hpp"
#include "veloxquant/transform/token_delta.hpp"

namespace vq {

QuantizedStream::QuantizedStream(std::int64_t batch, std::int64_t heads, int dim, int bits, const KVCacheConfig& config)
    : batch_(batch),
      heads_(heads),
      dim_(dim),
      bits_(bits),
      group_size_(config.cachegen_group_size),
      use_delta_(config.cachegen_use_delta),
      per_channel_(config.cachegen_per_channel),
      flush_(config.cachegen_flush) {
  check_quant_params(bits, group_size_);
  // Per-slice vectors and histograms are allocated when the first tokens arrive (allocate_slices,
  // sync_histograms): a stream of a wide, empty input costs nothing per (slice, channel).
}

void QuantizedStream::allocate_slices(DType dtype) {
  if (!codes_.empty()) return;
  dtype_ = dtype;
  const auto n = static_cast<std::size_t>(slices());
  codes_.assign(n, PackedRows(dim_, bits_));
  scales_.resize(n);
  mins_.resize(n);
  residual_ = ExactRows(batch_, heads_, dim_, dtype, group_size_ - 1);
}

QuantizedStream QuantizedStream::from_parts(std::int64_t batch, std::int64_t heads, int dim, int bits, const KVCacheConfig& config,
                                            DType dtype, QuantizedStreamParts parts) {
  QuantizedStream q(batch, heads, dim, bits, config);
  const auto n_slices = static_cast<std::size_t>(batch * heads);
  q.allocate_slices(dtype);
  require(parts.codes.size() == n_slices && parts.scales.size() == n_slices && parts.minima.size() == n_slices,
          "quantized stream parts: slice count disagrees with the shape");
  std::int64_t tokens = 0, groups = 0;
  for (const std::int64_t t : parts.piece_tokens) {
    require(t >= 1, "quantized stream parts: empty piece");
    tokens += t;
    groups += (t + q.group_size_ - 1) / q.group_size_;
  }
  if (q.flush_ == FlushMode::GroupAligned)
    require(parts.piece_tokens.size() <= 1 && tokens % q.group_size_ == 0,
            "quantized stream parts: a group_aligned stream is one piece of whole groups");
  const auto d = static_cast<std::size_t>(dim);
  for (std::size_t s = 0; s < n_slices; ++s)
    require(parts.codes[s].size() == static_cast<std::size_t>(tokens) * d && parts.scales[s].size() == static_cast<std::size_t>(groups) * d &&
                parts.minima[s].size() == static_cast<std::size_t>(groups) * d,
            "quantized stream parts: code, scale or minimum count disagrees with the pieces");
  for (std::size_t s = 0; s < n_slices; ++s) {  // packed here; the unpacked parts are freed as we go
    q.codes_[s].reserve(tokens);
    q.codes_[s].append(parts.codes[s].data(), tokens);
    UninitVector<std::uint8_t>().swap(parts.codes[s]);
  }
  const Tensor& r = parts.residual;
  if (!r.empty()) {
    require(r.dim(0) == batch && r.dim(1) == heads && r.dim(3) == dim && r.dtype() == dtype,
            "quantized stream parts: the residual {} {} disagrees with the stream [{}, {}, *, {}] {}", shape_string(r.shape()),
            dtype_name(r.dtype()), batch, heads, dim, dtype_name(dtype));
    require(q.flush_ == FlushMode::GroupAligned && r.dim(2) < q.group_size_,
            "quantized stream parts: a residual of {} tokens (group_aligned streams hold fewer than a group, per_call none)", r.dim(2));
    q.residual_.push(r, 0, r.dim(2));
  }
  q.scales_ = std::move(parts.scales);
  q.mins_ = std::move(parts.minima);
  q.quantized_ = tokens;
  if (q.flush_ == FlushMode::PerCall) {
    std::int64_t start = 0, first_group = 0;
    for (const std::int64_t t : parts.piece_tokens) {
      Segment seg;
      seg.start = start;
      seg.n_tokens = t;
      seg.first_group = first_group;
      q.account_segment(seg);
      q.seg_compressed_ += seg.compressed;
      q.seg_fixed_ += seg.fixed;
      q.segments_.push_back(seg);
      start += t;
      first_group += (t + q.group_size_ - 1) / q.group_size_;
    }
  }
  // group_aligned: the histograms fill lazily from accounted_ = 0 on the first counter read.
  return q;
}

std::int64_t QuantizedStream::n_groups() const {
  if (flush_ == FlushMode::GroupAligned) return quantized_ / group_size_;
  if (segments_.empty()) return 0;
  const Segment& last = segments_.back();
  return last.first_group + (last.n_tokens + group_size_ - 1) / group_size_;
}

std::vector<std::int64_t> QuantizedStream::segment_tokens() const {
  std::vector<std::int64_t> out;
  if (flush_ == FlushMode::GroupAligned) {
    if (quantized_ > 0) out.push_back(quantized_);
    return out;
  }
  out.reserve(segments_.size());
  for (const Segment& seg : segments_) out.push_back(seg.n_tokens);
  return out;
}

// A stream that never received tokens holds no per-slice vectors: each slice is empty.
std::vector<std::uint8_t> QuantizedStream::codes(std::int64_t slice) const {
  require(slice >= 0 && slice < slices(), "codes: slice {} out of range", slice);
  std::vector<std::uint8_t> out(static_cast<std::size_t>(quantized_ * dim_));
  if (quantized_ > 0) codes_[static_cast<std::size_t>(slice)].unpack(0, quantized_, out.data());
  return out;
}
void QuantizedStream::unpack_codes(std::int64_t slice, std::int64_t t0, std::int64_t n, std::uint8_t* out) const {
  require(slice >= 0 && slice < slices() && t0 >= 0 && n >= 0 && t0 + n <= quantized_, "unpack_codes: slice {} tokens [{}, {}) out of range",
          slice, t0, t0 + n);
  if (n > 0) codes_[static_cast<std::size_t>(slice)].unpack(t0, n, out);
}
std::span<const float> QuantizedStream::scales(std::int64_t slice) const {
  require(slice >= 0 && slice < slices(), "scales: slice {} out of range", slice);
  return scales_.empty() ? std::span<const float>() : std::span<const float>(scales_[static_cast<std::size_t>(slice)]);
}
std::span<const float> QuantizedStream::minima(std::int64_t slice) const {
  require(slice >= 0 && slice < slices(), "minima: slice {} out of range", slice);
  return mins_.empty() ? std::span<const float>() : std::span<const float>(mins_[static_cast<std::size_t>(slice)]);
}

QuantStatus QuantizedStream::quantize_rows(const Tensor& input, std::int64_t begin, std::int64_t slice, std::int64_t row0, int n_rows,
                                           std::int64_t group_index, int n_groups) {
  const std::int64_t b = slice / heads_, h = slice % heads_;
  const auto d = static_cast<std::size_t>(dim_);
  const std::size_t total_rows = static_cast<std::size_t>(n_rows) * static_cast<std::size_t>(n_groups);
  // The quantizer also writes each row's reconstruction, which nobody keeps: every row writes the
  // same scratch row (the kernels never read their outputs).
  std::vector<std::byte> sink(d * dtype_size(dtype_));
  std::vector<const std::byte*> src(total_rows);
  std::vector<std::byte*> dst(total_rows, sink.data());
  // Row pointers from the input's token stride (one row() call, not one per row).
  const std::int64_t input_step = input.strides()[2] * static_cast<std::int64_t>(dtype_size(input.dtype()));
  const std::byte* const input0 = input.dim(2) > 0 ? input.row(b, h, 0) : nullptr;
  for (std::size_t r = 0; r < total_rows; ++r) {
    const std::int64_t t = row0 + static_cast<std::int64_t>(r);
    src[r] = t >= begin ? input0 + (t - begin) * input_step : residual_.row(slice, t - quantized_);
  }
  std::vector<std::uint8_t> codes(total_rows * d);
  FusedGroupScratch scratch;
  auto& sc = scales_[static_cast<std::size_t>(slice)];
  auto& mn = mins_[static_cast<std::size_t>(slice)];
  sc.resize(static_cast<std::size_t>(group_index + n_groups) * d);
  mn.resize(sc.size());
  const QuantStatus st = quantize_groups(src.data(), dst.data(), n_groups, n_rows, dim_, bits_, dtype_, codes.data(),
                                         sc.data() + static_cast<std::size_t>(group_index) * d, mn.data() + static_cast<std::size_t>(group_index) * d,
                                         scratch);
  if (st == QuantStatus::Ok) codes_[static_cast<std::size_t>(slice)].append(codes.data(), static_cast<std::int64_t>(total_rows));
  return st;
}

std::vector<std::int16_t> QuantizedStream::symbols_of(std::int64_t slice, std::int64_t row0, std::int64_t n_rows) const {
  // Symbols of rows [row0, row0 + n_rows): the token delta within the stream (row 0 of a stream
  // is kept as is) or the plain codes. In per_call mode each segment is its own stream, so callers
  // pass a segment's first row as row0 and the delta restarts there.
  std::vector<std::uint8_t> rows(static_cast<std::size_t>(n_rows * dim_));
  unpack_codes(slice, row0, n_rows, rows.data());
  if (use_delta_) return token_delta(rows, static_cast<int>(n_rows), dim_);
  return {rows.begin(), rows.end()};
}

void QuantizedStream::account_segment(Segment& seg) const {
  seg.compressed = 0;
  seg.fixed = 0;
  const int ng = static_cast<int>((seg.n_tokens + group_size_ - 1) / group_size_);
  for (std::int64_t s = 0; s < slices(); ++s) {
    const auto sym = symbols_of(s, seg.start, seg.n_tokens);
    seg.compressed += entropy_coded_bytes(sym, static_cast<int>(seg.n_tokens), dim_, bits_, ng, per_channel_);
    seg.fixed += vq::fixed_width_bytes(seg.n_tokens, dim_, bits_, ng);
  }
}

// Delta symbols of rows [row0, row0 + n) of the closed group_aligned stream, per channel.
// Row r's delta needs row r - 1, which is always present (rows are removed from the end only).
void QuantizedStream::add_symbols(std::int64_t slice, std::int64_t row0, std::int64_t n) const {
  const auto d = static_cast<std::size_t>(dim_);
  // The codes of rows [first, row0 + n), unpacked: `codes` indexes them by absolute row.
  const std::int64_t first = (use_delta_ && row0 > 0) ? row0 - 1 : row0;
  std::vector<std::uint8_t> rows(static_cast<std::size_t>(row0 + n - first) * d);
  unpack_codes(slice, first, row0 + n - first, rows.data());
  const auto code = [&](std::size_t at) { return rows[at - static_cast<std::size_t>(first) * d]; };
  const bool bulk = per_channel_ ? n > hist_.alphabet_size() : n * dim_ > hist_.alphabet_size();
  if (!bulk) {  // few symbols (a decode step closing one group at 8 bits): O(1) updates each
    for (std::size_t i = 0; i < static_cast<std::size_t>(n) * d; ++i) {
      const std::size_t at = static_cast<std::size_t>(row0) * d + i;
      const int prev = (use_delta_ && at >= d) ? code(at - d) : 0;
      hist_.add(per_channel_ ? static_cast<std::size_t>(slice) * d + i % d : static_cast<std::size_t>(slice), code(at) - prev);
    }
    return;
  }
  // Many symbols: count them row by row (contiguous in memory), then recompute each histogram's
  // S once from its counts.
  const int lo = hist_.min_symbol(), A = hist_.alphabet_size();
  std::uint32_t* __restrict base = hist_.counts(per_channel_ ? static_cast<std::size_t>(slice) * d : static_cast<std::size_t>(slice));
  // index of symbol 0 of channel c's histogram; a symbol s lands at bin0[c] + s
  std::vector<std::int32_t> bin0(d);
  for (std::size_t c = 0; c < d; ++c) bin0[c] = static_cast<std::int32_t>(per_channel_ ? c * static_cast<std::size_t>(A) : 0) - lo;
  std::vector<std::uint8_t> zero_row(d, 0);
  for (std::int64_t r = row0; r < row0 + n; ++r) {
    const std::uint8_t* __restrict cur = rows.data() + static_cast<std::size_t>(r - first) * d;
    const std::uint8_t* __restrict prev = (use_delta_ && r > 0) ? cur - d : zero_row.data();
    const std::int32_t* __restrict b0 = bin0.data();
    for (std::size_t c = 0; c < d; ++c) ++base[b0[c] + static_cast<std::int32_t>(cur[c]) - static_cast<std::int32_t>(prev[c])];
  }
  if (per_channel_) {
    for (std::size_t c = 0; c < d; ++c) hist_.recount(static_cast<std::size_t>(slice) * d + c, static_cast<std::uint64_t>(n));
  } else {
    hist_.recount(static_cast<std::size_t>(slice), static_cast<std::uint64_t>(n) * d);
  }
}

void QuantizedStream::remove_symbols(std::int64_t slice, std::int64_t row0, std::int64_t n) const {
  const auto d = static_cast<std::size_t>(dim_);
  const std::int64_t first = (use_delta_ && row0 > 0) ? row0 - 1 : row0;
  std::vector<std::uint8_t> rows(static_cast<std::size_t>(row0 + n - first) * d);
  unpack_codes(slice, first, row0 + n - first, rows.data());
  const auto code = [&](std::size_t at) { return rows[at - static_cast<std::size_t>(first) * d]; };
  for (std::size_t i = 0; i < static_cast<std::size_t>(n) * d; ++i) {
    const std::size_t at = static_cast<std::size_t>(row0) * d + i;
    const int prev = (use_delta_ && at >= d) ? code(at - d) : 0;
    const std::size_t hist = per_channel_ ? static_cast<std::size_t>(slice) * d + i % d : static_cast<std::size_t>(slice);
    hist_.remove(hist, code(at) - prev);
  }
}

void QuantizedStream::undo_last_ingest() {
  if (undo_.pushed_segment) {
    seg_compressed_ -= segments_.back().compressed;
    seg_fixed_ -= segments_.back().fixed;
    segments_.pop_back();
  }
  const auto d = static_cast<std::size_t>(dim_);
  for (std::size_t s = 0; s < codes_.size(); ++s) {
    if (codes_[s].rows() > undo_.quantized) codes_[s].truncate(undo_.quantized);
    scales_[s].resize(static_cast<std::size_t>(undo_.groups) * d);
    mins_[s].resize(static_cast<std::size_t>(undo_.groups) * d);
  }
  if (undo_.replaced_residual) {
    residual_ = std::exchange(undo_residual_, ExactRows());
  } else if (residual_.size() > undo_.residual) {
    residual_.truncate(undo_.residual);
  }
  quantized_ = undo_.quantized;
  accounted_ = std::min(accounted_, quantized_);
  undo_ = Undo{quantized_, n_groups(), residual_.size(), false, false};
}

void QuantizedStream::commit_ingest() {
  undo_residual_ = ExactRows();
  undo_.replaced_residual = false;
}

QuantStatus QuantizedStream::ingest(const Tensor& input) {
  const std::int64_t begin = tokens(), end = begin + input.dim(2);
  undo_ = Undo{quantized_, n_groups(), residual_.size(), false, false};
  undo_residual_ = ExactRows();
  if (end <= begin) return QuantStatus::Ok;  // nothing to quantize or keep (and no pass over the slices)
  allocate_slices(input.dtype());
  if (flush_ == FlushMode::PerCall) {
    Segment seg;
    seg.start = begin;
    seg.n_tokens = end - begin;
    seg.first_group = n_groups();
    const std::int64_t ng = (seg.n_tokens + group_size_ - 1) / group_size_;
    for (std::int64_t s = 0; s < slices(); ++s) {
      codes_[static_cast<std::size_t>(s)].reserve(end);
      for (std::int64_t g = 0; g < ng; ++g) {
        const std::int64_t r0 = begin + g * group_size_;
        const QuantStatus st =
            quantize_rows(input, begin, s, r0, static_cast<int>(std::min<std::int64_t>(group_size_, end - r0)), seg.first_group + g, 1);
        if (st != QuantStatus::Ok) {
          undo_last_ingest();
          return st;
        }
      }
    }
    quantized_ = end;
    account_segment(seg);
    seg_compressed_ += seg.compressed;
    seg_fixed_ += seg.fixed;
    segments_.push_back(seg);
    undo_.pushed_segment = true;
    return QuantStatus::Ok;
  }
  // group_aligned: close every group that is now complete (the residual, < one group, and the
  // input's first rows), then keep the rows past the last closed group as the new residual.
  const std::int64_t closed_before = quantized_;
  const std::int64_t closable = std::max(closed_before, (end / group_size_) * group_size_);
  // Groups are quantized a batch at a time: the kernel overlaps one group's reads with the
  // previous group's writes, and the batch's codes (a scratch buffer) stay small.
  constexpr std::int64_t kBatchGroups = 32;
  for (std::int64_t s = 0; s < slices(); ++s) {
    codes_[static_cast<std::size_t>(s)].reserve(closable);
    for (std::int64_t r0 = closed_before; r0 < closable; r0 += kBatchGroups * group_size_) {
      const std::int64_t ng = std::min(kBatchGroups, (closable - r0) / group_size_);
      const QuantStatus st = quantize_rows(input, begin, s, r0, group_size_, r0 / group_size_, static_cast<int>(ng));
      if (st != QuantStatus::Ok) {
        undo_last_ingest();
        return st;
      }
    }
  }
  // The new residual rows are checked too: a NaN must not wait in the residual to fail later.
  const std::int64_t residual_begin = std::max(closable, begin);
  if (residual_begin < end && !input.slice(2, residual_begin - begin, end - begin).all_finite()) {
    undo_last_ingest();
    return QuantStatus::NonFinite;
  }
  if (closable > closed_before) {  // every old residual row is now in a closed group
    undo_residual_ = std::exchange(residual_, ExactRows(batch_, heads_, dim_, dtype_, group_size_ - 1));
    undo_.replaced_residual = true;
  }
  residual_.push(input, residual_begin - begin, end - residual_begin);
  quantized_ = closable;
  return QuantStatus::Ok;
}

void QuantizedStream::trim_to(std::int64_t new_end) {
  require(new_end >= 0 && new_end <= tokens(), "trim_to: end {} outside [0, {}]", new_end, tokens());
  if (new_end >= quantized_) {  // only the residual shrinks
    residual_.truncate(new_end - quantized_);
    return;
  }
  const auto d = static_cast<std::size_t>(dim_);
  residual_.clear();
  if (flush_ == FlushMode::PerCall) {
    while (!segments_.empty() && segments_.back().start >= new_end) {
      seg_compressed_ -= segments_.back().compressed;
      seg_fixed_ -= segments_.back().fixed;
      segments_.pop_back();
    }
    if (!segments_.empty() && segments_.back().start + segments_.back().n_tokens > new_end) {
      Segment& seg = segments_.back();
      seg_compressed_ -= seg.compressed;
      seg_fixed_ -= seg.fixed;
      seg.n_tokens = new_end - seg.start;
      for (auto& c : codes_) c.truncate(new_end);
      quantized_ = new_end;
      account_segment(seg);
      seg_compressed_ += seg.compressed;
      seg_fixed_ += seg.fixed;
    }
    quantized_ = new_end;
    const std::int64_t ng = n_groups();
    for (std::int64_t s = 0; s < slices(); ++s) {
      codes_[static_cast<std::size_t>(s)].truncate(quantized_);
      scales_[static_cast<std::size_t>(s)].resize(static_cast<std::size_t>(ng) * d);
      mins_[static_cast<std::size_t>(s)].resize(static_cast<std::size_t>(ng) * d);
    }
    return;
  }
  // group_aligned: the group cut by new_end reopens; its kept rows rejoin the residual as the
  // values state() showed (the reconstruction in the dtype).
  const std::int64_t keep = (new_end / group_size_) * group_size_;
  if (new_end > keep) {
    const std::size_t row_bytes = d * dtype_size(dtype_);
    const std::int64_t n = new_end - keep;
    std::vector<float> f(static_cast<std::size_t>(n) * d);
    std::vector<std::byte> rows(static_cast<std::size_t>(slices() * n) * row_bytes);
    for (std::int64_t s = 0; s < slices(); ++s) {
      read_tile(s, keep, n, f.data());
      from_f32(f.data(), rows.data() + static_cast<std::size_t>(s * n) * row_bytes, dtype_, f.size());
    }
    residual_.push_rows(rows.data(), n);
  }
  for (std::int64_t s = 0; s < slices(); ++s) {
    if (accounted_ > keep) remove_symbols(s, keep, accounted_ - keep);
    codes_[static_cast<std::size_t>(s)].truncate(keep);
    scales_[static_cast<std::size_t>(s)].resize(static_cast<std::size_t>(keep / group_size_) * d);
    mins_[static_cast<std::size_t>(s)].resize(static_cast<std::size_t>(keep / group_size_) * d);
  }
  quantized_ = keep;
  accounted_ = std::min(accounted_, keep);
}

std::pair<std::int64_t, std::int64_t> QuantizedStream::group_of(std::int64_t t) const {
  if (flush_ == FlushMode::GroupAligned) return {t / group_size_, (t / group_size_ + 1) * group_size_};
  // per_call: the segment holding t (segments are in token order), then its group
  const auto it = std::upper_bound(segments_.begin(), segments_.end(), t, [](std::int64_t x, const Segment& seg) { return x < seg.start; });
  const Segment& seg = *(it - 1);
  const std::int64_t k = (t - seg.start) / group_size_;
  return {seg.first_group + k, std::min(seg.start + (k + 1) * group_size_, seg.start + seg.n_tokens)};
}

void QuantizedStream::read_tile(std::int64_t slice, std::int64_t t0, std::int64_t n, float* out) const {
  const auto d = static_cast<std::size_t>(dim_);
  const std::int64_t end = t0 + n, closed_end = std::min(end, quantized_);
  float* o = out;
  if (t0 < closed_end) {
    const PackedRows& codes = codes_[static_cast<std::size_t>(slice)];
    const float* sc = scales_[static_cast<std::size_t>(slice)].data();
    const float* mn = mins_[static_cast<std::size_t>(slice)].data();
    for (std::int64_t t = t0; t < closed_end;) {  // a run of rows of one group at a time
      const auto [g, g_end] = group_of(t);
      const std::int64_t m = std::min(g_end, closed_end) - t;
      dequant_packed_rows(codes.row(t), codes.row_bytes(), m, dim_, bits_, sc + static_cast<std::size_t>(g) * d,
                          mn + static_cast<std::size_t>(g) * d, o);
      o += static_cast<std::size_t>(m) * d;
      t += m;
    }
    // what state() holds: the reconstruction rounded to the dtype
    round_through(out, static_cast<std::size_t>(closed_end - t0) * d, dtype_);
  }
  const std::int64_t r0 = std::max(t0, quantized_);
  if (r0 < end) residual_.read_f32(slice, r0 - quantized_, end - r0, o);
}

Tensor QuantizedStream::materialise() const {
  const std::int64_t T = tokens();
  if (T == 0) return Tensor();
  Tensor out = Tensor::uninitialized({batch_, heads_, T, dim_}, dtype_);
  const auto d = static_cast<std::size_t>(dim_);
  constexpr std::int64_t kTile = 256;
  std::vector<float> f(static_cast<std::size_t>(std::min(kTile, T)) * d);
  for (std::int64_t s = 0; s < slices(); ++s)
    for (std::int64_t t0 = 0; t0 < T; t0 += kTile) {
      const std::int64_t n = std::min(kTile, T - t0);
      read_tile(s, t0, n, f.data());
      from_f32(f.data(), out.row(s / heads_, s % heads_, t0), dtype_, static_cast<std::size_t>(n) * d);  // rows adjacent
    }
  return out;
}

void QuantizedStream::sync_histograms() const {
  if (flush_ != FlushMode::GroupAligned || accounted_ == quantized_) return;
  if (hist_.count() == 0) {  // first use: histograms exist only for a stream with codes
    const int levels = (1 << bits_) - 1;
    const int lo = use_delta_ ? -levels : 0;
    const auto n = static_cast<std::size_t>(slices());
    hist_ = ChannelHistograms(per_channel_ ? n * static_cast<std::size_t>(dim_) : n, lo, levels - lo + 1);
  }
  for (std::int64_t s = 0; s < slices(); ++s) add_symbols(s, accounted_, quantized_ - accounted_);
  accounted_ = quantized_;
}

std::uint64_t QuantizedStream::compressed_bytes(std::int64_t offset) const {
  const std::uint64_t residual = static_cast<std::uint64_t>(offset - quantized_) * static_cast<std::uint64_t>(slices()) *
                                 static_cast<std::uint64_t>(dim_) * 2;
  if (flush_ == FlushMode::PerCall) return seg_compressed_ + residual;
  if (quantized_ == 0) return residual;
  const std::uint64_t meta = static_cast<std::uint64_t>(n_groups()) * static_cast<std::uint64_t>(dim_) * kGroupMetaBytesPerChannel;
  std::uint64_t total = 0;
  const auto d = static_cast<std::size_t>(dim_);
  const int levels = (1 << bits_) - 1;
  const int lo = use_delta_ ? -levels : 0, alphabet = levels - lo + 1;
  if (per_channel_ && quantized_ < alphabet && hist_.count() == 0) {
    // Fewer tokens per channel than the alphabet has symbols: a histogram per (slice, channel)
    // (4 bytes per symbol, 2 KiB at 8 bits) would dwarf the codes it counts, so count each
    // channel's few symbols afresh, O(codes), in one reused buffer.
    std::vector<std::uint32_t> counts(static_cast<std::size_t>(alphabet), 0);
    const auto n = static_cast<std::size_t>(quantized_);
    std::vector<std::uint8_t> unpacked(n * d);
    for (std::int64_t s = 0; s < slices(); ++s) {
      unpack_codes(s, 0, quantized_, unpacked.data());
      const std::uint8_t* codes = unpacked.data();
      auto symbol = [&](std::size_t t, std::size_t c) {
        return static_cast<std::size_t>(codes[t * d + c] - ((use_delta_ && t > 0) ? codes[(t - 1) * d + c] : 0) - lo);
      };
      double bits = 0.0;
      for (std::size_t c = 0; c < d; ++c) {
        for (std::size_t t = 0; t < n; ++t) ++counts[symbol(t, c)];
        double sum_xlogx = 0.0;
        for (std::size_t t = 0; t < n; ++t)  // each distinct symbol once, clearing the buffer behind it
          if (std::uint32_t& k = counts[symbol(t, c)]; k != 0) {
            sum_xlogx += xlog2x(k);
            k = 0;
          }
        bits += ChannelHistograms::capped_bits_of(n, sum_xlogx, bits_);
      }
      total += code_bits_to_bytes(bits) + meta;
    }
    return total + residual;
  }
  sync_histograms();
  for (std::int64_t s = 0; s < slices(); ++s) {
    double bits = 0.0;
    if (per_channel_) {
      for (std::size_t c = 0; c < d; ++c) bits += hist_.capped_bits(static_cast<std::size_t>(s) * d + c, bits_);
    } else {
      bits = hist_.capped_bits(static_cast<std::size_t>(s), bits_);
    }
    total += code_bits_to_bytes(bits) + meta;
  }
  return total + residual;
}

std::uint64_t QuantizedStream::fixed_width_bytes(std::int64_t offset) const {
  const std::uint64_t residual = static_cast<std::uint64_t>(offset - quantized_) * static_cast<std::uint64_t>(slices()) *
                                 static_cast<std::uint64_t>(dim_) * 2;
  if (flush_ == FlushMode::PerCall) return seg_fixed_ + residual;
  return static_cast<std::uint64_t>(slices()) * vq::fixed_width_bytes(quantized_, dim_, bits_, n_groups()) + residual;
}

std::size_t QuantizedStream::memory_bytes() const {
  std::size_t total = codes_.capacity() * sizeof(codes_[0]) + (scales_.capacity() + mins_.capacity()) * sizeof(scales_[0]) +
                      segments_.capacity() * sizeof(Segment) + hist_.memory_bytes() + residual_.memory_bytes() + undo_residual_.memory_bytes();
  for (std::size_t s = 0; s < codes_.size(); ++s)
    total += codes_[s].memory_bytes() + (scales_[s].capacity() + mins_[s].capacity()) * sizeof(float);
  return total;
}

}  // namespace vq
