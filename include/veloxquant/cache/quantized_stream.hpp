// QuantizedStream: the resident state of one side (keys or values) of a CacheGenKVCache.
//
// It owns, per (batch, head) slice, the codes of every quantized token packed at the stream's bit
// width (transform/packed_rows.hpp: a row of D codes in ceil(D * bits / 8) bytes), the per-group
// float32 scales and minima, the exact residual (tokens not yet in a closed group, in the input
// dtype: cache/exact_rows.hpp), and the byte accounting. Nothing else: no dense reconstruction is
// kept. read_tile() dequantizes rows straight from the codes (what attention reads); materialise()
// writes the whole reconstruction into a tensor (what state() returns). Slice s is
// (b, h) = (s / H, s % H).
//
// per_call:      each ingest() quantizes the call's tokens as one segment of their own (the
//                reference). Bytes are computed per segment from the reference formulas. No
//                residual.
// group_aligned: tokens are quantized one whole group at a time once group_size of them are
//                present; tokens past the last closed group stay exact (the residual, < group_size
//                tokens). The entropy of the closed stream is kept incrementally per (slice,
//                channel), and lazily: symbols of newly closed groups enter the histograms when a
//                byte counter is next read, so an update never pays for an estimate nobody reads,
//                and a read after a decode step costs O(new tokens). Until the stream holds as many
//                tokens as the symbol alphabet (2^(bits+1) - 1 with deltas), a read counts the few
//                codes afresh instead, so no histogram outweighs the codes it would count. The
//                histograms (4 bytes per alphabet symbol per (slice, channel)) are derived state,
//                held and counted in memory_bytes() only once a counter has been read.
//                Not thread-safe (as the cache).
#pragma once
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "veloxquant/cache/config.hpp"
#include "veloxquant/cache/exact_rows.hpp"
#include "veloxquant/core/tensor.hpp"
#include "veloxquant/core/uninit_vector.hpp"
#include "veloxquant/entropy/channel_histograms.hpp"
#include "veloxquant/quant/fused_group_quant.hpp"
#include "veloxquant/transform/packed_rows.hpp"

namespace vq {

// The saved form of a stream (what the .vqkv container stores): codes, scales and minima per
// slice, the token counts of its independently quantized pieces, and the exact residual.
struct QuantizedStreamParts {
  std::vector<std::int64_t> piece_tokens;           // as QuantizedStream::segment_tokens()
  std::vector<UninitVector<std::uint8_t>> codes;    // [slice][token * D + c], unpacked (one code a byte)
  std::vector<UninitVector<float>> scales, minima;  // [slice][group * D + c]
  Tensor residual;                                  // [B, H, residual tokens, D] in the stream's dtype; may be empty
};

class QuantizedStream {
 public:
  QuantizedStream() = default;
  QuantizedStream(std::int64_t batch, std::int64_t heads, int dim, int bits, const KVCacheConfig& config);
  // Rebuild a stream from its saved parts (taken by value; the codes are packed). The byte
  // counters are recomputed from the codes, so they equal those of the stream that was saved.
  // Throws InvalidArgument when the parts disagree with the shape, the dtype, the flush mode or the
  // group size (group_aligned: at most one piece, a whole number of groups, a residual shorter than
  // a group; per_call: no residual; every piece >= 1 token), or a code does not fit in `bits`.
  static QuantizedStream from_parts(std::int64_t batch, std::int64_t heads, int dim, int bits, const KVCacheConfig& config, DType dtype,
                                    QuantizedStreamParts parts);

  // Take the S tokens of `input` ([B, H, S, D]) as tokens [tokens(), tokens() + S) of the stream:
  // quantize what the flush mode makes ready (reading old residual rows and the input directly)
  // and keep the rest in the residual. The first ingest of an empty stream fixes its dtype; later
  // inputs must have it (the cache checks). Transactional: when the input holds NaN or Inf, or a
  // range that overflows float32, nothing changes and the status says why. The input is never
  // scanned separately: the quantizer checks what it reads.
  QuantStatus ingest(const Tensor& input);
  // Undo the last successful ingest (when the other side of the same call failed), or drop what
  // keeps it undoable (commit_ingest, once both sides succeeded: frees the replaced residual).
  void undo_last_ingest();
  void commit_ingest();
  // The stream now holds tokens [0, new_end) only (new_end <= tokens()). Rolls the codes and the
  // byte counts back; in group_aligned mode a group cut by new_end is reopened (its kept rows,
  // dequantized to the dtype exactly as state() showed them, rejoin the residual).
  void trim_to(std::int64_t new_end);

  // Byte counters of the stream as it stands when the cache holds `offset` tokens (the residual,
  // offset - quantized_tokens(), is counted at 2 bytes per element in both).
  std::uint64_t compressed_bytes(std::int64_t offset) const;
  std::uint64_t fixed_width_bytes(std::int64_t offset) const;

