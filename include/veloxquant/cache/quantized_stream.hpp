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
//                entropy of the closed stream is kept incrementally per (slice, channel), and
//                lazily: symbols of newly closed groups enter the histograms when a byte counter
//                is next read, so update_and_fetch never pays for an estimate nobody reads, and
//                a read after a decode step costs O(new tokens). Until the stream holds as many
//                tokens as the symbol alphabet (2^(bits+1) - 1 with deltas), a read counts the
//                few codes afresh instead, so no histogram outweighs the codes it would count.
//                Not thread-safe (as the cache).
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "veloxquant/cache/config.hpp"
#include "veloxquant/core/tensor.hpp"
#include "veloxquant/core/uninit_vector.hpp"
#include "veloxquant/entropy/channel_histograms.hpp"
#include "veloxquant/quant/fused_group_quant.hpp"

namespace vq {

// The saved form of a stream (what the .vqkv container stores): codes, scales and minima per
// slice, and the token counts of its independently quantized pieces.
struct QuantizedStreamParts {
  std::vector<std::int64_t> piece_tokens;           // as QuantizedStream::segment_tokens()
  std::vector<UninitVector<std::uint8_t>> codes;    // [slice][token * D + c]
  std::vector<UninitVector<float>> scales, minima;  // [slice][group * D + c]
};

class QuantizedStream {
 public:
  QuantizedStream() = default;
  QuantizedStream(std::int64_t batch, std::int64_t heads, int dim, int bits, const KVCacheConfig& config);
  // Rebuild a stream from its saved parts (taken by value and moved in). The byte counters are
  // recomputed from the codes, so they equal those of the stream that was saved. Throws
  // InvalidArgument when the parts disagree with the shape, the flush mode or the group size
  // (group_aligned: at most one piece, a whole number of groups; every piece >= 1 token).
  static QuantizedStream from_parts(std::int64_t batch, std::int64_t heads, int dim, int bits, const KVCacheConfig& config,
                                    QuantizedStreamParts parts);

  // Take the S tokens of `input` ([B, H, S, D]) as tokens [begin, begin + S) of the stream:
  // quantize what the flush mode makes ready and write every new row of `dense`
  // ([B, H, capacity >= begin + S, D], same dtype) once, as its reconstruction or (residual) as
  // is. Reading the input directly saves a copy-then-rewrite pass over the dense buffer.
  // Transactional: when the input holds NaN or Inf, or a range that overflows float32, nothing
  // changes (rows of `dense` below `begin` that were overwritten are restored) and the status
  // says why. The input is never scanned separately: the quantizer checks what it reads.
  QuantStatus ingest(Tensor& dense, const Tensor& input, std::int64_t begin);
  // Undo the last successful ingest (when the other side of the same call failed).
  void undo_last_ingest(Tensor& dense);
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
  int group_size() const { return group_size_; }
  FlushMode flush() const { return flush_; }
  // Token counts of the stream's independently quantized pieces, in order (they sum to
  // quantized_tokens()): per_call, one per update_and_fetch call that quantized tokens;
  // group_aligned, the whole closed stream as one piece (none when it is empty).
  std::vector<std::int64_t> segment_tokens() const;
  // Codes of slice s, row-major [quantized_tokens(), D]; scales and minima [n_groups(), D].
  std::span<const std::uint8_t> codes(std::int64_t slice) const;
  std::span<const float> scales(std::int64_t slice) const;
  std::span<const float> minima(std::int64_t slice) const;
  // Bytes of memory held (codes, scales, minima, histograms, the undo copy). Proportional to the
  // tokens held: nothing per (slice, channel) is allocated before a token arrives, and histograms
  // (group_aligned, 4 bytes per alphabet symbol per (slice, channel)) only once each channel holds
  // at least as many codes as the alphabet has symbols.
  std::size_t memory_bytes() const;

 private:
  struct Segment {  // per_call: one update_and_fetch call
    std::int64_t start = 0;
    std::int64_t n_tokens = 0;
    std::int64_t first_group = 0;
    std::uint64_t compressed = 0;  // summed over slices
    std::uint64_t fixed = 0;
  };
  // Quantize rows [row0, row0 + n_rows * n_groups) of one slice as groups group_index, ... of
  // n_rows rows each; row r is read from input row r - begin when r >= begin, else from dense; the
  // reconstruction goes to dense.
  QuantStatus quantize_rows(Tensor& dense, const Tensor& input, std::int64_t begin, std::int64_t slice, std::int64_t row0, int n_rows,
                            std::int64_t group_index, int n_groups = 1);
  void account_segment(Segment& seg) const;
  std::vector<std::int16_t> symbols_of(std::int64_t slice, std::int64_t row0, std::int64_t n_rows) const;
  void add_symbols(std::int64_t slice, std::int64_t row0, std::int64_t n_rows) const;
  void remove_symbols(std::int64_t slice, std::int64_t row0, std::int64_t n_rows) const;
  // The per-slice vectors, on the first ingest of tokens.
  void allocate_slices();
  // Bring the histograms up to quantized_ (group_aligned); creates them on first use.
  void sync_histograms() const;

  std::int64_t batch_ = 0, heads_ = 0;
  int dim_ = 0, bits_ = 4, group_size_ = 32;
  bool use_delta_ = true, per_channel_ = true;
  FlushMode flush_ = FlushMode::GroupAligned;
  std::int64_t quantized_ = 0;                    // tokens with codes
  std::vector<UninitVector<std::uint8_t>> codes_;  // [slice][token * D + c]
  std::vector<UninitVector<float>> scales_, mins_; // [slice][group * D + c]
  // per_call
  std::vector<Segment> segments_;
  std::uint64_t seg_compressed_ = 0, seg_fixed_ = 0;
  // group_aligned: one histogram per (slice, channel), or per slice when pooled
  // Derived state, updated lazily by the const counters (see above).
  mutable ChannelHistograms hist_;
  mutable std::int64_t accounted_ = 0;  // closed tokens whose symbols are in hist_
  FusedGroupScratch scratch_;
  std::vector<const std::byte*> src_rows_;
  // What undo_last_ingest restores: sizes before the ingest, and the residual rows (older than
  // the call) that it overwrote with their reconstruction, per slice.
  struct Undo {
    std::int64_t quantized = 0, groups = 0, rows_begin = 0, rows_end = 0;
    bool pushed_segment = false;
    std::vector<std::byte> rows;
  } undo_;
  void save_undo(const Tensor& dense, std::int64_t rows_begin, std::int64_t rows_end);
  std::vector<std::byte*> dst_rows_;
};

}  // namespace vq
