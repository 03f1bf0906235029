// QuantizedStream: the quantized state of one side (keys or values) of a CacheGenKVCache.
//
// It owns, per (batch, head) slice, the codes of every quantized token, the per-group scales and
// minima, and the byte accounting; the cache owns the dense buffer the model reads, into which the
// stream writes its reconstructions. Slice s is (b, h) = (s / H, s % H).
//
// per_call:      each ingest() quantizes the call's tokens as one segment of their own (the
//                reference). Bytes are computed per segment from the reference formulas.
// group_aligned: tokens are quantized one whole group at a time once group_size of them are
//                present; tokens past the last closed group stay exact (the residual). The
//                entropy of the closed stream is kept incrementally per (slice, channel).
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "veloxquant/cache/config.hpp"
#include "veloxquant/core/tensor.hpp"
#include "veloxquant/entropy/channel_histograms.hpp"

namespace vq {

class QuantizedStream {
 public:
  QuantizedStream() = default;
  QuantizedStream(std::int64_t batch, std::int64_t heads, int dim, int bits, const KVCacheConfig& config);

  // Tokens [begin, end) of `dense` ([B, H, capacity, D]) were just appended. Quantize what the
  // flush mode makes ready and overwrite those rows of `dense` with their reconstruction.
  void ingest(Tensor& dense, std::int64_t begin, std::int64_t end);
  // The cache now holds tokens [0, new_end) only (new_end <= tokens seen). Rolls the codes and the
  // byte counts back; in group_aligned mode a group cut by new_end is reopened (its kept rows,
  // already holding their reconstruction in `dense`, rejoin the residual).
  void trim_to(std::int64_t new_end);

  // Byte counters of the stream as it stands when the cache holds `offset` tokens (the residual,
  // offset - quantized_tokens(), is counted at 2 bytes per element in both).
  std::uint64_t compressed_bytes(std::int64_t offset) const;
  std::uint64_t fixed_width_bytes(std::int64_t offset) const;

  std::int64_t quantized_tokens() const { return quantized_; }
  std::int64_t slices() const { return batch_ * heads_; }
  int dim() const { return dim_; }
  int bits() const { return bits_; }
  std::int64_t n_groups() const;
  // Codes of slice s, row-major [quantized_tokens(), D]; scales and minima [n_groups(), D].
  std::span<const std::uint8_t> codes(std::int64_t slice) const;
  std::span<const float> scales(std::int64_t slice) const;
  std::span<const float> minima(std::int64_t slice) const;
  // Bytes of memory held (codes, scales, minima, histograms).
  std::size_t memory_bytes() const;

 private:
  struct Segment {  // per_call: one update_and_fetch call
    std::int64_t start = 0;
    std::int64_t n_tokens = 0;
    std::int64_t first_group = 0;
    std::uint64_t compressed = 0;  // summed over slices
    std::uint64_t fixed = 0;
  };
  void quantize_rows(Tensor& dense, std::int64_t slice, std::int64_t row0, int n_rows, std::int64_t group_index);
  void account_segment(Segment& seg) const;
  std::vector<std::int16_t> symbols_of(std::int64_t slice, std::int64_t row0, std::int64_t n_rows) const;
  void add_symbols(std::int64_t slice, std::int64_t row0, std::int64_t n_rows);
  void remove_symbols(std::int64_t slice, std::int64_t row0, std::int64_t n_rows);

  std::int64_t batch_ = 0, heads_ = 0;
  int dim_ = 0, bits_ = 4, group_size_ = 32;
  bool use_delta_ = true, per_channel_ = true;
  FlushMode flush_ = FlushMode::GroupAligned;
  std::int64_t quantized_ = 0;                    // tokens with codes
  std::vector<std::vector<std::uint8_t>> codes_;  // [slice][token * D + c]
  std::vector<std::vector<float>> scales_, mins_; // [slice][group * D + c]
  // per_call
  std::vector<Segment> segments_;
  std::uint64_t seg_compressed_ = 0, seg_fixed_ = 0;
  // group_aligned: one histogram per (slice, channel), or per slice when pooled
  ChannelHistograms hist_;
  std::vector<float> scratch_in_, scratch_out_;
};

}  // namespace vq