  std::int64_t quantized_tokens() const { return quantized_; }
  std::int64_t residual_tokens() const { return residual_.size(); }
  std::int64_t tokens() const { return quantized_ + residual_.size(); }
  std::int64_t batch() const { return batch_; }
  std::int64_t heads() const { return heads_; }
  std::int64_t slices() const { return batch_ * heads_; }
  int dim() const { return dim_; }
  int bits() const { return bits_; }
  DType dtype() const { return dtype_; }
  std::int64_t n_groups() const;
  int group_size() const { return group_size_; }
  FlushMode flush() const { return flush_; }
  // Token counts of the stream's independently quantized pieces, in order (they sum to
  // quantized_tokens()): per_call, one per update call that quantized tokens;
  // group_aligned, the whole closed stream as one piece (none when it is empty).
  std::vector<std::int64_t> segment_tokens() const;
  // Codes of slice s, unpacked (a copy), row-major [quantized_tokens(), D]; unpack_codes writes
  // rows [t0, t0 + n) of them into out ([n, D]). Scales and minima [n_groups(), D].
  std::vector<std::uint8_t> codes(std::int64_t slice) const;
  void unpack_codes(std::int64_t slice, std::int64_t t0, std::int64_t n, std::uint8_t* out) const;
  std::span<const float> scales(std::int64_t slice) const;
  std::span<const float> minima(std::int64_t slice) const;
  // The packed codes of slice s and the exact residual, as held.
  const PackedRows& packed_codes(std::int64_t slice) const { return codes_.at(static_cast<std::size_t>(slice)); }
  const ExactRows& residual() const { return residual_; }

  // Tokens [t0, t0 + n) of slice s (t0 + n <= tokens()) as float32 rows into out ([n, D]): closed
  // tokens dequantized from their codes and rounded through the dtype (so they equal
  // materialise()'s values exactly), residual tokens converted exactly. The caller checks the range.
  void read_tile(std::int64_t slice, std::int64_t t0, std::int64_t n, float* out) const;
  // The whole reconstruction, a fresh tensor [B, H, tokens(), D] in the dtype (empty when no tokens).
  Tensor materialise() const;

  // Bytes of memory held: packed codes, scales, minima, the residual, the per_call segment list
  // and (once a byte counter has been read, group_aligned) the histograms; every vector at its
  // capacity. Proportional to the tokens held: nothing per slice is allocated before a token arrives.
  std::size_t memory_bytes() const;

 private:
  struct Segment {  // per_call: one update call
    std::int64_t start = 0;
    std::int64_t n_tokens = 0;
    std::int64_t first_group = 0;
    std::uint64_t compressed = 0;  // summed over slices
    std::uint64_t fixed = 0;
  };
  // Quantize n_groups groups of n_rows rows of slice s, tokens [row0, ...): token t is read from
  // the residual when t < begin (the stream's token count before the ingest), else from input row
  // t - begin. Appends the packed codes and writes the groups' scales and minima (group_index ...).
  QuantStatus quantize_rows(const Tensor& input, std::int64_t begin, std::int64_t slice, std::int64_t row0, int n_rows,
                            std::int64_t group_index, int n_groups);
  void account_segment(Segment& seg) const;
  std::vector<std::int16_t> symbols_of(std::int64_t slice, std::int64_t row0, std::int64_t n_rows) const;
  void add_symbols(std::int64_t slice, std::int64_t row0, std::int64_t n_rows) const;
  void remove_symbols(std::int64_t slice, std::int64_t row0, std::int64_t n_rows) const;
  // The per-slice vectors and the residual's layout, on the first ingest of tokens.
  void allocate_slices(DType dtype);
  // Bring the histograms up to quantized_ (group_aligned); creates them on first use.
  void sync_histograms() const;
  // Group index and the end of that group's rows for closed token t.
  std::pair<std::int64_t, std::int64_t> group_of(std::int64_t t) const;

  std::int64_t batch_ = 0, heads_ = 0;
  int dim_ = 0, bits_ = 4, group_size_ = 32;
  bool use_delta_ = true, per_channel_ = true;
  FlushMode flush_ = FlushMode::GroupAligned;
  DType dtype_ = DType::F32;
  std::int64_t quantized_ = 0;                      // tokens with codes
  std::vector<PackedRows> codes_;                   // [slice] rows of packed codes
  std::vector<UninitVector<float>> scales_, mins_;  // [slice][group * D + c]
  ExactRows residual_;                              // group_aligned: tokens [quantized_, tokens())
  // per_call
  std::vector<Segment> segments_;
  std::uint64_t seg_compressed_ = 0, seg_fixed_ = 0;
  // group_aligned: one histogram per (slice, channel), or per slice when pooled
  // Derived state, updated lazily by the const counters (see above).
  mutable ChannelHistograms hist_;
  mutable std::int64_t accounted_ = 0;  // closed tokens whose symbols are in hist_
  // What undo_last_ingest restores: sizes before the ingest and the residual it replaced.
  struct Undo {
    std::int64_t quantized = 0, groups = 0, residual = 0;
    bool pushed_segment = false, replaced_residual = false;
  } undo_;
  ExactRows undo_residual_;  // held between ingest and commit_ingest only
};

}  // namespace vq
