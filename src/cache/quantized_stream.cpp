#include "veloxquant/cache/quantized_stream.hpp"

#include <algorithm>
#include <cstring>

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

void QuantizedStream::allocate_slices() {
  if (!codes_.empty()) return;
  const auto n = static_cast<std::size_t>(slices());
  codes_.resize(n);
  scales_.resize(n);
  mins_.resize(n);
}

QuantizedStream QuantizedStream::from_parts(std::int64_t batch, std::int64_t heads, int dim, int bits, const KVCacheConfig& config,
                                            QuantizedStreamParts parts) {
  QuantizedStream q(batch, heads, dim, bits, config);
  const auto n_slices = static_cast<std::size_t>(batch * heads);
  q.allocate_slices();
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
  q.codes_ = std::move(parts.codes);
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
std::span<const std::uint8_t> QuantizedStream::codes(std::int64_t slice) const {
  require(slice >= 0 && slice < slices(), "codes: slice {} out of range", slice);
  return codes_.empty() ? std::span<const std::uint8_t>() : std::span<const std::uint8_t>(codes_[static_cast<std::size_t>(slice)]);
}
std::span<const float> QuantizedStream::scales(std::int64_t slice) const {
  require(slice >= 0 && slice < slices(), "scales: slice {} out of range", slice);
  return scales_.empty() ? std::span<const float>() : std::span<const float>(scales_[static_cast<std::size_t>(slice)]);
}
std::span<const float> QuantizedStream::minima(std::int64_t slice) const {
  require(slice >= 0 && slice < slices(), "minima: slice {} out of range", slice);
  return mins_.empty() ? std::span<const float>() : std::span<const float>(mins_[static_cast<std::size_t>(slice)]);
}

QuantStatus QuantizedStream::quantize_rows(Tensor& dense, const Tensor& input, std::int64_t begin, std::int64_t slice,
                                           std::int64_t row0, int n_rows, std::int64_t group_index, int n_groups) {
  const std::int64_t b = slice / heads_, h = slice % heads_;
  const auto d = static_cast<std::size_t>(dim_);
  const int total_rows = n_rows * n_groups;
  src_rows_.resize(static_cast<std::size_t>(total_rows));
  dst_rows_.resize(static_cast<std::size_t>(total_rows));
  // Row pointers from each tensor's token stride (one row() call per tensor, not two per row).
  const std::int64_t esz = static_cast<std::int64_t>(dtype_size(dense.dtype()));
  const std::int64_t dense_step = dense.strides()[2] * esz, input_step = input.strides()[2] * esz;
  std::byte* const dense0 = dense.row(b, h, 0);
  const std::byte* const input0 = input.row(b, h, 0);
  for (int r = 0; r < total_rows; ++r) {
    const std::int64_t t = row0 + r;
    src_rows_[static_cast<std::size_t>(r)] = t >= begin ? input0 + (t - begin) * input_step : dense0 + t * dense_step;
    dst_rows_[static_cast<std::size_t>(r)] = dense0 + t * dense_step;
  }
  auto& codes = codes_[static_cast<std::size_t>(slice)];
  auto& sc = scales_[static_cast<std::size_t>(slice)];
  auto& mn = mins_[static_cast<std::size_t>(slice)];
  codes.resize(static_cast<std::size_t>(row0 + total_rows) * d);
  sc.resize(static_cast<std::size_t>(group_index + n_groups) * d);
  mn.resize(sc.size());
  return quantize_groups(src_rows_.data(), dst_rows_.data(), n_groups, n_rows, dim_, bits_, dense.dtype(),
                         codes.data() + static_cast<std::size_t>(row0) * d, sc.data() + static_cast<std::size_t>(group_index) * d,
                         mn.data() + static_cast<std::size_t>(group_index) * d, scratch_);
}

std::vector<std::int16_t> QuantizedStream::symbols_of(std::int64_t slice, std::int64_t row0, std::int64_t n_rows) const {
  // Symbols of rows [row0, row0 + n_rows): the token delta within the stream (row 0 of a stream
  // is kept as is) or the plain codes. In per_call mode each segment is its own stream, so callers
  // pass a segment's first row as row0 and the delta restarts there.
  const auto& codes = codes_[static_cast<std::size_t>(slice)];
  const auto d = static_cast<std::size_t>(dim_);
  std::span<const std::uint8_t> rows(codes.data() + static_cast<std::size_t>(row0) * d, static_cast<std::size_t>(n_rows) * d);
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
  const std::uint8_t* codes = codes_[static_cast<std::size_t>(slice)].data();
  const bool bulk = per_channel_ ? n > hist_.alphabet_size() : n * dim_ > hist_.alphabet_size();
  if (!bulk) {  // few symbols (a decode step closing one group at 8 bits): O(1) updates each
    for (std::size_t i = 0; i < static_cast<std::size_t>(n) * d; ++i) {
      const std::size_t at = static_cast<std::size_t>(row0) * d + i;
      const int prev = (use_delta_ && at >= d) ? codes[at - d] : 0;
      hist_.add(per_channel_ ? static_cast<std::size_t>(slice) * d + i % d : static_cast<std::size_t>(slice), codes[at] - prev);
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
    const std::uint8_t* __restrict cur = codes + static_cast<std::size_t>(r) * d;
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
  const auto& codes = codes_[static_cast<std::size_t>(slice)];
  for (std::size_t i = 0; i < static_cast<std::size_t>(n) * d; ++i) {
    const std::size_t at = static_cast<std::size_t>(row0) * d + i;
    const int prev = (use_delta_ && at >= d) ? codes[at - d] : 0;
    const std::size_t hist = per_channel_ ? static_cast<std::size_t>(slice) * d + i % d : static_cast<std::size_t>(slice);
    hist_.remove(hist, codes[at] - prev);
  }
}

void QuantizedStream::save_undo(const Tensor& dense, std::int64_t rows_begin, std::int64_t rows_end) {
  undo_.quantized = quantized_;
  undo_.groups = n_groups();
  undo_.rows_begin = rows_begin;
  undo_.rows_end = rows_end;
  undo_.pushed_segment = false;
  const std::size_t row_bytes = static_cast<std::size_t>(dim_) * dtype_size(dense.dtype());
  undo_.rows.resize(static_cast<std::size_t>(std::max<std::int64_t>(0, rows_end - rows_begin) * slices()) * row_bytes);
  std::byte* out = undo_.rows.data();
  for (std::int64_t s = 0; s < slices(); ++s)
    for (std::int64_t t = rows_begin; t < rows_end; ++t, out += row_bytes) std::memcpy(out, dense.row(s / heads_, s % heads_, t), row_bytes);
}

void QuantizedStream::undo_last_ingest(Tensor& dense) {
  const std::size_t row_bytes = static_cast<std::size_t>(dim_) * dtype_size(dense.dtype());
  const std::byte* in = undo_.rows.data();
  for (std::int64_t s = 0; s < slices(); ++s)
    for (std::int64_t t = undo_.rows_begin; t < undo_.rows_end; ++t, in += row_bytes)
      std::memcpy(dense.row(s / heads_, s % heads_, t), in, row_bytes);
  if (undo_.pushed_segment) {
    seg_compressed_ -= segments_.back().compressed;
    seg_fixed_ -= segments_.back().fixed;
    segments_.pop_back();
  }
  const auto d = static_cast<std::size_t>(dim_);
  for (std::size_t s = 0; s < codes_.size(); ++s) {
    codes_[s].resize(static_cast<std::size_t>(undo_.quantized) * d);
    scales_[s].resize(static_cast<std::size_t>(undo_.groups) * d);
    mins_[s].resize(static_cast<std::size_t>(undo_.groups) * d);
  }
  quantized_ = undo_.quantized;
  accounted_ = std::min(accounted_, quantized_);
  undo_.rows_begin = undo_.rows_end = 0;
  undo_.pushed_segment = false;
}

QuantStatus QuantizedStream::ingest(Tensor& dense, const Tensor& input, std::int64_t begin) {
  const std::int64_t end = begin + input.dim(2);
  if (end <= begin) {  // nothing to quantize or copy (and no pass over the slices of an empty input)
    undo_ = Undo{quantized_, n_groups(), 0, 0, false, {}};
    return QuantStatus::Ok;
  }
  allocate_slices();
  if (flush_ == FlushMode::PerCall) {
    save_undo(dense, begin, begin);  // a segment only writes rows at or after begin
    Segment seg;
    seg.start = begin;
    seg.n_tokens = end - begin;
    seg.first_group = n_groups();
    const std::int64_t ng = (seg.n_tokens + group_size_ - 1) / group_size_;
    for (std::int64_t s = 0; s < slices(); ++s)
      for (std::int64_t g = 0; g < ng; ++g) {
        const std::int64_t r0 = begin + g * group_size_;
        const QuantStatus st =
            quantize_rows(dense, input, begin, s, r0, static_cast<int>(std::min<std::int64_t>(group_size_, end - r0)), seg.first_group + g);
        if (st != QuantStatus::Ok) {
          undo_last_ingest(dense);
          return st;
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
  // group_aligned: close every group that is now complete, then copy the new residual rows.
  const std::int64_t closed_before = quantized_;
  const std::int64_t closable = std::max(closed_before, (end / group_size_) * group_size_);
  save_undo(dense, closed_before, std::min(begin, closable));  // older residual rows about to be rewritten
  const auto d = static_cast<std::size_t>(dim_);
  const std::size_t row_bytes = d * dtype_size(dense.dtype());
  for (std::int64_t s = 0; s < slices(); ++s) {
    auto& codes = codes_[static_cast<std::size_t>(s)];
    if (codes.capacity() < static_cast<std::size_t>(closable) * d)
      codes.reserve(std::max(static_cast<std::size_t>(closable) * d, codes.capacity() * 2));
    if (closable > closed_before) {  // all of this slice's newly closed groups in one call
      const QuantStatus st = quantize_rows(dense, input, begin, s, closed_before, group_size_, closed_before / group_size_,
                                           static_cast<int>((closable - closed_before) / group_size_));
      if (st != QuantStatus::Ok) {
        undo_last_ingest(dense);
        return st;
      }
    }
  }
  // The new residual rows are checked too: a NaN must not wait in the residual to fail later.
  // One check of the whole new residual (all slices, rows [residual_begin, end)) before copying.
  const std::int64_t residual_begin = std::max(closable, begin);
  if (residual_begin < end && !input.slice(2, residual_begin - begin, end - begin).all_finite()) {
    undo_last_ingest(dense);
    return QuantStatus::NonFinite;
  }
  for (std::int64_t s = 0; s < slices(); ++s) {
    const std::int64_t b = s / heads_, h = s % heads_;
    for (std::int64_t t = residual_begin; t < end; ++t) std::memcpy(dense.row(b, h, t), input.row(b, h, t - begin), row_bytes);
  }
  quantized_ = closable;
  return QuantStatus::Ok;
}

void QuantizedStream::trim_to(std::int64_t new_end) {
  require(new_end >= 0, "trim_to: negative end");
  if (quantized_ == 0) return;  // no codes (perhaps no per-slice vectors) to roll back
  const auto d = static_cast<std::size_t>(dim_);
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
      for (auto& c : codes_) c.resize(static_cast<std::size_t>(new_end) * d);
      account_segment(seg);
      seg_compressed_ += seg.compressed;
      seg_fixed_ += seg.fixed;
    }
    quantized_ = std::min(quantized_, new_end);
    const std::int64_t ng = n_groups();
    for (std::int64_t s = 0; s < slices(); ++s) {
      codes_[static_cast<std::size_t>(s)].resize(static_cast<std::size_t>(quantized_) * d);
      scales_[static_cast<std::size_t>(s)].resize(static_cast<std::size_t>(ng) * d);
      mins_[static_cast<std::size_t>(s)].resize(static_cast<std::size_t>(ng) * d);
    }
    return;
  }
  if (new_end >= quantized_) return;  // only the residual shrinks
  const std::int64_t keep = (new_end / group_size_) * group_size_;
  for (std::int64_t s = 0; s < slices(); ++s) {
    if (accounted_ > keep) remove_symbols(s, keep, accounted_ - keep);
    codes_[static_cast<std::size_t>(s)].resize(static_cast<std::size_t>(keep) * d);
    scales_[static_cast<std::size_t>(s)].resize(static_cast<std::size_t>(keep / group_size_) * d);
    mins_[static_cast<std::size_t>(s)].resize(static_cast<std::size_t>(keep / group_size_) * d);
  }
  quantized_ = keep;
  accounted_ = std::min(accounted_, keep);
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
    for (std::int64_t s = 0; s < slices(); ++s) {
      const std::uint8_t* codes = codes_[static_cast<std::size_t>(s)].data();
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
                      hist_.memory_bytes() + undo_.rows.capacity();
  for (std::size_t s = 0; s < codes_.size(); ++s)
    total += codes_[s].capacity() + (scales_[s].capacity() + mins_[s].capacity()) * sizeof(float);
  return total;
}

}  // namespace vq
